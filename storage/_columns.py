"""Arrays the run writer extends at their end, always a whole chunk at a time.

Appending with ``zarr.Array.append`` rewrites the array's metadata on every call and, when
the old end is inside a chunk, reads that chunk back, decodes it, merges and re-encodes it;
each chunk of a multi-chunk write is also copied into a fresh buffer first. A
:class:`Column` avoids all three:

- the array's shape is a *capacity* that grows geometrically (one metadata write per
  doubling); :attr:`Column.rows` counts the rows written, and the run's ``committed`` counts
  say which of them readers may see;
- the rows of the last, partial chunk stay in memory (:attr:`Column.tail`), so every write
  covers whole chunks and zarr never reads one back;
- a whole chunk of the caller's rows is encoded straight from them (a view, no copy).

:meth:`Column.trim` cuts the shape back to the rows written, so a finished run's arrays have
their exact length for plain zarr readers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

__all__ = ["Column", "write_columns"]

_CONCURRENCY = 8
"""Chunk writes in flight at once (each holds at most one chunk of memory)."""


class Column:
    """One zarr array written at its end (axis 0) in whole chunks.

    Args:
        array: The zarr array; its shape along axis 0 may exceed ``rows`` (capacity).
        rows: Rows already written (on resume: the committed count). The partial chunk
            holding the last of them is read back once, here.
    """

    __slots__ = ("array", "chunk", "rows", "tail")

    def __init__(self, array: zarr.Array[Any], rows: int) -> None:
        self.array = array
        self.chunk = int(array.chunks[0])
        self.rows = rows
        self.tail: np.ndarray | None = None
        self._read_tail()

    def _read_tail(self) -> None:
        start = self.rows - self.rows % self.chunk
        self.tail = np.asarray(self.array[start:self.rows]) if self.rows > start else None

    @property
    def capacity(self) -> int:
        return int(self.array.shape[0])

    def _plan(self, values: np.ndarray) -> tuple[list[tuple[int, np.ndarray]], np.ndarray | None]:
        """The chunk writes ``(first row, chunk-shaped rows)`` that put ``values`` after the
        written rows, and the tail afterwards."""
        array, c = self.array, self.chunk
        if values.shape[1:] != array.shape[1:] or values.dtype != array.dtype:
            raise ValueError(f"array {array.path!r}: expected rows of shape {array.shape[1:]} and "
                             f"dtype {array.dtype}, got {values.shape[1:]} {values.dtype}")
        n, start = len(values), self.rows
        writes: list[tuple[int, np.ndarray]] = []
        if not n:
            return writes, self.tail
        values = np.ascontiguousarray(values)
        head, used = start - start % c, start % c
        pos = 0
        if used:  # the partial chunk: its kept rows, then the first new ones
            pos = min(n, c - used)
            block = np.zeros((c, *values.shape[1:]), values.dtype)
            block[:used] = self.tail
            block[used:used + pos] = values[:pos]
            writes.append((head, block))
            head += c
        while n - pos >= c:  # whole chunks: encoded from the caller's rows, no copy
            writes.append((head, values[pos:pos + c]))
            pos, head = pos + c, head + c
        if pos < n:
            block = np.zeros((c, *values.shape[1:]), values.dtype)
            block[:n - pos] = values[pos:]
            writes.append((head, block))
        end = (start + n) % c
        return writes, (writes[-1][1][:end] if end else None)

    def _reserve(self, rows: int) -> None:
        """Grow the capacity (a metadata write) to hold ``rows``, rounded to whole chunks."""
        need = -(-rows // self.chunk) * self.chunk
        if need > self.capacity:
            grown = -(-2 * self.capacity // self.chunk) * self.chunk
            self.array.resize((max(need, grown), *self.array.shape[1:]))

    def trim(self) -> None:
        """Cut the shape to the rows written (chunks past them are deleted)."""
        if self.capacity != self.rows:
            self.array.resize((self.rows, *self.array.shape[1:]))

    def rewind(self, rows: int) -> None:
        """Forget rows written after the first ``rows`` (an interrupted commit's)."""
        if rows < self.rows:
            self.rows = rows
            self._read_tail()


def write_columns(items: Sequence[tuple[Column, np.ndarray]]) -> None:
    """Append rows to several columns at once: their chunks are encoded and written
    concurrently (data only: nothing here is a commit). A column's :attr:`Column.rows`
    advances only once every write has succeeded."""
    plans = [(col, *col._plan(values), len(values)) for col, values in items]
    for col, _, _, n in plans:
        col._reserve(col.rows + n)

    async def _run() -> None:
        gate = asyncio.Semaphore(_CONCURRENCY)

        async def one(array: zarr.Array[Any], first: int, block: np.ndarray) -> None:
            async with gate:
                await array.async_array.setitem(slice(first, first + len(block)), block)

        await asyncio.gather(*(one(col.array, first, block)
                               for col, writes, _, _ in plans for first, block in writes))

    sync(_run())
    for col, _, tail, n in plans:
        col.rows += n
        col.tail = tail
