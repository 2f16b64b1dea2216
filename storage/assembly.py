"""Per-run episode assembly: which rows belong to which episode, which episodes are whole, where
each goes (export mode), and what the next commit holds.

A world's episode is stored only if the daemon saw it whole: from the run's start or the
world's previous ``EpisodeEnd``, with no lost message and no rejected batch in between.
Anything else is counted as incomplete and dropped. Store work (pieces of rows, then the
commit that indexes them) goes to the run's :class:`storage.write_queue.RunWriteQueue`; an
episode counts as stored only once its commit has run.

Every message is validated against the run before anything is allocated for it: world
indices against the run's world count, fields by name against the term's schema, variation
values against the variation's spec. A message that fails is a :class:`RejectedMessage`; the
episodes it touched become incomplete.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from broker import Batch, EpisodeEnd, FieldSpec, RunEnd, VariationSample

from .episode_buffers import DenseTopicBuffer, EpisodePacker, Segment, TopicBuffer
from .errors import StorageError, StoreFormatError
from .run_writer import RunWriter
from .write_queue import RunWriteQueue

__all__ = ["MAX_WORLDS", "ExportMode", "RejectedMessage", "RunAssembly"]

ExportMode: TypeAlias = Literal["all", "succeeded", "split", "none"]

MAX_WORLDS = 1 << 24
_MIN_PIECE = 512  # bytes: smallest write piece (a piece holds at least one row whatever its size)
"""Most worlds a run may have (world indices are checked against the run's count first)."""


class RejectedMessage(StorageError, ValueError):
    """A well-formed message the store cannot accept (out-of-range world, schema change).

    Attributes:
        reason: A short, stable code (``"worlds"``, ``"schema"``, ``"dtype"``, ``"replay"``,
            ``"budget"``, ``"run"``, ...) the daemon counts rejections by.
        worlds: World indices whose current episode the message touched (they become
            incomplete), ``None`` when they cannot be trusted (then every world's is).
    """

    def __init__(self, reason: str, message: str, worlds: np.ndarray | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.worlds = worlds


def as_numpy(t: Any, what: str) -> np.ndarray:
    """A host numpy view of a message tensor (bfloat16 as its 16 bits, see ``LAYOUT.md``).

    Raises:
        RejectedMessage: ``t`` is not a tensor.
    """
    if isinstance(t, np.ndarray):
        return t
    if not isinstance(t, torch.Tensor):
        raise RejectedMessage("type", f"{what}: expected a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        t = t.cpu()
    if t.requires_grad:  # (each torch call gives up the GIL: only when needed)
        t = t.detach()
    if t.dtype == torch.bfloat16:
        bits: np.ndarray = t.view(torch.int16).numpy().view(np.uint16)
        return bits
    try:
        values: np.ndarray = t.numpy()
        return values
    except TypeError as exc:  # a dtype numpy lacks (float8, complex32, ...)
        raise RejectedMessage("dtype", f"{what}: dtype {t.dtype} cannot be stored") from exc


def _spec_of(t: Any, values: np.ndarray) -> FieldSpec:
    dtype = "bfloat16" if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else str(values.dtype)
    return FieldSpec(dtype, tuple(int(d) for d in values.shape[1:]))


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
        commit_interval: Seconds between index commits while the run is busy.
    """

    def __init__(self, run: str, primary: RunWriter, failed: RunWriter | None, mode: ExportMode,
                 queue: RunWriteQueue, *, num_worlds: int | None, budget_bytes: int, clean: bool,
                 resumed: bool, commit_interval: float = 0.5) -> None:
        self.run, self.primary, self.failed, self.mode = run, primary, failed, mode
        self.queue = queue
        self.worlds_known = num_worlds is not None
        self.num_worlds = max(1, num_worlds or 1)
        self.budget_bytes = budget_bytes
        self.commit_interval = commit_interval
        self.topics: dict[str, TopicBuffer] = {}
        self.episode = np.full(self.num_worlds, 0 if clean else -1, np.int64)
        self.clean = np.full(self.num_worlds, clean, bool)
        self.frags: dict[int, list[Segment]] = defaultdict(list)
        self.pending: dict[int, list[tuple[dict[str, Any], list[Segment]]]] = defaultdict(list)
        self.pending_vars: dict[str, list[tuple[np.ndarray, ...]]] = defaultdict(list)
        self.var_meta: dict[str, tuple[str, list[Any] | None, FieldSpec]] = {}
        self.pending_gaps: list[tuple[int, int, int, str]] = []
        self.packers: dict[tuple[int, str], EpisodePacker] = {}
        committed = primary.committed
        self.seq_high = int(committed["seq_high"])
        self.step_high = int(committed["step_high"])
        self.resumed = resumed
        self._resume_seq: int | None = self.seq_high if resumed else None
        self.last_seq = self.seq_high
        self.last_commit = self.last_message = time.monotonic()
        self.filtered = self.incomplete = self.open_at_end = 0
        self.ended = False
        self.started = False
        """Whether the run's ``RunStart`` was seen."""
        self._clean_start = clean  # worlds discovered later start clean too (nothing lost yet)
        self.piece_bytes = 1 << 12
        self._rebudget()

    def adoptable(self) -> bool:
        """Whether a ``RunStart`` arriving now belongs to this run (joined a moment ago, nothing
        of it in the store yet) rather than starting a new session of its id."""
        return not self.started and not self.resumed and not self.primary.exists

    def adopt(self, num_worlds: int, device: str, metadata: dict[str, Any]) -> None:
        """Take the run's late ``RunStart``: its world count, device and metadata."""
        self.started = True
        if num_worlds > self.num_worlds:
            self._grow(num_worlds)
        self.worlds_known = True
        for writer in self._writers():
            with writer.lock:
                writer.meta.update({"num_worlds": self.num_worlds, "device": device,
                                    "metadata": metadata, "num_worlds_known": True})
            self.queue.submit(writer.create)

    # -- validation ----------------------------------------------------------------------

    def check_seq(self, seq: int, step: int) -> None:
        """Accept the run sequence number of the next message, or reject a repeat.

        Every message of a run carries a sequence number that grows in publication order; one
        that does not exceed the last one accepted was replayed or duplicated.

        Raises:
            RejectedMessage: (``"replay"``) ``seq`` was seen already.
        """
        if seq <= self.last_seq:
            raise RejectedMessage("replay", f"run {self.run!r}: message seq {seq} is not after the "
                                            f"last one accepted ({self.last_seq}); a replay or a "
                                            f"duplicate is never stored twice", worlds=np.zeros(0, np.int64))
        if self._resume_seq is not None:
            if seq > self._resume_seq + 1:  # what the daemon that stopped never committed
                self.pending_gaps.append((self._resume_seq + 1, seq, 1, ""))
            self._resume_seq = None
        self.last_seq = seq
        self.seq_high = max(self.seq_high, seq)
        self.step_high = max(self.step_high, step)
        self.last_message = time.monotonic()

    def _worlds(self, worlds_t: Any, episodes_t: Any, topic: str) -> tuple[np.ndarray, np.ndarray]:
        worlds = as_numpy(worlds_t, f"topic {topic!r} worlds")
        episodes = as_numpy(episodes_t, f"topic {topic!r} episodes")
        if worlds.ndim != 1 or episodes.shape != worlds.shape or worlds.dtype.kind not in "iu" \
                or episodes.dtype.kind not in "iu":
            raise RejectedMessage("worlds", f"topic {topic!r}: expected 1-D integer worlds and "
                                            f"episodes of one length, got {worlds.dtype}{worlds.shape}, "
                                            f"{episodes.dtype}{episodes.shape}")
        worlds = worlds.astype(np.int64, copy=False)
        if len(worlds):
            lo, hi = int(worlds.min()), int(worlds.max())
            limit = self.num_worlds if self.worlds_known else MAX_WORLDS
            if lo < 0 or hi >= limit:
                raise RejectedMessage("worlds", f"topic {topic!r}: world indices must lie in "
                                                f"[0, {limit}), got {lo}..{hi}")
            if len(np.unique(worlds)) != len(worlds):
                raise RejectedMessage("worlds", f"topic {topic!r}: world indices must be distinct")
            if hi >= self.num_worlds:
                self._grow(hi + 1)
        return worlds, episodes.astype(np.int64, copy=False)

    # -- message handlers ----------------------------------------------------------------

    def on_batch(self, msg: Batch) -> None:
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, msg.topic)
        fields: dict[str, np.ndarray] = {}
        specs: dict[str, FieldSpec] = {}
        try:
            for name, t in msg.fields.items():
                values = as_numpy(t, f"topic {msg.topic!r} field {name!r}")
                if values.shape[:1] != (len(worlds),):
                    raise RejectedMessage("shape", f"topic {msg.topic!r} field {name!r}: expected a "
                                                   f"leading worlds dimension of {len(worlds)}, got "
                                                   f"{values.shape}")
                specs[name] = _spec_of(t, values)
                fields[name] = values
            if not fields:
                raise RejectedMessage("schema", f"topic {msg.topic!r}: a batch without fields")
            buf = self._topic(msg.term, specs, dense=len(worlds) == self.num_worlds)
        except RejectedMessage as exc:
            exc.worlds = worlds
            raise
        if msg.hook not in ("pre_step", "post_step", "pre_reset", "post_reset"):
            raise RejectedMessage("hook", f"topic {msg.topic!r}: unknown hook {msg.hook!r}", worlds)
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
        buf.add(worlds, fields, msg.step, msg.hook)

    def on_end(self, msg: EpisodeEnd) -> None:
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, msg.topic)
        try:
            flags = {k: as_numpy(getattr(msg, k), f"episode/end {k}")
                     for k in ("success", "terminated", "truncated")}
            length = as_numpy(msg.length, "episode/end length")
            for name, v in (*flags.items(), ("length", length)):
                if v.shape != worlds.shape:
                    raise RejectedMessage("shape", f"episode/end {name}: expected shape {worlds.shape}, "
                                                   f"got {v.shape}")
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
                       "end_step": msg.step, "end_seq": msg.seq,
                       **{k: bool(v[i]) for k, v in flags.items()}}
                self.pending[id(writer)].append((row, segs[w]))
        self.episode[worlds] = episodes + 1
        self.clean[worlds] = True

    def on_variation(self, msg: VariationSample) -> None:
        worlds, episodes = self._worlds(msg.worlds, msg.episodes, msg.topic)
        value = as_numpy(msg.value, f"topic {msg.topic!r} value")
        if value.shape[:1] != (len(worlds),):
            raise RejectedMessage("shape", f"topic {msg.topic!r} value: expected a leading worlds "
                                           f"dimension of {len(worlds)}, got {value.shape}")
        if not isinstance(msg.key, str) or not msg.key:
            raise RejectedMessage("key", f"topic {msg.topic!r}: invalid variation key {msg.key!r}")
        if msg.phase not in ("build", "runtime"):
            raise RejectedMessage("phase", f"variation {msg.key!r}: phase {msg.phase!r} is neither "
                                           f"'build' nor 'runtime'")
        spec = _spec_of(msg.value, value)
        known = self.var_meta.get(msg.key)
        stored = known[2] if known is not None else self.primary.variation_spec(msg.key)
        if stored is not None and stored != spec:
            raise RejectedMessage("schema", f"variation {msg.key!r}: expected values of "
                                            f"{stored.dtype} {list(stored.shape)}, got {spec.dtype} "
                                            f"{list(spec.shape)}")
        if known is None:
            self.var_meta[msg.key] = (str(msg.phase), None if msg.labels is None else list(msg.labels),
                                      spec)
        self.pending_vars[msg.key].append((worlds.copy(), episodes.copy(),
                                           np.full(len(worlds), msg.step, np.int64),
                                           np.full(len(worlds), msg.seq, np.int64), value.copy()))

    def on_gap(self, expected: int, received: int, topic: str) -> None:
        """Messages were lost in transit (late joins included): every episode in progress is
        incomplete now, and the gap is recorded."""
        self.pending_gaps.append((int(expected), int(received), 0, str(topic)))
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
        :attr:`open_at_end`) and their fragments reclaimed. Waits for the store."""
        self.open_at_end += self.open_episodes()
        self._drop(np.arange(self.num_worlds))
        self.ended = True
        schema = {t: {f: s.to_dict() for f, s in fs.items()} for t, fs in msg.schema.items()}
        self.commit(status="complete", extra={"run_end": {"seq": msg.seq, "step": msg.step,
                                                          "schema": schema},
                                              "ended_at": time.time(),
                                              "open_at_end": self.open_at_end}, wait=True)
        self._finish_arrays()

    # -- commits -------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether something waits to be committed and the commit interval elapsed."""
        return bool(self.pending or self.pending_vars or self.pending_gaps) and \
            time.monotonic() - self.last_commit >= self.commit_interval

    def commit(self, *, status: str | None = None, extra: dict[str, Any] | None = None,
               wait: bool = False) -> None:
        """Commit pending episodes, variation samples and gaps to every writer.

        The packed data is queued first and the index job after it; the writer thread runs
        jobs in order and stops at the first failure, so an index never points at data whose
        write failed. With ``wait`` (shutdown, run end), returns once the commit has run (or
        the queue has failed: see :attr:`RunWriteQueue.failure`).
        """
        for packer in self.packers.values():
            packer.flush()
        pending = {id(w): self.pending.pop(id(w), []) for w in self._writers()}
        variations = {k: (*self.var_meta[k], parts) for k, parts in self.pending_vars.items()}
        self.pending_vars = defaultdict(list)
        gaps, self.pending_gaps = self.pending_gaps, []
        for writer in self._writers():
            self.queue.submit(_commit_job, writer, pending.get(id(writer), []), variations, gaps,
                              self.seq_high, self.step_high, status, extra)
        self.last_commit = time.monotonic()
        if wait:
            self.queue.wait()

    def _finish_arrays(self) -> None:
        """Cut every array to its committed rows and record that (run end, shutdown)."""
        for writer in self._writers():
            self.queue.submit(_trim_job, writer)
        self.queue.wait()

    # -- budget --------------------------------------------------------------------------

    def set_budget(self, budget_bytes: int) -> None:
        """Give the run a new share of the daemon's memory budget (buffers are resized)."""
        if budget_bytes != self.budget_bytes:
            self.budget_bytes = budget_bytes
            self._rebudget()

    def memory(self) -> int:
        """Bytes held for the run's buffers and pieces (the bound its budget keeps)."""
        return sum(b.nbytes for b in self.topics.values()) + sum(p.nbytes for p in self.packers.values())

    def min_budget(self) -> int:
        """The smallest budget the run's current terms and worlds fit in (one row per world)."""
        pairs = max(1, len(self.topics)) * len(self._writers())
        return sum(b.row_bytes for b in self.topics.values()) * self.num_worlds + 2 * _MIN_PIECE * pairs

    def _rebudget(self) -> None:
        """Give every topic the same rows per world within the budget, after the pieces' share.

        Raises:
            RejectedMessage: (``"budget"``) one row per world of every term does not fit.
        """
        pairs = max(1, len(self.topics)) * len(self._writers())
        piece = max(_MIN_PIECE, min(64 << 20, self.budget_bytes // (8 * pairs)))
        data = self.budget_bytes - 2 * piece * pairs
        per_row = sum(b.row_bytes for b in self.topics.values()) * self.num_worlds
        if self.topics and per_row > data:
            raise RejectedMessage("budget", f"run {self.run!r}: one row per world of every term "
                                            f"({per_row} bytes for {self.num_worlds} worlds) does "
                                            f"not fit in the run's share of the memory budget "
                                            f"({self.budget_bytes} bytes); raise --memory-budget")
        capacity = max(1, data // max(1, per_row))
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
        self.episode = np.concatenate([self.episode, np.full(n - old, 0 if self._clean_start else -1,
                                                             np.int64)])
        self.clean = np.concatenate([self.clean, np.full(n - old, self._clean_start, bool)])
        try:
            self._rebudget()
        except RejectedMessage:
            self.num_worlds = old
            self.episode, self.clean = self.episode[:old], self.clean[:old]
            raise

    def _topic(self, term: str, specs: dict[str, FieldSpec], *, dense: bool) -> TopicBuffer:
        """The buffer of ``term``, made on its first batch: time-major when that batch
        covers every world (a per-step term), else world-major. Fields are matched by name."""
        buf = self.topics.get(term)
        if buf is not None:
            if specs != buf.specs:  # dicts: compared by name, never by order
                raise RejectedMessage("schema", f"topic 'batch/{term}': expected fields "
                                                f"{_describe(buf.specs)}, got {_describe(specs)}")
            return buf
        for writer in self._writers():
            try:
                new = writer.declare_term(term, specs)
            except StoreFormatError as exc:
                raise RejectedMessage("schema", str(exc)) from exc
            if new:
                self.queue.submit(writer.create_term, term)
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

    def _packer(self, writer: RunWriter, buf: TopicBuffer) -> EpisodePacker:
        key = (id(writer), buf.term)
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


def _describe(specs: Mapping[str, FieldSpec]) -> str:
    return "{" + ", ".join(f"{n!r}: {s.dtype}{list(s.shape)}" for n, s in sorted(specs.items())) + "}"


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
        table = {k: np.asarray([r[k] for r, _ in rows]) for k in rows[0][0]}
        table["segment_count"] = np.asarray([len(s) for _, s in rows], np.int64)
        segs = np.asarray([seg for _, ss in rows for seg in ss], np.int64).reshape(-1, 3)
        episodes = EpisodeRows(table, segs)
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
    names = [*primary.meta["fields"][term], "_step", "_hook"]
    arrays = {n: primary.data_array(term, n) for n in names}
    for a in range(offset, offset + rows, step):
        b = min(a + step, offset + rows)
        fields = {n: np.asarray(arr[a:b]) for n, arr in arrays.items() if n not in ("_step", "_hook")}
        start = writer.append(term, fields, np.asarray(arrays["_step"][a:b]),
                              np.asarray(arrays["_hook"][a:b]))
        out.append((writer.topic_code(term), start, b - a))
