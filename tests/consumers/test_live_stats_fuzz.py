"""LiveStatistics fed structured mutations of valid messages, as an in-process publisher or a
remote one could hand them over: fields of more or fewer rows than the batch has worlds, of a
per-world shape other than the one seen before, of dtypes it cannot reduce, worlds that are not
1-D, episode ends whose columns do not match their worlds. Only the documented ``ValueError``
and ``TypeError`` escape, and a refused message changes nothing: afterwards the consumer's
summary, its subsampling included, is exactly that of one that never saw it."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Batch, EpisodeEnd
from consumers import LiveStatistics, LiveSummary

EXAMPLES = int(os.environ.get("WORLDTAP_FUZZ_EXAMPLES", "150"))
"""Examples a run of the fuzz test tries (a larger campaign: ``WORLDTAP_FUZZ_EXAMPLES=20000``)."""

WORLDS = 6


@st.composite
def _episode_end(draw: st.DrawFn) -> EpisodeEnd[torch.Tensor]:
    n = draw(st.integers(0, WORLDS))
    worlds = torch.arange(n)
    columns = {"success": torch.tensor(draw(st.lists(st.booleans(), min_size=n, max_size=n)), dtype=torch.bool),
               "length": torch.tensor(draw(st.lists(st.integers(1, 50), min_size=n, max_size=n)), dtype=torch.int64)}
    kind = draw(st.integers(0, 5))
    if kind == 0:  # a column of another length than the worlds
        name = draw(st.sampled_from(sorted(columns)))
        columns[name] = torch.cat([columns[name], columns[name][:1].clone() if n else columns[name].new_ones(1)])
    elif kind == 1:
        worlds = worlds.reshape(1, -1)
    ones = torch.ones(n, dtype=torch.bool)
    return EpisodeEnd("r", 0, 0, worlds, torch.zeros(n, dtype=torch.int64), columns["success"], ones, ~ones,
                      columns["length"])


@st.composite
def _batch(draw: st.DrawFn) -> Batch[torch.Tensor]:
    n = draw(st.integers(0, WORLDS))
    term = draw(st.sampled_from(["a", "b"]))
    value = draw(st.floats(-1e3, 1e3, allow_nan=False, width=32))
    fields = {"x": torch.full((n, 2), value) + torch.arange(2 * n, dtype=torch.float32).reshape(n, 2),
              "flag": torch.arange(n) % 2 == 0}
    if draw(st.booleans()):
        fields["y"] = torch.full((n, 3), value, dtype=torch.float64)
    worlds = torch.arange(n)
    kind = draw(st.integers(0, 9))
    name = draw(st.sampled_from(sorted(fields)))
    t = fields[name]
    if kind == 0:  # more rows, or fewer, than worlds
        fields[name] = torch.cat([t, t[:1]]) if n and draw(st.booleans()) else \
            torch.cat([t, t.new_zeros(1, *t.shape[1:])]) if not n else t[1:]
    elif kind == 1:  # another per-world shape than the field's before
        fields[name] = t.reshape(n, -1)[:, :1].repeat(1, 5) if n else t.new_zeros(0, 5)
    elif kind == 2:  # a dtype that has no moments
        fields[name] = t.to(draw(st.sampled_from([torch.complex64, torch.complex128])))
    elif kind == 3:  # a dtype that has: reduced as another layout
        fields[name] = t.to(draw(st.sampled_from([torch.bfloat16, torch.int16, torch.uint8, torch.float64])))
    elif kind == 4:
        worlds = worlds.reshape(1, -1)
    elif kind == 5:  # fields with no world dimension
        fields[name] = t[0] if n else torch.tensor(1.0)
    return Batch("r", 0, 0, f"batch/{term}", worlds, torch.zeros(n, dtype=torch.int64), fields)


def _seen(stats: LiveStatistics) -> Any:
    """Everything a LiveStatistics answers, as plain values: its summary, each field's
    moments (NaN equal to NaN), and, by one more batch of each topic, where its subsampling
    stands."""
    s: LiveSummary = stats.summary()
    fields = {k: (f.count, *(np.nan_to_num(a, nan=0.5, posinf=1e300, neginf=-1e300).tolist()
                             for a in (f.mean, f.std, f.min, f.max)))
              for k, f in sorted(s.fields.items())}
    return s.batches, s.episodes, s.successes, s.mean_length if s.episodes else None, fields


def _probe(stats: LiveStatistics, batch: Batch[torch.Tensor]) -> str:
    """The error a batch raises, or "" where it is taken."""
    try:
        stats(batch)
    except ValueError as exc:
        return str(exc)
    return ""


@settings(max_examples=EXAMPLES, deadline=None)
@given(messages=st.lists(st.one_of(_batch(), _episode_end()), min_size=1, max_size=12),
       every=st.integers(1, 3))
def test_only_documented_errors_escape_and_a_refused_message_changes_nothing(messages: list[Any],
                                                                              every: int) -> None:
    stats, reference = LiveStatistics(every=every), LiveStatistics(every=every)  # reference: only what stats took
    for message in messages:
        before = _seen(stats)
        _seen(reference)  # both merge their windows at the same points, so the sums stay bit-equal
        try:
            stats(message)
        except (ValueError, TypeError):
            assert _seen(stats) == before
        else:
            for t in (*getattr(message, "fields", {}).values(), getattr(message, "success", None),
                      getattr(message, "length", None)):
                assert t is None or (t.dim() >= 1 and t.shape[0] == message.worlds.numel())
            assert message.worlds.dim() == 1
            reference(message)
        # the subsampling of each topic stands where it stands in the reference
        probe = {"x": torch.ones(1, 2), "flag": torch.ones(1, dtype=torch.bool)}
        for term in ("a", "b"):
            probe_batch = Batch("r", 0, 0, f"batch/{term}", torch.arange(1), torch.zeros(1, dtype=torch.int64), probe)
            assert _probe(stats, probe_batch) == _probe(reference, probe_batch)
        assert _seen(stats) == _seen(reference)


@pytest.mark.parametrize("every", [1, 2])
def test_a_refused_batch_leaves_the_subsampling_where_it_was(every: int) -> None:
    """A batch refused for a field of a new shape is not one of the batches ``every`` counts."""
    stats = LiveStatistics(every=every)
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(2, 3)}))
    for _ in range(every):  # the next batch reduced would be this one, after every - 1 skipped
        with pytest.raises(ValueError, match="per-world shape"):
            stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(2, 4)}))
    for _ in range(every - 1):
        stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(2, 3)}))
    stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.ones(2, 3)}))
    x = stats.summary().fields["t/x"]
    assert x.count == 4
    assert x.mean.tolist() == [0.5] * 3


@pytest.mark.parametrize("rows", [1, 3])
def test_a_field_whose_rows_are_not_the_worlds_is_refused(rows: int) -> None:
    """Before, every kernel reduced such a field whole and counted it as the batch's 2 rows:
    after a batch of zeros, one of 3 rows of 9 gave a mean of 6.75 over 4 rows (1 row of 9:
    2.25), with nothing said."""
    stats = LiveStatistics()
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(2, 3)}))
    with pytest.raises(ValueError, match=rf"field 't/x': shape \({rows}, 3\), expected one row per world of the batch \(2 rows\)"):
        stats(Batch("r", 0, 0, "batch/t", w, e, {"x": torch.full((rows, 3), 9.0)}))
    x = stats.summary().fields["t/x"]
    assert (x.count, x.max.tolist()) == (2, [0.0] * 3)


def test_an_episode_end_whose_columns_are_not_its_worlds_is_refused() -> None:
    stats = LiveStatistics()
    w = torch.arange(2)
    ones = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"episode end: success has 3 values for 2 worlds"):
        stats(EpisodeEnd("r", 0, 0, w, torch.zeros(2, dtype=torch.int64), torch.ones(3, dtype=torch.bool),
                         ones, ~ones, torch.full((2,), 4)))
    stats(EpisodeEnd("r", 0, 0, w, torch.zeros(2, dtype=torch.int64), ones, ones, ~ones, torch.full((2,), 4)))
    s = stats.summary()
    assert (s.episodes, s.successes, s.mean_length) == (2, 2, 4.0)
