"""Columns as a state machine: appends of random sizes (flushed or not) to two columns at once,
chunk writes that fail part-way through a call, rewinds, trims and reopenings, on a real local
store. After every step each column's rows are those appended and not forgotten, every row it
counts as stored reads back byte for byte from a reader opened anew, the padding of a stored
partial chunk is zeros, and no append or flush read a chunk back.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zarr
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype

from storage._columns import Column, flush_columns, write_columns
from storage._format import RunLocalStore, codecs

pytestmark = pytest.mark.timeout(300)

# (name, chunk rows, row shape, dtype): two chunkings, so a call completes chunks of one column
# and not of the other
COLUMNS = (("x", 4, (3,), "float32"), ("n", 5, (), "int64"))


class FaultyStore(RunLocalStore):
    """A local run store that counts chunk reads and fails chunk writes on request: the
    ``fail_after``-th chunk write from now on, and every one after it, raises ``OSError``
    (disk full) before anything reaches the disk."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.fail_after: int | None = None
        self.chunk_reads = 0

    def set_sync(self, key: str, value: Buffer) -> None:
        if "/c" in key and self.fail_after is not None:
            self.fail_after -= 1
            if self.fail_after < 0:
                raise OSError(28, "No space left on device")
        super().set_sync(key, value)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        if "/c" in key:
            self.chunk_reads += 1
        return await super().get(key, prototype, byte_range)


class ColumnMachine(RuleBasedStateMachine):
    """Model per column: the rows appended and not forgotten (``rows``), and how many of them
    the column may count as stored (``stored``): every row after a flush, else those in the
    chunks the appends completed."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="worldtap-columns-"))
        self.store = FaultyStore(self.folder / "s.zarr")
        group = zarr.open_group(self.store, mode="w")
        for name, chunk, shape, dtype in COLUMNS:
            group.create_array(name, shape=(0, *shape), chunks=(chunk, *shape), dtype=dtype, fill_value=0,
                               compressors=codecs("lz4"))
        self.rows: dict[str, np.ndarray] = {name: np.zeros((0, *shape), dtype) for name, _, shape, dtype in COLUMNS}
        self.stored = {name: 0 for name, *_ in COLUMNS}
        # whether the store holds nothing but zeros after the stored rows of a partial chunk:
        # a failed call or a rewind leaves rows no one counts there, until the chunk is written
        # again
        self.clean = {name: True for name, *_ in COLUMNS}
        self.serial = 0
        self.columns = self._open()

    def _open(self) -> dict[str, Column]:
        """Every column opened anew on the store, with the rows the model says are stored."""
        return {name: Column(zarr.open_array(self.store, path=name, mode="a"), self.stored[name])
                for name, *_ in COLUMNS}

    def _values(self, name: str, n: int) -> np.ndarray:
        """``n`` rows no other call appended (a row appended twice would hide a lost one)."""
        _, _, shape, dtype = next(c for c in COLUMNS if c[0] == name)
        start = self.serial
        self.serial += n
        values = np.arange(start, start + n).reshape(n, *([1] * len(shape)))
        return np.broadcast_to(values * 1.5 if dtype == "float32" else values, (n, *shape)).astype(dtype)

    @rule(nx=st.integers(0, 13), nn=st.integers(0, 13), flush=st.booleans(),
          fail_after=st.one_of(st.none(), st.integers(0, 4)))
    def append(self, nx: int, nn: int, flush: bool, fail_after: int | None) -> None:
        values = {"x": self._values("x", nx), "n": self._values("n", nn)}
        before = {name: (col.rows, col.stored) for name, col in self.columns.items()}
        reads = self.store.chunk_reads
        self.store.fail_after = fail_after
        failure: OSError | None = None
        try:
            write_columns([(self.columns[name], values[name]) for name in values], flush=flush)
        except OSError as exc:
            failure = exc
        finally:
            self.store.fail_after = None
        if failure is not None:  # some chunk writes of the call failed: no column advances
            assert failure.errno == 28
            assert {name: (col.rows, col.stored) for name, col in self.columns.items()} == before
            self.clean = {name: False for name in self.clean}  # (the others may have been written)
            return
        assert self.store.chunk_reads == reads  # an append reads no chunk back
        for name, chunk, *_ in COLUMNS:
            if flush and (len(values[name]) or self.stored[name] < len(self.rows[name])):
                self.clean[name] = True  # its partial chunk was written
            self.rows[name] = np.concatenate([self.rows[name], values[name]])
            n = len(self.rows[name])
            self.stored[name] = n if flush else max(self.stored[name], n - n % chunk)

    @rule()
    def flush(self) -> None:
        reads = self.store.chunk_reads
        flush_columns(list(self.columns.values()))
        assert self.store.chunk_reads == reads
        for name in self.stored:
            if self.stored[name] < len(self.rows[name]):
                self.clean[name] = True
            self.stored[name] = len(self.rows[name])

    @rule(data=st.data())
    def rewind(self, data: st.DataObject) -> None:
        """Forget rows after a point (an interrupted commit's): a point in the tail, or one whose
        rows are all stored (the column reads its new tail back from the store)."""
        name = data.draw(st.sampled_from([c[0] for c in COLUMNS]))
        col, chunk = self.columns[name], self.columns[name].chunk
        n = len(self.rows[name])
        choices = sorted({*range(n - n % chunk, n + 1), *range(self.stored[name] + 1)})
        rows = data.draw(st.sampled_from(choices))
        col.rewind(rows)
        self.rows[name] = self.rows[name][:rows]
        self.stored[name] = min(self.stored[name], rows)
        self.clean[name] = False  # the forgotten rows stay in the store

    @rule(data=st.data())
    def trim(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from([c[0] for c in COLUMNS]))
        rows = data.draw(st.integers(0, self.stored[name]))
        self.columns[name].trim(rows)
        assert self.columns[name].array.shape[0] == rows
        self.rows[name] = self.rows[name][:rows]
        self.stored[name] = rows
        self.clean[name] = False

    @rule()
    def reopen(self) -> None:
        """A new writer (a restart): it knows only the stored rows; the others are lost."""
        for name in self.rows:
            self.rows[name] = self.rows[name][:self.stored[name]]
        self.columns = self._open()

    @invariant()
    def counts_match_the_model(self) -> None:
        for name, col in self.columns.items():
            assert col.rows == len(self.rows[name])
            assert col.stored == self.stored[name]
            assert col.capacity >= col.rows  # (whole chunks, but exact after a trim)

    @invariant()
    def stored_rows_read_back_exactly(self) -> None:
        for name, chunk, *_ in COLUMNS:
            stored = self.stored[name]
            array = zarr.open_array(RunLocalStore(self.folder / "s.zarr", read_only=True), path=name, mode="r")
            got = np.asarray(array[:stored])
            assert got.tobytes() == self.rows[name][:stored].tobytes()
            if stored % chunk and array.shape[0] >= stored - stored % chunk + chunk:
                # the rest of a stored partial chunk: the padding, never an older row
                pad = np.asarray(array[stored:stored - stored % chunk + chunk])
                if self.clean[name] and len(self.rows[name]) == stored:
                    assert not pad.any()

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


ColumnMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_column_sequence = ColumnMachine.TestCase
