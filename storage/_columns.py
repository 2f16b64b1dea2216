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
- a whole chunk of the caller's rows is encoded straight from them (a view, no copy);
- where the array's codecs and store support zarr's synchronous protocols
  (:class:`zarr.abc.codec.SupportsSyncCodec`, :class:`zarr.abc.store.SupportsSyncStore`: local
  directories and memory stores with the built-in codecs), chunks are encoded and written by
  a pool of plain threads that hold the GIL only briefly per chunk. zarr's asynchronous write
  path costs about a millisecond of event-loop work per chunk, all of it holding the GIL that
  the daemon's receiving thread needs. Other stores (fsspec URLs, sharded arrays) take
  zarr's asynchronous path.

:meth:`Column.trim` cuts the shape back to the rows written, so a finished run's arrays have
their exact length for plain zarr readers.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import zarr
from zarr.core.sync import sync

try:  # zarr >= 3.1.6; where these move or are missing, every column takes the asynchronous path
    from zarr.abc.codec import SupportsSyncCodec
    from zarr.abc.store import SupportsDeleteSync, SupportsSetSync
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.codec_pipeline import BatchedCodecPipeline, fill_value_or_default
    from zarr.core.metadata.v3 import ArrayV3Metadata
except ImportError:  # pragma: no cover - depends on the installed zarr
    SYNC_PATH = False
else:
    SYNC_PATH = True

__all__ = ["SYNC_PATH", "Column", "sync_path", "write_columns"]

_CONCURRENCY = 8
"""Chunk writes in flight at once on zarr's asynchronous path (each holds one chunk)."""


class _ChunkEncoder:
    """Encodes a whole chunk with the array's own codecs and writes it with the store's
    synchronous ``set_sync``: what zarr's pipeline does for a complete chunk, without the
    event loop. Build it with :meth:`of`, which says ``None`` where the array's codecs or
    store lack the synchronous protocols."""

    __slots__ = ("fill", "meta", "prefix", "proto", "skip_empty", "stages", "store")

    def __init__(self, array: zarr.Array[Any], codecs: tuple[Any, ...]) -> None:
        aa = array.async_array
        self.meta = aa.metadata
        self.proto = default_buffer_prototype()
        spec = self.meta.get_chunk_spec((0,) * len(array.shape), aa.config, self.proto)
        self.fill = fill_value_or_default(spec)
        self.skip_empty = not aa.config.write_empty_chunks
        self.stages: list[tuple[Any, Any]] = []
        for codec in codecs:
            self.stages.append((codec, spec))
            spec = codec.resolve_metadata(spec)
        self.store: Any = aa.store_path.store
        self.prefix = f"{aa.store_path.path}/" if aa.store_path.path else ""

    @classmethod
    def of(cls, array: zarr.Array[Any]) -> _ChunkEncoder | None:
        if not SYNC_PATH or not _sync_allowed:
            return None
        aa = array.async_array
        pipeline = aa.codec_pipeline
        store = aa.store_path.store
        if not (isinstance(aa.metadata, ArrayV3Metadata) and array.shards is None
                and isinstance(pipeline, BatchedCodecPipeline)
                and isinstance(store, SupportsSetSync) and isinstance(store, SupportsDeleteSync)):
            return None
        codecs = (*pipeline.array_array_codecs, pipeline.array_bytes_codec,
                  *pipeline.bytes_bytes_codecs)
        if not all(isinstance(c, SupportsSyncCodec) for c in codecs):
            return None
        return cls(array, codecs)

    def write(self, first: int, block: np.ndarray) -> None:
        """Encode and store the chunk starting at row ``first`` (``block``: chunk-shaped)."""
        coords = (first // block.shape[0],) + (0,) * (block.ndim - 1)
        key = self.prefix + self.meta.encode_chunk_key(coords)
        rows: Any = block
        data: Any = self.proto.nd_buffer.from_ndarray_like(rows)
        if self.skip_empty and data.all_equal(self.fill):
            self.store.delete_sync(key)
            return
        for codec, spec in self.stages:
            data = codec._encode_sync(data, spec)
        out = data.as_numpy_array()
        if np.may_share_memory(out, block):  # uncompressed: don't let a store keep our rows
            data = self.proto.buffer.from_bytes(out.tobytes())
        self.store.set_sync(key, data)


_sync_allowed = True


def sync_path(enabled: bool) -> None:
    """Allow (default) or forbid the synchronous chunk path for columns made afterwards
    (tests run the asynchronous fallback with it forbidden)."""
    global _sync_allowed
    _sync_allowed = enabled


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
        rows: Rows already written (on resume: the committed count). The partial chunk
            holding the last of them is read back once, here.
    """

    __slots__ = ("array", "chunk", "encoder", "rows", "tail")

    def __init__(self, array: zarr.Array[Any], rows: int) -> None:
        self.array = array
        self.chunk = int(array.chunks[0])
        self.rows = rows
        self.tail: np.ndarray | None = None
        self.encoder = _ChunkEncoder.of(array)
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

    pool = _threads()
    futures: list[Future[None]] = [pool.submit(col.encoder.write, first, block)
                                   for col, writes, _, _ in plans if col.encoder is not None
                                   for first, block in writes]
    slow = [(col.array, first, block) for col, writes, _, _ in plans if col.encoder is None
            for first, block in writes]

    async def _run() -> None:
        gate = asyncio.Semaphore(_CONCURRENCY)

        async def one(array: zarr.Array[Any], first: int, block: np.ndarray) -> None:
            async with gate:
                await array.async_array.setitem(slice(first, first + len(block)), block)

        await asyncio.gather(*(one(*write) for write in slow))

    try:
        if slow:
            sync(_run())
    finally:
        errors = [exc for f in futures if (exc := f.exception()) is not None]  # waits for all
    if errors:
        raise errors[0]
    for col, _, tail, n in plans:
        col.rows += n
        col.tail = tail
