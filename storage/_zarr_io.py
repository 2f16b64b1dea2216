"""Low-level zarr helpers shared by the writer and the reader: opening stores, codecs, names.

Nothing here knows about episodes. Everything zarr raises while opening is translated into
:class:`storage.errors.StoreFormatError` at this boundary.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias
from urllib.parse import quote, unquote

import numpy as np
import zarr
import zarr.codecs
from zarr.abc.store import Store
from zarr.core.array_spec import ArrayConfigParams
from zarr.core.buffer import Buffer
from zarr.core.chunk_key_encodings import ChunkKeyEncodingParams
from zarr.core.sync import sync
from zarr.storage import LocalStore

from .errors import StoreFormatError

__all__ = [
    "APPEND_CONFIG",
    "CHUNK_KEYS",
    "EPISODE_COLUMNS",
    "FORMAT",
    "FORMAT_VERSION",
    "GAP_COLUMNS",
    "HOOKS",
    "SEGMENT_COLUMNS",
    "Compression",
    "StoreLocation",
    "TABLE_CHUNK",
    "VAR_COLUMNS",
    "append_all",
    "as_array",
    "compressors",
    "decode_name",
    "encode_name",
    "local_path",
    "open_store",
    "remove_partial_files",
    "resize_tail",
    "zero_rows",
]

FORMAT: Final = "worldtap.runstore"
FORMAT_VERSION: Final = 1
HOOKS: Final = ("pre_step", "post_step", "pre_reset", "post_reset")
"""Lifecycle points, in the order of their codes in ``data/<term>/_hook``."""

EPISODE_COLUMNS: dict[str, str] = {
    "world": "int64", "index": "int64", "length": "int64", "success": "bool",
    "terminated": "bool", "truncated": "bool", "end_step": "int64", "end_seq": "int64",
    "segment_start": "int64", "segment_count": "int64",
}
SEGMENT_COLUMNS: dict[str, str] = {"episode": "int64", "topic": "int64", "offset": "int64", "rows": "int64"}
GAP_COLUMNS: dict[str, str] = {"expected": "int64", "received": "int64", "source": "int64",
                                 "topic": "int64"}
VAR_COLUMNS = ("world", "episode", "step", "seq")
TABLE_CHUNK = 16384
"""Columns of the episode, segment, gap and variation-sample tables, and their chunk length."""

APPEND_CONFIG: Final[ArrayConfigParams] = {"write_empty_chunks": True}
"""Config of the data arrays the daemon appends to: episode rows are never the fill value
worth skipping, and checking each chunk against it costs a chunk-sized compare. Reclaiming
crash debris (:func:`zero_rows`) writes with ``write_empty_chunks=False`` instead."""

CHUNK_KEYS: Final[ChunkKeyEncodingParams] = {"name": "default", "separator": "."}
"""Chunk key encoding of the data arrays: ``c.<row chunk>.0`` files beside ``zarr.json``.
With ``/`` every row chunk of a multi-dimensional field would be a directory of its own,
and creating a directory per chunk costs as much as writing a small chunk."""

Compression: TypeAlias = Literal["lz4", "zstd", "none"]
StoreLocation: TypeAlias = "str | os.PathLike[str] | Store"


class SyncedLocalStore(LocalStore):
    """A :class:`zarr.storage.LocalStore` whose every write is ``fsync``-ed (file and directory)
    before the write returns, so a commit reported afterwards survives power loss."""

    async def set(self, key: str, value: Buffer) -> None:
        await super().set(key, value)
        await asyncio.to_thread(_fsync_path, self.root / key)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:  # new groups' metadata
        await super().set_if_not_exists(key, value)
        await asyncio.to_thread(_fsync_path, self.root / key)

    def set_sync(self, key: str, value: Buffer) -> None:
        super().set_sync(key, value)
        _fsync_path(self.root / key)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def local_path(location: StoreLocation) -> Path | None:
    """The directory of a local store location (``file://`` URLs included), else ``None``."""
    if isinstance(location, LocalStore):
        return Path(location.root)
    if isinstance(location, Store):
        return None
    text = os.fspath(location)
    if text.startswith("file://"):
        return Path(text.removeprefix("file://"))
    if "://" in text:
        return None
    return Path(text)


def open_store(location: StoreLocation, *, fsync: bool = False, read_only: bool = False) -> Store:
    """A zarr store for a local directory, an fsspec URL (``s3://...``, ``memory://``) or a
    ready-made :class:`zarr.abc.store.Store`.

    Args:
        fsync: Sync every write of a local store to disk before it returns. Ignored (no
            stronger guarantee exists) for stores that are not local directories.
    """
    if isinstance(location, Store):
        return location
    path = local_path(location)
    if path is not None:
        if read_only and not path.is_dir():
            raise StoreFormatError(f"no run store at {str(path)!r}: the directory does not exist")
        cls = SyncedLocalStore if fsync and not read_only else LocalStore
        return cls(path, read_only=read_only)
    try:
        return zarr.storage.FsspecStore.from_url(os.fspath(location), read_only=read_only)
    except Exception as exc:  # fsspec raises many kinds; one of ours at the boundary
        raise StoreFormatError(f"cannot open store URL {os.fspath(location)!r}: {exc}") from exc


def compressors(name: Compression) -> Any:
    """The zarr v3 compressor chain for a compression name (``"lz4"`` is the fast default)."""
    if name == "lz4":
        return (zarr.codecs.BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"),)
    if name == "zstd":
        return (zarr.codecs.ZstdCodec(level=3),)
    if name == "none":
        return None
    raise ValueError(f"compression: expected one of 'lz4', 'zstd', 'none', got {name!r}")


def encode_name(name: str) -> str:
    """A zarr node name for a run id or variation key (``/`` and ``%`` are escaped)."""
    encoded = quote(name, safe="")
    if not encoded or encoded in (".", "..") or encoded.startswith("__"):
        encoded = "%" + encoded.encode().hex()
    return encoded


def decode_name(node: str) -> str:
    """Inverse of :func:`encode_name` for names produced by it."""
    return unquote(node)


def append_all(pairs: Sequence[tuple[zarr.Array[Any], np.ndarray]]) -> None:
    """Append to several arrays at once: one event-loop round trip, their chunks encoded and
    written concurrently. Each array grows by its own block (data first, as ever: nothing
    here is a commit)."""

    async def _run() -> None:
        await asyncio.gather(*(arr.async_array.append(values) for arr, values in pairs))

    sync(_run())


def zero_rows(array: zarr.Array[Any], start: int, stop: int, *, piece_rows: int = 1 << 16) -> None:
    """Overwrite rows ``[start, stop)`` with the fill value; chunks left entirely empty are
    deleted by zarr (``write_empty_chunks=False``), which is how crash debris is reclaimed."""
    stop = min(stop, array.shape[0])
    array = array.with_config({"write_empty_chunks": False})
    fill = np.zeros((min(piece_rows, max(stop - start, 0)), *array.shape[1:]), dtype=array.dtype)
    while start < stop:
        end = min(stop, start + piece_rows)
        array[start:end] = fill[: end - start]
        start = end


def remove_partial_files(location: StoreLocation) -> int:
    """Delete the temporary files of writes a crash interrupted (zarr writes ``*.partial``
    files and renames them into place). Only for local stores, under the store lock."""
    path = local_path(location)
    if path is None or not path.is_dir():
        return 0
    removed = 0
    for debris in path.rglob("*.partial"):
        debris.unlink(missing_ok=True)
        removed += 1
    return removed


def as_array(node: object) -> zarr.Array[Any]:
    if not isinstance(node, zarr.Array):
        raise StoreFormatError(f"expected a zarr array, got {node!r}")
    return node


def resize_tail(columns: Mapping[str, zarr.Array[Any]], n: int) -> None:
    """Cut arrays back to ``n`` committed rows (debris of an interrupted commit, or unused
    capacity): zarr deletes the chunks past the new end, and the rows past ``n`` in the
    chunk that holds it are zeroed first, so no uncommitted byte survives the cut."""
    for arr in columns.values():
        if arr.shape[0] > n:
            rows = int(arr.chunks[0])
            zero_rows(arr, n, -(-n // rows) * rows)
            arr.resize((n, *arr.shape[1:]))
