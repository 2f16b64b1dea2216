"""Per-run bookkeeping of the daemon: episodes in progress, export routing, pending commits.

A world's episode is stored only if the daemon saw it whole: from the run's start or the
world's previous ``EpisodeEnd``, with no sequence gap in between. Anything else is counted as
incomplete and dropped. Commits are batched (every ``commit_interval`` seconds, at run end and
at shutdown) and run on a writer thread after the data they reference; an episode counts as
stored only once its commit has run.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeAlias

import numpy as np
import torch

from broker import Batch, EpisodeEnd, FieldSpec, RunEnd, VariationSample

from .assembler import DenseTopicBuffer, Segment, Stager, TopicBuffer
from .errors import StorageError
from .zarr_store import EpisodeRows, RunWriter

__all__ = ["ExportMode", "RejectedMessage", "RunAssembler"]

ExportMode: TypeAlias = Literal["all", "succeeded", "split", "none"]


class RejectedMessage(StorageError, ValueError):
    """A well-formed message the store cannot accept (out-of-range world, schema change)."""


def _np(t: torch.Tensor, what: str) -> np.ndarray:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise RejectedMessage(f"{what}: expected a CPU tensor, got {t!r:.60}")
    try:  # (detach() is another torch call, each of which gives up the GIL: only if needed)
        return t.detach().numpy() if t.requires_grad else t.numpy()
    except TypeError as exc:  # e.g. bfloat16 has no numpy dtype
        raise RejectedMessage(f"{what}: dtype {t.dtype} cannot be stored") from exc


class RunAssembler:
    """Assembles the episodes of one run and commits them to one or two writers.

    Args:
        run: Run id.
        primary: Writer of kept (``all``) or succeeded episodes; fragments also go here.
        failed: Writer of failed episodes in ``split`` mode, else ``None``.
        mode: Export mode (``none`` is handled by the daemon, which builds no assembler).
        num_worlds: Worlds known so far (the dimension grows if messages need it).
        budget_bytes: Memory for in-progress rows and write pieces of this run.
        clean: Whether every world's current episode is seen from its start (a ``RunStart``).
    """

    def __init__(self, run: str, primary: RunWriter, failed: RunWriter | None, mode: ExportMode,
                 *, num_worlds: int, budget_bytes: int, clean: bool,
                 commit_interval: float = 0.5) -> None:
        self.run, self.primary, self.failed, self.mode = run, primary, failed, mode
        self.num_worlds = max(1, num_worlds)
        self.piece_bytes = max(1 << 12, min(64 << 20, budget_bytes // 16))
        # Staging, write copies and encoded chunks live beside the buffers: keep room for them.
        self.data_bytes = max(1 << 12, budget_bytes - 6 * self.piece_bytes)
        self.commit_interval = commit_interval
        self.topics: dict[str, TopicBuffer] = {}
        self.episode = np.full(self.num_worlds, 0 if clean else -1, np.int64)
        self.clean = np.full(self.num_worlds, clean, bool)
        self.frags: dict[int, list[Segment]] = defaultdict(list)
        self.pending: dict[int, list[tuple[dict[str, Any], list[Segment]]]] = defaultdict(list)
        self.pending_vars: dict[str, list[tuple[np.ndarray, ...]]] = defaultdict(list)
        self.var_meta: dict[str, tuple[str, list[Any] | None]] = {}
        self.pending_gaps: list[tuple[int, int, int, str]] = []
        self.stagers: dict[tuple[int, str], Stager] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"worldtap-store-{run}")
        self._last: Future[None] | None = None
        self.seq_high = int(primary.committed["seq_high"])
        self.step_high = int(primary.committed["step_high"])
        self.resumed = int(primary.meta.get("resumed", 0)) > 0 and not clean
        self._resumed_seq = self.seq_high if self.resumed else None
        self.committed_step = self.step_high
        self.last_commit = time.monotonic()
        self.stored = self.filtered = self.incomplete = self.open_at_end = 0
        self.ended = False

    # -- message handlers ----------------------------------------------------------------

    def note_seq(self, seq: int, step: int) -> None:
        if self._resumed_seq is not None:
            if seq > self._resumed_seq + 1:
                self.pending_gaps.append((self._resumed_seq + 1, seq, 1, ""))
            self._resumed_seq = None
        self.seq_high = max(self.seq_high, seq)
        self.step_high = max(self.step_high, step)

    def on_batch(self, msg: Batch) -> None:
        worlds = self._worlds(msg.worlds, msg.episodes, msg.topic)
        episodes = _np(msg.episodes, f"topic {msg.topic!r} episodes").astype(np.int64)
        specs = {}
        fields: dict[str, np.ndarray] = {}
        for name, t in msg.fields.items():
            values = _np(t, f"topic {msg.topic!r} field {name!r}")  # a view: checks the dtype
            if values.shape[:1] != (len(worlds),):
                raise RejectedMessage(f"topic {msg.topic!r} field {name!r}: expected a leading "
                                      f"worlds dimension of {len(worlds)}, got {values.shape}")
            specs[name] = FieldSpec(str(values.dtype), values.shape[1:])
            fields[name] = values
        buf = self._topic(msg.term, specs, dense=len(worlds) == self.num_worlds)
        stale = self.episode[worlds] != episodes
        if stale.any():  # we missed this world's episode boundary: its start is unseen
            self._drop(worlds[stale])
            self.episode[worlds[stale]] = episodes[stale]
            self.clean[worlds[stale]] = False
        keep = self.clean[worlds]
        if not keep.all():
            worlds = worlds[keep]
            fields = {n: v[keep] for n, v in fields.items()}
        if buf.full(worlds):
            self._fragments(buf)
        buf.add(worlds, fields, msg.step, msg.hook)

    def on_end(self, msg: EpisodeEnd) -> None:
        worlds = self._worlds(msg.worlds, msg.episodes, msg.topic)
        episodes = _np(msg.episodes, "episode/end episodes").astype(np.int64)
        flags = {k: _np(getattr(msg, k), f"episode/end {k}").astype(bool)
                 for k in ("success", "terminated", "truncated")}
        length = _np(msg.length, "episode/end length").astype(np.int64)
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
        worlds = self._worlds(msg.worlds, msg.episodes, msg.topic)
        episodes = _np(msg.episodes, f"topic {msg.topic!r} episodes").astype(np.int64)
        value = _np(msg.value, f"topic {msg.topic!r} value").copy()
        if value.shape[:1] != (len(worlds),):
            raise RejectedMessage(f"topic {msg.topic!r} value: expected a leading worlds "
                                  f"dimension of {len(worlds)}, got {value.shape}")
        self.var_meta.setdefault(msg.key, (str(msg.phase),
                                           None if msg.labels is None else list(msg.labels)))
        self.pending_vars[msg.key].append((worlds.copy(), episodes.copy(),
                                           np.full(len(worlds), msg.step, np.int64),
                                           np.full(len(worlds), msg.seq, np.int64), value))

    def on_gap(self, expected: int, received: int, topic: str) -> None:
        """Messages were lost in transit: every episode in progress is incomplete now.

        A resumed run's streams restart at wire number 0 for the new subscriber; those
        "late join" gaps are covered by the sequence gap found on resume, not recorded."""
        if not (self.resumed and expected == 0):
            self.pending_gaps.append((expected, received, 0, topic))
        self._drop(np.arange(self.num_worlds))
        self.clean[:] = False

    def on_run_end(self, msg: RunEnd) -> None:
        """Commit everything; episodes still open are dropped and their fragments reclaimed."""
        self.open_at_end += sum(int(self.clean[w]) for w in range(self.num_worlds)
                                if any(b.counts[w] for b in self.topics.values()) or self.frags[w])
        self._drop(np.arange(self.num_worlds))
        self.ended = True
        schema = {t: {f: s.to_dict() for f, s in fs.items()} for t, fs in msg.schema.items()}
        self.commit(status="complete", extra={"run_end": {"seq": msg.seq, "step": msg.step,
                                                          "schema": schema}}, wait=True)
        for writer in self._writers():
            writer._zero_holes()
            writer.trim()

    # -- commits -------------------------------------------------------------------------

    def due(self) -> bool:
        """Whether something waits to be committed and the commit interval elapsed."""
        return bool(self.pending or self.pending_vars or self.pending_gaps) and \
            time.monotonic() - self.last_commit >= self.commit_interval

    def commit(self, *, status: str | None = None, extra: dict[str, Any] | None = None,
               wait: bool = False) -> None:
        """Commit pending episodes, variation samples and gaps to every writer.

        The staged data is handed to the background writer first and the index job after
        it; the writer thread runs jobs in order, so data is always written before the
        index that references it. With ``wait`` (shutdown, run end), returns only once the
        commit is in the store; otherwise errors of a background commit surface here later.
        """
        if self._last is not None and self._last.done():
            self._last.result()  # re-raise a failed background commit
        for stager in self.stagers.values():
            stager.flush()
        work = ({id(w): self.pending.pop(id(w), []) for w in self._writers()},
                dict(self.pending_vars), list(self.pending_gaps), self.seq_high, self.step_high)
        self.pending_vars = defaultdict(list)
        self.pending_gaps = []
        self._last = self._executor.submit(self._commit_job, *work, status, extra)
        self.last_commit = time.monotonic()
        if wait:
            self._last.result()

    def _commit_job(self, pending: dict[int, list[tuple[dict[str, Any], list[Segment]]]],
                    variations: dict[str, list[tuple[np.ndarray, ...]]],
                    gaps: list[tuple[int, int, int, str]], seq_high: int, step_high: int,
                    status: str | None, extra: dict[str, Any] | None) -> None:
        """Runs on the writer thread, after the data jobs submitted before it."""
        for writer in self._writers():
            counts: dict[str, int] = {}
            for key, parts in variations.items():
                phase, labels = self.var_meta[key]
                w, e, s, q, v = (np.concatenate(c) for c in zip(*parts, strict=True))
                counts[key] = writer.append_variation(key, phase, labels, w, e, s, q, v)
            rows = pending.get(id(writer), [])
            episodes = None
            if rows:
                table = {k: np.asarray([r[k] for r, _ in rows]) for k in rows[0][0]}
                table["segment_count"] = np.asarray([len(s) for _, s in rows], np.int64)
                segs = np.asarray([seg for _, ss in rows for seg in ss], np.int64).reshape(-1, 3)
                episodes = EpisodeRows(table, segs)
            writer.commit(episodes, gaps=gaps, seq_high=seq_high, step_high=step_high,
                          variations=counts, status=status, extra=extra)
            if rows:
                self.stored += len(rows)
                self.committed_step = max(self.committed_step, max(r["end_step"] for r, _ in rows))

    # -- internals -----------------------------------------------------------------------

    def _writers(self) -> list[RunWriter]:
        return [self.primary] + ([self.failed] if self.failed is not None else [])

    def _worlds(self, worlds_t: torch.Tensor, episodes_t: torch.Tensor, topic: str) -> np.ndarray:
        worlds = _np(worlds_t, f"topic {topic!r} worlds").astype(np.int64)
        if worlds.ndim != 1 or episodes_t.shape != worlds_t.shape:
            raise RejectedMessage(f"topic {topic!r}: expected 1-D worlds and episodes of one "
                                  f"length, got {tuple(worlds_t.shape)}, {tuple(episodes_t.shape)}")
        if len(worlds) and (worlds.min() < 0 or np.bincount(worlds).max() > 1):
            raise RejectedMessage(f"topic {topic!r}: world indices must be distinct and >= 0")
        if len(worlds) and worlds.max() >= self.num_worlds:
            self._grow(int(worlds.max()) + 1)
        return worlds

    def _grow(self, n: int) -> None:
        if n > 1 << 24:
            raise RejectedMessage(f"world index {n - 1} is out of range (at most {1 << 24})")
        old = self.num_worlds
        self.num_worlds = n
        self.episode = np.concatenate([self.episode, np.full(n - old, -1, np.int64)])
        self.clean = np.concatenate([self.clean, np.zeros(n - old, bool)])
        for buf in self.topics.values():
            buf.grow_worlds(n)
        self._rebudget()

    def _topic(self, term: str, specs: dict[str, FieldSpec], *, dense: bool) -> TopicBuffer:
        """The buffer of ``term``, made on its first batch: time-major when that batch
        covers every world (a per-step term), else world-major."""
        buf = self.topics.get(term)
        if buf is not None:
            if specs != buf.specs:
                raise RejectedMessage(f"topic 'batch/{term}': expected fields {buf.specs!r}, "
                                      f"got {specs!r}")
            return buf
        for writer in self._writers():
            writer.ensure_term(term, specs)
        buf = (DenseTopicBuffer if dense else TopicBuffer)(term, specs, self.num_worlds, 1)
        self.topics[term] = buf
        self._rebudget()
        return buf

    def _rebudget(self) -> None:
        """Give every topic the same rows per world, within the data budget."""
        per_row = sum(b.row_bytes for b in self.topics.values()) * self.num_worlds
        capacity = max(1, self.data_bytes // max(1, per_row))
        for buf in self.topics.values():
            if buf.capacity != capacity:
                if buf.counts.any():
                    self._fragments(buf)
                for key in [k for k in self.stagers if k[1] == buf.term]:
                    stager = self.stagers.pop(key)
                    stager.flush()
                    stager.wait()
                buf.reshape(capacity, self.num_worlds)

    def _drop(self, worlds: np.ndarray) -> None:
        for buf in self.topics.values():
            buf.discard(worlds)
        for w in worlds.tolist():
            self.frags.pop(w, None)

    def _stager(self, writer: RunWriter, buf: TopicBuffer) -> Stager:
        key = (id(writer), buf.term)
        if key not in self.stagers:
            self.stagers[key] = Stager(writer, buf, self.piece_bytes, self._executor)
        return self.stagers[key]

    def _fragments(self, buf: TopicBuffer) -> None:
        """Move every in-progress row of ``buf`` to the primary store as fragments."""
        worlds = np.flatnonzero(buf.counts)
        self._stager(self.primary, buf).stage(buf, worlds, [self.frags[w] for w in worlds.tolist()])

    def _finish(self, writer: RunWriter, worlds: np.ndarray) -> dict[int, list[Segment]]:
        """Stage the tails of ``worlds`` for ``writer``; return each world's segment list
        (completed when the stagers flush, which every commit does first)."""
        if writer is self.primary:  # the fragments' list is the episode's list: order kept
            segs = {w: self.frags.pop(w, []) for w in worlds.tolist()}
        else:
            self._flush_staged()
            segs = {w: [s for frag in self.frags.pop(w, []) for s in self._copy(writer, *frag)]
                    for w in worlds.tolist()}
        for buf in self.topics.values():
            self._stager(writer, buf).stage(buf, worlds, [segs[w] for w in worlds.tolist()])
        return segs

    def _flush_staged(self) -> None:
        """Write everything staged and wait for it: the segments are complete afterwards."""
        for stager in self.stagers.values():
            stager.flush()
        for stager in self.stagers.values():
            stager.wait()

    def close(self) -> None:
        """Stop the background writer (call after the last commit) and cut the arrays to
        their length (a run left open at shutdown is resumed by a later daemon)."""
        self._executor.shutdown(wait=True)
        if not self.ended:
            for writer in self._writers():
                writer.trim()

    def _copy(self, writer: RunWriter, code: int, offset: int, rows: int) -> list[Segment]:
        """Copy a fragment from the primary store to ``writer`` (split mode, failed episode)."""
        term = self.primary.meta["topics"][code]
        arrays = {n: self.primary.data_array(term, n)
                  for n in [*self.primary.meta["fields"][term], "_step", "_hook"]}
        out: list[Segment] = []
        step = max(1, self.piece_bytes // self.topics[term].row_bytes)
        for a in range(offset, offset + rows, step):
            b = min(a + step, offset + rows)
            fields = {n: np.asarray(arr[a:b]) for n, arr in arrays.items()
                      if n not in ("_step", "_hook")}
            start = writer.append(term, fields, np.asarray(arrays["_step"][a:b]),
                                  np.asarray(arrays["_hook"][a:b]))
            out.append((writer.topic_code(term), start, b - a))
        return out
