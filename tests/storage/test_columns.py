"""Columns: arrays extended in whole chunks, with a capacity, never reading a chunk back."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import zarr
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import MemoryStore

from storage._columns import Column, write_columns

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
        col.trim()
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
