"""The daemon's episode buffers (world-major and time-major) against a per-world reference.

The term has fields named ``_step`` and ``_hook`` beside the row columns (``steps``,
``hooks``) with other values: a buffer that kept them in one dict lost the fields' values.
Small fields of one dtype and shape share an array (``x`` and ``y``, ``flag`` and ``ok``);
``big`` has one of its own; every field is read back the way the packer moves it out."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker import FieldSpec
from storage._format import HOOKS
from storage.episode_buffers import DenseTopicBuffer, TopicBuffer, _gather

pytestmark = pytest.mark.timeout(60)

SPECS = {"_step": FieldSpec("int64", ()), "x": FieldSpec("float32", (3,)), "flag": FieldSpec("bool", ()),
         "_hook": FieldSpec("uint8", ()), "y": FieldSpec("float32", (3,)), "big": FieldSpec("float32", (20,)),
         "ok": FieldSpec("bool", ())}

Row = tuple[Any, ...]
"""x, the row's step, the fields ``_step`` and ``_hook``, the row's hook code, y, big, flag, ok."""


def _fields(x: np.ndarray) -> dict[str, np.ndarray]:
    """A batch's fields; ``_step`` and ``_hook`` differ from any row's step and hook code."""
    return {"_step": -x[:, 0].astype(np.int64) - 7, "x": x, "flag": x[:, 0] % 2 > 0,
            "_hook": (x[:, 0].astype(np.int64) % 200 + 50).astype(np.uint8), "y": -x - 0.5,
            "big": np.repeat(x[:, :1], 20, axis=1) + np.arange(20, dtype=np.float32), "ok": x[:, 0] % 3 > 0}


def _model_rows(x: np.ndarray, fields: dict[str, np.ndarray], step: int, hook: int) -> list[Row]:
    return list(zip(map(tuple, x.tolist()), [step] * len(x), fields["_step"].tolist(),
                    fields["_hook"].tolist(), [hook] * len(x), map(tuple, fields["y"].tolist()),
                    map(tuple, fields["big"].tolist()), fields["flag"].tolist(), fields["ok"].tolist(),
                    strict=True))


def test_small_fields_of_one_dtype_and_shape_share_an_array() -> None:
    buf = TopicBuffer("t", SPECS, 2, 3)
    assert [names for _, _, names in buf.layout.groups] == [("_step",), ("x", "y"), ("flag", "ok"),
                                                            ("_hook",), ("big",)]
    assert list(buf.views) == list(SPECS)


def _rows(buf: TopicBuffer, worlds: np.ndarray, at: int) -> dict[int, list[Row]]:
    """Each world's buffered rows, moved out the way the packer does: gathered into a
    block from row ``at`` on, then turned into one column per field."""
    out: dict[int, list[Row]] = {}
    idx = buf.rows_of(worlds)
    block = _gather(buf, np.zeros(0, np.int64)).zeros(at + len(idx) + 2)
    _gather(buf, idx, block, at)
    alone = _gather(buf, idx)  # (a world longer than a piece: new arrays)
    columns = block.head(at + len(idx)).columns()
    for name, values in alone.columns().items():
        np.testing.assert_array_equal(values, columns[name][at:], err_msg=name)
        assert values.flags.c_contiguous
        assert columns[name].flags.c_contiguous
    steps, hooks = block.steps[at:at + len(idx)].tolist(), block.hooks[at:at + len(idx)].tolist()
    cols = [[tuple(v) if isinstance(v, list) else v for v in c]
            for c in (columns["x"][at:].tolist(), steps, columns["_step"][at:].tolist(),
                      columns["_hook"][at:].tolist(), hooks, columns["y"][at:].tolist(),
                      columns["big"][at:].tolist(), columns["flag"][at:].tolist(), columns["ok"][at:].tolist())]
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

    def _move_out(self, worlds: np.ndarray, at: int = 0) -> None:
        assert _rows(self.buf, worlds, at) == {w: self.model[w] for w in worlds.tolist()}
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
        for w, row in zip(worlds.tolist(), _model_rows(x, fields, self.step, HOOKS.index(hook)), strict=True):
            self.model[w].append(row)
        self.step += 1

    @rule(data=st.data(), at=st.integers(0, 5))
    def end_episodes(self, data: st.DataObject, at: int) -> None:
        ended = data.draw(st.sets(st.integers(0, self.worlds_n - 1)))
        self._move_out(np.array(sorted(ended), dtype=np.int64), at)

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
