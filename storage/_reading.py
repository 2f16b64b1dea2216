"""The reader's chunk machinery and array helpers: the cache of decoded chunks, the fetching
and decoding of chunks, the threads that read an object store's arrays at once, which stores
and arrays may skip zarr's event loop, and the index arithmetic of segments and keys
(:mod:`storage.reader` and the modules reading a store with it use them)."""

from __future__ import annotations

import asyncio
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import zarr
from zarr.buffer import default_buffer_prototype
from zarr.core.sync import sync

from ._columns import SYNC_PATH, _threads
from .errors import StoreDamagedError

_CONCURRENCY = 32
"""Chunk fetches in flight at once on zarr's asynchronous path (fsspec stores), per array."""
_ARRAYS_AT_ONCE = 32
"""Arrays read at once on zarr's asynchronous path (see :meth:`RunStore._take_all`): each waits
for round trips, not a core (6 runs of an object store answering each request in 20 ms:
`read_episodes()` 635 ms with 8, 365 ms with 32; `verify` 1.9 s and 0.85 s)."""
_array_pool: ThreadPoolExecutor | None = None
_array_pool_lock = threading.Lock()


def _array_threads() -> ThreadPoolExecutor:
    """The threads that read the arrays of an object store concurrently (not the chunk threads
    of :func:`storage._columns._threads`, which a local read waits on)."""
    global _array_pool
    with _array_pool_lock:
        if _array_pool is None:
            _array_pool = ThreadPoolExecutor(_ARRAYS_AT_ONCE, thread_name_prefix="worldtap-read-arrays")
        return _array_pool


def _forget_array_threads() -> None:
    """In a forked child (a DataLoader worker): the parent's threads do not exist there."""
    global _array_pool, _array_pool_lock
    _array_pool, _array_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_array_threads)


class _ChunkCache:
    """Decoded chunks by ``(array path, chunk index)``, the least recently used dropped first
    once they hold more than ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self.items: OrderedDict[tuple[str, int], np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # the arrays of a read may be fetched on several threads

    def get(self, key: tuple[str, int]) -> np.ndarray | None:
        with self._lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: tuple[str, int], value: np.ndarray) -> None:
        with self._lock:
            if value.nbytes > self.capacity or key in self.items:
                return
            self.items[key] = value
            self.size += value.nbytes
            while self.size > self.capacity:
                self.size -= self.items.popitem(last=False)[1].nbytes

    def clear(self) -> None:
        with self._lock:
            self.items.clear()
            self.size = 0


def _local(store: Any) -> bool:
    """Whether ``store`` (a zarr store) can be read without zarr's event loop (local
    directories and memory stores); object stores cannot, and are read concurrently."""
    if not SYNC_PATH:
        return False
    from zarr.abc.store import SupportsGetSync

    return isinstance(store, SupportsGetSync)


def _sync_codecs(aa: Any) -> tuple[Any, ...] | None:
    """The codecs of array ``aa`` (a ``zarr.AsyncArray``) in encoding order, when its chunks
    can be fetched and decoded without the event loop (zarr's synchronous store and codec
    protocols: local directories and memory stores); ``None`` otherwise."""
    if not _local(aa.store_path.store):
        return None
    from zarr.abc.codec import SupportsSyncCodec
    from zarr.core.codec_pipeline import BatchedCodecPipeline

    pipeline = aa.codec_pipeline
    if not isinstance(pipeline, BatchedCodecPipeline):
        return None
    codecs = (*pipeline.array_array_codecs, pipeline.array_bytes_codec, *pipeline.bytes_bytes_codecs)
    return codecs if all(isinstance(c, SupportsSyncCodec) for c in codecs) else None


def _float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values stored as their 16 bits, as float32 (exactly)."""
    out: np.ndarray = (bits.astype(np.uint32) << 16).view(np.float32)
    return out


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``concatenate([arange(s, s + c) for s, c in zip(starts, counts)])``, without the loop."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    out: np.ndarray = np.arange(total, dtype=np.int64)
    if total:
        out += np.repeat(np.asarray(starts, np.int64) - (np.cumsum(counts) - counts), counts)
    return out


def _before(counts: np.ndarray, owner: np.ndarray) -> np.ndarray:
    """For segments grouped by ``owner`` (ascending), the rows of the same owner before each."""
    ends = np.cumsum(counts)
    starts = ends - counts
    first = np.r_[True, owner[1:] != owner[:-1]] if len(owner) else np.zeros(0, bool)
    out: np.ndarray = starts - np.maximum.accumulate(np.where(first, starts, 0))
    return out


def _span(start: Any, stop: Any, n: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``start``/``stop`` of :meth:`RunStore.read_batch` as one int64 per episode.

    Raises:
        ValueError: A negative bound, or an array whose length is not ``n``.
    """
    if start is None and stop is None:
        return None, None
    out = []
    for name, value, default in (("start", start, 0), ("stop", stop, np.iinfo(np.int64).max)):
        bound = np.asarray(default if value is None else value)
        if bound.ndim == 0:
            bound = np.full(n, bound)
        if bound.shape != (n,) or bound.dtype.kind not in "iu" or (n and int(bound.min()) < 0):
            raise ValueError(f"{name}: expected an integer >= 0 or one per episode ({n}), got {value!r}")
        out.append(bound.astype(np.int64))
    return out[0], out[1]


def _keys(*columns: np.ndarray) -> np.ndarray:
    """The rows of int64 ``columns`` as one structured array (sorts lexicographically)."""
    out = np.empty(len(columns[0]), [(f"k{i}", np.int64) for i in range(len(columns))])
    for i, column in enumerate(columns):
        out[f"k{i}"] = column
    return out


def _locate(table: tuple[np.ndarray, ...], wanted: tuple[np.ndarray, ...]) -> np.ndarray:
    """For each row of the key columns ``wanted``, the position of the last row of ``table``
    with the same keys, -1 where there is none."""
    keys = _keys(*table)
    order = np.argsort(keys, kind="stable")
    return _find(keys[order], order, _keys(*wanted))


def _find(keys: np.ndarray, order: np.ndarray, want: np.ndarray) -> np.ndarray:
    """For each of ``want``, ``order[i]`` of the last ``keys[i]`` equal to it (``keys``
    sorted), -1 where none is."""
    pos = np.searchsorted(keys, want, side="right") - 1
    found = pos >= 0
    found[found] = keys[pos[found]] == want[found]
    out: np.ndarray = np.where(found, order[np.maximum(pos, 0)], -1) if len(order) else np.full(len(want), -1)
    return out


def _missing_chunks(arr: zarr.Array[Any], start: int, stop: int) -> list[int]:
    """Row-chunk indices of ``arr`` within rows ``[start, stop)`` whose chunk is not stored
    (zarr would read them as the fill value)."""
    rows = int(arr.chunks[0])
    first, last = start // rows, (stop - 1) // rows
    meta = arr.metadata
    store = arr.store_path.store
    prefix = f"{arr.store_path.path}/" if arr.store_path.path else ""
    rest = (0,) * (len(arr.shape) - 1)
    keys = [(i, prefix + meta.encode_chunk_key((i, *rest))) for i in range(first, last + 1)]

    async def check() -> list[bool]:
        return list(await asyncio.gather(*(store.exists(k) for _, k in keys)))

    found = sync(check())
    return [i for (i, _), ok in zip(keys, found, strict=True) if not ok]


def _fetch(run: str, arr: zarr.Array[Any], chunk_ids: list[int],
           place: Callable[[int, np.ndarray], None]) -> list[np.ndarray]:
    """Fetch and decode row chunks ``chunk_ids`` of ``arr``, calling ``place(i, chunk)``
    for chunk ``chunk_ids[i]`` as soon as it is decoded (on the fetching threads: each
    call must touch only its own part of the output); returns the decoded chunks.

    Raises:
        StoreDamagedError: A chunk is missing or fails to decode (its checksum included).
    """
    aa = arr.async_array
    store = aa.store_path.store
    prefix = f"{aa.store_path.path}/" if aa.store_path.path else ""
    rest = (0,) * (len(arr.shape) - 1)
    keys = [prefix + aa.metadata.encode_chunk_key((i, *rest)) for i in chunk_ids]
    proto = default_buffer_prototype()
    spec = aa.metadata.get_chunk_spec((0, *rest), aa.config, proto)
    where = arr.path
    chunks: list[np.ndarray | None] = [None] * len(keys)
    missing: list[int] = []
    codecs = _sync_codecs(aa)
    if codecs is not None:
        stages = []
        for codec in codecs:
            stages.append((codec, spec))
            spec = codec.resolve_metadata(spec)

        getter: Any = store

        def work(i: int) -> None:
            data: Any = getter.get_sync(keys[i], prototype=proto)
            if data is None:
                missing.append(chunk_ids[i])
                return
            for codec, s in reversed(stages):
                data = codec._decode_sync(data, s)
            chunk = data.as_numpy_array()
            place(i, chunk)
            chunks[i] = chunk

        futures = [_threads().submit(work, i) for i in range(len(keys))]
        errors = [exc for f in futures if (exc := f.exception()) is not None]
    else:
        async def fetch() -> list[Any]:
            gate = asyncio.Semaphore(_CONCURRENCY)

            async def one(key: str) -> Any:
                async with gate:
                    return await store.get(key, prototype=proto)

            return list(await asyncio.gather(*(one(k) for k in keys)))

        errors = []
        try:
            found = sync(fetch())
            missing = [chunk_ids[i] for i, data in enumerate(found) if data is None]
            if not missing:
                decoded = sync(aa.codec_pipeline.decode([(data, spec) for data in found]))
                for i, chunk in enumerate(decoded):
                    if chunk is None:
                        raise ValueError(f"chunk {chunk_ids[i]} decoded to nothing")
                    value = chunks[i] = chunk.as_numpy_array()
                    place(i, value)
        except Exception as exc:
            errors = [exc]
    if missing:
        raise StoreDamagedError(f"run {run!r}: array {where!r} lacks chunk(s) {sorted(missing)[:5]} "
                                f"of its committed rows")
    if errors:
        raise StoreDamagedError(f"run {run!r}: array {where!r} chunk(s) cannot be read: "
                                f"{errors[0]!r}") from errors[0]
    return [c for c in chunks if c is not None]

def _at_once(calls: Sequence[tuple[Callable[..., Any], tuple[Any, ...]]], concurrent: bool) -> list[Any]:
    """``function(*args)`` of each of ``calls``, in order; with ``concurrent`` and two or more,
    at once on the array threads (calls that use those threads themselves must not come here:
    they would wait on threads busy waiting for them), the first error in ``calls`` order
    raised after every call has ended."""
    if not concurrent or len(calls) < 2:
        return [function(*args) for function, args in calls]
    futures = [_array_threads().submit(function, *args) for function, args in calls]
    try:
        return [future.result() for future in futures]
    finally:
        wait(futures)
