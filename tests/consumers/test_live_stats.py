from __future__ import annotations

import numpy as np
import pytest
import torch

from broker import Batch, Broker
from capture import FunctionTerm, Recorder
from consumers import LiveStatistics


def test_moments_match_numpy_over_every_row_and_sources_stay_borrowed() -> None:
    broker = Broker(strict=True)
    stats = LiveStatistics()
    stats.attach(broker)
    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(5, 3)
    flag = torch.zeros(5, dtype=torch.bool)
    rec = Recorder(5, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"x": x, "flag": flag}))
    rows = []
    for _ in range(9):
        x.copy_(torch.randn(5, 3, generator=gen) * 3 + 1)
        flag.copy_(torch.rand(5, generator=gen) < 0.3)
        rows.append((x.numpy().astype(np.float64).copy(), flag.numpy().copy()))
        rec.record_post_step()
    x.fill_(1e6)  # mutating the source afterwards changes nothing kept
    rec.record_pre_reset([0, 1, 2], success=torch.tensor([True, False, True]))
    rec.record_pre_reset([3])
    xs = np.concatenate([r[0] for r in rows])
    fs = np.concatenate([r[1] for r in rows]).astype(np.float64)
    s = stats.summary()
    fx = s.fields["t/x"]
    assert fx.count == 45
    np.testing.assert_allclose(fx.mean, xs.mean(0), rtol=1e-6)
    np.testing.assert_allclose(fx.std, xs.std(0, ddof=1), rtol=1e-6)
    np.testing.assert_array_equal(fx.min, xs.min(0))
    np.testing.assert_array_equal(fx.max, xs.max(0))
    np.testing.assert_allclose(s.fields["t/flag"].mean, fs.mean())
    assert (s.batches, s.episodes, s.successes) == (9, 4, 2)
    assert s.success_rate == 0.5
    assert s.mean_length == 9.0


def test_field_filter_and_subsampling() -> None:
    broker = Broker(strict=True)
    stats = LiveStatistics(fields=["t/a"], every=3)
    stats.attach(broker)
    a = torch.zeros(2)
    rec = Recorder(2, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"a": a, "b": a}))
    for i in range(7):
        a.fill_(i)
        rec.record_post_step()
    s = stats.summary()
    assert set(s.fields) == {"t/a"}
    assert s.fields["t/a"].count == 6  # steps 0, 3, 6
    assert float(s.fields["t/a"].mean) == 3.0
    assert np.isnan(s.success_rate)
    with pytest.raises(ValueError, match="every: expected a positive int, got 0"):
        LiveStatistics(every=0)


def test_layout_changes_on_one_topic_are_reduced_with_the_new_layout() -> None:
    # Each step of one topic changes the previous step's layout: the number of worlds, a
    # field's dtype, the fields' order, a field added or dropped. A layout kept from the
    # step before would mix up columns or reduce in the wrong dtype.
    gen = torch.Generator().manual_seed(3)

    def floats(n: int, dtype: torch.dtype, scale: float) -> torch.Tensor:
        return (torch.randn(n, 2, 3, generator=gen) * scale + 5 * scale).to(dtype)

    steps: list[dict[str, torch.Tensor]] = []
    for n, a_dtype, order, extra in [(4, torch.float32, "ad", False), (4, torch.float32, "ad", False),
                                     (6, torch.float32, "ad", False), (4, torch.float64, "ad", False),
                                     (4, torch.float32, "da", False), (5, torch.float32, "ad", True),
                                     (5, torch.float16, "da", False), (4, torch.float32, "ad", False)]:
        fields = {"a": floats(n, a_dtype, 1.0), "d": floats(n, torch.float32, 100.0)}
        fields = {k: fields[k] for k in order}
        if extra:
            fields["c"] = torch.randint(-50, 50, (n,), generator=gen, dtype=torch.int16)
        steps.append(fields)
    stats = LiveStatistics()
    only_d = LiveStatistics(fields=["t/d"])
    for i, fields in enumerate(steps):
        n = next(iter(fields.values())).shape[0]
        batch = Batch("r", i, i, "batch/t", torch.arange(n), torch.zeros(n, dtype=torch.int64), fields)
        stats(batch)
        only_d(batch)
    s, sd = stats.summary(), only_d.summary()
    assert set(s.fields) == {"t/a", "t/c", "t/d"}
    assert set(sd.fields) == {"t/d"}
    for key in ("a", "c", "d"):
        rows = np.concatenate([f[key].numpy().astype(np.float64) for f in steps if key in f])
        for got in (s.fields[f"t/{key}"], *([sd.fields["t/d"]] if key == "d" else [])):
            assert got.count == rows.shape[0]
            assert got.mean.shape == rows.shape[1:]
            np.testing.assert_allclose(got.mean, rows.mean(0), rtol=1e-6)
            np.testing.assert_allclose(got.std, rows.std(0, ddof=1), rtol=1e-5)
            np.testing.assert_array_equal(got.min, rows.min(0))
            np.testing.assert_array_equal(got.max, rows.max(0))
