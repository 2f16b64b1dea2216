"""Arrays the run writer extends at their end, a whole chunk at a time.

Appending with ``zarr.Array.append`` rewrites the array's metadata on every call and, when
the old end is inside a chunk, reads that chunk back, decodes it, merges and re-encodes it;
each chunk of a multi-chunk write is also copied into a fresh buffer first. A
:class:`Column` avoids all of it:

- the array's shape is a *capacity* that grows geometrically (one metadata write per
  doubling); :attr:`Column.rows` counts the rows appended and :attr:`Column.stored` those in
  the store; the run's ``committed`` counts say which of them readers may see;
- the rows of the last, partial chunk stay in memory (:attr:`Column.tail`). An append writes
  only the chunks it completes; the partial chunk is written (zero-padded to a whole chunk)
  only when its rows must be in the store (``write_columns(..., flush=True)``: a commit that
  counts them, or a caller that reads the array). A chunk is therefore written once when it
  fills, plus once per commit that needs it before then, and zarr never reads one back;
- a whole chunk of the caller's rows is encoded straight from them (a view, no copy);
- chunks go through :mod:`storage._zarr_io`: on local directories and memory stores, encoded
  and written by a pool of plain threads that hold the GIL only briefly per chunk; elsewhere
  (fsspec URLs, sharded arrays, another codec pipeline) with zarr's public ``__setitem__``.

:meth:`Column.trim` cuts the shape back to a number of stored rows, so a finished run's arrays
have their exact length for plain zarr readers.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr

from ._zarr_io import ChunkEncoder, private_api, sync_path, write_rows

SYNC_PATH = private_api() is not None
"""Whether this zarr has what the thread path needs (see :mod:`storage._zarr_io`)."""

__all__ = ["SYNC_PATH", "Column", "flush_columns", "sync_path", "write_columns"]

_pool_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None


def _threads() -> ThreadPoolExecutor:
    """The chunk-writing threads: as many as zarr's ``threading.max_workers`` (the daemon's
    ``--io-threads``), else the CPU count."""
    global _pool
    size = int(zarr.config.get("threading.max_workers") or os.cpu_count() or 2)
    with _pool_lock:
        if _pool is None or _pool[0] != size:
            if _pool is not None:
                _pool[1].shutdown(wait=False)
            _pool = (size, ThreadPoolExecutor(size, thread_name_prefix="worldtap-chunks"))
        return _pool[1]


def _forget_threads() -> None:
    """In a forked child: the parent's threads (and the lock's holder) do not exist there."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_threads)


class Column:
    """One zarr array written at its end (axis 0) in whole chunks.

    Args:
        array: The zarr array; its shape along axis 0 may exceed ``rows`` (capacity).
        rows: Rows already in the store (on resume: the committed count). The partial chunk
            holding the last of them is read back once, here.
    """

    __slots__ = ("array", "chunk", "encoder", "rows", "stored", "tail")

    def __init__(self, array: zarr.Array[Any], rows: int) -> None:
        self.array = array
        self.chunk = int(array.chunks[0])
        self.rows = rows
        self.stored = rows
        """Rows in the store: the first :attr:`rows` but the tail's, or all of them once the
        tail is written."""
        self.tail: np.ndarray | None = None
        """The rows after the last whole chunk (fewer than a chunk; ``None``: none)."""
        self.encoder = ChunkEncoder.of(array)
        self._read_tail()

    def _read_tail(self) -> None:
        start = self.rows - self.rows % self.chunk
        self.tail = self._kept(np.asarray(self.array[start:self.rows])) if self.rows > start else None

    @property
    def capacity(self) -> int:
        return int(self.array.shape[0])

    def _kept(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (a chunk's at most) copied to the start of a new chunk-sized buffer, as the
        view of it a tail is: later rows of the same chunk are copied in after them
        (:meth:`_grown`), never the rows already there again."""
        room = np.empty((self.chunk, *rows.shape[1:]), rows.dtype)
        room[:len(rows)] = rows
        return room[:len(rows)]

    def _grown(self, tail: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """The tail ``tail`` followed by ``rows`` (a chunk's at most together): ``rows`` are
        copied after the tail in its buffer (appends of a few rows each to a large chunk were
        a copy of the whole tail each: quadratic in the rows per chunk)."""
        room = tail.base
        if not (isinstance(room, np.ndarray) and len(room) == self.chunk and room.dtype == tail.dtype
                and room.flags.c_contiguous and tail.ctypes.data == room.ctypes.data):
            return self._kept(np.concatenate([tail, rows]))  # (a tail made elsewhere)
        room[len(tail):len(tail) + len(rows)] = rows
        return room[:len(tail) + len(rows)]

    def _block(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (fewer than a chunk) zero-padded to a whole chunk."""
        block = np.zeros((self.chunk, *rows.shape[1:]), rows.dtype)
        block[:len(rows)] = rows
        return block

    def _plan(self, values: np.ndarray, flush: bool) -> tuple[list[tuple[int, np.ndarray]], np.ndarray | None]:
        """The writes ``(first row, whole chunks of rows)`` that put ``values`` after the rows
        appended, and the tail afterwards. Only chunks the values complete are written, and
        with ``flush`` the partial last chunk too, unless it is stored already."""
        array, c = self.array, self.chunk
        if values.shape[1:] != array.shape[1:] or values.dtype != array.dtype:
            raise ValueError(f"array {array.path!r}: expected rows of shape {array.shape[1:]} and "
                             f"dtype {array.dtype}, got {values.shape[1:]} {values.dtype}")
        n, start = len(values), self.rows
        values = np.ascontiguousarray(values)
        used = start % c
        head, pos = start - used, 0
        writes: list[tuple[int, np.ndarray]] = []
        tail = self.tail
        if used and n:
            assert tail is not None  # the rows of the partial chunk
            if used + n >= c:  # it fills: its kept rows, then the first new ones
                pos = c - used
                writes.append((head, self._grown(tail, values[:pos])))
                head, tail = head + c, None
            else:  # it stays partial (rows past the tail's are no one's: a failed write keeps it)
                tail, pos = self._grown(tail, values), n
        whole = (n - pos) // c * c
        if whole:  # whole chunks: encoded from the caller's rows, no copy
            writes.append((head, values[pos:pos + whole]))
            pos, head = pos + whole, head + whole
        if pos < n:
            tail = self._kept(values[pos:])  # (a copy: the caller reuses its buffer)
        end = start + n
        if flush and end % c and self.stored < end:
            assert tail is not None
            writes.append((end - end % c, self._block(tail)))
        return writes, tail

    def _reserve(self, rows: int) -> None:
        """Grow the capacity (a metadata write) to hold ``rows``, rounded to whole chunks."""
        need = -(-rows // self.chunk) * self.chunk
        if need > self.capacity:
            grown = -(-2 * self.capacity // self.chunk) * self.chunk
            self.array.resize((max(need, grown), *self.array.shape[1:]))

    def trim(self, rows: int) -> None:
        """Cut the shape to the first ``rows`` rows, which must be in the store (chunks past
        them are deleted); rows after them are forgotten, as :meth:`rewind` does.

        Raises:
            ValueError: ``rows`` exceeds :attr:`stored`.
        """
        if rows > self.stored:
            raise ValueError(f"array {self.array.path!r}: rows: {rows} exceeds the {self.stored} "
                             f"rows in the store")
        self.rewind(rows)
        if self.capacity != rows:
            self.array.resize((rows, *self.array.shape[1:]))

    def rewind(self, rows: int) -> None:
        """Forget rows appended after the first ``rows`` (an interrupted commit's)."""
        if rows >= self.rows:
            return
        first = self.rows - (len(self.tail) if self.tail is not None else 0)
        if rows > first:
            assert self.tail is not None
            self.tail = self.tail[:rows - first]
        self.rows, self.stored = rows, min(self.stored, rows)
        if rows <= first:
            self._read_tail()


def _store(column: Column, first: int, rows: np.ndarray) -> None:
    """Write whole chunks of ``rows`` from row ``first`` on (a pool thread): one chunk through
    the column's encoder, or any run of chunks through zarr's public API."""
    if column.encoder is None:
        write_rows(column.array, first, rows)
    else:
        column.encoder.write(first, rows)


def write_columns(items: Sequence[tuple[Column, np.ndarray]], *, flush: bool = True) -> None:
    """Append rows to several columns at once: their chunks are encoded and written
    concurrently (data only: nothing here is a commit). With ``flush`` every row appended is
    in the store when this returns (each partial last chunk is written unless it already
    is); without it only the chunks the rows complete are written, and the rest waits in
    :attr:`Column.tail`. A column's :attr:`Column.rows` and :attr:`Column.stored` advance only
    once every write has succeeded."""
    plans = [(col, *col._plan(values, flush), len(values)) for col, values in items]
    for col, _, _, n in plans:
        col._reserve(col.rows + n)
    pool = _threads()
    futures: list[Future[None]] = []
    for col, writes, _, _ in plans:
        step = col.chunk if col.encoder is not None else None  # zarr spreads a run of chunks itself
        for first, rows in writes:
            futures.extend(pool.submit(_store, col, first + at, rows[at:at + (step or len(rows))])
                           for at in range(0, len(rows), step or len(rows)))
    errors = [exc for f in futures if (exc := f.exception()) is not None]  # waits for all
    if errors:
        raise errors[0]
    for col, _, tail, n in plans:
        col.rows += n
        col.tail = tail
        col.stored = col.rows if flush or tail is None else max(col.stored, col.rows - len(tail))


def flush_columns(columns: Sequence[Column]) -> None:
    """Write the partial last chunks of ``columns`` that are not in the store yet
    (concurrently), so every row appended to them is stored."""
    write_columns([(c, np.empty((0, *c.array.shape[1:]), c.array.dtype)) for c in columns
                   if c.stored < c.rows])
