"""The run-store format: layout constants, node names, codecs, JSON-safe attributes, and opening
stores. Shared by the writer and the reader; nothing here knows about episodes.

Everything zarr or fsspec raise while opening is translated into :class:`storage.StoreFormatError`
at this boundary.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import math
import os
import re
import uuid
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

import numpy as np
import zarr
import zarr.codecs
from zarr.abc.buffer import Buffer
from zarr.abc.store import Store
from zarr.storage import LocalStore

from .errors import StoreFormatError

if TYPE_CHECKING:  # zarr's public config argument is typed with this TypedDict
    from zarr.core.array_spec import ArrayConfigParams

__all__ = [
    "ALL_RUNS",
    "APPEND_CONFIG",
    "CHUNK_KEYS",
    "EPISODE_COLUMNS",
    "FORMAT",
    "FORMAT_VERSION",
    "GAP_COLUMNS",
    "HOOKS",
    "HOOK_NODE",
    "ROW_DTYPES",
    "SEGMENT_COLUMNS",
    "STEP_NODE",
    "TABLE_CHUNK",
    "VAR_COLUMNS",
    "Compression",
    "Partition",
    "StoreLocation",
    "codecs",
    "from_json",
    "is_partial_file",
    "local_path",
    "name_of",
    "node_name",
    "numpy_dtype",
    "open_store",
    "remove_partial_files",
    "root_metadata",
    "child_nodes",
    "create_groups",
    "resize_tail",
    "to_json",
    "url_options",
    "zero_rows",
]

FORMAT: Final = "worldtap.runstore"
FORMAT_VERSION: Final = 2
"""Version 2: node names escaped reversibly (:func:`node_name`), every chunk checksummed
(crc32c), every chunk written (tables too), bfloat16 fields stored as their bits."""
HOOKS: Final = ("pre_step", "post_step", "pre_reset", "post_reset", "post_physics_decimation_step")
"""Lifecycle points, in the order of their codes in ``data/<term>/_hook``. Append-only: a new
point gets the next code, so the codes of existing stores keep their meaning (a store whose
root lists fewer hooks is brought up to this list when a writer opens it)."""
STEP_NODE: Final = "_step"
HOOK_NODE: Final = "_hook"
"""Nodes of a term's row columns in ``data/<term>/``: the global step (int64) and the lifecycle
code (uint8, into :data:`HOOKS`) of each row. They are no fields: a field's node is always
:func:`node_name` of its name, which escapes a leading ``_`` (a field named ``_step`` is node
``%5Fstep``), so no field can land on them."""
ROW_DTYPES: Final[Mapping[str, str]] = {STEP_NODE: "int64", HOOK_NODE: "uint8"}

EPISODE_COLUMNS: Final[Mapping[str, str]] = {
    "world": "int64", "index": "int64", "length": "int64", "success": "bool",
    "terminated": "bool", "truncated": "bool", "end_step": "int64", "end_seq": "int64",
    "segment_start": "int64", "segment_count": "int64",
}
SEGMENT_COLUMNS: Final[Mapping[str, str]] = {"episode": "int64", "topic": "int64", "offset": "int64",
                                             "rows": "int64"}
GAP_COLUMNS: Final[Mapping[str, str]] = {"expected": "int64", "received": "int64", "source": "int64",
                                         "topic": "int64"}
VAR_COLUMNS: Final = ("world", "episode", "step", "seq")
TABLE_CHUNK: Final = 16384
"""Columns of the episode, segment, gap and variation-sample tables, and their chunk length."""

APPEND_CONFIG: Final[ArrayConfigParams] = {"write_empty_chunks": True}
"""Config of every array the writer appends to. Every chunk inside the committed rows exists
in the store (a chunk of zeros too), so a missing chunk is damage the reader can detect
instead of reading zeros; and checking each chunk against the fill value would cost a
chunk-sized compare. Reclaiming crash debris (:func:`zero_rows`) deletes chunks on purpose."""

CHUNK_KEYS: Final[dict[str, str]] = {"name": "default", "separator": "."}
"""Chunk key encoding of the data arrays: ``c.<row chunk>.0`` files beside ``zarr.json``.
With ``/`` every row chunk of a multi-dimensional field would be a directory of its own,
and creating a directory per chunk costs as much as writing a small chunk."""

Compression: TypeAlias = Literal["lz4", "zstd", "none"]
StoreLocation: TypeAlias = "str | os.PathLike[str] | Store"

_MAX_NODE: Final = 120
"""Longest node name written as is (escaped); longer ones are cut and hashed (names of 255
bytes are the common file-name limit, and an escaped byte takes three)."""
_PLAIN: Final = re.compile(rb"[A-Za-z0-9\-]")


# -- node names --------------------------------------------------------------------------------


def node_name(name: str) -> str:
    """The zarr node name of a run id, term, field or variation key: the same name always gives
    the same node, different names never collide, and no name can climb out of its group or
    land on a reserved name (``zarr.json``, ``..``, ``__``-prefixed, ``*.partial``, or the row
    columns :data:`STEP_NODE` and :data:`HOOK_NODE`).

    Bytes other than ASCII letters, digits and ``-`` (and ``_`` after the first character)
    are written as ``%XX``; :func:`name_of` reverses that. Escaped names longer than 120
    characters are cut and end in ``~`` and a hash of the whole name (not reversible: the
    run's attributes hold the names).

    Raises:
        ValueError: ``name`` is empty.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"expected a non-empty name, got {name!r}")
    raw = name.encode("utf-8", "surrogatepass")
    out = []
    for i, byte in enumerate(raw):
        char = bytes((byte,))
        plain = _PLAIN.fullmatch(char) is not None or (byte == ord("_") and i > 0)
        out.append(char.decode() if plain else f"%{byte:02X}")
    encoded = "".join(out)
    if len(encoded) > _MAX_NODE:
        digest = hashlib.sha256(raw).hexdigest()[:20]
        cut = encoded[:_MAX_NODE - 21]
        cut = cut[:cut.rfind("%")] if "%" in cut[-2:] else cut  # never split an escape
        encoded = f"{cut}~{digest}"
    return encoded


def name_of(node: str) -> str | None:
    """The name :func:`node_name` turned into ``node``, or ``None`` for a hashed long name or a
    node it cannot have written."""
    if "~" in node:
        return None
    try:
        name = _unescape(node)
    except (ValueError, UnicodeDecodeError):
        return None
    return name if node_name(name) == node else None


def _unescape(node: str) -> str:
    out = bytearray()
    i = 0
    while i < len(node):
        if node[i] == "%":
            out.append(int(node[i + 1:i + 3], 16))
            i += 3
        else:
            out.extend(node[i].encode())
            i += 1
    return out.decode("utf-8", "surrogatepass")


# -- partitions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Partition:
    """Partition ``index`` of ``count``: the runs one of ``count`` daemons on a store writes.

    A run belongs to partition ``crc32(run id as UTF-8) % count``, the same in every process
    and on every host (never Python's salted ``hash``); the sessions ``<run>#2``, ... of a run
    id belong with it, since they share the id. ``Partition(0, 1)`` holds every run.

    Raises:
        ValueError: ``count`` is not a positive int or ``index`` not in ``[0, count)``.
    """

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        for name, value in (("index", self.index), ("count", self.count)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"partition {name}: expected an int, got {value!r}")
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"partition: expected K/N with 0 <= K < N, got "
                             f"{self.index}/{self.count}")

    @classmethod
    def parse(cls, text: str) -> Partition:
        """``"K/N"`` -> ``Partition(K, N)``.

        Raises:
            ValueError: ``text`` is not two integers ``K/N`` with ``0 <= K < N``.
        """
        index, slash, count = text.strip().partition("/")
        if not slash or not index.isdigit() or not count.isdigit():
            raise ValueError(f"partition: expected K/N (e.g. 0/3), got {text!r}")
        return cls(int(index), int(count))

    @property
    def whole(self) -> bool:
        """Whether this partition holds every run (``count == 1``)."""
        return self.count == 1

    def owns(self, run: str) -> bool:
        """Whether run id ``run`` (the published id, not a session's stored name) is ours."""
        if self.count == 1:
            return True
        return zlib.crc32(run.encode("utf-8", "surrogatepass")) % self.count == self.index

    def owns_meta(self, meta: Mapping[str, Any]) -> bool:
        """Whether the stored run with attributes ``meta`` is ours (by the id it was
        published under: ``session_of``, else ``run``)."""
        return self.owns(str(meta.get("session_of") or meta.get("run")))

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


ALL_RUNS: Final = Partition()
"""The partition of a daemon alone on its store: every run."""


# -- JSON attributes -------------------------------------------------------------------------


def to_json(value: Any) -> Any:
    """``value`` made storable in zarr's JSON attributes without loss: ``bytes`` become
    ``{"$bytes": base64}``, non-finite floats ``{"$float": "nan"}`` (JSON has none), bytes keys
    ``"$bytes:" + base64``; :func:`from_json` reverses it."""
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else "$bytes:" + base64.b64encode(bytes(k)).decode()
                 if isinstance(k, bytes | bytearray) else str(k)): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if isinstance(value, bytes | bytearray | memoryview):
        return {"$bytes": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": repr(value)}
    if isinstance(value, np.generic):
        return to_json(value.item())
    return value


def from_json(value: Any) -> Any:
    """Inverse of :func:`to_json`."""
    if isinstance(value, dict):
        if len(value) == 1 and "$bytes" in value and isinstance(value["$bytes"], str):
            return base64.b64decode(value["$bytes"])
        if len(value) == 1 and "$float" in value and isinstance(value["$float"], str):
            return float(value["$float"])
        return {(base64.b64decode(k[7:]) if k.startswith("$bytes:") else k): from_json(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


# -- dtypes and codecs -----------------------------------------------------------------------


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype an array of wire dtype ``name`` is stored as (bfloat16: its 16 bits)."""
    return np.dtype("uint16" if name == "bfloat16" else name)


def codecs(name: Compression) -> tuple[Any, ...]:
    """The zarr v3 bytes-to-bytes codecs for a compression name, ending with a crc32c checksum
    of the stored bytes (a torn or altered chunk fails to decode instead of reading wrong)."""
    crc = zarr.codecs.Crc32cCodec()
    if name == "lz4":
        return (zarr.codecs.BloscCodec(cname="lz4", clevel=1, shuffle="shuffle"), crc)
    if name == "zstd":
        return (zarr.codecs.ZstdCodec(level=3), crc)
    if name == "none":
        return (crc,)
    raise ValueError(f"compression: expected one of 'lz4', 'zstd', 'none', got {name!r}")


# -- stores ----------------------------------------------------------------------------------


class RunLocalStore(LocalStore):
    """The :class:`zarr.storage.LocalStore` worldtap writes local run stores through.

    - An exclusive create (``set_if_not_exists``) of a key that exists writes nothing. zarr
      calls it for the ``zarr.json`` of every ancestor group each time it creates an array or a
      group, so without this check each creation wrote (and a kill in the middle left) a
      temporary file beside the root's and ``runs/``'s metadata, outside any run.
    - A write whose temporary file disappears before it is renamed into place (another
      daemon's startup removed it as crash debris) is written again, not failed.
    - ``durable``: every write is ``fsync``-ed, renamed over the key, and its directory is
      ``fsync``-ed (:class:`SyncedLocalStore`).
    """

    durable = False

    async def set(self, key: str, value: Buffer) -> None:
        self._check_writable()
        await asyncio.to_thread(_write, self.root / key, value, self.durable, False)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:  # new nodes' metadata
        self._check_writable()
        await asyncio.to_thread(_write, self.root / key, value, self.durable, True)

    def set_sync(self, key: str, value: Buffer) -> None:
        self._check_writable()
        _write(self.root / key, value, self.durable, False)


class SyncedLocalStore(RunLocalStore):
    """A :class:`RunLocalStore` whose every write reaches the disk before it returns: the bytes
    go to a temporary file that is ``fsync``-ed, renamed over the key, and the directory is
    ``fsync``-ed. A power cut leaves either the old file or the complete new one (the previous
    commit point stays readable until the new one is whole on disk)."""

    durable = True


_WRITE_ATTEMPTS = 5


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)


def _write(path: Path, value: Buffer, durable: bool, exclusive: bool) -> None:
    """Write ``value`` to ``path`` through a temporary file beside it (see
    :class:`RunLocalStore`); ``exclusive``: only if ``path`` does not exist.

    A chunk write is a handful of system calls (create, write, rename): the parent directory
    is made only when the create finds it missing, and the temporary file is removed only
    when the rename did not happen (a commit of hundreds of columns writes hundreds of files).
    """
    target = os.fspath(path)
    for _ in range(_WRITE_ATTEMPTS):
        if exclusive and os.path.exists(target):
            return
        tmp = f"{target}.{uuid.uuid4().hex}.partial"
        try:
            fd = os.open(tmp, _CREATE, 0o666)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            fd = os.open(tmp, _CREATE, 0o666)
        placed = False
        try:
            with open(fd, "wb", closefd=True) as f:
                f.write(value.as_buffer_like())
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            try:
                if exclusive:
                    os.link(tmp, target)
                else:
                    os.replace(tmp, target)
                    placed = True
            except FileExistsError:  # exclusive: another writer created it meanwhile
                return
            except FileNotFoundError:
                if not os.path.isdir(os.path.dirname(target)):
                    raise
                continue  # the temporary file was removed as debris: write it again
        finally:
            if not placed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        if durable:
            fd = os.open(os.path.dirname(target), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        return
    raise OSError(f"{target!r}: its temporary file was removed {_WRITE_ATTEMPTS} times before it "
                  f"could be renamed into place (another process keeps deleting *.partial files here)")


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


_EXTRAS: Final[Mapping[str, str]] = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
"""fsspec protocols whose filesystem a worldtap extra installs (``pip install 'worldtap[s3]'``)."""
_URL_OPTIONS: Final[Mapping[str, Mapping[str, Any]]] = {
    "s3": {"max_concurrency": 1},
}
"""Options worldtap opens URLs of a protocol with, unless fsspec's configuration sets them.
Every URL store gets ``use_listings_cache=False``: a cached listing never learns of runs
another process (or thread: fsspec keeps a filesystem per thread) adds, so a reader's
``refresh()`` would not see them. s3fs reads a whole object with a HEAD first, to split it
into concurrent ranged reads when it exceeds its 50 MiB block; chunks and metadata never do,
so with ``max_concurrency=1`` a read is one request instead of two."""


def url_options(url: str) -> dict[str, Any]:
    """The fsspec options worldtap opens the store (or lease) URL ``url`` with.

    Raises:
        StoreFormatError: The filesystem of ``url``'s protocol is not installed (the message
            names the ``pip install`` that adds it) or the protocol is unknown.
    """
    import fsspec

    classes = [_filesystem(url, part) for part in url.split("::")]
    if len(classes) > 1:  # a chained URL: its options are the user's, per protocol
        return {}
    protocol, cls = classes[0]
    names = cls.protocol if isinstance(cls.protocol, tuple | list) else (protocol,)
    options: dict[str, Any] = {"use_listings_cache": False}
    for name in names:
        options.update(_URL_OPTIONS.get(name, {}))
    configured = {key for name in names for key in fsspec.config.conf.get(name, {})}
    return {key: value for key, value in options.items() if key not in configured}


def _filesystem(url: str, part: str) -> tuple[str, Any]:
    """The protocol of one part of ``url`` and its fsspec filesystem class.

    Raises:
        StoreFormatError: The filesystem is not installed, or the protocol is unknown.
    """
    import fsspec

    protocol = fsspec.core.split_protocol(part)[0] or "file"
    try:
        return protocol, fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'worldtap[{extra}]'" if extra else str(exc)
        raise StoreFormatError(f"store {url!r}: the filesystem for {protocol}:// URLs is not "
                               f"installed; {hint}") from None
    except ValueError:
        raise StoreFormatError(f"store {url!r}: unknown URL protocol {protocol!r}") from None


def open_store(location: StoreLocation, *, fsync: bool = False, read_only: bool = False) -> Store:
    """A zarr store for a local directory, an fsspec URL (``s3://...``, ``memory://``) or a
    ready-made :class:`zarr.abc.store.Store`.

    Args:
        fsync: Make every write of a local store durable before it returns. Ignored (no
            stronger guarantee exists) for stores that are not local directories.

    Raises:
        StoreFormatError: The location cannot be opened (missing directory when reading, a URL
            whose filesystem is not installed: the message names the ``pip install`` that
            adds it, ...).
    """
    if isinstance(location, Store):
        return location
    path = local_path(location)
    if path is not None:
        if read_only and not path.is_dir():
            raise StoreFormatError(f"no run store at {str(path)!r}: the directory does not exist")
        cls = LocalStore if read_only else SyncedLocalStore if fsync else RunLocalStore
        return cls(path, read_only=read_only)
    url = os.fspath(location)
    options = url_options(url)
    try:
        return zarr.storage.FsspecStore.from_url(url, storage_options=options, read_only=read_only)
    except Exception as exc:  # fsspec raises many kinds; one of ours at the boundary
        raise StoreFormatError(f"cannot open store URL {url!r}: {exc}") from exc


def root_metadata(attributes: Mapping[str, Any] | None = None) -> bytes:
    """The ``zarr.json`` of a group with ``attributes``: the same attributes always give the
    same bytes, the bytes zarr itself writes for such a group."""
    from zarr.buffer import default_buffer_prototype
    from zarr.core.group import GroupMetadata

    meta = GroupMetadata(attributes=dict(attributes or {}))
    return meta.to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()


def create_groups(store: Store, groups: Mapping[str, Mapping[str, Any]]) -> None:
    """Create each group (path -> attributes; ``""`` is the root) whose ``zarr.json`` is absent,
    leaving present ones as they are. Safe when several processes do it at once: every writer
    writes the same bytes (:func:`root_metadata`), and a local store creates the key without
    replacing one that appeared meanwhile (the others compare, then write whole objects)."""
    from zarr.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    async def create() -> None:
        prototype = default_buffer_prototype()
        for path, attributes in groups.items():
            key = f"{path}/zarr.json" if path else "zarr.json"
            await store.set_if_not_exists(key, prototype.buffer.from_bytes(root_metadata(attributes)))

    sync(create())


def child_nodes(group: zarr.Group) -> list[str]:
    """Names of the nodes directly under ``group``, listed from the store without opening any
    of them (one unreadable member must not hide the others)."""
    from zarr.core.sync import sync

    store = group.store_path.store
    prefix = group.store_path.path

    async def listing() -> list[str]:
        return [name async for name in store.list_dir(prefix)]

    return sorted(name for name in sync(listing()) if name != "zarr.json" and
                  not name.endswith(".partial"))


_PARTIAL: Final = re.compile(r".+\.[0-9a-f]{32}\.partial")
"""Temporary files of zarr's atomic writes (``<name>.<uuid hex>.partial``) and of ours."""


def is_partial_file(name: str) -> bool:
    """Whether ``name`` is the temporary file of an atomic write (in flight, or left by a
    crash)."""
    return _PARTIAL.fullmatch(name) is not None


def remove_partial_files(root: Path, *, recursive: bool = True) -> int:
    """Delete the temporary files of writes a crash interrupted, inside the run store
    directory ``root`` only (call it once the directory is known to be a run store, under the
    store lock), or (``recursive=False``) directly in ``root`` only. Returns how many were
    removed."""
    removed = 0
    for debris in root.rglob("*.partial") if recursive else root.glob("*.partial"):
        if _PARTIAL.fullmatch(debris.name) and debris.is_file():
            debris.unlink(missing_ok=True)
            removed += 1
    return removed


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


def resize_tail(arrays: Iterable[zarr.Array[Any]], n: int) -> None:
    """Cut arrays back to ``n`` committed rows (debris of an interrupted commit, or unused
    capacity): zarr deletes the chunks past the new end, and the rows past ``n`` in the
    chunk that holds it are zeroed first, so no uncommitted byte survives the cut."""
    for arr in arrays:
        if arr.shape[0] > n:
            rows = int(arr.chunks[0])
            if n % rows:
                tail = -(-n // rows) * rows
                block = np.asarray(arr[n - n % rows:min(tail, arr.shape[0])])
                block[n % rows:] = 0
                arr.with_config(APPEND_CONFIG)[n - n % rows:n - n % rows + len(block)] = block
            arr.resize((n, *arr.shape[1:]))
