"""The daemon's episode buffers (world-major and time-major) against a per-world reference."""

from __future__ import annotations

import numpy as np
import pytest

from broker import FieldSpec
from storage.assembler import DenseTopicBuffer, TopicBuffer

pytestmark = pytest.mark.timeout(60)

SPECS = {"x": FieldSpec("float32", (3,)), "flag": FieldSpec("bool", ())}


def _rows(buf: TopicBuffer, worlds: np.ndarray) -> dict[int, list[tuple[float, int]]]:
    """Each world's buffered rows as (x[0], step), gathered the way the stager does."""
    out: dict[int, list[tuple[float, int]]] = {}
    idx = buf.rows_of(worlds)
    x, steps = buf.views["x"][idx, 0].tolist(), buf.views["_step"][idx].tolist()
    pos = 0
    for w, n in zip(worlds.tolist(), buf.counts[worlds].tolist(), strict=True):
        out[w] = list(zip(x[pos:pos + n], steps[pos:pos + n], strict=True))
        pos += n
    return out


@pytest.mark.parametrize("kind", [TopicBuffer, DenseTopicBuffer])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_buffers_hold_what_a_per_world_list_holds(kind: type[TopicBuffer], seed: int) -> None:
    rng = np.random.default_rng(seed)
    worlds_n, capacity = 5, 6
    buf = kind("t", SPECS, worlds_n, capacity)
    model: dict[int, list[tuple[float, int]]] = {w: [] for w in range(worlds_n)}
    for step in range(300):
        if rng.random() < 0.02 and worlds_n < 9:  # a world joins (a run joined late)
            worlds_n += 1
            buf.grow_worlds(worlds_n)
            model[worlds_n - 1] = []
        every = rng.random() < 0.8
        worlds = np.arange(worlds_n) if every else np.sort(
            rng.choice(worlds_n, size=int(rng.integers(1, worlds_n + 1)), replace=False))
        if buf.full(worlds):  # what the assembler does: move every world's rows out
            busy = np.flatnonzero(buf.counts)
            assert _rows(buf, busy) == {w: model[w] for w in busy.tolist()}
            buf.discard(busy)
            for w in busy.tolist():
                model[w] = []
        x = rng.standard_normal((len(worlds), 3)).astype(np.float32)
        buf.add(worlds, {"x": x, "flag": x[:, 0] > 0}, step, "post_step")
        for w, v in zip(worlds.tolist(), x[:, 0].tolist(), strict=True):
            model[w].append((v, step))
        for w in range(worlds_n):
            assert buf.counts[w] == len(model[w])
        ended = np.flatnonzero(rng.random(worlds_n) < 0.1)  # episodes end: staged and dropped
        assert _rows(buf, ended) == {w: model[w] for w in ended.tolist()}
        buf.discard(ended)
        for w in ended.tolist():
            model[w] = []
    everyone = np.arange(worlds_n)
    assert _rows(buf, everyone) == model


def test_dense_buffer_batch_of_every_world_is_one_slot() -> None:
    buf = DenseTopicBuffer("t", SPECS, 4, 3)
    for step in range(3):
        x = np.full((4, 3), float(step), np.float32)
        buf.add(np.arange(4), {"x": x, "flag": x[:, 0] > 0}, step, "post_step")
    assert buf.full(np.arange(4))
    np.testing.assert_array_equal(buf.views["x"][:, 0].reshape(3, 4), [[0] * 4, [1] * 4, [2] * 4])
    np.testing.assert_array_equal(buf.rows_of(np.array([2])), [2, 6, 10])
