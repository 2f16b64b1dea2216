"""Retention fed structured mutations of valid messages, as a remote subscriber could decode
them: worlds outside the run, of other dtypes and shapes, fields of other shapes, dtypes and
names, episode ends naming worlds that do not exist. Only ``RetentionError`` (with its
``RetentionSchemaError``) escapes, and a refused message changes nothing: afterwards the
consumer holds exactly what one that never saw it holds."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Batch, EpisodeEnd
from consumers import Retention, RetentionError

EXAMPLES = int(os.environ.get("WORLDTAP_FUZZ_EXAMPLES", "200"))
"""Examples a run of the fuzz test tries (a larger campaign: ``WORLDTAP_FUZZ_EXAMPLES=20000``)."""

WORLDS = 4
_HOOKS = ["post_step", "post_reset"]


@st.composite
def _worlds(draw: st.DrawFn) -> torch.Tensor:
    n = draw(st.integers(0, WORLDS))
    worlds = draw(st.lists(st.integers(0, WORLDS - 1), min_size=n, max_size=n, unique=True))
    t = torch.tensor(worlds, dtype=torch.int64)
    kind = draw(st.integers(0, 7))
    if kind == 0 and n:
        t[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, -WORLDS - 1, WORLDS, 2**40]))
    elif kind == 1:
        t = t.to(draw(st.sampled_from([torch.int32, torch.float32, torch.bool])))
    elif kind == 2:
        t = t.reshape(1, -1)
    elif kind == 3:
        t = torch.arange(WORLDS + 1)
    return t


@st.composite
def _message(draw: st.DrawFn) -> Any:
    worlds = draw(_worlds())
    n = worlds.shape[-1]
    if draw(st.integers(0, 3)) == 0:
        ones = torch.ones(n, dtype=torch.bool)
        return EpisodeEnd("r", 0, 0, worlds, torch.zeros(n, dtype=torch.int64), ones, ones, ~ones,
                          torch.full((n,), 3))
    term = draw(st.sampled_from(["a", "b"]))
    rows = n if draw(st.integers(0, 5)) else n + 1
    tail = (2,) if draw(st.integers(0, 5)) else (3,)
    dtype = torch.float32 if draw(st.integers(0, 5)) else torch.float64
    value = float(draw(st.integers(0, 1000)))
    fields = {"x": torch.full((rows, *tail), value, dtype=dtype)}
    if draw(st.integers(0, 7)) == 0:
        fields["y"] = torch.zeros(rows)
    return Batch("r", 0, 0, f"batch/{term}", worlds, torch.zeros(n, dtype=torch.int64), fields,
                 draw(st.sampled_from(_HOOKS)) if term == "b" else "post_step")  # type: ignore[arg-type]


def _held(r: Retention) -> Any:
    """Everything a Retention answers: each world's episode, bytes and all, and its counters."""
    episodes = {w: {t: {f: (v.dtype, tuple(v.shape), v.tolist()) for f, v in fields.items()}
                    for t, fields in r.episode(w).items()} for w in range(WORLDS)}
    stats = r.statistics()
    return episodes, dict(r.capacity), stats.batches, stats.episodes_finished, stats.topics


@settings(max_examples=EXAMPLES, deadline=None)
@given(messages=st.lists(_message(), min_size=1, max_size=14))
def test_only_documented_errors_escape_and_a_refused_message_changes_nothing(messages: list[Any]) -> None:
    retention, reference = Retention(num_worlds=WORLDS, initial_capacity=2), \
        Retention(num_worlds=WORLDS, initial_capacity=2)  # reference: only what retention took
    for message in messages:
        before = _held(retention)
        try:
            retention(message)
        except RetentionError:
            assert _held(retention) == before
        else:
            worlds = message.worlds
            assert not (worlds.numel() and (int(worlds.min()) < 0 or int(worlds.max()) >= WORLDS))
            reference(message)
        assert _held(retention) == _held(reference)


@pytest.mark.parametrize("hook", _HOOKS)
def test_the_fuzzed_kinds_of_message_are_valid_without_mutation(hook: str) -> None:
    """The strategies' unmutated messages are taken (the test above is not vacuous)."""
    r = Retention(num_worlds=WORLDS)
    w = torch.arange(WORLDS)
    r(Batch("r", 0, 0, "batch/b", w, torch.zeros(WORLDS, dtype=torch.int64), {"x": torch.zeros(WORLDS, 2)},
            hook))  # type: ignore[arg-type]
    ones = torch.ones(WORLDS, dtype=torch.bool)
    r(EpisodeEnd("r", 0, 0, w, torch.zeros(WORLDS, dtype=torch.int64), ones, ones, ~ones, torch.full((WORLDS,), 3)))
    assert r.statistics().episodes_finished == WORLDS
