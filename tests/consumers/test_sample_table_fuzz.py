"""SampleTable fed structured mutations of valid messages: world indices out of range (negative,
past the run's worlds, huge without a RunStart), tensors of other shapes and dtypes, labels
that do not cover the codes, keys that change shape. Only ``SampleTableError`` escapes, a
rejected message changes nothing (the table then behaves exactly as one that never saw it),
and no message with a world outside the run is accepted."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import EpisodeEnd, RunStart, VariationSample
from consumers.errors import SampleTableError
from consumers.sample_table import MAX_WORLDS_UNSEEN, SampleTable

EXAMPLES = int(os.environ.get("WORLDTAP_FUZZ_EXAMPLES", "150"))
"""Examples a run of the fuzz test tries (a larger campaign: ``WORLDTAP_FUZZ_EXAMPLES=20000``)."""

WORLDS = 6
RUN = "r"

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.bool, torch.uint8, torch.complex64]


@st.composite
def _tensor(draw: st.DrawFn, n: int, tail: tuple[int, ...] = (), *, integral: bool = False) -> torch.Tensor:
    """A tensor of ``n`` rows of shape ``tail``, or (sometimes) one of another shape or dtype."""
    shape = (n, *tail)
    if draw(st.integers(0, 5)) == 0:
        shape = draw(st.sampled_from([(), (n + 1, *tail), (max(n - 1, 0), *tail), (n, 2, 2), (1, n)]))
    dtype = torch.int64 if integral else torch.float32
    if draw(st.integers(0, 3)) == 0:
        dtype = draw(st.sampled_from(_DTYPES))
    values = draw(st.lists(st.integers(-3, 9), min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    t = torch.tensor(values, dtype=torch.int64).reshape(shape).to(dtype)
    if t.is_floating_point() and t.numel() and draw(st.integers(0, 3)) == 0:  # NaN, infinity, a fraction
        special = draw(st.sampled_from([math.nan, math.inf, -math.inf, 0.5, torch.finfo(t.dtype).max]))
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = special
    return t


@st.composite
def _worlds(draw: st.DrawFn) -> torch.Tensor:
    n = draw(st.integers(0, 4))
    worlds = draw(st.lists(st.integers(0, WORLDS - 1), min_size=n, max_size=n, unique=True))
    if n and draw(st.integers(0, 3)) == 0:  # one world out of the run
        worlds[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, -WORLDS, WORLDS, WORLDS + 3, 2**40]))
    return torch.tensor(worlds, dtype=torch.int64)


@st.composite
def _message(draw: st.DrawFn) -> Any:
    worlds = draw(_worlds())
    n = worlds.shape[0]
    episodes = draw(_tensor(n, integral=True))
    if draw(st.booleans()):
        key = draw(st.sampled_from(["mass", "friction", "object"]))
        width = {"mass": (2,), "friction": (), "object": ()}[key]
        if draw(st.integers(0, 6)) == 0:
            width = (3,)  # the key changes its per-world shape
        labels = ("cube", "ball", "mug") if key == "object" else None
        if labels is not None and draw(st.integers(0, 4)) == 0:
            labels = ("cube",)  # codes past the labels
        value = draw(_tensor(n, width, integral=key == "object"))
        phase = draw(st.sampled_from(["build", "runtime"]))
        return VariationSample(RUN, 0, 0, key, phase, worlds, episodes, value, labels)  # type: ignore[arg-type]
    flags = [draw(_tensor(n)).bool() if draw(st.booleans()) else draw(_tensor(n)) for _ in range(3)]
    outcomes = {}
    if draw(st.booleans()):
        outcomes[draw(st.sampled_from(["return", "", "success"]))] = draw(_tensor(n))
    return EpisodeEnd(RUN, 0, 0, worlds, episodes, *flags, draw(_tensor(n, integral=True)), outcomes=outcomes)


def _same(a: Any, b: Any) -> None:
    """Two SampleArrays hold the same rows (NaN equal to NaN)."""
    assert a.x_columns == b.x_columns
    assert a.y_columns == b.y_columns
    for name in ("run", "world", "episode"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    np.testing.assert_array_equal(a.x, b.x)  # assert_array_equal treats NaNs as equal
    np.testing.assert_array_equal(a.y, b.y)
    assert a.labels.keys() == b.labels.keys()
    for key in a.labels:
        assert a.labels[key].tolist() == b.labels[key].tolist()


def _outside(message: Any, bound: int) -> bool:
    worlds = message.worlds
    return bool(worlds.numel()) and (int(worlds.min()) < 0 or int(worlds.max()) >= bound)


@pytest.mark.parametrize("run_start", [True, False], ids=["run-start", "joined-late"])
@settings(max_examples=EXAMPLES, deadline=None)
@given(messages=st.lists(_message(), min_size=1, max_size=12))
def test_only_documented_errors_escape_and_a_rejected_message_changes_nothing(
        run_start: bool, messages: list[Any]) -> None:
    table, reference = SampleTable(), SampleTable()  # reference: only the messages table accepts
    if run_start:
        for t in (table, reference):
            t(RunStart(RUN, 0, 0, WORLDS, "cpu"))
    for message in messages:
        try:
            table(message)
        except SampleTableError:
            pass
        else:
            bound = WORLDS if run_start else MAX_WORLDS_UNSEEN
            assert not _outside(message, bound), f"accepted a world outside [0, {bound}): {message.worlds}"
            reference(message)
    # both now see the same ends of every world: their rows must be the same
    everyone = torch.arange(WORLDS)
    for t in (table, reference):
        t(EpisodeEnd(RUN, 0, 0, everyone, torch.zeros(WORLDS, dtype=torch.int64),
                     torch.ones(WORLDS, dtype=torch.bool), torch.ones(WORLDS, dtype=torch.bool),
                     torch.zeros(WORLDS, dtype=torch.bool), torch.full((WORLDS,), 3)))
    _same(table.arrays(), reference.arrays())
