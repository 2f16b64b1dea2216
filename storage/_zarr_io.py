"""How the run writer hands whole chunks to zarr: the one module that knows zarr's internals.

Two ways to store a run of whole chunks of one array, byte-for-byte the same files:

- :func:`write_rows`, zarr's public API (``zarr.Array.__setitem__`` of whole chunks, so zarr
  never reads one back). Every store and codec takes it: fsspec URLs, sharded arrays, a codec
  pipeline chosen in ``zarr.config`` (``codec_pipeline.path``, e.g. ``zarrs``).
- :class:`ChunkEncoder`, for local directories and memory stores with zarr's own codec
  pipeline: the chunk is encoded with the array's codecs (``_encode_sync``) and written with the
  store's ``set_sync``, on the caller's thread, without zarr's event loop, whose per-chunk work
  holds the GIL that the daemon's receiving thread needs. It uses names zarr keeps private
  (``zarr.core.codec_pipeline``, ``zarr.core.metadata.v3``, the codecs' ``_encode_sync``): where
  any of them is missing or has changed, :meth:`ChunkEncoder.of` answers ``None`` and the
  array takes the public path, so a zarr release that moves them costs speed, never data.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import numpy as np
import zarr

__all__ = ["ChunkEncoder", "private_api", "sync_path", "write_rows"]

_sync_allowed = True


def sync_path(enabled: bool) -> None:
    """Allow (default) or forbid :class:`ChunkEncoder` for columns made afterwards (tests run
    the public path with it forbidden)."""
    global _sync_allowed
    _sync_allowed = enabled


def private_api() -> SimpleNamespace | None:
    """zarr's names the thread path needs, looked up now; ``None`` where one is missing
    (zarr moved or renamed it: every array then takes the public path)."""
    names = {"SupportsSetSync": "zarr.abc.store",
             "SupportsDeleteSync": "zarr.abc.store", "default_buffer_prototype": "zarr.core.buffer",
             "BatchedCodecPipeline": "zarr.core.codec_pipeline",
             "fill_value_or_default": "zarr.core.codec_pipeline", "ArrayV3Metadata": "zarr.core.metadata.v3"}
    try:
        return SimpleNamespace(**{name: getattr(importlib.import_module(module), name)
                                  for name, module in names.items()})
    except (ImportError, AttributeError):
        return None


class ChunkEncoder:
    """Encodes a whole chunk with the array's own codecs and writes it with the store's
    synchronous ``set_sync``: what zarr's pipeline does for a complete chunk, without the
    event loop. Build it with :meth:`of`."""

    __slots__ = ("fill", "meta", "prefix", "proto", "skip_empty", "stages", "store")

    def __init__(self, array: zarr.Array[Any], codecs: tuple[Any, ...], api: SimpleNamespace) -> None:
        aa = array.async_array
        self.meta = aa.metadata
        self.proto = api.default_buffer_prototype()
        spec = self.meta.get_chunk_spec((0,) * len(array.shape), aa.config, self.proto)
        self.fill = api.fill_value_or_default(spec)
        self.skip_empty = not aa.config.write_empty_chunks
        self.stages: list[tuple[Any, Any]] = []
        for codec in codecs:
            self.stages.append((codec, spec))
            spec = codec.resolve_metadata(spec)
        self.store: Any = aa.store_path.store
        self.prefix = f"{aa.store_path.path}/" if aa.store_path.path else ""

    @classmethod
    def of(cls, array: zarr.Array[Any]) -> ChunkEncoder | None:
        """The encoder of ``array``, or ``None`` where it must take :func:`write_rows`: the
        thread path is forbidden, zarr lacks a private name it needs, the array is sharded or
        not v3, its codec pipeline is not zarr's own, or its store or a codec lacks zarr's
        synchronous protocols."""
        api = private_api() if _sync_allowed else None
        if api is None:
            return None
        aa = array.async_array
        pipeline: Any = aa.codec_pipeline
        store = aa.store_path.store
        if not (isinstance(aa.metadata, api.ArrayV3Metadata) and array.shards is None
                and type(pipeline) is api.BatchedCodecPipeline
                and isinstance(store, api.SupportsSetSync) and isinstance(store, api.SupportsDeleteSync)):
            return None
        codecs = (*pipeline.array_array_codecs, pipeline.array_bytes_codec, *pipeline.bytes_bytes_codecs)
        if not all(callable(getattr(c, "_encode_sync", None)) for c in codecs):
            return None
        return cls(array, codecs, api)

    def write(self, first: int, block: np.ndarray) -> None:
        """Encode and store the chunk starting at row ``first`` (``block``: chunk-shaped)."""
        coords = (first // block.shape[0],) + (0,) * (block.ndim - 1)
        key = self.prefix + self.meta.encode_chunk_key(coords)
        data: Any = self.proto.nd_buffer.from_ndarray_like(block)
        if self.skip_empty and data.all_equal(self.fill):
            self.store.delete_sync(key)
            return
        for codec, spec in self.stages:
            data = codec._encode_sync(data, spec)
        out = data.as_numpy_array()
        if np.may_share_memory(out, block):  # uncompressed: don't let a store keep our rows
            data = self.proto.buffer.from_bytes(out.tobytes())
        self.store.set_sync(key, data)


def write_rows(array: zarr.Array[Any], first: int, rows: np.ndarray) -> None:
    """Store ``rows`` (whole chunks: ``first`` and ``len(rows)`` are multiples of the chunk
    rows) from row ``first`` on, with zarr's public API; zarr reads no chunk back."""
    array[first:first + len(rows)] = rows
