"""Write amplification of the run writer: bytes handed to a real local store, counted per key.

An append writes only the chunks it completes; the partial last chunk waits in memory until a
commit counts its rows. So a chunk is written once when it fills, plus at most once per commit
that needs it earlier, and never once per append.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import zarr
from zarr.core.buffer import Buffer

from broker import FieldSpec
from storage import RunStore, RunStoreWriter
from storage._columns import Column, flush_columns, write_columns
from storage.run_writer import EpisodeRows

pytestmark = pytest.mark.timeout(60)

WIDTH = 16  # float32 values per row: 64 bytes
CHUNK_ROWS = 1024
PIECE = 300  # rows per append: never a whole number of chunks


class CountingStore(zarr.storage.LocalStore):
    """A local store that counts the chunk bytes handed to it, per array."""

    written: ClassVar[Counter[str]] = Counter()

    @classmethod
    def count(cls, key: str, value: Buffer) -> None:
        array, found = re.subn(r"/c([./]\d+)+$", "", key)
        if found:
            cls.written[array] += len(value)

    def set_sync(self, key: str, value: Buffer) -> None:
        self.count(key, value)
        super().set_sync(key, value)

    async def set(self, key: str, value: Buffer) -> None:
        self.count(key, value)
        await super().set(key, value)


def _episode(index: int, offset: int, rows: int) -> EpisodeRows:
    one = {"world": [0], "index": [index], "length": [rows], "success": [True], "terminated": [False],
           "truncated": [False], "end_step": [offset + rows], "end_seq": [offset + rows],
           "segment_count": [1]}
    return EpisodeRows({k: np.asarray(v) for k, v in one.items()}, np.array([[0, offset, rows]]))


def _files(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("c*") if p.is_file())


@pytest.mark.parametrize("pieces_per_commit", [40, 8])
def test_a_run_writes_each_chunk_about_once(tmp_path: Path, pieces_per_commit: int) -> None:
    """A run of 120 appends of 300 rows (1024 rows per chunk), committed every
    ``pieces_per_commit`` appends: the bytes written to the field's chunks are at most the final
    chunks plus one chunk per commit, within 1.2x the raw field data at 40 appends per commit.
    Bug caught: a writer that rewrites the partial last chunk at every append (about 4x here:
    seen failing with the append writing its tail, ``flush=True``), or that re-encodes whole
    chunks it already wrote."""
    path = tmp_path / "s.zarr"
    CountingStore.written.clear()
    writer = RunStoreWriter(CountingStore(path), compression="none", chunk_bytes=CHUNK_ROWS * WIDTH * 4)
    run = writer.run("r", num_worlds=1)
    run.declare_term("t", {"x": FieldSpec("float32", (WIDTH,))})
    run.create_term("t")
    rng = np.random.default_rng(0)
    published, commits, first = [], 0, 0
    for k in range(1, 121):
        values = rng.standard_normal((PIECE, WIDTH)).astype(np.float32)
        published.append(values)
        run.append("t", {"x": values}, np.arange(PIECE) + k * PIECE, np.ones(PIECE, np.uint8))
        if k % pieces_per_commit == 0:
            end = k * PIECE
            run.commit(_episode(commits, first, end - first))
            commits, first = commits + 1, end
    run.zero_holes()
    run.trim()
    run.mark_clean()

    data = np.concatenate(published)
    reader = RunStore(path)
    got = np.concatenate([reader.episode("r", 0, i)["t/x"] for i in range(commits)])
    np.testing.assert_array_equal(got, data)
    field = "runs/r/data/t/x"
    final = _files(path / field)
    chunk = CHUNK_ROWS * WIDTH * 4 + 4  # uncompressed, with its crc32c
    assert final == -(-len(data) // CHUNK_ROWS) * chunk
    assert final <= CountingStore.written[field] <= final + commits * chunk
    if pieces_per_commit == 40:
        assert CountingStore.written[field] <= 1.2 * data.nbytes


def test_an_append_writes_only_the_chunks_it_completes(tmp_path: Path) -> None:
    """Rows short of a chunk stay in memory (``stored`` says so) until a flush, and the chunk
    they start is written when it fills. Bugs caught: an append that writes its partial chunk,
    a flush that writes nothing, a ``stored`` count that claims rows not in the store."""
    store = CountingStore(tmp_path / "s.zarr")
    CountingStore.written.clear()
    group = zarr.open_group(store, mode="w")
    col = Column(group.create_array("a", shape=(0,), chunks=(4,), dtype="int64", fill_value=0,
                                    compressors=None), 0)
    write_columns([(col, np.arange(3))], flush=False)
    assert (col.rows, col.stored, CountingStore.written["a"]) == (3, 0, 0)
    write_columns([(col, np.arange(3, 9))], flush=False)  # fills chunk 0 and 1, one row left
    assert (col.rows, col.stored, CountingStore.written["a"]) == (9, 8, 2 * 32)
    flush_columns([col])
    assert (col.stored, CountingStore.written["a"]) == (9, 3 * 32)
    flush_columns([col])  # nothing new: nothing written
    assert CountingStore.written["a"] == 3 * 32
    np.testing.assert_array_equal(col.array[:9], np.arange(9))
    col.trim(9)
    assert col.array.shape == (9,)
    with pytest.raises(ValueError, match="rows: 10 exceeds the 9 rows in the store"):
        col.trim(10)
