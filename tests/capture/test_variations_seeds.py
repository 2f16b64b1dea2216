"""Default seeds: derived from the run seed and the variation key, independent, reproducible."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest
import torch

from broker import Broker, Message, RunStart
from capture import Recorder, RecorderClosedError
from capture.variations import (
    ChoiceCfg,
    DesignCfg,
    LogUniformCfg,
    NormalCfg,
    UniformCfg,
    UniformSampler,
    Variation,
    VariationCfg,
    VariationError,
    VariationRecorder,
    derive_seed,
)


def _var(name: str, sampler: object) -> Variation:
    return Variation(name, VariationCfg(sampler=sampler))  # type: ignore[arg-type]


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def test_two_default_variations_draw_independent_streams() -> None:
    """Catches the default seed 0 shared by every sampler: a uniform factor and a log-uniform
    one left at the default drew the same uniform stream (|corr| about 0.9), so no analysis
    could tell them apart. Independent streams give |corr| < 0.03 over 10k draws (4 sigma)."""
    friction = _var("friction", UniformCfg(0.0, 1.0))
    mass = _var("mass", LogUniformCfg(0.1, 10.0))
    f, m = friction.sample(10_000), mass.sample(10_000)
    assert abs(_corr(f, m)) < 0.04
    assert abs(_corr(f, m.log())) < 0.04


def test_attached_default_variations_are_independent_under_the_run_seed() -> None:
    """The same check after attach re-derived both seeds from a recorder's run seed."""
    recorder = Recorder(10_000, seed=123, run="r")
    friction = _var("friction", UniformCfg(0.0, 1.0))
    mass = _var("mass", LogUniformCfg(0.1, 10.0))
    VariationRecorder(recorder, keep_records=False).attach([friction, mass])
    assert abs(_corr(friction.sample(10_000), mass.sample(10_000).log())) < 0.04


def _streams(run_seed: int, keys: tuple[str, ...] = ("friction", "mass")) -> list[torch.Tensor]:
    recorder = Recorder(64, seed=run_seed, run=f"run{run_seed}")
    variations = [_var(k, UniformCfg(0.0, 1.0)) for k in keys]
    VariationRecorder(recorder, keep_records=False).attach(variations)
    return [v.sample(64) for v in variations]


def test_same_run_seed_same_streams_other_run_seed_or_key_differs() -> None:
    """Catches seeds that ignore the run seed or the key (or depend on anything else, such as
    the order of attachment or the process)."""
    a, b = _streams(5), _streams(5)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    c = _streams(6)
    assert not any(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    assert not torch.equal(a[0], a[1])  # different keys, same cfg
    swapped = _streams(5, ("mass", "friction"))  # attachment order does not matter
    assert torch.equal(swapped[0], a[1])
    assert torch.equal(swapped[1], a[0])


def test_derived_seed_is_pinned_and_stable_across_processes() -> None:
    """Catches a seed derived with hash() (salted per process) or a changed derivation: the
    seeds are pinned, and a fresh interpreter with another hash seed derives the same."""
    assert derive_seed(0, "mass") == derive_seed(0, "mass")
    pinned = {(0, "mass"): derive_seed(0, "mass"), (7, "friction"): derive_seed(7, "friction")}
    assert pinned == {(0, "mass"): 10680270829785438451, (7, "friction"): 272844429616966939}
    # the seeds module alone (no torch): a fresh interpreter starts in well under a second
    code = ("import importlib.util as u; spec = u.spec_from_file_location('seeds', "
            "'capture/variations/seeds.py'); m = u.module_from_spec(spec); "
            "spec.loader.exec_module(m); print(m.derive_seed(0, 'mass'), m.derive_seed(7, 'friction'))")
    env = {**os.environ, "PYTHONHASHSEED": "1"}  # this process's hash seed is random
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=60, cwd=root)
    assert out.stdout.split() == [str(pinned[(0, "mass")]), str(pinned[(7, "friction")])]
    assert len({derive_seed(s, k) for s in range(4) for k in ("a", "b", "ab", "")}) == 16


def test_standalone_variation_derives_from_run_seed_zero_and_its_key() -> None:
    v = _var("mass", UniformCfg(0, 1))
    assert v.seed_derived
    assert v.run_seed == 0
    assert v.seed == derive_seed(0, "mass")
    assert torch.equal(v.sample(8), UniformSampler(0, 1, seed=derive_seed(0, "mass")).sample(8))


def test_a_given_seed_is_kept_and_recorded() -> None:
    recorder = Recorder(4, seed=99, run="r")
    v = _var("mass", UniformCfg(0, 1, seed=3))
    VariationRecorder(recorder).attach(v)
    assert not v.seed_derived
    assert v.seed == 3
    assert recorder.variations["mass"]["seed"] == 3
    assert torch.equal(v.sample(4), UniformSampler(0, 1, seed=3).sample(4))


def test_attach_rederives_keeping_listeners_and_apply_cfg_derives_from_the_run_seed() -> None:
    recorder = Recorder(4, seed=42, run="r")
    v = _var("mass", UniformCfg(0, 1))
    seen: list[torch.Tensor] = []
    v.add_sample_listener(lambda value, worlds: seen.append(value.clone()))
    VariationRecorder(recorder).attach(v)
    assert v.run_seed == 42
    assert v.seed == derive_seed(42, "mass")
    drawn = v.sample(4)
    assert torch.equal(drawn, UniformSampler(0, 1, seed=derive_seed(42, "mass")).sample(4))
    assert len(seen) == 1  # the user's listener moved to the rebuilt sampler
    assert torch.equal(seen[0], drawn)
    v.apply_cfg(VariationCfg(sampler=NormalCfg(0, 1)))
    assert v.seed == derive_seed(42, "mass")
    assert recorder.variations["mass"]["seed"] == derive_seed(42, "mass")


def test_attach_refuses_to_reseed_a_variation_that_has_drawn_and_attaches_nothing() -> None:
    """Catches a silent re-seed after draws: the recorded stream would then differ from a
    replay of the run from its recorded seed."""
    recorder = Recorder(4, seed=1, run="r")
    fresh = _var("fresh", UniformCfg(0, 1))
    used = _var("used", UniformCfg(0, 1))
    used.sample(2)
    vr = VariationRecorder(recorder)
    with pytest.raises(VariationError, match=r"variation 'used': cannot derive its seed from run "
                                             r"seed 1: it has already drawn 2 values .* attach it "
                                             r"before its first draw, or give its sampler"):
        vr.attach([fresh, used])
    assert vr.attached == ()
    assert fresh.run_seed == 0  # nothing changed
    assert recorder.variations == {}
    VariationRecorder(Recorder(4, seed=0, run="r0")).attach(used)  # same derived seed: fine
    pinned = _var("pinned", UniformCfg(0, 1, seed=5))
    pinned.sample(2)
    VariationRecorder(recorder).attach(pinned)  # an explicit seed is never re-derived
    assert pinned.seed == 5


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (UniformCfg([0, 1], [2, 3]), {"kind": "uniform", "shape": [2], "low": [0.0, 1.0],
                                      "high": [2.0, 3.0]}),
        (LogUniformCfg(0.1, 10), {"kind": "log_uniform", "shape": [], "low": 0.1, "high": 10.0}),
        (NormalCfg(1, 0.5), {"kind": "normal", "shape": [], "mean": 1.0, "std": 0.5, "low": None,
                             "high": None}),
        (NormalCfg([1, 2], [1, 1], low=[0, 0], high=[3, 3]),
         {"kind": "normal", "shape": [2], "mean": [1.0, 2.0], "std": [1.0, 1.0], "low": [0.0, 0.0],
          "high": [3.0, 3.0]}),
        (ChoiceCfg(["cube", "ball"]), {"kind": "choice", "shape": [], "labels": ["cube", "ball"],
                                       "weights": None}),
        (ChoiceCfg([{"usd": "a"}, {"usd": "b"}], [1, 3], labels=["a", "b"]),
         {"kind": "choice", "shape": [], "labels": ["a", "b"], "weights": [1.0, 3.0]}),
        (DesignCfg([[0.5, 1.0], [0.25, 3.0]]), {"kind": "design", "shape": [2], "low": [0.25, 1.0],
                                                "high": [0.5, 3.0]}),
        (DesignCfg([0.5, 0.75], low=0, high=1), {"kind": "design", "shape": [], "low": 0.0,
                                                 "high": 1.0}),
    ],
)
def test_declarations_in_the_contract_format(cfg: object, expected: dict[str, object]) -> None:
    v = Variation("k", VariationCfg(sampler=cfg, phase="build"))  # type: ignore[arg-type]
    decl = v.declaration()
    assert decl == {**expected, "phase": "build", "seed": derive_seed(0, "k")}
    assert list(decl)[:2] == ["kind", "phase"]
    assert json.loads(json.dumps(decl)) == decl  # plain JSON and msgpack types only
    assert msgpack.unpackb(msgpack.packb(decl)) == decl
    assert UniformCfg(0, 1).declaration()["seed"] is None  # a cfg alone has not derived it yet


def test_declarations_travel_in_run_start_and_run_end() -> None:
    """Catches declarations that never reach the run (the analysis would have to guess the
    problem's bounds from the data) and a late declaration lost from RunEnd."""
    broker = Broker(strict=True)
    messages: list[Message] = []
    broker.subscribe("run/", messages.append)
    recorder = Recorder(4, broker=broker, run="r", seed=11)
    vr = VariationRecorder(recorder)
    early = Variation("early", VariationCfg(sampler=UniformCfg(0, 2), phase="build"))
    late = Variation("late", VariationCfg(sampler=ChoiceCfg(["a", "b"], seed=4)))
    vr.attach(early)
    early.sample(4)  # starts the run
    vr.attach(late)
    late.sample(4)
    early_decl = {"kind": "uniform", "phase": "build", "shape": [], "seed": derive_seed(11, "early"),
                  "low": 0.0, "high": 2.0}
    late_decl = {"kind": "choice", "phase": "runtime", "shape": [], "seed": 4, "labels": ["a", "b"],
                 "weights": None}
    assert recorder.variations == {"early": early_decl, "late": late_decl}
    recorder.close()
    start, end = messages
    assert isinstance(start, RunStart)
    assert dict(start.variations) == {"early": early_decl}
    assert dict(end.variations) == {"early": early_decl, "late": late_decl}  # type: ignore[union-attr]
    assert start.seed == end.seed == 11  # type: ignore[union-attr]
    assert 0 < start.wall_time <= end.wall_time  # type: ignore[union-attr]


def test_apply_cfg_is_declared_at_its_next_accepted_draw() -> None:
    """Catches a declaration that no longer describes the draws: after apply_cfg the recorder
    holds the new declaration from the first accepted draw on (and not after a refused one)."""
    recorder = Recorder(2, run="r")
    v = _var("friction", UniformCfg(0, 1))
    VariationRecorder(recorder).attach(v)
    v.apply_cfg(VariationCfg(sampler=UniformCfg(0, 2)))
    assert recorder.variations["friction"]["high"] == 1.0  # nothing drawn from it yet
    v.sample(2)
    assert recorder.variations["friction"]["high"] == 2.0
    v.apply_cfg(VariationCfg(sampler=UniformCfg(0, 3)))
    recorder.record_post_step()
    with pytest.raises(VariationError, match="already stepped"):
        v.sample(2)
    assert recorder.variations["friction"]["high"] == 2.0
    recorder.record_pre_reset()
    v.sample(2)
    assert recorder.variations["friction"]["high"] == 3.0


def test_bad_run_seeds_and_keys() -> None:
    with pytest.raises(VariationError, match=r"run_seed: expected an int in \[0, 2\*\*64\), got -1"):
        derive_seed(-1, "k")
    with pytest.raises(VariationError, match=r"run_seed: .*got True"):
        derive_seed(True, "k")
    with pytest.raises(VariationError, match=r"key: expected a str, got 3"):
        derive_seed(0, 3)  # type: ignore[arg-type]
    v = _var("k", UniformCfg(0, 1))
    with pytest.raises(VariationError, match=r"run_seed: expected an int in \[0, 2\*\*64\), got 2\.0"):
        v.set_run_seed(2.0)  # type: ignore[arg-type]
    assert v.run_seed == 0


def test_attach_to_a_closed_recorder_is_refused() -> None:
    recorder = Recorder(2, run="r")
    recorder.close()
    vr = VariationRecorder(recorder)
    with pytest.raises(RecorderClosedError, match=r"attach: recorder of run 'r' is closed"):
        vr.attach(_var("k", UniformCfg(0, 1)))
    assert vr.attached == ()
