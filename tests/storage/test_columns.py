"""Columns: arrays extended in whole chunks, with a capacity, never reading a chunk back."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import MemoryStore

from storage._columns import Column, write_columns
from storage._format import CHUNK_KEYS, Compression
from storage._format import codecs as compressors

pytestmark = pytest.mark.timeout(60)


class CountingStore(MemoryStore):
    """A memory store that counts reads of chunk keys."""

    chunk_reads = 0

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if "/c/" in key:
            type(self).chunk_reads += 1
        return await super().get(key, prototype, byte_range)


def _array(store: Any, name: str, chunk: int, width: int | None = 3, dtype: str = "float32") -> zarr.Array[Any]:
    group = zarr.open_group(store, mode="a")
    shape = (0,) if width is None else (0, width)
    chunks = (chunk,) if width is None else (chunk, width)
    return group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, fill_value=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_writes_read_back_and_never_read_a_chunk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    store = CountingStore()
    a, b = Column(_array(store, "a", 7), 0), Column(_array(store, "b", 5, None, "int64"), 0)
    want_a, want_b = [], []
    CountingStore.chunk_reads = 0
    for _ in range(40):
        n = int(rng.choice([0, 1, 3, 6, 7, 8, 15, 30]))
        va = rng.standard_normal((n, 3)).astype(np.float32)
        vb = rng.integers(0, 1000, n)
        write_columns([(a, va), (b, vb)])
        want_a.append(va)
        want_b.append(vb)
        for col in (a, b):
            assert col.capacity >= col.rows
            assert col.capacity % col.chunk == 0
    assert CountingStore.chunk_reads == 0
    rows = sum(len(v) for v in want_a)
    assert a.rows == b.rows == rows
    np.testing.assert_array_equal(a.array[:rows], np.concatenate(want_a))
    np.testing.assert_array_equal(b.array[:rows], np.concatenate(want_b))
    for col in (a, b):
        col.trim(rows)
        assert col.array.shape[0] == rows
    np.testing.assert_array_equal(zarr.open_array(store, path="a", mode="r")[:], np.concatenate(want_a))


def test_resume_reads_the_partial_chunk_once_and_continues(tmp_path: Any) -> None:
    store = zarr.storage.LocalStore(tmp_path / "s.zarr")
    first = Column(_array(store, "a", 4), 0)
    write_columns([(first, np.arange(18, dtype=np.float32).reshape(6, 3))])
    again = Column(zarr.open_array(store, path="a", mode="a"), 6)  # a new writer
    assert again.tail is not None
    assert again.tail.shape == (2, 3)
    write_columns([(again, np.full((5, 3), -1, np.float32))])
    got = zarr.open_array(store, path="a", mode="r")[:11]
    np.testing.assert_array_equal(got[:6], np.arange(18, dtype=np.float32).reshape(6, 3))
    np.testing.assert_array_equal(got[6:], np.full((5, 3), -1, np.float32))


def test_rewind_overwrites_rows_of_an_interrupted_commit() -> None:
    store = MemoryStore()
    col = Column(_array(store, "a", 4, None, "int64"), 0)
    write_columns([(col, np.arange(6))])
    write_columns([(col, np.arange(100, 103))])  # never committed
    col.rewind(6)
    write_columns([(col, np.array([7, 8]))])
    np.testing.assert_array_equal(col.array[:col.rows], [0, 1, 2, 3, 4, 5, 7, 8])


def test_wrong_rows_are_refused_and_nothing_is_written() -> None:
    col = Column(_array(MemoryStore(), "a", 4), 0)
    write_columns([(col, np.ones((3, 3), np.float32))])
    with pytest.raises(ValueError, match=r"array 'a': expected rows of shape \(3,\) and dtype float32, "
                                         r"got \(2,\) float64"):
        write_columns([(col, np.ones((2, 2)))])
    assert col.rows == 3
    np.testing.assert_array_equal(col.array[:3], np.ones((3, 3), np.float32))


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "zarr.json"}


@pytest.mark.parametrize("compression", ["lz4", "zstd", "none"])
def test_the_thread_path_stores_the_bytes_zarrs_own_path_stores(tmp_path: Path,
                                                               compression: Compression) -> None:
    """Columns on a local store encode and write chunks on plain threads; the chunk files
    must be exactly those zarr's asynchronous pipeline writes for the same rows."""
    rng = np.random.default_rng(3)
    roots = {path: tmp_path / f"{path}.zarr" for path in ("threads", "zarr")}
    kinds = {"f": ((5, 3), "float32"), "b": ((6,), "bool"), "i": ((4, 2, 2), "int64")}
    columns: dict[str, dict[str, Column]] = {}
    for path, root in roots.items():
        group = zarr.open_group(zarr.storage.LocalStore(root), mode="w")
        columns[path] = {}
        for name, ((chunk, *shape), dtype) in kinds.items():
            col = Column(group.create_array(name, shape=(0, *shape), chunks=(chunk, *shape),
                                            dtype=dtype, compressors=compressors(compression)), 0)
            assert col.encoder is not None  # a local store and built-in codecs
            if path == "zarr":
                col.encoder = None
            columns[path][name] = col
    for _ in range(12):
        n = int(rng.integers(0, 17))
        batch = {name: (rng.standard_normal((n, *shape)) > 0 if dtype == "bool"
                        else rng.standard_normal((n, *shape)) * 100).astype(dtype)
                 for name, ((_, *shape), dtype) in kinds.items()}
        for path in roots:
            write_columns([(columns[path][name], values) for name, values in batch.items()])
    written = {path: _files(root) for path, root in roots.items()}
    assert written["threads"] == written["zarr"]
    assert len(written["zarr"]) > 10


def test_uncompressed_chunks_in_a_memory_store_do_not_alias_the_callers_rows() -> None:
    rows = np.arange(24, dtype=np.float32).reshape(8, 3)
    group = zarr.open_group(MemoryStore(), mode="w")
    col = Column(group.create_array("a", shape=(0, 3), chunks=(4, 3), dtype="float32",
                                    compressors=None), 0)
    assert col.encoder is not None
    write_columns([(col, rows)])
    rows[:] = -1  # the caller reuses its buffer
    np.testing.assert_array_equal(col.array[:8], np.arange(24, dtype=np.float32).reshape(8, 3))


@pytest.mark.parametrize("compression", ["lz4", "none"])
def test_the_padding_of_a_flushed_chunk_is_zeros_after_a_rewind(compression: Compression) -> None:
    # Rows of an interrupted commit stay in the tail's buffer after a rewind: the padding of
    # the next flushed chunk must be zeros, not them.
    store = MemoryStore()
    group = zarr.open_group(store, mode="w")
    col = Column(group.create_array("a", shape=(0,), chunks=(4,), dtype="int64", fill_value=0,
                                    compressors=compressors(compression)), 0)
    write_columns([(col, np.array([1, 2, 3]))])  # flushed, never committed
    col.rewind(1)
    write_columns([(col, np.array([9]))])
    assert col.array.shape[0] >= 4
    np.testing.assert_array_equal(col.array[:4], [1, 9, 0, 0])


def test_empty_chunks_are_skipped_where_the_array_says_so() -> None:
    store = MemoryStore()
    group = zarr.open_group(store, mode="w")
    array = group.create_array("a", shape=(0,), chunks=(4,), dtype="int64", fill_value=0,
                               chunk_key_encoding=CHUNK_KEYS).with_config({"write_empty_chunks": False})
    col = Column(array, 0)
    write_columns([(col, np.r_[np.zeros(4, np.int64), np.arange(1, 5)])])
    keys = sorted(k for k in store._store_dict if not k.endswith("zarr.json"))
    assert keys == ["a/c.1"]
    np.testing.assert_array_equal(col.array[:8], [0, 0, 0, 0, 1, 2, 3, 4])


class FailingStore(zarr.storage.LocalStore):
    """A local store whose chunk writes fail after ``allowed`` of them."""

    allowed = 1 << 30

    def set_sync(self, key: str, value: Buffer) -> None:
        if "/c" in key:
            type(self).allowed -= 1
            if type(self).allowed < 0:
                raise OSError(28, "No space left on device")
        super().set_sync(key, value)


def test_a_failed_chunk_write_raises_and_the_rows_do_not_advance(tmp_path: Path) -> None:
    col = Column(_array(FailingStore(tmp_path / "s.zarr"), "a", 4), 0)
    write_columns([(col, np.ones((4, 3), np.float32))])
    FailingStore.allowed = 2
    with pytest.raises(OSError, match="No space left"):
        write_columns([(col, np.full((20, 3), 5, np.float32))])
    assert col.rows == 4
    FailingStore.allowed = 1 << 30
    write_columns([(col, np.full((2, 3), 7, np.float32))])  # the failed rows are overwritten
    np.testing.assert_array_equal(col.array[:6], np.r_[np.ones((4, 3)), np.full((2, 3), 7)])


def test_stores_without_synchronous_writes_take_zarrs_path() -> None:
    pytest.importorskip("fsspec")
    store = zarr.storage.FsspecStore.from_url("memory://columns-fallback")
    col = Column(_array(store, "a", 4), 0)
    assert col.encoder is None
    write_columns([(col, np.arange(30, dtype=np.float32).reshape(10, 3))])
    np.testing.assert_array_equal(col.array[:10], np.arange(30, dtype=np.float32).reshape(10, 3))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_writes_with_threads_of_its_own(tmp_path: Path) -> None:
    col = Column(_array(zarr.storage.LocalStore(tmp_path / "parent.zarr"), "a", 4), 0)
    write_columns([(col, np.ones((8, 3), np.float32))])  # the parent's threads exist now
    ctx = multiprocessing.get_context("fork")
    child = ctx.Process(target=_write_in_child, args=(str(tmp_path / "child.zarr"),))
    child.start()
    child.join(30)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the forked child hung writing chunks")
    assert child.exitcode == 0
    got = zarr.open_array(zarr.storage.LocalStore(tmp_path / "child.zarr"), path="a", mode="r")
    np.testing.assert_array_equal(got[:8], np.full((8, 3), 2, np.float32))


def _write_in_child(path: str) -> None:
    col = Column(_array(zarr.storage.LocalStore(path), "a", 4), 0)
    write_columns([(col, np.full((8, 3), 2, np.float32))])


@pytest.mark.parametrize("missing", ["pipeline", "encode_sync"])
def test_a_zarr_without_the_private_names_takes_the_public_path(tmp_path: Path, missing: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a zarr release moves or drops a private name the thread path uses (the codec
    pipeline's module, a codec's ``_encode_sync``), columns are written through zarr's public
    API instead, into the same chunk files. Bug caught: a writer that fails (or writes
    wrongly) on such a zarr instead of falling back."""
    from zarr.codecs.bytes import BytesCodec

    from storage import _zarr_io

    rows = np.arange(60, dtype=np.float32).reshape(20, 3)
    written = {}
    for name in ("threads", "public"):
        root = tmp_path / f"{name}.zarr"
        with monkeypatch.context() as patch:
            if name == "public" and missing == "pipeline":
                patch.delattr("zarr.core.codec_pipeline.BatchedCodecPipeline")
                assert _zarr_io.private_api() is None
            elif name == "public":  # codecs that only have zarr's asynchronous entry point
                async def encode_single(self: BytesCodec, chunk: Any, spec: Any,
                                        encode: Any = BytesCodec._encode_sync) -> Any:
                    return encode(self, chunk, spec)

                patch.delattr(BytesCodec, "_encode_sync")
                patch.setattr(BytesCodec, "_encode_single", encode_single)
            col = Column(_array(zarr.storage.LocalStore(root), "a", 4), 0)
            assert (col.encoder is None) == (name == "public")
            write_columns([(col, rows[:7])], flush=False)
            write_columns([(col, rows[7:])])
        np.testing.assert_array_equal(col.array[:20], rows)
        written[name] = _files(root)
    assert written["threads"] == written["public"]
