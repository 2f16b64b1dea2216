"""Per-world CartPole physics: the arrays broadcast per world, and the variation samples recorded
for each episode are the parameters the environment used in that episode, from its first step."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pytest
import torch

from broker import Batch, Broker, Message, VariationSample
from capture.cartpole import DERIVED, PARAMETERS, CartPoleRandomizer, physics
from capture.gymnasium import RecordingVectorEnv
from capture.recorder import Recorder
from capture.variations import UniformCfg, Variation, VariationCfg, VariationRecorder

gym = pytest.importorskip("gymnasium")
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv  # noqa: E402

N_WORLDS = 6
RANGES = {"length": (0.2, 1.0), "masspole": (0.05, 0.5), "masscart": (0.5, 2.0), "force_mag": (5.0, 15.0)}


class SpyCartPole(CartPoleVectorEnv):  # type: ignore[misc]
    """Logs the physical parameters in effect at every ``step`` and ``reset`` call."""

    def __init__(self, num_envs: int, max_episode_steps: int) -> None:
        super().__init__(num_envs=num_envs, max_episode_steps=max_episode_steps)
        self.at_step: list[dict[str, np.ndarray]] = []
        self.at_reset: list[dict[str, np.ndarray]] = []

    def step(self, action: Any) -> Any:
        self.at_step.append(physics(self))
        return super().step(action)

    def reset(self, **kwargs: Any) -> Any:
        self.at_reset.append(physics(self))
        return super().reset(**kwargs)


def variations(phase: str = "runtime") -> dict[str, Variation]:
    return {name: Variation(name, VariationCfg(sampler=UniformCfg(lo, hi), phase=phase))  # type: ignore[arg-type]
            for name, (lo, hi) in RANGES.items()}


def test_parameters_broadcast_per_world() -> None:
    """Each world of one CartPoleVectorEnv with per-world arrays steps exactly like a one-world
    env given that world's parameters as scalars (and unrandomized arrays change nothing).

    Catches: parameters written to the wrong world, derived parameters left stale, or a dtype
    change that alters the dynamics."""
    plain, arrays = CartPoleVectorEnv(num_envs=N_WORLDS), CartPoleVectorEnv(num_envs=N_WORLDS)
    CartPoleRandomizer(arrays, {})  # arrays of the default values: the same dynamics
    actions = np.random.default_rng(0).integers(0, 2, (8, N_WORLDS))
    for env in (plain, arrays):
        env.reset(seed=3)
    for a in actions:
        assert plain.step(a)[0].tobytes() == arrays.step(a)[0].tobytes()

    env = CartPoleVectorEnv(num_envs=N_WORLDS)
    randomizer = CartPoleRandomizer(env, variations())
    env.reset(seed=5)
    randomizer(torch.arange(N_WORLDS))
    params = physics(env)
    assert np.array_equal(params["polemass_length"], params["masspole"] * params["length"])
    assert np.array_equal(params["total_mass"], params["masspole"] + params["masscart"])
    assert len(set(params["length"].tolist())) == N_WORLDS
    singles = []
    for w in range(N_WORLDS):
        single = CartPoleVectorEnv(num_envs=1)
        single.reset(seed=0)
        single.state = env.state[:, w:w + 1].copy()
        for name in (*PARAMETERS, *DERIVED):
            setattr(single, name, float(params[name][w]))
        singles.append(single)
    for a in actions[:6]:
        obs = env.step(a)[0]
        for w, single in enumerate(singles):
            assert obs[w].tobytes() == single.step(a[w:w + 1])[0][0].tobytes(), f"world {w}"


class Log:
    """Variation samples and batch rows (with their step) per (world, episode); copies."""

    def __init__(self) -> None:
        self.samples: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
        self.rows: dict[tuple[int, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.physics: dict[tuple[int, int], list[dict[str, float]]] = defaultdict(list)

    def __call__(self, m: Message) -> None:
        if isinstance(m, VariationSample):
            for i, (w, e) in enumerate(zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)):
                assert m.key not in self.samples[(w, e)], f"{m.key} drawn twice for episode {(w, e)}"
                self.samples[(w, e)][m.key] = float(m.value[i])
        elif isinstance(m, Batch):
            for i, (w, e) in enumerate(zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)):
                self.rows[(w, e)][m.term].append(m.step)
                if m.term == "step":
                    self.physics[(w, e)].append({k.removeprefix("physics/"): float(v[i])
                                                 for k, v in m.fields.items() if k.startswith("physics/")})


def randomized_run(broker: Broker, steps: int = 80) -> tuple[SpyCartPole, Log]:
    log = Log()
    broker.subscribe("", log)
    env = SpyCartPole(N_WORLDS, max_episode_steps=10)
    recorder = Recorder(N_WORLDS, broker=broker, run="cartpole")
    vs = variations()
    VariationRecorder(recorder).attach(vs.values())
    wrapped = RecordingVectorEnv(env, recorder, on_reset=[CartPoleRandomizer(env, vs)],
                                 step_fields=lambda: {"physics": physics(env)})
    wrapped.reset(seed=11)
    rng = np.random.default_rng(4)
    for _ in range(steps):
        wrapped.step((rng.random(N_WORLDS) < 0.8).astype(np.int64))
    wrapped.close()
    return env, log


def test_recorded_samples_are_the_parameters_used(broker: Broker) -> None:
    """For every episode, the values recorded as its variation samples equal the parameters the
    env used at every step of that episode (read from the env at each step call).

    Catches: a draw applied to the wrong worlds, recorded for the wrong episode, or written to
    the env without being recorded (or recorded without being written)."""
    env, log = randomized_run(broker)
    episodes = sorted(log.rows)
    assert sum(e > 0 for _, e in episodes) >= 2 * N_WORLDS  # many resets with new draws
    for w, e in episodes:
        sample = log.samples[(w, e)]
        assert sorted(sample) == sorted(RANGES), (w, e)
        steps = log.rows[(w, e)].get("step", [])
        assert len(log.physics[(w, e)]) == len(steps)
        for s, recorded in zip(steps, log.physics[(w, e)], strict=True):
            used = env.at_step[s]
            assert recorded == {k: float(v[w]) for k, v in used.items()}  # step_fields: this step's
            for name in PARAMETERS:
                assert used[name][w] == np.float64(np.float32(sample[name])), (w, e, s, name)
            assert used["polemass_length"][w] == used["masspole"][w] * used["length"][w]
            assert used["total_mass"][w] == used["masspole"][w] + used["masscart"][w]


def test_draw_happens_before_the_first_step_of_each_episode(broker: Broker) -> None:
    """Each episode's parameters are in place before the env steps the world in that episode:
    at the initial ``reset``, and, under NEXT_STEP, already at the step that resets the world
    (the one whose observation is the episode's reset row), hence at its first transition.

    Catches: randomization applied after the world's first step of the new episode (or after
    the step that resets it inside the env), which runs part of an episode with the previous
    episode's parameters while recording the new ones."""
    env, log = randomized_run(broker)
    checked = 0
    for (w, e), rows in sorted(log.rows.items()):
        sample = log.samples[(w, e)]
        reset_step = rows["reset"][0]
        used_at_start = env.at_reset[0] if e == 0 else env.at_step[reset_step]
        steps = rows.get("step", [])
        if e > 0:
            assert steps == [] or steps[0] == reset_step + 1, (w, e)  # the reset step is no transition
        for name in PARAMETERS:
            assert used_at_start[name][w] == np.float64(np.float32(sample[name])), (w, e, name)
            if steps:
                assert env.at_step[steps[0]][name][w] == np.float64(np.float32(sample[name])), (w, e, name)
            if e > 0:
                assert sample[name] != log.samples[(w, e - 1)][name]
        checked += e > 0
    assert checked >= 2 * N_WORLDS


def test_build_phase_variations_are_drawn_once(broker: Broker) -> None:
    """A build-phase variation is drawn at the first reset of each world only; runtime ones at
    every reset. Catches: redrawing build-phase values at later resets (refused by the
    variation recorder, and not what the phase means)."""
    log = Log()
    broker.subscribe("", log)
    env = CartPoleVectorEnv(num_envs=N_WORLDS, max_episode_steps=5)
    recorder = Recorder(N_WORLDS, broker=broker)
    vs = {"masscart": Variation("masscart", VariationCfg(sampler=UniformCfg(0.5, 2.0), phase="build")),
          "length": variations()["length"]}
    VariationRecorder(recorder).attach(vs.values())
    wrapped = RecordingVectorEnv(env, recorder, on_reset=[CartPoleRandomizer(env, vs)])
    wrapped.reset(seed=0)
    masscart = physics(env)["masscart"]
    for _ in range(20):
        wrapped.step(np.ones(N_WORLDS, np.int64))
    wrapped.close()
    assert np.array_equal(physics(env)["masscart"], masscart)
    assert {k for s in log.samples.values() for k in s} == {"masscart", "length"}
    assert all("masscart" not in s for (_, e), s in log.samples.items() if e > 0)
    assert all("length" in s for s in log.samples.values())
    assert max(e for _, e in log.samples) >= 3


def test_randomizer_errors() -> None:
    env = CartPoleVectorEnv(num_envs=2)
    with pytest.raises(ValueError, match=r"variations: expected parameters among .* got 'gravity'"):
        CartPoleRandomizer(env, {"gravity": variations()["length"]})
    wide = Variation("length", VariationCfg(sampler=UniformCfg([0.1, 0.1], [0.5, 0.5])))
    with pytest.raises(ValueError, match=r"variations\['length'\]: expected per-world shape \(\), got \(2,\)"):
        CartPoleRandomizer(env, {"length": wide})
    with pytest.raises(TypeError, match="expected gymnasium's CartPoleVectorEnv"):
        CartPoleRandomizer(gym.make_vec("MountainCar-v0", num_envs=2), {})
    randomizer = CartPoleRandomizer(env, variations())
    with pytest.raises(ValueError, match="worlds: expected a 1-D integer index of worlds below 2"):
        randomizer(torch.tensor([2]))
