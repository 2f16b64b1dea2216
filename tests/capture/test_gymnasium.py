"""RecordingVectorEnv: episodes recorded through the wrapper equal a hand-written reference loop,
byte for byte, under every gymnasium autoreset mode; a real storage daemon keeps them."""

from __future__ import annotations

import copy
import sys
from collections import defaultdict
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from broker import Batch, Broker, EpisodeEnd, Message
from capture.gymnasium import RecordingVectorEnv
from capture.recorder import Recorder

gym = pytest.importorskip("gymnasium")
from gymnasium import spaces  # noqa: E402
from gymnasium.vector import AutoresetMode, SyncVectorEnv  # noqa: E402
from gymnasium.wrappers import TimeLimit  # noqa: E402

NEXT, SAME, DISABLED = AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP, AutoresetMode.DISABLED
N_WORLDS, N_STEPS, SEED = 5, 60, 7


class Walker(gym.Env):  # type: ignore[misc]
    """A tiny non-vectorized env: Dict observation (with a nested Tuple), random terminations,
    info ``energy`` on every step (and ``-1.0`` at reset), ``bonus`` only on odd steps."""

    observation_space = spaces.Dict({
        "pos": spaces.Box(-np.inf, np.inf, (2,), np.float32),
        "count": spaces.Box(0, 1000, (), np.int64),
        "pair": spaces.Tuple((spaces.Discrete(4), spaces.Box(-1.0, 1.0, (3,), np.float64))),
    })
    action_space = spaces.Discrete(3)

    def _obs(self) -> dict[str, Any]:
        return {"pos": self.pos.copy(), "count": np.int64(self.count),
                "pair": (int(self.count % 4), np.tanh(np.array([*self.pos, self.count], np.float64)))}

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos = self.np_random.normal(size=2).astype(np.float32)
        self.count = 0
        return self._obs(), {"energy": -1.0}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.pos += np.float32(0.1) * np.array([int(action) - 1, 0.5], np.float32)
        self.pos += self.np_random.normal(scale=0.05, size=2).astype(np.float32)
        self.count += 1
        info: dict[str, Any] = {"energy": float(self.pos.sum())}
        if self.count % 2:
            info["bonus"] = self.count
        terminated = bool(self.np_random.random() < 0.15)
        return self._obs(), float(self.pos[0]), terminated, False, info


def cartpole_vector(mode: AutoresetMode) -> Any:
    assert mode == NEXT  # CartPoleVectorEnv resets its worlds on the next step, always
    return gym.make_vec("CartPole-v1", num_envs=N_WORLDS, vectorization_mode="vector_entry_point",
                        max_episode_steps=12)


def sync_cartpole(mode: AutoresetMode) -> Any:
    return SyncVectorEnv([lambda: gym.make("CartPole-v1", max_episode_steps=12)] * N_WORLDS,
                         autoreset_mode=mode)


def sync_walker(mode: AutoresetMode) -> Any:
    return SyncVectorEnv([lambda: TimeLimit(Walker(), max_episode_steps=6)] * N_WORLDS, autoreset_mode=mode)


WALKER_INFO = ("energy", "bonus")
INFO_DTYPES = {"energy": np.dtype(np.float64), "bonus": np.dtype(np.int64)}


def make_actions(make: Callable[[AutoresetMode], Any], mode: AutoresetMode) -> np.ndarray:
    """Seeded actions for every step; CartPole's push mostly one way, so poles fall within its
    time limit and both kinds of episode end occur."""
    env = make(mode)
    rng = np.random.default_rng(SEED)
    if env.single_action_space == spaces.Discrete(2):
        actions = (rng.random((N_STEPS, N_WORLDS)) < 0.8).astype(np.int64)
        actions[:, ::2] = 1 - actions[:, ::2]  # even worlds lean the other way
    else:
        actions = rng.integers(0, 3, (N_STEPS, N_WORLDS), dtype=np.int64)
    env.close()
    return actions


# -- the reference: a plain loop over the raw environment, world by world ----------------------

def flat(value: Any, prefix: str) -> dict[str, np.ndarray]:
    """One world's observation or action flattened by the documented names."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}/{key}").items()}
    if isinstance(value, tuple):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}/{i}").items()}
    return {prefix: np.asarray(value)}


def world(value: Any, w: int) -> Any:
    """World ``w`` of a batched observation or action."""
    if isinstance(value, dict):
        return {k: world(v, w) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(world(v, w) for v in value)
    return np.asarray(value)[w]


def info_row(info: dict[str, Any], w: int, keys: tuple[str, ...]) -> dict[str, np.ndarray]:
    row = {}
    for k in keys:
        present = k in info and bool(info[f"_{k}"][w])
        row[f"info/{k}"] = np.asarray(info[k][w] if k in info else 0, INFO_DTYPES[k])
        row[f"info/_{k}"] = np.asarray(present)
    return row


def reference(make: Callable[[AutoresetMode], Any], mode: AutoresetMode, actions: np.ndarray,
              keys: tuple[str, ...]) -> list[list[dict[str, Any]]]:
    """Per world, its episodes: ``reset`` (the first observation), ``steps`` (transitions),
    and, once ended, ``terminated``, ``truncated`` and ``return``."""
    env = make(mode)
    obs, _ = env.reset(seed=SEED)
    episodes: list[list[dict[str, Any]]] = [[{"reset": flat(world(obs, w), "obs"), "steps": []}]
                                            for w in range(N_WORLDS)]
    awaiting_reset = [False] * N_WORLDS

    def end(w: int, term: bool, trunc: bool) -> None:
        ep = episodes[w][-1]
        ep["terminated"], ep["truncated"] = term, trunc
        ret = 0.0
        for row in ep["steps"]:
            ret += float(row["reward"])
        ep["return"] = ret

    for a in actions:
        obs, rew, term, trunc, info = env.step(a)
        for w in range(N_WORLDS):
            if mode == NEXT and awaiting_reset[w]:  # the env reset this world inside this step
                episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
                awaiting_reset[w] = False
                continue
            done = bool(term[w] or trunc[w])
            if mode == SAME and done:
                next_obs, step_info = info["final_obs"][w], info["final_info"]
            else:
                next_obs, step_info = world(obs, w), info
            episodes[w][-1]["steps"].append({
                **flat(world(a, w), "action"), "reward": np.asarray(rew[w]), "terminated": np.asarray(term[w]),
                "truncated": np.asarray(trunc[w]), **flat(next_obs, "next_obs"), **info_row(step_info, w, keys)})
            if done and mode != DISABLED:
                end(w, bool(term[w]), bool(trunc[w]))
                if mode == SAME:
                    episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
                else:
                    awaiting_reset[w] = True
        if mode == DISABLED and (term | trunc).any():
            mask = term | trunc
            obs, _ = env.reset(options={"reset_mask": mask})
            for w in np.flatnonzero(mask):
                end(int(w), bool(term[w]), bool(trunc[w]))
                episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
    env.close()
    return episodes


# -- what the wrapper publishes, collected per (world, episode) ---------------------------------

class Collector:
    """Copies every row of every batch and every episode end, keyed by (world, episode)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], dict[str, list[dict[str, np.ndarray]]]] = defaultdict(
            lambda: defaultdict(list))
        self.steps: dict[tuple[int, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.ends: dict[tuple[int, int], dict[str, Any]] = {}

    def __call__(self, m: Message) -> None:
        if isinstance(m, Batch):
            for i, (w, e) in enumerate(zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)):
                self.rows[(w, e)][m.term].append({k: v[i].cpu().numpy().copy() for k, v in m.fields.items()})
                self.steps[(w, e)][m.term].append(m.step)
        elif isinstance(m, EpisodeEnd):
            for i, (w, e) in enumerate(zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)):
                assert (w, e) not in self.ends, f"episode {(w, e)} ended twice"
                self.ends[(w, e)] = {
                    "success": bool(m.success[i]), "terminated": bool(m.terminated[i]),
                    "truncated": bool(m.truncated[i]), "length": int(m.length[i]),
                    "outcomes": {k: v[i].cpu().numpy().copy() for k, v in m.outcomes.items()}}


def same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray], where: str) -> None:
    assert sorted(got) == sorted(want), where
    for name, value in want.items():
        value = np.asarray(value)
        assert got[name].dtype == value.dtype, f"{where} {name}: {got[name].dtype} != {value.dtype}"
        assert got[name].shape == value.shape, f"{where} {name}"
        assert got[name].tobytes() == value.tobytes(), f"{where} {name}: {got[name]!r} != {value!r}"


def run_wrapper(make: Callable[[AutoresetMode], Any], mode: AutoresetMode, actions: np.ndarray,
                keys: tuple[str, ...], broker: Broker, device: str = "cpu", **kwargs: Any,
                ) -> tuple[Collector, Recorder]:
    collector = Collector()
    broker.subscribe("", collector)
    recorder = Recorder(N_WORLDS, device, broker=broker, run="gym")
    env = RecordingVectorEnv(make(mode), recorder, info_keys=keys, **kwargs)
    assert env.autoreset_mode == mode
    env.reset(seed=SEED)
    for a in actions:
        _, _, term, trunc, _ = env.step(a)
        if mode == DISABLED and (term | trunc).any():
            env.reset(options={"reset_mask": term | trunc})
    env.close()
    return collector, recorder


def check_against_reference(collector: Collector, episodes: list[list[dict[str, Any]]],
                            success: Callable[[dict[str, Any]], bool]) -> int:
    ended = 0
    for w, eps in enumerate(episodes):
        for e, ep in enumerate(eps):
            where = f"world {w} episode {e}"
            rows = collector.rows.get((w, e), {})
            assert len(rows.get("reset", [])) == 1, f"{where}: expected one reset row"
            same_bytes(rows["reset"][0], ep["reset"], f"{where} reset")
            got_steps = rows.get("step", [])
            assert len(got_steps) == len(ep["steps"]), f"{where}: transitions"
            for t, (got, want) in enumerate(zip(got_steps, ep["steps"], strict=True)):
                same_bytes(got, want, f"{where} step {t}")
            if "terminated" in ep:
                ended += 1
                end = collector.ends[(w, e)]
                assert (end["terminated"], end["truncated"]) == (ep["terminated"], ep["truncated"]), where
                assert end["length"] == len(ep["steps"]), where
                assert end["success"] == success(ep), where
                assert end["outcomes"]["return"].tobytes() == np.float64(ep["return"]).tobytes(), where
            else:
                assert (w, e) not in collector.ends, f"{where}: still in progress, yet ended"
    expected = {(w, e) for w, eps in enumerate(episodes) for e in range(len(eps))}
    assert set(collector.rows) == expected, "rows recorded for episodes the reference does not have"
    return ended


CASES = [
    (cartpole_vector, NEXT, ()),
    (sync_cartpole, NEXT, ()),
    (sync_cartpole, SAME, ()),
    (sync_cartpole, DISABLED, ()),
    (sync_walker, NEXT, WALKER_INFO),
    (sync_walker, SAME, WALKER_INFO),
    (sync_walker, DISABLED, WALKER_INFO),
]


@pytest.mark.parametrize(("make", "mode", "keys"), CASES,
                         ids=[f"{m.__name__}-{mode.name}" for m, mode, _ in CASES])
def test_episodes_equal_the_reference_loop(make: Callable[[AutoresetMode], Any], mode: AutoresetMode,
                                           keys: tuple[str, ...], broker: Broker) -> None:
    """Every episode recorded through the wrapper (reset row, transitions, flags, length, return)
    equals, byte for byte, the one a plain loop over the same env, seed and actions builds.

    Catches: an episode boundary in the wrong place for the autoreset mode (a NEXT_STEP reset
    step recorded as a transition or counted in the length, a SAME_STEP final observation or
    final info replaced by the reset's), a lost final observation, a transition across a boundary,
    info masks ignored, a wrong return or success."""
    actions = make_actions(make, mode)
    episodes = reference(make, mode, actions, keys)
    collector, _ = run_wrapper(make, mode, actions, keys, broker)
    ended = check_against_reference(collector, episodes, lambda ep: ep["truncated"] and not ep["terminated"])
    assert ended >= 2 * N_WORLDS  # many boundaries were crossed
    kinds = {(ep["terminated"], ep["truncated"]) for eps in episodes for ep in eps if "terminated" in ep}
    assert (False, True) in kinds  # time limits
    assert (True, False) in kinds  # terminations


def test_success_fn_and_info_spec(broker: Broker) -> None:
    """A user success function sees the ended step's info (for SAME_STEP, ``final_info``, not the
    reset's), and an info key declared with its spec records zeros and a false mask when absent.

    Catches: success read from the reset's info under SAME_STEP, a declared spec ignored."""
    def success(terminated: np.ndarray, truncated: np.ndarray, info: dict[str, Any]) -> np.ndarray:
        return np.asarray(info["energy"] > 0.0)

    actions = make_actions(sync_walker, SAME)
    keys = {"energy": (np.float64, ()), "bonus": (np.int64, ())}
    episodes = reference(sync_walker, SAME, actions, WALKER_INFO)
    collector, _ = run_wrapper(sync_walker, SAME, actions, keys, broker, success_fn=success)
    check_against_reference(collector, episodes, lambda ep: bool(ep["steps"][-1]["info/energy"] > 0.0))


@pytest.mark.cuda
@pytest.mark.parametrize("mode", [NEXT, SAME], ids=["NEXT_STEP", "SAME_STEP"])
def test_recorder_on_cuda(mode: AutoresetMode, broker: Broker) -> None:
    """A numpy env recorded by a recorder on a CUDA device: every field is moved there, and the
    episodes still equal the reference. Catches: a tensor left on the host (the recorder refuses
    it) or an index on the wrong device."""
    actions = make_actions(sync_walker, mode)
    episodes = reference(sync_walker, mode, actions, WALKER_INFO)
    collector, _ = run_wrapper(sync_walker, mode, actions, WALKER_INFO, broker, device="cuda")
    check_against_reference(collector, episodes, lambda ep: ep["truncated"] and not ep["terminated"])


class Labelled(Walker):
    """A Walker whose info also carries a string."""

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        obs, reward, terminated, truncated, info = super().step(action)
        return obs, reward, terminated, truncated, {**info, "label": "walking"}


def test_non_numeric_info_key_is_refused(broker: Broker) -> None:
    """Only numeric info arrays can be recorded; a string info names the key in a TypeError."""
    recorder = Recorder(2, broker=broker)
    env = RecordingVectorEnv(SyncVectorEnv([Labelled] * 2), recorder, info_keys=("label",))
    env.reset(seed=0)
    with pytest.raises(TypeError, match=r"info\['label'\]: expected a numeric or bool array, got dtype object"):
        env.step(np.zeros(2, np.int64))
    env.close()


def test_absent_info_key_needs_a_spec(broker: Broker) -> None:
    """An info key absent from the first step cannot fix its schema: a clear error names it."""
    recorder = Recorder(N_WORLDS, broker=broker)
    env = RecordingVectorEnv(sync_cartpole(NEXT), recorder, info_keys=("missing",))
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"key 'missing' is absent from the first step's info; give its dtype"):
        env.step(env.action_space.sample())
    env.close()


def test_numpy_fields_are_not_copied(broker: Broker) -> None:
    """Observations, actions and rewards enter the batch as views of the env's numpy arrays.

    Catches: a copy (``torch.tensor``/``np.ascontiguousarray`` on every step) on the hot path."""
    seen: dict[str, int] = {}

    def spy(m: Message) -> None:
        if isinstance(m, Batch) and m.term == "step":
            seen.update({k: v.data_ptr() for k, v in m.fields.items()})

    broker.subscribe("batch/step", spy)
    recorder = Recorder(N_WORLDS, broker=broker)
    env = RecordingVectorEnv(cartpole_vector(NEXT), recorder)
    env.reset(seed=0)
    action = np.ones(N_WORLDS, np.int64)
    obs, reward, terminated, truncated, _ = env.step(action)
    for name, array in (("next_obs", obs), ("reward", reward), ("action", action),
                        ("terminated", terminated), ("truncated", truncated)):
        assert seen[name] == array.__array_interface__["data"][0], name
    env.close()


class TorchWalls(gym.vector.VectorEnv):  # type: ignore[misc]
    """A vector env that returns torch tensors (a GPU simulator's style), NEXT_STEP autoreset."""

    metadata: ClassVar[dict[str, Any]] = {"autoreset_mode": NEXT}

    def __init__(self, num_envs: int) -> None:
        self.num_envs = num_envs
        self.single_observation_space = spaces.Box(-10, 10, (2,), np.float32)
        self.single_action_space = spaces.Box(-1, 1, (), np.float32)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)
        self.action_space = gym.vector.utils.batch_space(self.single_action_space, num_envs)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        self.gen = torch.Generator().manual_seed(seed or 0)
        self.state = torch.rand(self.num_envs, 2, generator=self.gen)
        self.done = torch.zeros(self.num_envs, dtype=torch.bool)
        return self.state.clone(), {}

    def step(self, action: Any) -> tuple[Any, ...]:
        a = torch.as_tensor(action)
        self.state = self.state + torch.stack([a, -a], 1)
        reward = self.state.sum(1)
        fresh = torch.rand(self.num_envs, 2, generator=self.gen)
        self.state[self.done] = fresh[self.done]
        reward[self.done] = 0.0
        terminated = (self.state[:, 0].abs() > 1.5) & ~self.done
        truncated = torch.zeros_like(terminated)
        self.done = terminated | truncated
        return self.state.clone(), reward, terminated, truncated, {}


def test_torch_env(broker: Broker) -> None:
    """A vector env of torch tensors is recorded like a numpy one: NEXT_STEP reset steps are not
    transitions, lengths count transitions, tensors pass uncopied.

    Catches: numpy-only handling of flags and rewards."""
    collector = Collector()
    broker.subscribe("", collector)
    recorder = Recorder(3, broker=broker)
    env = RecordingVectorEnv(TorchWalls(3), recorder)
    obs, _ = env.reset(seed=1)
    gen = torch.Generator().manual_seed(2)
    ref: list[list[list[np.ndarray]]] = [[[o.numpy()]] for o in obs]  # per world, episodes of observations
    pending = [False] * 3
    for _ in range(60):
        action = torch.rand(3, generator=gen) * 2 - 1
        obs, _, term, trunc, _ = env.step(action)
        for w in range(3):
            if pending[w]:
                ref[w].append([obs[w].numpy()])
                pending[w] = False
            else:
                ref[w][-1].append(obs[w].numpy())
                pending[w] = bool(term[w] or trunc[w])
    env.close()
    for w in range(3):
        assert len(ref[w]) >= 3
        for e, observations in enumerate(ref[w]):
            rows = collector.rows[(w, e)]
            got = [rows["reset"][0]["obs"], *(r["next_obs"] for r in rows.get("step", []))]
            assert [g.tobytes() for g in got] == [o.tobytes() for o in observations], (w, e)
            if (w, e) in collector.ends:
                assert collector.ends[(w, e)]["length"] == len(observations) - 1


def test_stored_episodes_equal_the_reference(tmp_path: Any, broker: Broker) -> None:
    """Through a real storage daemon (in process) into a Zarr store: each stored episode's rows
    equal the reference's, byte for byte, with the episode table's lengths and returns.

    Catches: the NEXT_STEP steps that record only some worlds being refused or misplaced by the
    store (a per-step topic whose batches sometimes skip worlds)."""
    from storage import RunStore, StoreDaemon

    actions = make_actions(cartpole_vector, NEXT)
    episodes = reference(cartpole_vector, NEXT, actions, ())
    daemon = StoreDaemon(tmp_path / "runs.zarr")
    try:
        broker.subscribe("", daemon)
        run_wrapper(cartpole_vector, NEXT, actions, (), broker)
    finally:
        daemon.close()
    store = RunStore(tmp_path / "runs.zarr")
    table = store.episodes("gym")
    ended = [(w, e) for w, eps in enumerate(episodes) for e, ep in enumerate(eps) if "terminated" in ep]
    assert sorted(zip(table["world"].tolist(), table["index"].tolist(), strict=True)) == sorted(ended)
    for w, e in ended:
        ep, got = episodes[w][e], store.episode("gym", w, e)
        same_bytes({"obs": got["reset/obs"][0]}, ep["reset"], f"{(w, e)} reset")
        for name in ("action", "reward", "terminated", "truncated", "next_obs"):
            want = np.stack([row[name] for row in ep["steps"]])
            same_bytes({name: got[f"step/{name}"]}, {name: want}, f"{(w, e)} step")
        row = table.filter(world=w, index=e).rows()[0]
        assert row["length"] == len(ep["steps"])
        assert (row["terminated"], row["truncated"]) == (ep["terminated"], ep["truncated"])


@pytest.mark.parametrize("mode", [NEXT, SAME], ids=["NEXT_STEP", "SAME_STEP"])
def test_full_reset_in_the_middle_of_a_run(mode: AutoresetMode, broker: Broker) -> None:
    """A ``reset()`` without a mask ends every episode in progress with the flags of its last
    step (neither, mid-episode), never ends an episode twice, and draws once per new episode,
    when its episode index is already the new one and its length is 0.

    Catches: a NEXT_STEP world that ended at the last step ended again (an empty episode), a
    SAME_STEP world reset at the last step ended with that step's flags, a second draw."""
    collector = Collector()
    broker.subscribe("", collector)
    recorder = Recorder(N_WORLDS, broker=broker)
    draws: list[tuple[int, int, int]] = []

    def on_reset(worlds: torch.Tensor) -> None:
        episodes, lengths = recorder.episode_index[worlds], recorder.episode_length[worlds]
        draws.extend(zip(worlds.tolist(), episodes.tolist(), lengths.tolist(), strict=True))

    env = RecordingVectorEnv(sync_cartpole(mode), recorder, on_reset=[on_reset])
    env.reset(seed=SEED)
    actions = make_actions(sync_cartpole, mode)
    for t, a in enumerate(actions):
        _, _, term, trunc, _ = env.step(a)
        if t > 10 and (term | trunc).any() and not (term | trunc).all():
            break
    done = term | trunc
    assert done.any()  # the case under test: some worlds ended at the last step, others did not
    assert not done.all()
    ended_before = set(collector.ends)
    in_progress = {w: e for (w, e) in collector.rows if (w, e) not in collector.ends}
    env.reset(seed=SEED + 1)
    env.step(a)
    env.close()
    new_ends = {k: v for k, v in collector.ends.items() if k not in ended_before}
    if mode == NEXT:  # done worlds already ended; their next episode's reset row comes from this reset
        assert set(new_ends) == {(w, e) for w, e in in_progress.items() if not done[w]}
    else:  # done worlds were reset at once: their empty new episode ends here, with neither flag
        assert set(new_ends) == set(in_progress.items())
        for w in np.flatnonzero(done):
            assert new_ends[(int(w), in_progress[int(w)])]["length"] == 0
    for end in new_ends.values():
        assert (end["terminated"], end["truncated"], end["success"]) == (False, False, False)
    assert sorted({(w, e) for w, e, _ in draws}) == sorted(collector.rows), "one draw per episode"
    assert len(draws) == len(collector.rows)
    assert all(length == 0 for _, _, length in draws)
    for key, rows in collector.rows.items():
        assert len(rows["reset"]) == 1, key


def test_missing_gymnasium_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without gymnasium the wrapper names the package to install (gymnasium is optional)."""
    monkeypatch.setitem(sys.modules, "gymnasium", None)
    with pytest.raises(ImportError, match=r"RecordingVectorEnv needs gymnasium 1.x: pip install 'worldtap\[demo\]'"):
        RecordingVectorEnv(object(), Recorder(1))


# -- stateful: any interleaving of steps, masked resets and full resets -------------------------

SM_WORLDS = 3


class WrapperMachine(RuleBasedStateMachine):
    """The wrapper and a raw twin env get the same calls; a model builds each world's episodes
    from the twin's outputs by the autoreset rules; at the end every recorded episode equals the
    model's byte for byte (and what the wrapper returns equals what the twin returns)."""

    mode: AutoresetMode = NEXT

    def __init__(self) -> None:
        super().__init__()
        self.broker = Broker(strict=True)
        self.collector = Collector()
        self.broker.subscribe("", self.collector)
        self.recorder = Recorder(SM_WORLDS, broker=self.broker, run="sm")
        make = lambda: SyncVectorEnv([lambda: TimeLimit(Walker(), max_episode_steps=4)] * SM_WORLDS,  # noqa: E731
                                     autoreset_mode=self.mode)
        self.env = RecordingVectorEnv(make(), self.recorder, info_keys=WALKER_INFO)
        self.twin = make()
        self.episodes: list[list[dict[str, Any]]] = [[] for _ in range(SM_WORLDS)]
        self.pending = [False] * SM_WORLDS  # NEXT_STEP: the env resets the world inside the next step
        self.waiting = [False] * SM_WORLDS  # DISABLED: done, the user must reset it before stepping
        self.resets(np.ones(SM_WORLDS, np.bool_), seed=5)

    def twin_calls(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        # each gets its own options: SyncVectorEnv.reset pops "reset_mask" out of the dict it is given
        got = getattr(self.env, method)(*args, **copy.deepcopy(kwargs))
        want = getattr(self.twin, method)(*args, **copy.deepcopy(kwargs))
        assert flat(got[0], "obs").keys() == flat(want[0], "obs").keys()
        for name, value in flat(want[0], "obs").items():
            assert flat(got[0], "obs")[name].tobytes() == value.tobytes(), f"{method} returned other {name}"
        return tuple(want)

    def end(self, w: int, term: bool, trunc: bool) -> None:
        ep = self.episodes[w][-1]
        ep["terminated"], ep["truncated"] = term, trunc
        ret = 0.0
        for row in ep["steps"]:
            ret += float(row["reward"])
        ep["return"] = ret

    def resets(self, mask: np.ndarray, seed: int | None = None) -> None:
        options = None if mask.all() else {"reset_mask": mask}
        obs, _ = self.twin_calls("reset", seed=seed, options=options)
        for w in np.flatnonzero(mask).tolist():
            if self.episodes[w] and not self.pending[w]:  # the episode in progress ends here
                steps = self.episodes[w][-1]["steps"]
                last = steps[-1] if steps else {"terminated": False, "truncated": False}
                self.end(w, bool(last["terminated"]), bool(last["truncated"]))
            self.episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
            self.pending[w] = self.waiting[w] = False

    @precondition(lambda self: not any(self.waiting))
    @rule(actions=st.lists(st.integers(0, 2), min_size=SM_WORLDS, max_size=SM_WORLDS))
    def step(self, actions: list[int]) -> None:
        a = np.asarray(actions, np.int64)
        obs, rew, term, trunc, info = self.twin_calls("step", a)
        for w in range(SM_WORLDS):
            if self.mode == NEXT and self.pending[w]:
                self.episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
                self.pending[w] = False
                continue
            done = bool(term[w] or trunc[w])
            final = self.mode == SAME and done
            next_obs = info["final_obs"][w] if final else world(obs, w)
            self.episodes[w][-1]["steps"].append({
                "action": a[w], "reward": np.asarray(rew[w]), "terminated": np.asarray(term[w]),
                "truncated": np.asarray(trunc[w]), **flat(next_obs, "next_obs"),
                **info_row(info["final_info"] if final else info, w, WALKER_INFO)})
            if done and self.mode == DISABLED:
                self.waiting[w] = True
            elif done:
                self.end(w, bool(term[w]), bool(trunc[w]))
                if self.mode == SAME:
                    self.episodes[w].append({"reset": flat(world(obs, w), "obs"), "steps": []})
                else:
                    self.pending[w] = True

    @rule(mask=st.lists(st.booleans(), min_size=SM_WORLDS, max_size=SM_WORLDS).filter(any))
    def reset_some(self, mask: list[bool]) -> None:
        self.resets(np.asarray(mask, np.bool_) | np.asarray(self.waiting))

    @rule()
    def reset_all(self) -> None:
        self.resets(np.ones(SM_WORLDS, np.bool_))

    def teardown(self) -> None:
        self.env.close()
        self.twin.close()
        check_against_reference(self.collector, self.episodes, lambda ep: ep["truncated"] and not ep["terminated"])


class NextStepMachine(WrapperMachine):
    mode = NEXT


class SameStepMachine(WrapperMachine):
    mode = SAME


class DisabledMachine(WrapperMachine):
    mode = DISABLED


_SETTINGS = settings(max_examples=25, stateful_step_count=25, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
NextStepMachine.TestCase.settings = _SETTINGS
SameStepMachine.TestCase.settings = _SETTINGS
DisabledMachine.TestCase.settings = _SETTINGS
TestNextStepMachine = NextStepMachine.TestCase
TestSameStepMachine = SameStepMachine.TestCase
TestDisabledMachine = DisabledMachine.TestCase


def test_an_info_key_seen_first_in_the_final_info_of_a_same_step_reset_is_recorded() -> None:
    """Found by the SAME_STEP machine: at the first step every world that reports ``bonus``
    ends and resets in that step, so ``bonus`` is only in ``final_info``; the wrapper refused
    it as absent from the first step's info instead of learning its spec from the final rows."""
    machine = SameStepMachine()
    machine.reset_some(mask=[False, True, True])
    machine.reset_some(mask=[False, True, False])
    machine.step(actions=[0, 0, 0])
    machine.teardown()


def test_step_fields_are_recorded_with_the_transitions(broker: Broker) -> None:
    """``step_fields()`` rows go with the transitions: only for worlds that took one (none at a
    NEXT_STEP reset step), byte for byte what it returned; a name clash is refused.

    Catches: extra fields recorded for every world (a row in the new episode at its reset step)."""
    collector = Collector()
    broker.subscribe("", collector)
    recorder = Recorder(N_WORLDS, broker=broker)
    env = cartpole_vector(NEXT)
    returned: list[np.ndarray] = []

    def extra() -> dict[str, Any]:
        returned.append(np.stack([env.unwrapped.state[2], env.unwrapped.steps.astype(np.float64)], 1))
        return {"sim": {"theta_steps": returned[-1]}}

    wrapped = RecordingVectorEnv(env, recorder, step_fields=extra)
    wrapped.reset(seed=SEED)
    for t, a in enumerate(make_actions(cartpole_vector, NEXT)):
        wrapped.step(a)
        assert returned[t].shape == (N_WORLDS, 2)
    wrapped.close()
    for (w, e), rows in collector.rows.items():
        got = [row["sim/theta_steps"] for row in rows.get("step", [])]
        want = [returned[s][w] for s in collector.steps[(w, e)].get("step", [])]
        assert [g.tobytes() for g in got] == [x.tobytes() for x in want], (w, e)
        assert all(g[1] >= 1 for g in got)  # the env's step counter: never a reset step (0)

    clash = RecordingVectorEnv(cartpole_vector(NEXT), Recorder(N_WORLDS, broker=Broker()),
                               step_fields=lambda: {"reward": np.zeros(N_WORLDS)})
    clash.reset(seed=0)
    with pytest.raises(ValueError, match=r"step_fields\(\): field 'reward' is empty, contains '/' or names a field"):
        clash.step(np.zeros(N_WORLDS, np.int64))
    clash.close()
