"""The daemon's episode buffers (world-major and time-major) against a per-world reference.

The term has fields named ``_step`` and ``_hook`` beside the row columns (``steps``,
``hooks``) with other values: a buffer that kept them in one dict lost the fields' values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker import FieldSpec
from storage._format import HOOKS
from storage.episode_buffers import DenseTopicBuffer, TopicBuffer

pytestmark = pytest.mark.timeout(60)

SPECS = {"_step": FieldSpec("int64", ()), "x": FieldSpec("float32", (3,)), "flag": FieldSpec("bool", ()),
         "_hook": FieldSpec("uint8", ())}

Row = tuple[float, int, int, int, int]
"""x[0], the row's step, the fields ``_step`` and ``_hook``, the row's hook code."""


def _fields(x: np.ndarray) -> dict[str, np.ndarray]:
    """A batch's fields; ``_step`` and ``_hook`` differ from any row's step and hook code."""
    return {"_step": -x[:, 0].astype(np.int64) - 7, "x": x, "flag": x[:, 0] > 0,
            "_hook": (x[:, 0].astype(np.int64) % 200 + 50).astype(np.uint8)}


def _rows(buf: TopicBuffer, worlds: np.ndarray) -> dict[int, list[Row]]:
    """Each world's buffered rows, gathered the way the stager does."""
    out: dict[int, list[Row]] = {}
    idx = buf.rows_of(worlds)
    cols = (buf.views["x"][idx, 0].tolist(), buf.steps[idx].tolist(), buf.views["_step"][idx].tolist(),
            buf.views["_hook"][idx].tolist(), buf.hooks[idx].tolist())
    pos = 0
    for w, n in zip(worlds.tolist(), buf.counts[worlds].tolist(), strict=True):
        out[w] = list(zip(*(c[pos:pos + n] for c in cols), strict=True))
        pos += n
    return out


class BufferMachine(RuleBasedStateMachine):
    """Either buffer kind against a per-world list of rows, under any interleaving of batches
    (every world or some), episode ends, moves when full, and reshapes (new capacity or new
    world count, as the daemon does after moving every row out)."""

    kind: type[TopicBuffer] = TopicBuffer

    def __init__(self) -> None:
        super().__init__()
        self.worlds_n, self.step = 3, 0
        self.buf = self.kind("t", SPECS, self.worlds_n, 4)
        self.model: dict[int, list[Row]] = {w: [] for w in range(self.worlds_n)}

    def _move_out(self, worlds: np.ndarray) -> None:
        assert _rows(self.buf, worlds) == {w: self.model[w] for w in worlds.tolist()}
        self.buf.discard(worlds)
        for w in worlds.tolist():
            self.model[w] = []

    @rule(data=st.data(), every=st.booleans(), hook=st.sampled_from(HOOKS))
    def batch(self, data: st.DataObject, every: bool, hook: str) -> None:
        if every:
            worlds = np.arange(self.worlds_n)
        else:
            chosen = data.draw(st.sets(st.integers(0, self.worlds_n - 1), min_size=1))
            worlds = np.array(sorted(chosen))
        if self.buf.full(worlds):  # what the assembly does: move every world's rows out
            self._move_out(np.flatnonzero(self.buf.counts))
        x = (np.arange(len(worlds) * 3, dtype=np.float32).reshape(-1, 3) + 1000 * self.step)
        fields = _fields(x)
        self.buf.add(worlds, fields, self.step, hook)
        for w, v, fs, fh in zip(worlds.tolist(), x[:, 0].tolist(), fields["_step"].tolist(),
                                fields["_hook"].tolist(), strict=True):
            self.model[w].append((v, self.step, fs, fh, HOOKS.index(hook)))
        self.step += 1

    @rule(data=st.data())
    def end_episodes(self, data: st.DataObject) -> None:
        ended = data.draw(st.sets(st.integers(0, self.worlds_n - 1)))
        self._move_out(np.array(sorted(ended), dtype=np.int64))

    @rule(capacity=st.integers(1, 6), grow=st.integers(0, 3))
    def reshape(self, capacity: int, grow: int) -> None:
        if self.buf.counts.any():
            with pytest.raises(RuntimeError, match="holds rows"):
                self.buf.reshape(capacity, self.worlds_n + grow)
            self._move_out(np.flatnonzero(self.buf.counts))
        self.worlds_n += grow
        self.buf.reshape(capacity, self.worlds_n)
        for w in range(self.worlds_n):
            self.model.setdefault(w, [])

    @invariant()
    def counts_match(self) -> None:
        assert self.buf.counts.tolist() == [len(self.model[w]) for w in range(self.worlds_n)]


class DenseBufferMachine(BufferMachine):
    kind = DenseTopicBuffer


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestTopicBuffer = BufferMachine.TestCase
TestTopicBuffer.settings = _settings
TestDenseTopicBuffer = DenseBufferMachine.TestCase
TestDenseTopicBuffer.settings = _settings


def test_dense_buffer_batch_of_every_world_is_one_slot() -> None:
    buf = DenseTopicBuffer("t", SPECS, 4, 3)
    for step in range(3):
        x = np.full((4, 3), float(step), np.float32)
        buf.add(np.arange(4), _fields(x), step, "post_step")
    assert buf.full(np.arange(4))
    np.testing.assert_array_equal(buf.views["x"][:, 0].reshape(3, 4), [[0] * 4, [1] * 4, [2] * 4])
    np.testing.assert_array_equal(buf.rows_of(np.array([2])), [2, 6, 10])
