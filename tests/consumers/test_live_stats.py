from __future__ import annotations

import numpy as np
import pytest
import torch

from broker import Broker
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
