"""Sampler configurations and samplers: validation, listeners, seeding, devices, bounds."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import capture.variations as variations
from capture.errors import CaptureError
from capture.variations import (
    ChoiceCfg,
    ChoiceSampler,
    LogUniformCfg,
    LogUniformSampler,
    NormalCfg,
    NormalSampler,
    UniformCfg,
    UniformSampler,
    VariationError,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_exported_surface() -> None:
    assert variations.__all__ == sorted(variations.__all__)
    assert set(variations.__all__) == {
        "Bounds", "ChoiceCfg", "ChoiceSampler", "DesignCfg", "DesignSampler", "EpisodeSample",
        "LogUniformCfg",
        "LogUniformSampler", "NormalCfg", "NormalSampler", "SampleListener", "Sampler",
        "SamplerCfg", "UniformCfg", "UniformSampler", "Variation", "VariationCfg",
        "VariationDraw", "VariationError", "VariationRecord", "VariationRecorder",
        "VariationSummary", "derive_seed",
    }
    for name in variations.__all__:
        assert getattr(variations, name) is not None


def test_variation_error_is_a_capture_value_error() -> None:
    assert issubclass(VariationError, CaptureError)
    assert issubclass(VariationError, ValueError)


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: UniformCfg(2, 1), r"low, high: expected low <= high, got low=2.0 > high=1.0"),
        (lambda: UniformCfg([0, 0], [1]), r"low and high: expected the same shape.*\(2,\).*\(1,\)"),
        (lambda: UniformCfg(0, [1, 2]), r"low and high: expected the same shape"),
        (lambda: UniformCfg(float("nan"), 1), r"low: expected a finite number, got nan"),
        (lambda: UniformCfg([], []), r"low: expected a number or a non-empty vector"),
        (lambda: UniformCfg("a", "b"),  # type: ignore[arg-type]
         r"low: expected a number or a sequence of numbers"),
        (lambda: UniformCfg(0, 1, seed=-1), r"seed: expected an int in \[0, 2\*\*64\), got -1"),
        (lambda: UniformCfg(0, 1, seed=True), r"seed: expected an int.*got True"),
        (lambda: NormalCfg(0, -1), r"std: expected values >= 0, got std=-1.0"),
        (lambda: NormalCfg([0, 0], [1]), r"mean and std: expected the same shape"),
        (lambda: NormalCfg(0, 1, low=1, high=0), r"expected low <= high, got low=1.0 > high=0.0"),
        (lambda: NormalCfg(0, 1, low=[0, 1]), r"mean and low: expected the same shape"),
        (lambda: LogUniformCfg(0, 1), r"low: expected values > 0 .*got low=0.0"),
        (lambda: LogUniformCfg(2, 1), r"expected low <= high, got low=2.0 > high=1.0"),
        (lambda: ChoiceCfg([]), r"choices: expected at least one choice"),
        (lambda: ChoiceCfg("abc"), r"choices: expected a sequence of choices, got 'abc'"),
        (lambda: ChoiceCfg(["a", "b"], [0, 0]), r"weights: expected non-negative weights with "
                                                r"a positive sum, got \[0, 0\]"),
        (lambda: ChoiceCfg(["a", "b"], [1, -1]), r"weights: .*got \[1, -1\]"),
        (lambda: ChoiceCfg(["a", "b"], [1]), r"weights: expected 2 weights .*got \[1\]"),
        (lambda: ChoiceCfg([{"usd": "a"}]), r"choices\[0\]: expected a label msgpack carries "
                                            r"as a plain scalar.*got dict \{'usd': 'a'\}"),
        (lambda: ChoiceCfg(["a"], labels=[(1, 2)]),  # type: ignore[list-item]
         r"labels\[0\]: .*got tuple \(1, 2\)"),
        (lambda: ChoiceCfg(["a"], labels=[2**70]), r"labels\[0\]: .*got int"),
        (lambda: ChoiceCfg(["a", "b"], labels=["x"]), r"labels: expected 2 labels"),
        (lambda: ChoiceCfg(["a", "b", "a"]), r"choices: expected distinct labels, got 'a'"),
    ],
)
def test_bad_configs_raise_naming_the_values(build: object, match: str) -> None:
    with pytest.raises(VariationError, match=match):
        build()  # type: ignore[operator]


def test_configs_normalize_and_are_frozen() -> None:
    cfg = UniformCfg([0, 1], (2, 3), seed=4)
    assert cfg.low == (0.0, 1.0)
    assert cfg.high == (2.0, 3.0)
    assert cfg.shape == (2,)
    assert UniformCfg(0, 1).shape == ()
    with pytest.raises(AttributeError):
        cfg.seed = 5  # type: ignore[misc]
    choice = ChoiceCfg(["a", 1, 2.5, True], weights=[1, 1, 1, 1])
    assert choice.labels == ("a", 1, 2.5, True)  # 1 and True are distinct labels
    objects = ChoiceCfg([{"usd": "cube.usd"}, {"usd": "mug.usd"}], labels=["cube", "mug"])
    assert objects.labels == ("cube", "mug")


def test_sample_shapes_and_dtypes() -> None:
    assert UniformSampler(0, 1).sample(5).shape == (5,)
    vec = UniformSampler([0, 10, 100], [1, 11, 101]).sample(4)
    assert vec.shape == (4, 3)
    assert vec.dtype == torch.float32
    assert (vec[:, 1] >= 10).all()
    assert (vec[:, 2] >= 100).all()
    assert NormalSampler([0, 0], [1, 1]).sample(3).shape == (3, 2)
    assert LogUniformSampler(1, 2).sample(0).shape == (0,)
    codes = ChoiceSampler(["a", "b"]).sample(6)
    assert codes.dtype == torch.int64
    assert ChoiceSampler(["a", "b"], [1, 1]).sample(0).shape == (0,)
    with pytest.raises(VariationError, match=r"n: expected a non-negative int, got -1"):
        UniformSampler(0, 1).sample(-1)


def test_listeners_see_every_draw_in_order_with_their_worlds() -> None:
    sampler = UniformSampler(0, 1, seed=1)
    calls: list[tuple[str, torch.Tensor, object]] = []
    sampler.add_listener(lambda v, w: calls.append(("first", v, w)))
    sampler.add_listener(lambda v, w: calls.append(("second", v, w)))
    mask = torch.tensor([True, False, True])
    draws = [sampler.sample(3), sampler.sample(2, [4, 1]), sampler.sample(2, mask)]
    assert [c[0] for c in calls] == ["first", "second"] * 3
    assert [c[2] for c in calls[::2]] == [None, [4, 1], mask]
    for (_, value, _), draw in zip(calls[::2], draws, strict=True):
        assert value is draw  # the very tensor returned: borrowed, not copied


def test_remove_listener() -> None:
    sampler = ChoiceSampler(["a", "b"])
    seen: list[int] = []

    def listener(v: torch.Tensor, w: object) -> None:
        seen.append(v.numel())

    sampler.add_listener(listener)
    sampler.sample(2)
    sampler.remove_listener(listener)
    sampler.sample(3)
    assert seen == [2]
    with pytest.raises(VariationError, match=r"listener: .* is not registered"):
        sampler.remove_listener(listener)
    with pytest.raises(TypeError, match=r"listener: expected a callable"):
        sampler.add_listener(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg",
    [UniformCfg([0, 1], [1, 3], seed=7), NormalCfg(0, 1, seed=7), LogUniformCfg(0.1, 10, seed=7),
     ChoiceCfg(["a", "b", "c"], seed=7), ChoiceCfg(["a", "b", "c"], [1, 2, 3], seed=7)],
)
def test_same_seed_same_draws_different_seed_differs(
    cfg: UniformCfg | NormalCfg | LogUniformCfg | ChoiceCfg,
) -> None:
    a, b = cfg.build(), cfg.build()
    first = [a.sample(16) for _ in range(3)]
    second = [b.sample(16) for _ in range(3)]
    for x, y in zip(first, second, strict=True):
        assert torch.equal(x, y)
    other = dataclasses.replace(cfg, seed=8)
    assert not torch.equal(other.build().sample(64), cfg.build().sample(64))


def test_generator_is_per_sampler_and_ignores_the_global_rng() -> None:
    a, b = UniformSampler(0, 1, seed=3), UniformSampler(0, 1, seed=3)
    x = a.sample(8)
    torch.manual_seed(123)
    torch.rand(100)
    UniformSampler(0, 1, seed=3).sample(50)  # another sampler's draws do not interleave
    assert torch.equal(x, b.sample(8))


def test_device_is_respected_on_cpu() -> None:
    for sampler in (UniformSampler(0, 1), NormalSampler(0, 1), ChoiceSampler(["a"], [1.0])):
        assert sampler.device == torch.device("cpu")
        assert sampler.sample(2).device == torch.device("cpu")


@pytest.mark.cuda
@cuda
def test_device_is_respected_on_cuda() -> None:
    for cfg in (UniformCfg(0, 1, seed=1), NormalCfg(0, 1, low=-1, high=1, seed=1),
                LogUniformCfg(1, 2, seed=1), ChoiceCfg(["a", "b"], [1, 2], seed=1),
                ChoiceCfg(["a", "b"], seed=1)):
        sampler = cfg.build("cuda")
        assert sampler.device.type == "cuda"
        value = sampler.sample(32)
        assert value.device.type == "cuda"
        assert torch.equal(value, cfg.build("cuda").sample(32))


def test_choice_codes_decode_and_weights() -> None:
    sampler = ChoiceSampler([{"usd": "cube"}, {"usd": "ball"}, {"usd": "mug"}], [0, 1, 3],
                            labels=["cube", "ball", "mug"], seed=2)
    codes = sampler.sample(200)
    assert sampler.labels == ("cube", "ball", "mug")
    assert not (codes == 0).any()  # weight 0 is never drawn
    assert (codes == 2).sum() > (codes == 1).sum()
    decoded = sampler.decode(codes[:3])
    assert decoded == [sampler.choices[int(c)] for c in codes[:3]]
    assert UniformSampler(0, 1).labels is None


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@settings(max_examples=30, deadline=None)
@given(finite, st.floats(0, 1e3, width=32), st.integers(0, 2**32))
def test_uniform_stays_within_bounds(low: float, span: float, seed: int) -> None:
    high = low + span
    value = UniformSampler([low, low], [high, high], seed=seed).sample(64)
    assert (value >= torch.tensor(low)).all()
    assert (value <= torch.tensor(high)).all()


@settings(max_examples=30, deadline=None)
@given(finite, st.floats(0, 100, width=32), st.floats(0, 10, width=32), st.integers(0, 2**32))
def test_clipped_normal_stays_within_bounds(mean: float, std: float, half: float, seed: int) -> None:
    value = NormalSampler(mean, std, mean - half, mean + half, seed=seed).sample(64)
    assert (value >= torch.tensor(mean - half, dtype=torch.float32)).all()
    assert (value <= torch.tensor(mean + half, dtype=torch.float32)).all()


@settings(max_examples=30, deadline=None)
@given(st.floats(1e-3, 1e3), st.floats(1, 1e3), st.integers(0, 2**32))
def test_log_uniform_stays_within_bounds(low: float, ratio: float, seed: int) -> None:
    value = LogUniformSampler(low, low * ratio, seed=seed).sample(64)
    assert (value >= torch.tensor(low, dtype=torch.float32)).all()
    assert (value <= torch.tensor(low * ratio, dtype=torch.float32)).all()


def test_log_uniform_is_uniform_in_log_space() -> None:
    logs = LogUniformSampler(1e-2, 1e2, seed=0).sample(20000).log10()
    counts = torch.histc(logs, bins=4, min=-2, max=2)
    assert (counts > 4000).all()  # about 5000 each; a linear uniform would put ~all in one bin
    assert math.isclose(float(logs.mean()), 0.0, abs_tol=0.1)


class _EndpointUniform(UniformSampler):
    def _rand(self, n: int) -> torch.Tensor:
        return torch.tensor([0.0, 1.0 - 2.0**-24])  # the extremes torch.rand can return


class _EndpointLogUniform(LogUniformSampler):
    def _rand(self, n: int) -> torch.Tensor:
        return torch.tensor([0.0, 1.0 - 2.0**-24])


@pytest.mark.parametrize("sampler_type", [_EndpointUniform, _EndpointLogUniform])
def test_rounding_at_the_extremes_never_leaves_the_bounds(
    sampler_type: type[UniformSampler] | type[LogUniformSampler],
) -> None:
    rng = random.Random(0)
    for _ in range(200):
        low = rng.uniform(1e-3, 10)
        high = low * rng.uniform(1, 100)
        sampler = sampler_type(low, high)
        value = sampler.sample(2)
        bounds = torch.tensor([low, high], dtype=torch.float32)
        assert value[0] >= bounds[0]
        assert value[1] <= bounds[1]
