"""The rows of episodes in progress, per topic, in bounded buffers; and the packer that moves
finished rows out of them to the run's writer thread.

Every batch row is copied into its world's place (no Python loop over worlds). When a topic
is full its rows are moved to the store as *fragments*; at an episode's end its remaining rows
are moved and the episode, with all its segments, waits for the next index commit. Nothing
written from here is visible before :meth:`storage.RunWriter.commit`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from broker import FieldSpec, TopicSchema

from ._format import HOOKS, numpy_dtype
from .run_writer import RunWriter
from .write_queue import RunWriteQueue

__all__ = ["GROUP_ROW_BYTES", "TRANSPOSE_ROWS", "DenseTopicBuffer", "EpisodePacker", "Layout", "RowBlock",
           "Segment", "TopicBuffer", "iter_pieces"]

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


GROUP_ROW_BYTES = 64
"""Fields of at most this many bytes a row (a cache line) share one array with the other
fields of their dtype and row shape (see :class:`Layout`); larger fields have an array each:
their rows are read whole lines at a time already, and a group would cost the writer a copy
to turn its records back into columns."""


@dataclass(frozen=True, slots=True)
class Layout:
    """How a term's fields are held: one ``[rows, fields, *shape]`` array per group of
    fields, each field the view ``group[:, j]``.

    Fields of one dtype and row shape whose rows are small (:data:`GROUP_ROW_BYTES`) form
    one group, whose rows are records of every field: a batch is copied in with one call per
    group, and moving an episode's rows out is one ``take`` of contiguous records per group,
    not one ``take`` per field that reads a whole cache line for every few bytes (a term of
    hundreds of scalar fields: hundreds of scattered reads a row). :meth:`RowBlock.columns`
    turns the records back into one contiguous array per field, on the writer thread.
    Every larger field is a group of its own, a plain ``[rows, *shape]`` array.
    """

    groups: tuple[tuple[np.dtype[Any], tuple[int, ...], tuple[str, ...]], ...]
    """``(dtype, row shape, field names)`` of each group."""
    where: dict[str, tuple[int, int]]
    """Field name -> (group, position in it), in the specs' order."""

    @staticmethod
    def of(dtypes: Mapping[str, np.dtype[Any]], specs: Mapping[str, FieldSpec]) -> Layout:
        keys: dict[tuple[Any, ...], list[str]] = {}
        for name, spec in specs.items():
            dtype, shape = dtypes[name], tuple(spec.shape)
            small = dtype.itemsize * math.prod(shape) <= GROUP_ROW_BYTES
            keys.setdefault((dtype, shape) if small else (dtype, shape, name), []).append(name)
        groups = tuple((key[0], key[1], tuple(names)) for key, names in keys.items())
        at = {name: (g, j) for g, (_, _, names) in enumerate(groups) for j, name in enumerate(names)}
        return Layout(groups, {name: at[name] for name in specs})

    @property
    def grouped_bytes(self) -> int:
        """Bytes a row of the fields in groups of several (a batch's staging copy of them, and
        the writer's copy of a piece's records turned into columns, are this per row)."""
        return sum(dtype.itemsize * math.prod(shape) * len(names)
                   for dtype, shape, names in self.groups if len(names) > 1)

    def zeros(self, rows: int) -> list[np.ndarray]:
        """New zeroed group arrays of ``rows`` rows (pages mapped lazily: calloc)."""
        return [np.zeros((rows, len(names), *shape), dtype) for dtype, shape, names in self.groups]

    def views(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Field name -> its ``[rows, *shape]`` view of ``arrays`` (strided in a group of
        several fields), in the specs' order."""
        return {name: arrays[g][:, j] for name, (g, j) in self.where.items()}


TRANSPOSE_ROWS = 256
"""Records turned into columns at a time (:meth:`RowBlock.columns`): a block stays in cache."""


@dataclass(slots=True)
class RowBlock:
    """Rows of one term: its field groups (:class:`Layout`) and, never among them, the row
    columns (the global step and the lifecycle code of each row)."""

    layout: Layout
    groups: list[np.ndarray]
    steps: np.ndarray
    hooks: np.ndarray

    def columns(self) -> dict[str, np.ndarray]:
        """Field name -> its rows as one contiguous array: a field alone in its group is a
        view; a group of several is turned into columns :data:`TRANSPOSE_ROWS` records at a time
        (a plain strided copy per field reads a cache line for each of its values)."""
        out = {}
        for g, (_, _, names) in zip(self.groups, self.layout.groups, strict=True):
            if len(names) == 1:
                out[names[0]] = g[:, 0]
                continue
            cols = np.empty((len(names), len(g), *g.shape[2:]), g.dtype)
            for r in range(0, len(g), TRANSPOSE_ROWS):
                cols[:, r:r + TRANSPOSE_ROWS] = np.swapaxes(g[r:r + TRANSPOSE_ROWS], 0, 1)
            out.update(zip(names, cols, strict=True))
        return {name: out[name] for name in self.layout.where}

    def zeros(self, rows: int) -> RowBlock:
        """``rows`` zero rows of the same columns."""
        return RowBlock(self.layout, self.layout.zeros(rows), np.zeros(rows, self.steps.dtype),
                        np.zeros(rows, self.hooks.dtype))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.groups) + int(self.steps.nbytes) + \
            int(self.hooks.nbytes)

    def head(self, n: int) -> RowBlock:
        """The first ``n`` rows (views)."""
        return RowBlock(self.layout, [g[:n] for g in self.groups], self.steps[:n], self.hooks[:n])


def _gather(buf: TopicBuffer, idx: np.ndarray, out: RowBlock | None = None, at: int = 0) -> RowBlock:
    """Rows ``idx`` of ``buf``: into ``out`` from row ``at`` on, or into new arrays (one
    ``take`` of records per field group)."""
    # numpy gathers on this thread alone: torch's index_select would fan out to OpenMP
    # workers that contend with zarr's codec threads and the receiver for the cores.
    if out is None:
        return RowBlock(buf.layout, [np.take(g, idx, axis=0) for g in buf.groups],
                        np.take(buf.steps, idx), np.take(buf.hooks, idx))
    end = at + len(idx)
    for g, o in zip(buf.groups, out.groups, strict=True):
        np.take(g, idx, axis=0, out=o[at:end], mode="clip")
    np.take(buf.steps, idx, out=out.steps[at:end], mode="clip")
    np.take(buf.hooks, idx, out=out.hooks[at:end], mode="clip")
    return out


class TopicBuffer:
    """Rows of one batch topic (a recorder term), per world, for the episodes in progress.

    Storage is one ``[worlds * capacity, *shape]`` view per field (:attr:`views`, by field
    name; small fields of one dtype and shape share an array, :attr:`groups`, see
    :class:`Layout`) and, apart from them, the row columns :attr:`steps` (global step of each row) and
    :attr:`hooks` (lifecycle code of each row), so a field may bear any name (``_step`` too).
    Row ``r`` of world ``w`` is at ``w * capacity + r`` (world-major), so a batch is one fancy-index assignment and
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
        self.schema = TopicSchema(specs)
        """The term's schema: every later batch is checked by it (by name)."""
        self.dtypes = {name: numpy_dtype(spec.dtype) for name, spec in specs.items()}
        self.layout = Layout.of(self.dtypes, self.specs)
        self.row_bytes = sum(d.itemsize * int(np.prod(s.shape, dtype=np.int64))
                             for d, s in zip(self.dtypes.values(), specs.values(), strict=True))
        self.row_bytes += 9  # the row columns: step (int64) and hook (uint8)
        self.num_worlds = num_worlds
        self.counts = np.zeros(num_worlds, np.int64)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        n = capacity * self.num_worlds
        # np.zeros maps pages lazily (calloc): only rows actually used become resident
        self.groups = self.layout.zeros(n)
        """The field groups' arrays, ``[rows, fields, *shape]`` each (:class:`Layout`)."""
        self.views = self.layout.views(self.groups)
        """Field name -> rows (fields only: the row columns are :attr:`steps` and :attr:`hooks`)."""
        self.steps = np.zeros(n, np.int64)
        self.hooks = np.zeros(n, np.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes allocated for rows (pages are mapped lazily; this is the bound)."""
        return sum(int(g.nbytes) for g in self.groups) + int(self.steps.nbytes) + \
            int(self.hooks.nbytes)

    @property
    def memory(self) -> int:
        """Every byte the buffer holds: its rows (:attr:`nbytes`) and its per-world bookkeeping."""
        return self.nbytes + int(self.counts.nbytes)

    def reshape(self, capacity: int, num_worlds: int) -> None:
        """Reallocate for a new capacity or world count; the buffer must be empty (move its rows
        out first)."""
        if self.counts.any():
            raise RuntimeError(f"term {self.term!r}: reshape() of a buffer that holds rows")
        if num_worlds != self.num_worlds:
            self.num_worlds = num_worlds
            self.counts = np.zeros(num_worlds, np.int64)
        self._alloc(capacity)

    def full(self, worlds: np.ndarray) -> bool:
        return bool(len(worlds)) and int(self.counts[worlds].max()) >= self.capacity

    def add(self, worlds: np.ndarray, fields: Mapping[str, np.ndarray], step: int,
            hook: str) -> None:
        """Copy one batch's rows into the worlds' slots (the caller checked ``full``)."""
        rows = self.counts[worlds]
        idx = worlds * self.capacity + rows
        for name, values in fields.items():  # numpy's fancy setitem: far faster than index_copy_
            self.views[name][idx] = values
        self.steps[idx] = step
        self.hooks[idx] = HOOKS.index(hook)
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
        self._stage = [np.empty((len(names), self.num_worlds, *shape), dtype) if len(names) > 1 else None
                       for dtype, shape, names in self.layout.groups]  # a batch's groups, column-wise
        self._all = np.arange(self.num_worlds)

    @property
    def memory(self) -> int:
        return super().memory + int(self.first.nbytes + self.present.nbytes + self._all.nbytes) + \
            sum(int(s.nbytes) for s in self._stage if s is not None)

    def full(self, worlds: np.ndarray) -> bool:
        busy = self.counts > 0
        return bool(busy.any()) and self.t - int(self.first[busy].min()) >= self.capacity

    def add(self, worlds: np.ndarray, fields: Mapping[str, np.ndarray], step: int,
            hook: str) -> None:
        """Copy one batch into the next slot (the caller checked ``full``)."""
        n, slot = self.num_worlds, self.t % self.capacity
        rows = slice(slot * n, (slot + 1) * n)
        if len(worlds) == n and np.array_equal(worlds, self._all):  # every world: plain copies
            for g, stage, (_, _, names) in zip(self.groups, self._stage, self.layout.groups, strict=True):
                if stage is None:
                    g[rows, 0] = fields[names[0]]
                else:  # the group's fields side by side (one call), then into records (one copy)
                    np.stack([fields[name] for name in names], out=stage)
                    g[rows] = np.swapaxes(stage, 0, 1)
            self.present[slot] = True
        else:
            for name, values in fields.items():
                self.views[name][rows][worlds] = values
            self.present[slot] = False
            self.present[slot, worlds] = True
        self.steps[rows] = step
        self.hooks[rows] = HOOKS.index(hook)
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


class EpisodePacker:
    """Packs finished rows of one term, for one store, into large pieces for the writer thread.

    Each packed run of rows comes with the segment list of its episode; when the piece is
    written the ``(topic code, offset, rows)`` segment is appended to that list, so segment
    order follows packing order (fragments before tails). Nothing here is committed.

    Pieces are written by the run's :class:`storage.write_queue.RunWriteQueue` while the next
    one is packed (double buffering); if a write fails the queue stops, the segments of that
    piece are never filled in, and nothing referencing them is ever committed.
    """

    def __init__(self, writer: RunWriter, buf: TopicBuffer, piece_bytes: int,
                 queue: RunWriteQueue) -> None:
        self.writer, self.term = writer, buf.term
        self.rows = max(1, piece_bytes // buf.row_bytes)
        self._empty = _gather(buf, np.zeros(0, np.int64))  # the columns, no rows
        self.arrays = self._alloc()
        self._spare: RowBlock | None = None
        self._queue = queue
        self._pending: Future[None] | None = None
        self.n = 0
        self.entries: list[tuple[list[Segment], int]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the piece buffers (two while a piece is being written)."""
        return self.arrays.nbytes * (2 if self._spare is not None else 1)

    def _alloc(self) -> RowBlock:
        return self._empty.zeros(self.rows)

    def pack(self, buf: TopicBuffer, worlds: np.ndarray, segs: list[list[Segment]]) -> None:
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
            if total > self.rows:  # one world longer than a piece: a piece of its own
                self.wait()
                self._queue.submit(self._write, _gather(buf, idx),
                                   list(zip(segs[piece], counts[piece].tolist(), strict=True))).result()
            else:
                _gather(buf, idx, self.arrays, self.n)
                self.entries.extend(zip(segs[piece], counts[piece].tolist(), strict=True))
                self.n += total
            buf.discard(worlds[piece])

    def flush(self) -> None:
        """Queue what is packed for writing (data only); the segments are filled in when the
        write has run (:meth:`wait`)."""
        if not self.n:
            return
        previous = self._pending
        self._pending = self._queue.submit(self._write, self.arrays.head(self.n), self.entries)
        if previous is not None:
            previous.result()  # the spare buffers were being written: reuse them now
        spare = self._spare if self._spare is not None else self._alloc()
        self._spare, self.arrays = self.arrays, spare
        self.n = 0
        self.entries = []

    def wait(self) -> None:
        """Wait for the piece being written (run or skipped after a failure)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _write(self, block: RowBlock, entries: list[tuple[list[Segment], int]]) -> None:
        offset = self.writer.append(self.term, block.columns(), block.steps, block.hooks)
        code = self.writer.topic_code(self.term)
        for segs, rows in entries:
            segs.append((code, offset, rows))
            offset += rows
