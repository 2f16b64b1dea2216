"""Episode assembly with bounded memory: per-topic ``[capacity, worlds, ...]`` buffers.

Every batch row is scattered into its world's slot (no Python loop over worlds). When a
world's slot is full the topic's rows are flushed to the store as *fragments*; at the
episode's end its remaining rows are written and the episode, with all its segments, is
queued for the next index commit. Nothing written here is visible before
:meth:`storage.RunWriter.commit`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from broker import FieldSpec

from ._zarr_io import HOOKS
from .zarr_store import RunWriter

__all__ = ["DenseTopicBuffer", "Segment", "Stager", "TopicBuffer", "iter_pieces"]

Segment = tuple[int, int, int]
"""``(topic code, first row, row count)`` of one contiguous run of rows in one store."""


def iter_pieces(rows: np.ndarray, row_bytes: int, piece_bytes: int) -> Iterator[slice]:
    """Consecutive slices of ``rows`` (rows per world) whose total bytes stay near
    ``piece_bytes`` (a world with more rows than a piece gets a piece of its own)."""
    start, acc = 0, 0
    for i, r in enumerate(rows.tolist()):
        if acc and acc + r * row_bytes > piece_bytes:
            yield slice(start, i)
            start, acc = i, 0
        acc += r * row_bytes
    if start < len(rows):
        yield slice(start, len(rows))


class TopicBuffer:
    """Rows of one batch topic (a recorder term), per world, for the episodes in progress.

    Storage is one ``[worlds * capacity, *shape]`` array per field, row ``r`` of world ``w``
    at ``w * capacity + r`` (world-major), so a batch is one fancy-index assignment and
    copying out episodes one ``take`` over contiguous runs of rows (an episode's rows are
    adjacent in memory: the copy-out streams instead of striding across the buffer).

    Args:
        term: The term name (topic without ``batch/``).
        specs: Field name -> spec.
        num_worlds: Worlds dimension.
        capacity: Rows held per world before the topic must flush fragments.
    """

    def __init__(self, term: str, specs: Mapping[str, FieldSpec], num_worlds: int,
                 capacity: int) -> None:
        self.term = term
        self.specs = dict(specs)
        self.dtypes = {name: np.dtype(spec.dtype) for name, spec in specs.items()}
        self.row_bytes = sum(d.itemsize * int(np.prod(s.shape, dtype=np.int64))
                             for d, s in zip(self.dtypes.values(), specs.values(), strict=True))
        self.row_bytes += 9  # _step and _hook
        self.num_worlds = num_worlds
        self.counts = np.zeros(num_worlds, np.int64)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        n = capacity * self.num_worlds
        # np.zeros maps pages lazily (calloc): only rows actually used become resident
        self.views = {name: np.zeros((n, *spec.shape), self.dtypes[name])
                      for name, spec in self.specs.items()}
        self.views["_step"] = np.zeros(n, np.int64)
        self.views["_hook"] = np.zeros(n, np.uint8)

    def reshape(self, capacity: int, num_worlds: int) -> None:
        """Reallocate for a new capacity or world count; the buffer must be empty."""
        assert not self.counts.any(), "reshape() of a non-empty TopicBuffer"
        if num_worlds != self.num_worlds:
            self.num_worlds = num_worlds
            self.counts = np.zeros(num_worlds, np.int64)
        self._alloc(capacity)

    def grow_worlds(self, num_worlds: int) -> None:
        """Widen the worlds dimension (a run joined without its ``RunStart``), keeping rows."""
        if num_worlds <= self.num_worlds:
            return
        old, w, c = self.views, self.num_worlds, self.capacity
        old_counts = self.counts
        self.num_worlds = num_worlds
        self._alloc(c)
        self.counts = np.zeros(num_worlds, np.int64)
        self.counts[:w] = old_counts
        for name, buf in old.items():
            self.views[name][:w * c] = buf  # world-major: the old worlds are a prefix

    def full(self, worlds: np.ndarray) -> bool:
        return bool(len(worlds)) and int(self.counts[worlds].max()) >= self.capacity

    def add(self, worlds: np.ndarray, fields: Mapping[str, np.ndarray], step: int,
            hook: str) -> None:
        """Copy one batch's rows into the worlds' slots (the caller checked ``full``)."""
        rows = self.counts[worlds]
        idx = worlds * self.capacity + rows
        for name, values in fields.items():  # numpy's fancy setitem: far faster than index_copy_
            self.views[name][idx] = values
        self.views["_step"][idx] = step
        self.views["_hook"][idx] = HOOKS.index(hook)
        self.counts[worlds] = rows + 1

    def discard(self, worlds: np.ndarray) -> None:
        self.counts[worlds] = 0

    def rows_of(self, worlds: np.ndarray) -> np.ndarray:
        """Flat buffer rows of ``worlds``' episodes, world after world, each in order."""
        counts = self.counts[worlds]
        total = int(counts.sum())
        starts = np.cumsum(counts) - counts
        r = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        rows: np.ndarray = r + np.repeat(worlds * self.capacity, counts)
        return rows


class DenseTopicBuffer(TopicBuffer):
    """A :class:`TopicBuffer` for topics whose batches cover every world (the per-step terms).

    Storage is time-major, ``[capacity slots * worlds, *shape]`` with row ``w`` of slot ``s``
    at ``s * worlds + w``, used as a ring: a batch of every world is one contiguous copy per
    field, and an episode's rows are gathered when it is staged. ``capacity`` counts slots;
    the topic is full when the next slot still holds the first row of an episode in progress.
    A batch of only some worlds (rare here) marks which worlds its slot holds.
    """

    def _alloc(self, capacity: int) -> None:
        super()._alloc(capacity)
        self.t = 0  # slots used so far (the next slot is t % capacity)
        self.first = np.zeros(self.num_worlds, np.int64)  # slot count at each world's first row
        self.present = np.ones((capacity, self.num_worlds), bool)
        self._all = np.arange(self.num_worlds)

    def grow_worlds(self, num_worlds: int) -> None:
        if num_worlds <= self.num_worlds:
            return
        w, c = self.num_worlds, self.capacity
        old = {name: v.reshape(c, w, *v.shape[1:]) for name, v in self.views.items()}
        counts, first, present, t = self.counts, self.first, self.present, self.t
        self.num_worlds = num_worlds
        self._alloc(c)
        self.t = t
        self.counts = np.zeros(num_worlds, np.int64)
        self.counts[:w] = counts
        self.first[:w] = first
        self.present[:, :w] = present
        self.present[:, w:] = False
        for name, v in self.views.items():
            v.reshape(c, num_worlds, *v.shape[1:])[:, :w] = old[name]

    def full(self, worlds: np.ndarray) -> bool:
        busy = self.counts > 0
        return bool(busy.any()) and self.t - int(self.first[busy].min()) >= self.capacity

    def add(self, worlds: np.ndarray, fields: Mapping[str, np.ndarray], step: int,
            hook: str) -> None:
        """Copy one batch into the next slot (the caller checked ``full``)."""
        n, slot = self.num_worlds, self.t % self.capacity
        rows = slice(slot * n, (slot + 1) * n)
        if len(worlds) == n and np.array_equal(worlds, self._all):  # every world: plain copies
            for name, values in fields.items():
                self.views[name][rows] = values
            self.present[slot] = True
        else:
            for name, values in fields.items():
                self.views[name][rows][worlds] = values
            self.present[slot] = False
            self.present[slot, worlds] = True
        self.views["_step"][rows] = step
        self.views["_hook"][rows] = HOOKS.index(hook)
        starting = worlds[self.counts[worlds] == 0]
        self.first[starting] = self.t
        self.counts[worlds] += 1
        self.t += 1

    def rows_of(self, worlds: np.ndarray) -> np.ndarray:
        counts = self.counts[worlds]
        span = np.where(counts > 0, self.t - self.first[worlds], 0)
        starts = np.cumsum(span) - span
        slots = np.repeat(self.first[worlds], span) + (np.arange(int(span.sum())) - np.repeat(starts, span))
        slots %= self.capacity
        owners = np.repeat(worlds, span)
        rows: np.ndarray = slots * self.num_worlds + owners
        if not np.array_equal(span, counts):  # some slots skip some of these worlds
            rows = rows[self.present[slots, owners]]
        return rows


class Stager:
    """Collects episode rows of one term for one store and appends them in large pieces.

    Each staged run of rows comes with the segment list of its episode; when the piece is
    written the ``(topic code, offset, rows)`` segment is appended to that list, so segment
    order follows staging order (fragments before tails). Nothing here is committed.

    With an ``executor`` (one thread), pieces are written in the background while the next
    one is staged (double buffering); :meth:`wait` must return before the segments are read.
    """

    def __init__(self, writer: RunWriter, buf: TopicBuffer, piece_bytes: int,
                 executor: ThreadPoolExecutor | None = None) -> None:
        self.writer, self.term = writer, buf.term
        self.rows = max(1, piece_bytes // buf.row_bytes)
        self._shapes = {name: ((self.rows, *b.shape[1:]), b.dtype) for name, b in buf.views.items()}
        self.arrays = self._alloc()
        self._spare: dict[str, np.ndarray] | None = None
        self._executor = executor
        self._pending: Future[None] | None = None
        self.n = 0
        self.entries: list[tuple[list[Segment], int]] = []

    def _alloc(self) -> dict[str, np.ndarray]:
        return {name: np.zeros(shape, dtype) for name, (shape, dtype) in self._shapes.items()}

    def stage(self, buf: TopicBuffer, worlds: np.ndarray, segs: list[list[Segment]]) -> None:
        """Move the rows of ``worlds`` (``segs``: each world's segment list) out of ``buf``."""
        counts = buf.counts[worlds]
        keep = counts > 0
        worlds, counts = worlds[keep], counts[keep]
        segs = [s for s, k in zip(segs, keep.tolist(), strict=True) if k]
        for piece in iter_pieces(counts, buf.row_bytes, self.rows * buf.row_bytes):
            total = int(counts[piece].sum())
            if self.n + total > self.rows:
                self.flush()
            idx = buf.rows_of(worlds[piece])
            # numpy gathers on this thread alone: torch's index_select would fan out to OpenMP
            # workers that contend with zarr's codec threads and the receiver for the cores.
            if total > self.rows:  # one world longer than a piece: write it directly
                self.wait()
                self._write({n: np.take(b, idx, axis=0) for n, b in buf.views.items()},
                            list(zip(segs[piece], counts[piece].tolist(), strict=True)))
            else:
                for name, b in buf.views.items():
                    np.take(b, idx, axis=0, out=self.arrays[name][self.n:self.n + total], mode="clip")
                self.entries.extend(zip(segs[piece], counts[piece].tolist(), strict=True))
                self.n += total
            buf.discard(worlds[piece])

    def flush(self) -> None:
        """Append what is staged to the store (data only) and fill in the segments; in the
        background with an executor (call :meth:`wait` before reading the segments)."""
        if not self.n:
            return
        arrays = {name: a[:self.n] for name, a in self.arrays.items()}
        if self._executor is None:
            self._write(arrays, self.entries)
        else:
            previous = self._pending
            self._pending = self._executor.submit(self._write, arrays, self.entries)
            if previous is not None:
                previous.result()  # the spare buffers were being written: reuse them now
            spare = self._spare if self._spare is not None else self._alloc()
            self._spare, self.arrays = self.arrays, spare
        self.n = 0
        self.entries = []

    def wait(self) -> None:
        """Wait for the background write (re-raising its error)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, arrays: dict[str, np.ndarray], entries: list[tuple[list[Segment], int]]) -> None:
        data = dict(arrays)
        steps, hooks = data.pop("_step"), data.pop("_hook")
        offset = self.writer.append(self.term, data, steps, hooks)
        code = self.writer.topic_code(self.term)
        for segs, rows in entries:
            segs.append((code, offset, rows))
            offset += rows
