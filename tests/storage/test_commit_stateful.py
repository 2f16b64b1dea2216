"""The commit sequence as a state machine: appends of random sizes (episode rows, and fragments
no commit references), commits, kills at any point and clean shutdowns, on a real local store.

Appends write only whole chunks; a commit writes the partial chunks that hold the rows it
counts, and counts only rows in the store. After every step a reader opened anew sees exactly
the committed episodes, byte for byte, and nothing else.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker import FieldSpec
from storage import RunStore, RunStoreWriter
from storage.run_writer import EpisodeRows, RunWriter

pytestmark = pytest.mark.timeout(300)

SPECS = {"x": FieldSpec("float32", (3,)), "flag": FieldSpec("bool", ())}
CHUNK_BYTES = 60  # x: 5 rows a chunk, _step: 7, flag and _hook: 60: the term's columns differ


class CommitSequence(RuleBasedStateMachine):
    """Model: the committed episodes (their rows), and those appended but not committed."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="worldtap-commits-"))
        self.path = self.folder / "s.zarr"
        self.committed: list[dict[str, np.ndarray]] = []
        self.pending: list[tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]] = []
        self.step = 0
        self.writer = self._open(new=True)

    def _open(self, *, new: bool = False) -> RunWriter:
        store = RunStoreWriter(self.path, compression="lz4", chunk_bytes=CHUNK_BYTES)
        run = store.run("r", num_worlds=1)
        if new:
            run.declare_term("t", SPECS)
            run.create_term("t")
            run.commit()
        else:
            run.recover()
        return run

    def _rows(self, n: int) -> dict[str, np.ndarray]:
        steps = np.arange(self.step, self.step + n)
        self.step += n
        return {"x": np.stack([steps, -steps, steps * 0.5], axis=1).astype(np.float32),
                "flag": steps % 3 == 0, "_step": steps, "_hook": (steps % 4).astype(np.uint8)}

    def _append(self, rows: dict[str, np.ndarray]) -> int:
        return self.writer.append("t", {k: rows[k] for k in SPECS}, rows["_step"], rows["_hook"])

    @rule(sizes=st.lists(st.integers(1, 13), min_size=1, max_size=3))
    def episode(self, sizes: list[int]) -> None:
        """An episode written in pieces (its segments), waiting for a commit."""
        parts, segments = [], []
        for n in sizes:
            rows = self._rows(n)
            segments.append((0, self._append(rows), n))
            parts.append(rows)
        self.pending.append(({k: np.concatenate([p[k] for p in parts]) for k in parts[0]}, segments))

    @rule(n=st.integers(1, 17))
    def fragment(self, n: int) -> None:
        """Rows of an episode that never ends: no commit references them."""
        self._append(self._rows(n))

    @rule()
    def commit(self) -> None:
        if self.pending:
            k = len(self.committed)
            columns = {"world": np.zeros(len(self.pending), np.int64),
                       "index": np.arange(k, k + len(self.pending)),
                       "length": np.array([len(rows["_step"]) for rows, _ in self.pending]),
                       "success": np.ones(len(self.pending), bool),
                       "terminated": np.zeros(len(self.pending), bool),
                       "truncated": np.zeros(len(self.pending), bool),
                       "end_step": np.array([int(rows["_step"][-1]) + 1 for rows, _ in self.pending]),
                       "end_seq": np.arange(k, k + len(self.pending)),
                       "segment_count": np.array([len(segs) for _, segs in self.pending])}
            segments = np.array([seg for _, segs in self.pending for seg in segs], np.int64)
            self.writer.commit(EpisodeRows(columns, segments))
        else:
            self.writer.commit()
        self.committed += [rows for rows, _ in self.pending]
        self.pending = []

    @rule()
    def kill(self) -> None:
        """The writer vanishes (nothing flushed, nothing trimmed); a new one resumes the run."""
        self.pending = []
        self.writer = self._open()

    @rule()
    def shutdown(self) -> None:
        """A clean stop after a commit (as the daemon's): holes zeroed, arrays trimmed."""
        self.commit()
        self.writer.zero_holes()
        self.writer.trim()
        self.writer.mark_clean()
        self.writer = self._open()

    @invariant()
    def committed_episodes_read_back_exactly(self) -> None:
        reader = RunStore(self.path)
        episodes = reader.episodes("r")
        assert episodes["index"].tolist() == list(range(len(self.committed)))
        rows = reader.info("r")["committed"]["rows"]["t"]
        assert rows >= sum(len(e["_step"]) for e in self.committed)
        for i, want in enumerate(self.committed):
            got = reader.episode("r", 0, i)
            np.testing.assert_array_equal(got["t/x"], want["x"])
            np.testing.assert_array_equal(got["t/flag"], want["flag"])
            steps = reader.episode_rows("r", 0, i)["t"]["step"]
            np.testing.assert_array_equal(steps, want["_step"])

    def teardown(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


CommitSequence.TestCase.settings = settings(max_examples=25, stateful_step_count=14, deadline=None)
test_commit_sequence = CommitSequence.TestCase
