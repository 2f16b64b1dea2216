"""Variation: configuration, listener ownership across apply_cfg, removal."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from capture.variations import (
    ChoiceCfg,
    NormalCfg,
    UniformCfg,
    UniformSampler,
    Variation,
    VariationCfg,
    VariationError,
)


def _uniform(seed: int = 0, phase: str = "runtime") -> VariationCfg:
    return VariationCfg(sampler=UniformCfg(0, 1, seed=seed), phase=phase)  # type: ignore[arg-type]


def test_variation_exposes_cfg_phase_enabled_and_sampler() -> None:
    v = Variation("mass", VariationCfg(sampler=UniformCfg([1, 2], [2, 3]), phase="build",
                                       enabled=False))
    assert v.name == "mass"
    assert v.phase == "build"
    assert v.enabled is False
    assert isinstance(v.sampler, UniformSampler)
    assert v.sampler.shape == (2,)
    assert v.labels is None
    assert v.device == torch.device("cpu")
    assert Variation("object", VariationCfg(sampler=ChoiceCfg(["a", "b"]))).labels == ("a", "b")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: VariationCfg(sampler=UniformCfg(0, 1), phase="later"),  # type: ignore[arg-type]
         r"phase: expected 'build' or 'runtime', got 'later'"),
        (lambda: VariationCfg(sampler=UniformCfg(0, 1), enabled=1),  # type: ignore[arg-type]
         r"enabled: expected a bool, got 1"),
        (lambda: VariationCfg(sampler=(0, 1)),  # type: ignore[arg-type]
         r"sampler: expected a sampler configuration with build\(\), got \(0, 1\)"),
        (lambda: Variation("bad key", _uniform()), r"name: expected a non-empty key without "
                                                   r"whitespace, got 'bad key'"),
        (lambda: Variation("", _uniform()), r"name: .*got ''"),
        (lambda: Variation("k", UniformCfg(0, 1)),  # type: ignore[arg-type]
         r"cfg: expected a VariationCfg, got UniformCfg"),
    ],
)
def test_bad_variation_configs(make: object, match: str) -> None:
    with pytest.raises(VariationError, match=match):
        make()  # type: ignore[operator]


def test_sample_listeners_see_every_draw_in_order_with_worlds() -> None:
    v = Variation("friction", _uniform(seed=1))
    calls: list[tuple[int, torch.Tensor, object]] = []
    v.add_sample_listener(lambda value, worlds: calls.append((1, value, worlds)))
    v.add_sample_listener(lambda value, worlds: calls.append((2, value, worlds)))
    a = v.sample(4)
    b = v.sample(2, [3, 0])
    c = v.sampler.sample(1, 2)  # a draw straight from the sampler is seen too
    assert [(i, w) for i, _, w in calls] == [(1, None), (2, None), (1, [3, 0]), (2, [3, 0]),
                                             (1, 2), (2, 2)]
    assert all(got is drawn for (_, got, _), drawn in zip(calls[::2], (a, b, c), strict=True))


def test_listeners_survive_apply_cfg_and_leave_the_old_sampler() -> None:
    v = Variation("friction", _uniform(seed=1))
    seen: list[tuple[str, object]] = []
    first = lambda value, worlds: seen.append(("first", worlds))  # noqa: E731
    second = lambda value, worlds: seen.append(("second", worlds))  # noqa: E731
    v.add_sample_listener(first)
    v.add_sample_listener(second)
    old = v.sampler
    v.apply_cfg(VariationCfg(sampler=NormalCfg([0, 0], [1, 1], seed=2), phase="build"))
    assert v.sampler is not old
    assert v.phase == "build"
    assert v.sample(3, [0, 1, 2]).shape == (3, 2)
    assert seen == [("first", [0, 1, 2]), ("second", [0, 1, 2])]
    old.sample(1)  # the discarded sampler notifies nobody
    assert len(seen) == 2
    v.apply_cfg(_uniform(seed=3))
    v.sample(1, 5)
    assert seen[2:] == [("first", 5), ("second", 5)]


def test_apply_cfg_restarts_the_stream_from_the_new_seed() -> None:
    v = Variation("friction", _uniform(seed=4))
    first = v.sample(8)
    v.sample(8)
    v.apply_cfg(_uniform(seed=4))
    assert torch.equal(v.sample(8), first)
    v.apply_cfg(_uniform(seed=5))
    assert not torch.equal(v.sample(8), first)


def test_failed_apply_cfg_keeps_the_old_configuration() -> None:
    v = Variation("friction", _uniform(seed=4))
    cfg, sampler = v.cfg, v.sampler
    with pytest.raises(VariationError, match="cfg: expected a VariationCfg"):
        v.apply_cfg(dataclasses.asdict(cfg))  # type: ignore[arg-type]
    assert v.cfg is cfg
    assert v.sampler is sampler


def test_remove_sample_listener() -> None:
    v = Variation("friction", _uniform())
    seen: list[object] = []

    def listener(value: torch.Tensor, worlds: object) -> None:
        seen.append(worlds)

    v.add_sample_listener(listener)
    v.sample(1, 0)
    v.remove_sample_listener(listener)
    v.sample(1, 1)
    v.apply_cfg(_uniform(seed=9))  # a removed listener is not re-bound either
    v.sample(1, 2)
    assert seen == [0]
    with pytest.raises(VariationError, match=r"is not a sample listener of variation 'friction'"):
        v.remove_sample_listener(listener)
