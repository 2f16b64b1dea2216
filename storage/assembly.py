"""Per-run episode assembly: which rows belong to which episode, which episodes are whole, where
each goes (export mode), and what the next commit holds.

A world's episode is stored only if the daemon saw it whole: from the run's start or the
world's previous ``EpisodeEnd``, with no lost message and no rejected batch in between.
Anything else is counted as incomplete and dropped. Store work (pieces of rows, then the
commit that indexes them) goes to the run's :class:`storage.write_queue.RunWriteQueue`; an
episode counts as stored only once its commit has run.

Every message is validated against the run before anything is allocated for it: world
indices against the run's world count, fields by name against the term's schema (any valid
name: the row columns are kept apart from the fields), one world's row against the run's memory share, variation values
against the variation's spec, labels and flags by type. A message that fails is a
:class:`RejectedMessage`; the episodes it touched become incomplete.

Sequence numbers: a run's messages are numbered consecutively, so a repeat or a step back is a
replay (rejected, never stored twice) and a step forward by more than one is a loss, even when
the transport reports it only later: every episode in progress becomes incomplete at once, and
the range is recorded as a gap (source :data:`GAP_SEQUENCE`). A repeated number is a replay
only if the message is the one accepted under it (kind, topic, step and hook, checked over the
last :data:`SEQ_MEMORY` numbers accepted); a different message is a conflict: it is rejected
too, and the episodes it touched become incomplete, for its rows are never stored. A run joined
without its ``RunStart`` from a message past seq 1 records what it missed as a gap of source
:data:`GAP_JOINED_LATE`. Such a run writes nothing to the store until it has an episode or a
variation sample to commit (or its ``RunStart`` or ``RunEnd`` arrives): stray one-message runs
leave no files, and their gaps wait with them in memory.

Memory: :meth:`RunAssembly.memory` counts every array the run holds (rows, per-world
bookkeeping, write pieces, variation samples waiting for their commit); the budget bounds it,
and a world count that cannot fit is rejected before anything is allocated for it.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict, deque
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import numpy as np

from broker import Batch, EpisodeEnd, FieldSpec, RunEnd, SchemaError, VariationSample

from ._format import HOOKS
from ._message_values import RejectedMessage, _describe, _outcomes, _spec_of, as_numpy, identity, run_fields
from .episode_buffers import DenseTopicBuffer, EpisodePacker, Segment, TopicBuffer
from .errors import StoreFormatError
from .run_writer import RunWriter
from .write_queue import RunWriteQueue

__all__ = ["COMMIT_PACE", "GAP_JOINED_LATE", "GAP_SEQUENCE", "MAX_WORLDS", "ExportMode", "RejectedMessage",
           "RunAssembly", "run_fields"]

ExportMode: TypeAlias = Literal["all", "succeeded", "split", "none"]

MAX_WORLDS = 1 << 24
"""Most worlds a run may have (world indices are checked against the run's count first)."""
COMMIT_PACE = 4.0
"""A busy run's next commit waits at least this many times what its last commit took on the
writer thread (and at least the commit interval): commits take at most about a fifth of the
writer's time however many columns each rewrites."""
_MIN_PIECE = 512  # bytes: smallest write piece (a piece holds at least one row whatever its size)
_WORLD_BYTES = 9  # per world: its episode index (int64) and whether it is seen whole (bool)
_TOPIC_WORLD_BYTES = 24  # per world and topic: row count, first slot, world index (int64 each)
SEQ_MEMORY = 1024
"""Sequence numbers of a run whose message (kind, topic, step, hook) the daemon remembers, to tell
a replay from a conflict (:meth:`RunAssembly.check_seq`)."""
GAP_JOINED_LATE = 2
"""Gap ``source`` of a run joined late: run sequence numbers ``[0, received)`` were published
before this daemon saw the run (its first message was neither its ``RunStart`` nor seq 1)."""
GAP_SEQUENCE = 3
"""Gap ``source`` of a hole in a run's sequence numbers: messages ``[expected, received)`` never
arrived (a run's messages are numbered consecutively; the transport may report the same loss
later, per topic, as a source 0 gap)."""


class RunAssembly:
    """Assembles the episodes of one run and commits them to one or two writers.

    Args:
        run: Run id as published (messages carry it).
        primary: Writer of kept (``all``) or succeeded episodes; fragments also go here.
        failed: Writer of failed episodes in ``split`` mode, else ``None``.
        mode: Export mode (``none`` is handled by the daemon, which builds no assembly).
        queue: The run's writer thread.
        num_worlds: The run's world count, or ``None`` while unknown (a run joined without its
            ``RunStart``: worlds are then discovered, up to :data:`MAX_WORLDS`).
        budget_bytes: Memory for in-progress rows and write pieces of this run.
        clean: Whether every world's current episode is seen from its start.
        resumed: Whether the run was reopened from the store (its first job recovers it).
        commit_interval: Seconds between index commits while the run is busy, at least; a
            commit that took long spaces the next by :data:`COMMIT_PACE` times its duration
            (``0``: a commit at every call of :meth:`due` that finds something to commit).
        joined: Whether the run was joined without its ``RunStart`` (and not resumed): if its
            first message is not seq 0 or 1, the messages before it are recorded as a gap
            (source :data:`GAP_JOINED_LATE`).

    Raises:
        RejectedMessage: (``"budget"``) the run's worlds do not fit in ``budget_bytes``.
    """

    def __init__(self, run: str, primary: RunWriter, failed: RunWriter | None, mode: ExportMode,
                 queue: RunWriteQueue, *, num_worlds: int | None, budget_bytes: int, clean: bool,
                 resumed: bool, commit_interval: float = 0.5, joined: bool = False) -> None:
        self.run, self.primary, self.failed, self.mode = run, primary, failed, mode
        self.queue = queue
        self.worlds_known = num_worlds is not None
        self.num_worlds = max(1, num_worlds or 1)
        self._worlds_range: np.ndarray | None = None
        self.budget_bytes = budget_bytes
        need = self.base_bytes(self.num_worlds, len(self._writers()))
        if need > budget_bytes:  # before anything per world is allocated
            raise RejectedMessage("budget", f"run {run!r}: {self.num_worlds} worlds need {need} "
                                            f"bytes, more than the run's share of the memory "
                                            f"budget ({budget_bytes}); raise --memory-budget")
        self._joined = joined
        self._unmade: set[tuple[int, str]] = set()  # (writer, term) declared, arrays not made yet
        self.commit_interval = commit_interval
        self._commit_took: dict[int, float] = {}  # writer -> seconds its last commit job ran
        self.topics: dict[str, TopicBuffer] = {}
        self.episode = np.full(self.num_worlds, 0 if clean else -1, np.int64)
        self.clean = np.full(self.num_worlds, clean, bool)
        self.frags: dict[int, list[Segment]] = defaultdict(list)
        self.pending: dict[int, list[tuple[dict[str, Any], list[Segment]]]] = defaultdict(list)
        self.pending_vars: dict[str, list[tuple[np.ndarray, ...]]] = defaultdict(list)
        self.var_meta: dict[str, tuple[str, list[Any] | None, FieldSpec]] = {}
        self.pending_gaps: list[tuple[int, int, int, str]] = []
        self._pending_var_bytes = 0
        self.packers: dict[tuple[int, str], EpisodePacker] = {}
        committed = primary.committed
        self.seq_high = int(committed["seq_high"])
        self.step_high = int(committed["step_high"])
        self.resumed = resumed
        self._resume_seq: int | None = self.seq_high if resumed else None
        self.last_seq = self.seq_high
        # what was accepted under each of the last SEQ_MEMORY sequence numbers, oldest first
        self._accepted: dict[int, tuple[str, str, int, str | None]] = {}
        self._accepted_order: deque[int] = deque()
        self.last_commit = self.last_message = time.monotonic()
        self.filtered = self.incomplete = self.open_at_end = 0
        # Messages of this run the daemon rejected, by reason: kept in the run's attributes at
        # each commit (``rejected``), counted on from what a resumed run had stored.
        stored = primary.meta.get("rejected") if resumed else None
        self.rejected: Counter[str] = Counter(
            {str(k): int(v) for k, v in stored.items() if isinstance(v, int) and not isinstance(v, bool)}
            if isinstance(stored, dict) else {})
        self._rejected_committed = dict(self.rejected)
        self.ended = False
        self.started = False
        """Whether the run's ``RunStart`` was seen."""
        self.first_seq: int | None = None
        """Sequence number of the first message this daemon accepted for the run."""
        self._clean_start = clean  # worlds discovered later start clean too (nothing lost yet)
        self.piece_bytes = 1 << 12
        self._rebudget()

    def adoptable(self, seq: int) -> bool:
        """Whether a ``RunStart`` of sequence number ``seq`` arriving now belongs to this run
        (joined by this daemon a moment ago, from a message numbered after ``seq``, with no
        episode stored yet) rather than starting a new session of its id."""
        return (not self.started and not self.resumed and self.first_seq is not None
                and seq < self.first_seq and not any(w.stored for w in self._writers()))

    def adopt(self, num_worlds: int, device: str, metadata: dict[str, Any],
              fields: Mapping[str, Any] | None = None) -> None:
        """Take the run's late ``RunStart``: its world count, device, metadata and run fields
        (:func:`run_fields`).

        Raises:
            RejectedMessage: (``"budget"``) ``num_worlds`` do not fit in the run's budget.
        """
        if num_worlds > self.num_worlds:
            self._grow(num_worlds)
        self.started = True
        self.worlds_known = True
        for writer in self._writers():
            with writer.lock:
                writer.meta.update({"num_worlds": self.num_worlds, "device": device,
                                    "metadata": metadata, "num_worlds_known": True, **(fields or {})})
            self.queue.submit(writer.create)
            self.queue.submit(writer.write_meta)

    def set_run_fields(self, fields: Mapping[str, Any]) -> None:
        """Record a ``RunStart``'s fields (:func:`run_fields`) in the run's attributes (on
        the writer thread, after the run's creation)."""
        for writer in self._writers():
            with writer.lock:
                writer.meta.update(fields)
            self.queue.submit(writer.write_meta)

    # -- validation ----------------------------------------------------------------------

    def check_seq(self, seq: int, step: int, message: Any) -> None:
        """Accept the run sequence number of the next message, or reject a repeat.

        Every message of a run carries a sequence number that grows in publication order; one
        that does not exceed the last one accepted was replayed or duplicated, unless another
        message was accepted under it (see :func:`identity`): then this one is never stored.

        Raises:
            RejectedMessage: (``"replay"``) ``seq`` was seen already, for this message (or
                too long ago to tell); (``"conflict"``) another message was accepted under
                ``seq``: the episodes this one touches become incomplete.
        """
        seq, step = int(seq), int(step)
        if self._joined:  # the first message of a run joined without its RunStart
            self._joined = False
            if seq > 1:
                self.pending_gaps.append((0, seq, GAP_JOINED_LATE, ""))
                self.invalidate(None)
            self.last_seq = seq - 1
        if self.first_seq is None:
            self.first_seq = seq
        ident = identity(message, step)
        if seq <= self.last_seq:
            taken = self._accepted.get(seq)
            if taken is not None and taken != ident:
                raise RejectedMessage("conflict", f"run {self.run!r}: message seq {seq} was accepted "
                                                  f"for another message ({_describe(taken)}); this "
                                                  f"one ({_describe(ident)}) is never stored",
                                      worlds=self._touched_worlds(message))
            raise RejectedMessage("replay", f"run {self.run!r}: message seq {seq} is not after the "
                                            f"last one accepted ({self.last_seq}); a replay or a "
                                            f"duplicate is never stored twice", worlds=np.zeros(0, np.int64))
        self._accepted[seq] = ident
        self._accepted_order.append(seq)
        if len(self._accepted_order) > SEQ_MEMORY:
            del self._accepted[self._accepted_order.popleft()]
        if self._resume_seq is not None:
            # What the daemon that stopped never committed: the messages after its last
            # commit, and the episodes then in progress (so recorded even when none was lost).
            self.pending_gaps.append((self._resume_seq + 1, max(seq, self._resume_seq + 1), 1, ""))
            self._resume_seq = None
        elif seq > self.last_seq + 1:  # messages of this run never arrived (or went elsewhere)
            self.pending_gaps.append((self.last_seq + 1, seq, GAP_SEQUENCE, ""))
            self.invalidate(None)
        self.last_seq = seq
        self.seq_high = max(self.seq_high, seq)
        self.step_high = max(self.step_high, step)
        self.last_message = time.monotonic()

    @staticmethod
    def _touched_worlds(message: Any) -> np.ndarray | None:
        """The worlds whose current episode ``message`` would have touched: those it names, if
        it names them as a 1-D integer array; ``None`` (every world) otherwise. Nothing about
        the run changes (:meth:`invalidate` ignores indices outside it)."""
        if not isinstance(message, Batch | EpisodeEnd | VariationSample):
            return None
        try:
            worlds = as_numpy(message.worlds, "worlds")
        except RejectedMessage:
            return None
        if worlds.ndim != 1 or worlds.dtype.kind not in "iu":
            return None
        return worlds.astype(np.int64, copy=False)

    def _worlds(self, worlds_t: Any, episodes_t: Any, topic: str) -> tuple[np.ndarray, np.ndarray]:
        worlds = as_numpy(worlds_t, f"topic {topic!r} worlds")
        episodes = as_numpy(episodes_t, f"topic {topic!r} episodes")
        if worlds.ndim != 1 or episodes.shape != worlds.shape or worlds.dtype.kind not in "iu" \
                or episodes.dtype.kind not in "iu":
            raise RejectedMessage("worlds", f"topic {topic!r}: expected 1-D integer worlds and "
                                            f"episodes of one length, got {worlds.dtype}{worlds.shape}, "
                                            f"{episodes.dtype}{episodes.shape}")
        worlds = worlds.astype(np.int64, copy=False)
        n = len(worlds)
        if n and not (n == self.num_worlds and np.array_equal(worlds, self._every_world())):
            # (every world in order, the per-step case, is valid as it is)
            lo, hi = int(worlds.min()), int(worlds.max())
            limit = self.num_worlds if self.worlds_known else MAX_WORLDS
            if lo < 0 or hi >= limit:  # the episodes of the worlds it does name miss it
                named = np.unique(worlds[(worlds >= 0) & (worlds < self.num_worlds)])
                raise RejectedMessage("worlds", f"topic {topic!r}: world indices must lie in "
                                                f"[0, {limit}), got {lo}..{hi}", named)
            if n > 1 and int(np.bincount(worlds).max()) > 1:  # O(n + hi), no sort
                raise RejectedMessage("worlds", f"topic {topic!r}: world indices must be distinct",
                                      np.unique(worlds[worlds < self.num_worlds]))
            if hi >= self.num_worlds:
                self._grow(hi + 1)
        return worlds, episodes.astype(np.int64, copy=False)

    def _every_world(self) -> np.ndarray:
        """``0..num_worlds - 1`` (cached while the number of worlds stays)."""
        every = self._worlds_range
        if every is None or len(every) != self.num_worlds:
            every = self._worlds_range = np.arange(self.num_worlds, dtype=np.int64)
        return every

    # -- message handlers ----------------------------------------------------------------

    def on_batch(self, msg: Batch[Any]) -> None:
        topic = msg.topic
        if not isinstance(topic, str) or not topic.startswith("batch/") or topic == "batch/":
            raise RejectedMessage("topic", f"a batch on topic {topic!r:.80}: expected 'batch/<term>'")
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, topic)
        fields: dict[str, np.ndarray] = {}
        specs: dict[str, FieldSpec] = {}
        try:
            if msg.hook not in HOOKS:
                raise RejectedMessage("hook", f"topic {topic!r}: unknown hook {msg.hook!r:.80}")
            if not isinstance(msg.fields, Mapping) or not msg.fields:
                raise RejectedMessage("schema", f"topic {topic!r}: expected a non-empty mapping of "
                                                f"fields, got {msg.fields!r:.80}")
            leading = (len(worlds),)
            for name, t in msg.fields.items():  # (what errors name is spelled on error only)
                if not isinstance(name, str) or not name:
                    raise RejectedMessage("name", f"topic {topic!r} field name: expected a non-empty str, "
                                                  f"got {name!r:.80}")
                values = as_numpy(t, (topic, name))
                if values.shape[:1] != leading:
                    raise RejectedMessage("shape", f"topic {topic!r} field {name!r}: expected a "
                                                   f"leading worlds dimension of {len(worlds)}, got "
                                                   f"{values.shape}")
                specs[name] = _spec_of(t, values, (topic, name), self.budget_bytes)
                fields[name] = values
            buf = self._topic(topic.removeprefix("batch/"), specs, msg.fields, len(worlds),
                              dense=len(worlds) == self.num_worlds)
        except RejectedMessage as exc:
            exc.worlds = worlds
            raise
        stale = self.episode[worlds] != episodes
        if stale.any():  # we missed this world's episode boundary: its start is unseen
            self._drop(worlds[stale])
            self.episode[worlds[stale]] = episodes[stale]
            self.clean[worlds[stale]] = False
        keep = self.clean[worlds]
        if not keep.all():
            worlds = worlds[keep]
            fields = {n: v[keep] for n, v in fields.items()}
        if not len(worlds):
            return
        if buf.full(worlds):
            self._fragments(buf)
        buf.add(worlds, fields, int(msg.step), msg.hook)

    def on_end(self, msg: EpisodeEnd[Any]) -> None:
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, "episode/end")
        try:
            flags = {k: as_numpy(getattr(msg, k), f"episode/end {k}")
                     for k in ("success", "terminated", "truncated")}
            length = as_numpy(msg.length, "episode/end length")
            for name, v in (*flags.items(), ("length", length)):
                if v.shape != worlds.shape:
                    raise RejectedMessage("shape", f"episode/end {name}: expected shape {worlds.shape}, "
                                                   f"got {v.shape}")
                if v.dtype.kind not in ("iu" if name == "length" else "b"):
                    raise RejectedMessage("dtype", f"episode/end {name}: expected "
                                                   f"{'integers' if name == 'length' else 'bools'}, "
                                                   f"got {v.dtype}")
            if len(length) and int(length.min()) < 0:
                raise RejectedMessage("length", f"episode/end length: expected counts >= 0, got "
                                                f"{int(length.min())}")
            outcomes = _outcomes(msg, len(worlds))
        except RejectedMessage as exc:
            exc.worlds = worlds
            raise
        flags = {k: v.astype(bool) for k, v in flags.items()}
        length = length.astype(np.int64)
        ok = self.clean[worlds] & (self.episode[worlds] == episodes)
        self.incomplete += int((~ok).sum())
        self._drop(worlds[~ok])
        success = flags["success"]
        dests: list[tuple[RunWriter | None, np.ndarray]] = [(self.primary, ok & success)]
        other = self.primary if self.mode == "all" else self.failed
        dests.append((other, ok & ~success))
        for writer, sel in dests:
            if not sel.any():
                continue
            if writer is None:
                self.filtered += int(sel.sum())
                self._drop(worlds[sel])
                continue
            segs = self._finish(writer, worlds[sel])
            for i in np.flatnonzero(sel).tolist():
                w = int(worlds[i])
                row = {"world": w, "index": int(episodes[i]), "length": int(length[i]),
                       "end_step": int(msg.step), "end_seq": int(msg.seq),
                       **{k: bool(v[i]) for k, v in flags.items()},
                       "outcomes": {k: float(v[i]) for k, v in outcomes.items()}}
                self.pending[id(writer)].append((row, segs[w]))
        # The next episode is seen whole from here, unless this end is of an episode the world
        # has ended already (a stale copy): then the rows of the one in progress were dropped
        # above, and it stays incomplete until its own end.
        current = self.episode[worlds]
        self.clean[worlds] = episodes >= current
        self.episode[worlds] = np.maximum(current, episodes + 1)

    def on_variation(self, msg: VariationSample[Any]) -> None:
        if not isinstance(msg.key, str) or not msg.key:
            raise RejectedMessage("key", f"invalid variation key {msg.key!r:.80}")
        topic = f"variation/{msg.key}"
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, topic)
        try:
            value = as_numpy(msg.value, f"topic {topic!r} value")
            if value.shape[:1] != (len(worlds),):
                raise RejectedMessage("shape", f"topic {topic!r} value: expected a leading worlds "
                                               f"dimension of {len(worlds)}, got {value.shape}")
            if msg.phase not in ("build", "runtime"):
                raise RejectedMessage("phase", f"variation {msg.key!r}: phase {msg.phase!r:.80} is "
                                               f"neither 'build' nor 'runtime'")
            labels = _labels(msg.labels, msg.key)
            spec = _spec_of(msg.value, value, f"topic {topic!r} value", self.budget_bytes)
        except RejectedMessage as exc:
            exc.worlds = worlds
            raise
        known = self.var_meta.get(msg.key)
        stored = known[2] if known is not None else self.primary.variation_spec(msg.key)
        if stored is not None and stored != spec:
            raise RejectedMessage("schema", f"variation {msg.key!r}: expected values of "
                                            f"{stored.dtype} {list(stored.shape)}, got {spec.dtype} "
                                            f"{list(spec.shape)}", worlds)
        if known is None:
            self.var_meta[msg.key] = (str(msg.phase), labels, spec)
        self.pending_vars[msg.key].append((worlds.copy(), episodes.copy(),
                                           np.full(len(worlds), int(msg.step), np.int64),
                                           np.full(len(worlds), int(msg.seq), np.int64), value.copy()))
        self._pending_var_bytes += int(value.nbytes) + 32 * len(worlds)

    def on_gap(self, expected: int, received: int, topic: str) -> None:
        """Messages were lost in transit: the gap is recorded, and every episode in progress is
        incomplete now, except after a gap of a topic's first messages (``expected == 0``).
        Such a gap means this daemon joined the topic late (a resumed or joined run): what it
        missed came before its first message of the run, whose episodes are dropped already
        (a resumed run starts with no world clean; a late join is :data:`GAP_JOINED_LATE`),
        and any message lost after that leaves a hole in the run's sequence numbers, which
        :meth:`check_seq` records and drops the episodes for. Dropping the episodes again
        would lose those begun since the daemon (re)joined."""
        self.pending_gaps.append((int(expected), int(received), 0, str(topic)))
        if expected > 0:
            self._clean_start = False
            self.invalidate(None)

    def invalidate(self, worlds: np.ndarray | None) -> None:
        """The current episodes of ``worlds`` (all when ``None``) miss something: drop them."""
        if worlds is None:
            self._clean_start = False
            worlds = np.arange(self.num_worlds)
        worlds = worlds[(worlds >= 0) & (worlds < self.num_worlds)]
        self._drop(worlds)
        self.clean[worlds] = False

    def open_episodes(self) -> int:
        """Episodes seen from their start that have rows buffered or written but no end yet."""
        busy = np.zeros(self.num_worlds, bool)
        for buf in self.topics.values():
            busy |= buf.counts[:self.num_worlds] > 0
        for w, frags in self.frags.items():
            if frags:
                busy[w] = True
        return int((busy & self.clean).sum())

    def on_run_end(self, msg: RunEnd) -> None:
        """Commit everything and cut the arrays; episodes still open are dropped (counted in
        :attr:`open_at_end`) and their fragments reclaimed. Waits for the store.

        The ``RunEnd``'s declarations replace the stored ones key by key (a ``RunEnd`` repeats
        every declaration, so a run joined without its ``RunStart`` gets them all here); its
        seed replaces the stored one unless ``None``; its wall time is the run's ``ended_at``.
        A ``RunEnd`` with ``interrupted`` ends the run with status ``interrupted`` instead of
        ``complete`` (every complete episode is stored either way).

        Raises:
            RejectedMessage: The ``RunEnd``'s fields cannot be stored (nothing changed then).
        """
        fields = run_fields(msg)
        for writer in self._writers():
            with writer.lock:
                writer.meta["declarations"] = {**writer.meta.get("declarations", {}),
                                               **fields["declarations"]}
                if fields["seed"] is not None or "seed" not in writer.meta:
                    writer.meta["seed"] = fields["seed"]
        self.open_at_end += self.open_episodes()
        self._drop(np.arange(self.num_worlds))
        self.ended = True
        schema = {t: {f: s.to_dict() for f, s in fs.items()} for t, fs in msg.schema.items()}
        interrupted = msg.interrupted is True  # (a RunEnd's flag: the publisher stopped early)
        self.commit(status="interrupted" if interrupted else "complete",
                    extra={"run_end": {"seq": msg.seq, "step": msg.step, "interrupted": interrupted,
                                       "schema": schema},
                           "ended_at": fields["ended_at"], "open_at_end": self.open_at_end}, wait=True)
        self._finish_arrays()

    # -- commits -------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether something waits to be committed and the commit interval elapsed (or the
        variation samples waiting for it fill an eighth of the run's budget).

        The interval is at least :data:`COMMIT_PACE` times what the last commit took on the
        writer thread (a commit rewrites every column's partial last chunk: with hundreds of
        fields, commits every half second would take the writer's whole time), so commits
        cost at most about a fifth of it; a zero interval commits whenever asked."""
        if self._pending_var_bytes > self.budget_bytes // 8:
            return True
        interval = self.commit_interval
        if interval:
            interval = max(interval, COMMIT_PACE * sum(self._commit_took.values()))
        return bool(self.pending or self.pending_vars or self.pending_gaps
                    or self.rejected != self._rejected_committed) and \
            time.monotonic() - self.last_commit >= interval

    def _timed_commit(self, writer: RunWriter, *args: Any) -> None:
        """:func:`_commit_job` on the writer thread, timed for :meth:`due`."""
        began = time.monotonic()
        try:
            _commit_job(writer, *args)
        finally:
            self._commit_took[id(writer)] = time.monotonic() - began

    def commit(self, *, status: str | None = None, extra: dict[str, Any] | None = None,
               wait: bool = False) -> None:
        """Commit pending episodes, variation samples and gaps to every writer.

        The packed data is queued first and the index job after it; the writer thread runs
        jobs in order and stops at the first failure, so an index never points at data whose
        write failed. With ``wait`` (shutdown, run end), returns once the commit has run (or
        the queue has failed: see :attr:`RunWriteQueue.failure`).
        """
        if not (self.started or self.resumed or status is not None or self.pending or self.pending_vars) \
                and not any(w.exists for w in self._writers()):
            # A run joined without its RunStart that has nothing but gaps to commit: nothing
            # of it goes to the store yet (its gaps wait for its first episode or sample), so
            # stray one-message runs leave no files behind.
            self.last_commit = time.monotonic()
            return
        for packer in self.packers.values():
            packer.flush()
        pending = {id(w): self.pending.pop(id(w), []) for w in self._writers()}
        variations = {k: (*self.var_meta[k], parts) for k, parts in self.pending_vars.items()}
        self.pending_vars = defaultdict(list)
        self._pending_var_bytes = 0
        gaps, self.pending_gaps = self.pending_gaps, []
        if self.rejected != self._rejected_committed:
            self._rejected_committed = dict(self.rejected)
            extra = {**(extra or {}), "rejected": dict(sorted(self.rejected.items()))}
        for writer in self._writers():
            self.queue.submit(self._timed_commit, writer, pending.get(id(writer), []), variations, gaps,
                              self.seq_high, self.step_high, status, extra)
        self.last_commit = time.monotonic()
        if wait:
            self.queue.wait()

    def _finish_arrays(self) -> None:
        """Cut every array to its committed rows and record that (run end, shutdown)."""
        self.queue.wait()  # (a run that never reached the store has nothing to cut)
        for writer in self._writers():
            if writer.exists:
                self.queue.submit(_trim_job, writer)
        self.queue.wait()

    # -- budget --------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """Give the run a new share of the daemon's memory budget (buffers are resized)."""
        if budget_bytes != self.budget_bytes:
            self.budget_bytes = budget_bytes
            self._rebudget()

    def memory(self) -> int:
        """Bytes held for the run's buffers, bookkeeping, pieces and variation samples waiting
        for their commit (the bound its budget keeps)."""
        total = int(self.episode.nbytes + self.clean.nbytes) + self._pending_var_bytes
        for buf in self.topics.values():
            total += buf.memory
        return total + sum(p.nbytes for p in self.packers.values())

    @staticmethod
    def base_bytes(num_worlds: int, writers: int = 1) -> int:
        """The smallest budget of a run of ``num_worlds`` worlds before its first term."""
        return num_worlds * _WORLD_BYTES + 2 * _MIN_PIECE * writers

    def min_budget(self) -> int:
        """The smallest budget the run's current terms and worlds fit in (one row per world)."""
        return self._need(_MIN_PIECE, 1)

    def _need(self, piece: int, capacity: int) -> int:
        """Bytes the run holds at most with pieces of ``piece`` bytes and ``capacity`` rows per
        world of every topic: per-world bookkeeping, rows (one ``present`` byte each
        included), and two piece buffers per term and writer (a piece holds one row at least);
        for fields held in groups (:class:`storage.episode_buffers.Layout`), a batch's staging
        copy of them and the writer thread's copy of a piece's records turned into columns."""
        writers = len(self._writers())
        grouped = sum(b.layout.grouped_bytes for b in self.topics.values())
        fixed = self.num_worlds * (_WORLD_BYTES + _TOPIC_WORLD_BYTES * len(self.topics) + grouped)
        rows = capacity * self.num_worlds * sum(b.row_bytes + 1 for b in self.topics.values())
        pieces = writers * (sum(2 * max(piece, b.row_bytes) + max(1, piece // b.row_bytes) * b.layout.grouped_bytes
                                for b in self.topics.values()) if self.topics else 2 * piece)
        return fixed + rows + pieces

    def _rebudget(self) -> None:
        """Give every topic the same rows per world within the budget, after the bookkeeping's
        and the pieces' share (pieces shrink, down to their minimum, before rows do).

        Raises:
            RejectedMessage: (``"budget"``) one row per world of every term does not fit.
        """
        pairs = max(1, len(self.topics)) * len(self._writers())
        piece = max(_MIN_PIECE, min(64 << 20, self.budget_bytes // (8 * pairs)))
        while piece > _MIN_PIECE and self._need(piece, 1) > self.budget_bytes:
            piece = max(_MIN_PIECE, piece // 2)
        if self._need(piece, 1) > self.budget_bytes:
            raise RejectedMessage("budget", f"run {self.run!r}: one row per world of every term "
                                            f"({self._need(piece, 1)} bytes with bookkeeping for "
                                            f"{self.num_worlds} worlds) does not fit in the run's "
                                            f"share of the memory budget ({self.budget_bytes} "
                                            f"bytes); raise --memory-budget")
        per_row = self._need(piece, 2) - self._need(piece, 1)
        capacity = max(1, (self.budget_bytes - self._need(piece, 0)) // max(1, per_row))
        if piece != self.piece_bytes:
            self._drop_packers()
            self.piece_bytes = piece
        for buf in self.topics.values():
            if buf.capacity != capacity or buf.num_worlds != self.num_worlds:
                if buf.counts.any():
                    self._fragments(buf)
                for key in [k for k in self.packers if k[1] == buf.term]:
                    packer = self.packers.pop(key)
                    packer.flush()
                    packer.wait()
                buf.reshape(capacity, self.num_worlds)

    def _drop_packers(self) -> None:
        for packer in self.packers.values():
            packer.flush()
            packer.wait()
        self.packers.clear()

    # -- internals -----------------------------------------------------------------------

    def _writers(self) -> list[RunWriter]:
        return [self.primary] + ([self.failed] if self.failed is not None else [])

    def _grow(self, n: int) -> None:
        """Discover worlds up to ``n`` (a run joined without its ``RunStart``): the budget is
        re-divided before any buffer is reallocated."""
        old = self.num_worlds
        self.num_worlds = n
        if self._need(_MIN_PIECE, 1) > self.budget_bytes:  # before anything is allocated
            self.num_worlds = old
            raise RejectedMessage("budget", f"run {self.run!r}: {n} worlds do not fit in the run's "
                                            f"share of the memory budget ({self.budget_bytes} "
                                            f"bytes); raise --memory-budget")
        self.episode = np.concatenate([self.episode, np.full(n - old, 0 if self._clean_start else -1,
                                                             np.int64)])
        self.clean = np.concatenate([self.clean, np.full(n - old, self._clean_start, bool)])
        try:
            self._rebudget()
        except RejectedMessage:
            self.num_worlds = old
            self.episode, self.clean = self.episode[:old], self.clean[:old]
            raise
        for writer in self._writers():  # the count discovered so far, stored at the next commit
            with writer.lock:
                writer.meta["num_worlds"] = max(int(writer.meta["num_worlds"]), n)

    def _topic(self, term: str, specs: dict[str, FieldSpec], fields: Mapping[str, Any], rows: int, *,
                dense: bool) -> TopicBuffer:
        """The buffer of ``term``, made on its first batch: time-major when that batch
        covers every world (a per-step term), else world-major. Later batches are checked by
        the term's :class:`broker.TopicSchema` (by name, never by order) against the batch's
        own ``fields`` (its tensors: a bfloat16 field is bfloat16 there, not the 16 bits it is
        stored as)."""
        buf = self.topics.get(term)
        if buf is not None:
            try:
                buf.schema.check(fields, topic=f"batch/{term}", rows=rows)
            except SchemaError as exc:
                raise RejectedMessage("schema", str(exc)) from None
            return buf
        for writer in self._writers():
            try:
                new = writer.declare_term(term, specs)
            except StoreFormatError as exc:
                raise RejectedMessage("schema", str(exc)) from exc
            if new:  # its arrays are made before its first rows are written (never if none are)
                self._unmade.add((id(writer), term))
        buf = (DenseTopicBuffer if dense else TopicBuffer)(term, specs, self.num_worlds, 1)
        self.topics[term] = buf
        try:
            self._rebudget()
        except RejectedMessage:
            del self.topics[term]
            raise
        return buf

    def _drop(self, worlds: np.ndarray) -> None:
        for buf in self.topics.values():
            buf.discard(worlds)
        for w in worlds.tolist():
            self.frags.pop(w, None)

    def _make_term(self, writer: RunWriter, term: str) -> None:
        """Queue the creation of ``term``'s arrays in ``writer``'s store before its first rows."""
        if (id(writer), term) in self._unmade:
            self._unmade.discard((id(writer), term))
            self.queue.submit(writer.create_term, term)

    def _packer(self, writer: RunWriter, buf: TopicBuffer) -> EpisodePacker:
        key = (id(writer), buf.term)
        self._make_term(writer, buf.term)
        if key not in self.packers:
            self.packers[key] = EpisodePacker(writer, buf, self.piece_bytes, self.queue)
        return self.packers[key]

    def _fragments(self, buf: TopicBuffer) -> None:
        """Move every in-progress row of ``buf`` to the primary store as fragments."""
        worlds = np.flatnonzero(buf.counts)
        self._packer(self.primary, buf).pack(buf, worlds, [self.frags[w] for w in worlds.tolist()])

    def _finish(self, writer: RunWriter, worlds: np.ndarray) -> dict[int, list[Segment]]:
        """Pack the tails of ``worlds`` for ``writer``; return each world's segment list
        (completed when the pieces are written, which every commit queues first)."""
        if writer is self.primary:  # the fragments' list is the episode's list: order kept
            segs = {w: self.frags.pop(w, []) for w in worlds.tolist()}
        else:
            segs = {}
            fragmented = [w for w in worlds.tolist() if self.frags.get(w)]
            if fragmented:  # (split mode) their fragments are in the primary store: copy them
                self._flush_packed()
            for w in worlds.tolist():
                frags = self.frags.pop(w, [])
                segs[w] = []
                for frag in frags:
                    segs[w].extend(self._copy(writer, *frag))
        for buf in self.topics.values():
            self._packer(writer, buf).pack(buf, worlds, [segs[w] for w in worlds.tolist()])
        return segs

    def _flush_packed(self) -> None:
        """Write everything packed and wait for it: the segments are complete afterwards."""
        for packer in self.packers.values():
            packer.flush()
        self.queue.wait()

    def _copy(self, writer: RunWriter, code: int, offset: int, rows: int) -> list[Segment]:
        """Copy a fragment from the primary store to ``writer`` (split mode, failed episode),
        on the writer thread; returns the new segments once written."""
        out: list[Segment] = []
        term = self.primary.meta["topics"][code]
        step = max(1, self.piece_bytes // self.topics[term].row_bytes)
        self._make_term(writer, term)
        self.queue.submit(_copy_job, self.primary, writer, term, offset, rows, step, out)
        self.queue.wait()
        return out

    def close(self) -> None:
        """Commit what is complete, cut the arrays to their committed rows, and stop the writer
        thread (a run left open is resumed by a later daemon). Idempotent."""
        if self.queue.closed:
            return
        if not self.ended and self.queue.failure is None:
            self.commit(wait=True)
            self._finish_arrays()
        self.queue.close()


def _labels(labels: Any, key: str) -> list[Any] | None:
    """The labels of a categorical variation as stored (``None``, or a list of scalars).

    Raises:
        RejectedMessage: (``"labels"``) they are not a tuple or list of str, int, float or bool.
    """
    if labels is None:
        return None
    if not isinstance(labels, tuple | list) or not all(
            isinstance(v, str | int | float | bool) for v in labels):
        raise RejectedMessage("labels", f"variation {key!r}: expected labels as a tuple of str, int, "
                                        f"float or bool, got {labels!r:.80}")
    return list(labels)


# -- jobs of the writer thread -----------------------------------------------------------------


def _commit_job(writer: RunWriter, rows: list[tuple[dict[str, Any], list[Segment]]],
                variations: dict[str, tuple[str, list[Any] | None, FieldSpec, list[tuple[np.ndarray, ...]]]],
                gaps: list[tuple[int, int, int, str]], seq_high: int, step_high: int,
                status: str | None, extra: dict[str, Any] | None) -> None:
    """Write the variation samples, then the episode index, then the commit point."""
    from .run_writer import EpisodeRows

    counts: dict[str, int] = {}
    for key, (phase, labels, spec, parts) in variations.items():
        w, e, s, q, v = (np.concatenate(c) for c in zip(*parts, strict=True))
        counts[key] = writer.append_variation(key, phase, labels, w, e, s, q, v, spec)
    episodes = None
    if rows:
        table = {k: np.asarray([r[k] for r, _ in rows]) for k in rows[0][0] if k != "outcomes"}
        table["segment_count"] = np.asarray([len(s) for _, s in rows], np.int64)
        segs = np.asarray([seg for _, ss in rows for seg in ss], np.int64).reshape(-1, 3)
        names = sorted({name for r, _ in rows for name in r["outcomes"]})
        outcomes = {name: np.asarray([r["outcomes"].get(name, np.nan) for r, _ in rows], np.float64)
                    for name in names}
        episodes = EpisodeRows(table, segs, outcomes)
    writer.commit(episodes, gaps=gaps, seq_high=seq_high, step_high=step_high,
                  variations=counts, status=status, extra=extra)
    if rows:
        writer.stored += len(rows)
        writer.committed_step = max(writer.committed_step, max(r["end_step"] for r, _ in rows))


def _trim_job(writer: RunWriter) -> None:
    if writer.exists:
        writer.zero_holes()
        writer.trim()
        writer.mark_clean()


def _copy_job(primary: RunWriter, writer: RunWriter, term: str, offset: int, rows: int, step: int,
              out: list[Segment]) -> None:
    arrays = {n: primary.data_array(term, n) for n in primary.meta["fields"][term]}
    steps, hooks = primary.row_arrays(term)
    for a in range(offset, offset + rows, step):
        b = min(a + step, offset + rows)
        fields = {n: np.asarray(arr[a:b]) for n, arr in arrays.items()}
        start = writer.append(term, fields, np.asarray(steps[a:b]), np.asarray(hooks[a:b]))
        out.append((writer.topic_code(term), start, b - a))
