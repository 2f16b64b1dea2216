"""Designed samples: DesignCfg takes the rows of a given design (e.g. SALib's) in order."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from SALib.sample import latin, sobol

from broker import Broker, Message, VariationSample
from capture import Recorder
from capture.variations import (
    DesignCfg,
    DesignSampler,
    UniformCfg,
    Variation,
    VariationCfg,
    VariationError,
    VariationRecorder,
)

PROBLEM: dict[str, Any] = {"num_vars": 2, "names": ["length", "masspole"], "bounds": [[0.2, 1.2], [0.03, 0.5]]}


def _f32(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=np.float32).tobytes()


def test_a_salib_latin_hypercube_is_assigned_to_worlds_in_order() -> None:
    """Catches design rows skipped, repeated, reordered or given to the wrong world: with
    worlds resetting in an arbitrary order, the rows recorded per draw are the design's rows in
    order, byte for byte, and row i of a draw is the value of the draw's i-th world."""
    design = latin.sample(PROBLEM, 40, seed=7)
    low, high = [b[0] for b in PROBLEM["bounds"]], [b[1] for b in PROBLEM["bounds"]]
    broker = Broker(strict=True)
    messages: list[Message] = []
    broker.subscribe("variation/", messages.append)
    n = 6
    recorder = Recorder(n, broker=broker, run="doe")
    joint = Variation("physics", VariationCfg(sampler=DesignCfg(design, low, high)))
    length = Variation("length", VariationCfg(sampler=DesignCfg(design[:, 0], low[0], high[0])))
    vr = VariationRecorder(recorder)
    vr.attach([joint, length])
    assert recorder.variations["physics"] == {"kind": "design", "phase": "runtime", "shape": [2],
                                              "seed": joint.seed, "low": low, "high": high}
    assert recorder.variations["length"]["low"] == 0.2
    rng = np.random.default_rng(0)
    order: list[tuple[int, int]] = []  # (world, episode) in the order the rows were handed out
    episode = [0] * n
    worlds = list(range(n))
    while len(order) < len(design):
        take = worlds[: len(design) - len(order)]
        joint.sample(len(take), take)
        length.sample(len(take), take)
        order += [(w, episode[w]) for w in take]
        recorder.record_post_step()
        done = sorted(rng.choice(n, size=int(rng.integers(1, n + 1)), replace=False).tolist(),
                      key=lambda _: rng.random())
        recorder.record_pre_reset(done)
        for w in done:
            episode[w] += 1
        worlds = done
    samples = [m for m in messages if isinstance(m, VariationSample)]
    got = torch.cat([s.value for s in samples if s.key == "physics"]).numpy()
    assert _f32(got) == _f32(design)
    got = torch.cat([s.value for s in samples if s.key == "length"]).numpy()
    assert _f32(got) == _f32(design[:, 0])
    for row, (w, e) in enumerate(order):
        kept = vr.sample_for_episode(w, e)
        assert _f32(kept["physics"].value.numpy()) == _f32(design[row])
        assert _f32(kept["length"].value.numpy()) == _f32(design[row, :1])
    with pytest.raises(VariationError, match=r"variation 'physics': design: expected a draw of at "
                                             r"most the 0 rows left \(40 of 40 used\), got a draw "
                                             r"of 1; give a design with at least 41 rows"):
        joint.sample(1, 0)


def test_a_salib_sobol_design_with_default_bounds() -> None:
    design = sobol.sample(PROBLEM, 8, calc_second_order=False, seed=1)
    cfg = DesignCfg(design)
    values = torch.from_numpy(design.astype(np.float32))
    assert cfg.low == tuple(values.amin(0).tolist())
    assert cfg.high == tuple(values.amax(0).tolist())
    assert cfg.rows == len(design)
    sampler = cfg.build()
    assert _f32(torch.cat([sampler.sample(5), sampler.sample(len(design) - 5)]).numpy()) == _f32(design)


def test_an_exhausting_draw_takes_no_row() -> None:
    """Catches a refused draw that still advanced the design (the next draw would skip rows)."""
    sampler = DesignSampler(np.arange(5.0))
    assert sampler.sample(3).tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(VariationError, match=r"design: expected a draw of at most the 2 rows left "
                                             r"\(3 of 5 used\), got a draw of 4; give a design with "
                                             r"at least 7 rows"):
        sampler.sample(4)
    assert sampler.remaining == 2
    assert sampler.sample(2).tolist() == [3.0, 4.0]
    assert sampler.sample(0).shape == (0,)


def test_the_design_is_an_owned_copy_and_apply_cfg_restarts_it() -> None:
    design = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    v = Variation("pair", VariationCfg(sampler=DesignCfg(design)))
    design[:] = -1.0  # the caller reuses its array
    first = v.sample(2).clone()
    assert first.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    v.apply_cfg(VariationCfg(sampler=DesignCfg(torch.tensor([[7.0, 8.0]]))))
    assert v.sample(1).tolist() == [[7.0, 8.0]]
    assert v.sampler.shape == (2,)
    assert v.sample(0, []).shape == (0, 2)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: DesignCfg([]), r"values: expected a non-empty 1-D \(n,\) or 2-D \(n, d\) design, "
                                r"got shape \(0,\)"),
        (lambda: DesignCfg(np.zeros((2, 0))), r"got shape \(2, 0\)"),
        (lambda: DesignCfg(np.zeros((2, 2, 2))), r"got shape \(2, 2, 2\)"),
        (lambda: DesignCfg(["a", "b"]), r"values: expected a 1-D or 2-D array of real numbers, "
                                        r"got dtype <U1"),
        (lambda: DesignCfg([True, False]), r"got dtype bool"),
        (lambda: DesignCfg([[1.0], [1.0, 2.0]]), r"values: expected a 1-D or 2-D array of numbers"),
        (lambda: DesignCfg([0.0, float("nan")]), r"values: expected finite numbers"),
        (lambda: DesignCfg([0.5], low=[0, 0], high=[1, 1]),
         r"low: expected the shape of one design row \(\), got low=\(0.0, 0.0\)"),
        (lambda: DesignCfg([[0.5, 0.5]], low=0, high=1),
         r"low: expected the shape of one design row \(2,\), got low=0.0"),
        (lambda: DesignCfg([0.5], low=1, high=0), r"low, high: expected low <= high"),
        (lambda: DesignCfg([0.5, 1.5], low=0, high=1),
         r"values: expected every value within \[low, high\] = \[0.0, 1.0\], got row 1 = 1.5"),
        (lambda: DesignCfg([0.5], seed=-1), r"seed: expected an int in \[0, 2\*\*64\)"),
    ],
)
def test_bad_designs(make: object, match: str) -> None:
    with pytest.raises(VariationError, match=match):
        make()  # type: ignore[operator]


def test_a_bound_is_met_by_its_own_float32_rounding() -> None:
    """0.3 rounds up in float32; a design value of 0.3 with high=0.3 is within its bounds."""
    cfg = DesignCfg([0.1, 0.3], low=0.1, high=0.3)
    assert cfg.declaration()["high"] == 0.3  # the bound as given, as the SALib problem has it


def test_design_and_random_variations_mix_in_one_run() -> None:
    recorder = Recorder(3, run="mix")
    design = Variation("d", VariationCfg(sampler=DesignCfg([0.0, 1.0, 2.0, 3.0])))
    other = Variation("u", VariationCfg(sampler=UniformCfg(0, 1)))
    VariationRecorder(recorder).attach([design, other])
    assert design.sample(3).tolist() == [0.0, 1.0, 2.0]
    other.sample(3)
    recorder.record_post_step()
    recorder.record_pre_reset([1])
    assert design.sample(1, [1]).tolist() == [3.0]
