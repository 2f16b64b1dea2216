"""``worldtap-store export --format minari``, loaded back with Minari's own ``load_dataset``.

Stores are recorded the way users make them: a real gymnasium vector environment (CartPole,
and a small environment with a ``Dict`` observation space) stepped through
``capture.RecordingVectorEnv`` into the real StoreDaemon (Zarr on disk), and a run recorded
with worldtap terms of its own. The reference is what the environment returned, collected
in the test beside the wrapper (each episode's reset observation, then per step the action,
reward, flags and next observation), independent of the store and of the export's mapping.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from broker import Broker
from capture import FunctionTerm, Recorder, RecordingVectorEnv
from storage import RunStore, StoreDaemon
from storage.cli import main as cli_main
from storage.export import ExportError, MissingExtraError, OutputExistsError, export_minari

minari = pytest.importorskip("minari", reason="minari is not installed (pip install 'worldtap[export]')")
gym = pytest.importorskip("gymnasium")

pytestmark = pytest.mark.timeout(120)

Episode = dict[str, Any]


def stack(values: list[Any]) -> Any:
    if isinstance(values[0], dict):
        return {key: np.stack([v[key] for v in values]) for key in values[0]}
    return np.stack(values)


class Oracle:
    """The episodes a NEXT_STEP vector environment returned, in the order they ended (worlds
    ending at one step in world order): observations (reset one, then each next one), actions,
    rewards, terminations, truncations."""

    def __init__(self, obs: Any, num_envs: int) -> None:
        self.num_envs = num_envs
        self.open = [self._start(obs, w) for w in range(num_envs)]
        self.resetting = np.zeros(num_envs, bool)
        self.ended: list[Episode] = []

    @staticmethod
    def _pick(obs: Any, w: int) -> Any:
        return {k: np.array(v[w]) for k, v in obs.items()} if isinstance(obs, dict) else np.array(obs[w])

    def _start(self, obs: Any, w: int) -> Episode:
        return {"observations": [self._pick(obs, w)], "actions": [], "rewards": [], "terminations": [],
                "truncations": []}

    def step(self, actions: Any, result: tuple[Any, ...]) -> None:
        obs, reward, terminated, truncated, _ = result
        for w in range(self.num_envs):
            if self.resetting[w]:  # the environment reset this world inside the step
                self.open[w] = self._start(obs, w)
                self.resetting[w] = False
                continue
            ep = self.open[w]
            ep["observations"].append(self._pick(obs, w))
            ep["actions"].append(self._pick(actions, w))
            ep["rewards"].append(reward[w])
            ep["terminations"].append(terminated[w])
            ep["truncations"].append(truncated[w])
            if terminated[w] or truncated[w]:
                self.ended.append({k: stack(v) for k, v in ep.items()})
                self.resetting[w] = True


def record(env: Any, store: Path, run: str, steps: int, seed: int) -> list[Episode]:
    """Step ``env`` through RecordingVectorEnv into a store; returns the oracle's episodes."""
    broker = Broker(strict=True)
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    try:
        wrapped = RecordingVectorEnv(env, Recorder(env.num_envs, broker=broker, run=run, seed=seed))
        obs, _ = wrapped.reset(seed=seed)
        oracle = Oracle(obs, env.num_envs)
        env.action_space.seed(seed)
        for _ in range(steps):
            actions = env.action_space.sample()
            oracle.step(actions, wrapped.step(actions))
        wrapped.close()
    finally:
        daemon.close()
        broker.close()
    assert sum(daemon.statistics().rejected.values()) == 0
    return oracle.ended


@pytest.fixture(scope="module")
def cartpole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Episode]]:
    store = tmp_path_factory.mktemp("cartpole") / "runs.zarr"
    env = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="vector_entry_point", max_episode_steps=20)
    return store, record(env, store, "cartpole", steps=60, seed=3)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Minari's datasets folder for this test (``minari.load_dataset`` reads it)."""
    folder = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(folder))
    return folder


def assert_episodes(dataset: Any, want: list[Episode]) -> None:
    """Every episode of ``dataset`` equals ``want``'s, value for value and dtype for dtype."""
    assert dataset.total_episodes == len(want)
    assert dataset.total_steps == sum(len(e["actions"]) for e in want)
    for got, ep in zip(dataset.iterate_episodes(), want, strict=True):
        for role in ("observations", "actions", "rewards", "terminations", "truncations"):
            value, expected = getattr(got, role), ep[role]
            if isinstance(expected, dict):
                assert sorted(value) == sorted(expected), role
                pairs = [(value[k], expected[k]) for k in expected]
            else:
                pairs = [(value, expected)]
            for v, e in pairs:
                assert v.dtype == e.dtype, (got.id, role)
                np.testing.assert_array_equal(v, e, err_msg=f"episode {got.id} {role}")


def test_cartpole_store_to_minari(cartpole: tuple[Path, list[Episode]], root: Path) -> None:
    """A RecordingVectorEnv store exports with the default mapping (reset/obs then
    step/next_obs: T+1 observations, the last one the final observation) and Minari's
    load_dataset returns exactly what CartPole returned, episode for episode in the order they
    ended. Catches a dropped first or final observation, an off-by-one between observations and
    actions, episodes out of order, flags or rewards taken from the wrong step."""
    store, episodes = cartpole
    assert len(episodes) >= 8
    assert {len(e["actions"]) for e in episodes} != {20}
    summary = export_minari(store, "cartpole", "worldtap/cartpole-v0", root=root)
    assert summary.out == str(root / "worldtap" / "cartpole-v0")
    assert summary.samples == sum(len(e["actions"]) for e in episodes)
    dataset = minari.load_dataset("worldtap/cartpole-v0")
    assert_episodes(dataset, episodes)
    assert dataset.observation_space == gym.spaces.Box(-np.inf, np.inf, (4,), np.float32)
    assert dataset.action_space == gym.spaces.Box(np.iinfo(np.int64).min, np.iinfo(np.int64).max, (), np.int64)
    assert "worldtap/cartpole-v0" in minari.list_local_datasets()
    assert sorted(p.name for p in root.iterdir()) == ["worldtap"]  # no staging folder left


def test_env_spaces_and_filters(cartpole: tuple[Path, list[Episode]], root: Path) -> None:
    """``env`` gives the dataset the environment's own spaces (Discrete actions) and spec, so
    ``recover_environment`` works; ``episodes="succeeded"`` keeps the time-limit episodes only
    (the wrapper's default success), ``limit`` the first ones to end; an existing dataset is
    refused until ``overwrite``."""
    store, episodes = cartpole
    export_minari(store, "cartpole", "cartpole-ok-v0", root=root, env="CartPole-v1", episodes="succeeded")
    dataset = minari.load_dataset("cartpole-ok-v0")
    assert dataset.action_space == gym.spaces.Discrete(2)
    assert dataset.observation_space == gym.make("CartPole-v1").observation_space
    assert dataset.recover_environment().spec.id == "CartPole-v1"
    succeeded = [e for e in episodes if e["truncations"][-1] and not e["terminations"][-1]]
    assert 0 < len(succeeded) < len(episodes)
    assert_episodes(dataset, succeeded)
    with pytest.raises(OutputExistsError, match="cartpole-ok-v0' exists"):
        export_minari(store, "cartpole", "cartpole-ok-v0", root=root, limit=2)
    summary = export_minari(store, "cartpole", "cartpole-ok-v0", root=root, limit=2, overwrite=True)
    assert len(summary.episodes) == 2
    assert_episodes(minari.load_dataset("cartpole-ok-v0"), episodes[:2])
    with pytest.raises(ExportError, match=r"actions: step/next_obs holds float32\[4\] per row; the space Discrete\(2\)"):
        export_minari(store, "cartpole", "bad-v0", root=root, env="CartPole-v1",
                      observations=["step/next_obs"], actions="step/next_obs")
    with pytest.raises(ExportError, match="env: gymnasium cannot make 'Nowhere-v0'"):
        export_minari(store, "cartpole", "bad-v0", root=root, env="Nowhere-v0")


class DictEnv(gym.Env):  # type: ignore[misc]
    """A small environment with a Dict observation: a position that integrates the action and
    a step counter; it terminates when the position leaves [-1, 1] and truncates at 6 steps."""

    observation_space = gym.spaces.Dict({"pos": gym.spaces.Box(-np.inf, np.inf, (2,), np.float32),
                                         "count": gym.spaces.Box(0, 100, (), np.int64)})
    action_space = gym.spaces.Box(-0.5, 0.5, (2,), np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        self.pos = self.np_random.uniform(-0.5, 0.5, 2).astype(np.float32)
        self.count = 0
        return self._obs(), {}

    def _obs(self) -> dict[str, Any]:
        return {"pos": self.pos.copy(), "count": np.int64(self.count)}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.pos = (self.pos + action).astype(np.float32)
        self.count += 1
        return self._obs(), float(-np.abs(self.pos).sum()), bool(np.abs(self.pos).max() > 1), self.count >= 6, {}


def test_dict_observations(tmp_path: Path, root: Path) -> None:
    """A Dict observation space (stored as obs/<key> and next_obs/<key>) exports as a Minari
    Dict space whose every key matches what the environment returned."""
    env = gym.vector.SyncVectorEnv([DictEnv for _ in range(3)])
    episodes = record(env, tmp_path / "runs.zarr", "dict", steps=20, seed=5)
    assert len(episodes) >= 5
    export_minari(tmp_path / "runs.zarr", "dict", "dict-v1", root=root)
    dataset = minari.load_dataset("dict-v1")
    assert isinstance(dataset.observation_space, gym.spaces.Dict)
    assert sorted(dataset.observation_space.spaces) == ["count", "pos"]
    assert_episodes(dataset, episodes)


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[tuple[int, int], Episode]]:
    """A run recorded with worldtap terms of its own: ``begin`` (post_reset: obs), ``act``
    (pre_step: action), ``after`` (post_step: obs, reward, reward2 (a vector)); per episode the
    expected Minari arrays (terminations and truncations False but at the last step, which
    has the episode's flags)."""
    store = tmp_path_factory.mktemp("native") / "runs.zarr"
    gen = torch.Generator().manual_seed(0)
    rng = np.random.default_rng(0)
    worlds = 3
    broker = Broker(strict=True)
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    rec = Recorder(worlds, broker=broker, run="native")
    current: dict[int, Episode] = {w: {k: [] for k in ("observations", "actions", "rewards")} for w in range(worlds)}
    expected: dict[tuple[int, int], Episode] = {}
    episode = [0] * worlds

    def begin(ids: torch.Tensor) -> dict[str, torch.Tensor]:
        obs = torch.randn(len(ids), 3, generator=gen)
        for i, w in enumerate(ids.tolist()):
            current[w] = {"observations": [obs[i].numpy().copy()], "actions": [], "rewards": []}
        return {"obs": obs}

    def act() -> dict[str, torch.Tensor]:
        action = torch.randn(worlds, 2, generator=gen)
        for w in range(worlds):
            current[w]["actions"].append(action[w].numpy().copy())
        return {"action": action}

    def after() -> dict[str, torch.Tensor]:
        obs, reward = torch.randn(worlds, 3, generator=gen), torch.rand(worlds, generator=gen)
        for w in range(worlds):
            current[w]["observations"].append(obs[w].numpy().copy())
            current[w]["rewards"].append(reward[w].numpy().copy())
        return {"obs": obs, "reward": reward, "reward2": torch.rand(worlds, 2, generator=gen)}

    rec.add_term("begin", FunctionTerm(post_reset=begin))
    rec.add_term("act", FunctionTerm(pre_step=act))
    rec.add_term("after", FunctionTerm(post_step=after))
    try:
        rec.record_post_reset(None)
        for _ in range(25):
            rec.record_pre_step()
            rec.record_post_step()
            done = [w for w in range(worlds) if rng.random() < 0.25]
            if done:
                term = torch.tensor([bool(rng.random() < 0.5) for _ in done])
                rec.record_pre_reset(torch.tensor(done), success=~term, terminated=term, truncated=~term)
                for w, t in zip(done, term.tolist(), strict=True):
                    ep = {k: np.stack(v) for k, v in current[w].items()}
                    flags = np.zeros(len(ep["actions"]), bool)
                    ep["terminations"], ep["truncations"] = flags.copy(), flags.copy()
                    ep["terminations" if t else "truncations"][-1] = True
                    expected[(w, episode[w])] = ep
                    episode[w] += 1
                rec.record_post_reset(torch.tensor(done))
        rec.close()
    finally:
        daemon.close()
        broker.close()
    return store, expected


def test_native_store_with_explicit_mapping(native: tuple[Path, dict[tuple[int, int], Episode]], root: Path) -> None:
    """Sources from terms of one's own: observations ``begin/obs`` (post_reset) and
    ``after/obs`` (post_step) are concatenated in recording order, whatever order they are
    named in; without termination and truncation sources both come from the episode's stored
    flags at its last step."""
    store, expected = native
    summary = export_minari(store, "native", "native-v0", root=root, observations=["after/obs", "begin/obs"],
                            actions="act/action", rewards="after/reward")
    assert sorted(summary.episodes) == sorted(expected)
    assert_episodes(minari.load_dataset("native-v0"), [expected[k] for k in summary.episodes])


def test_mapping_errors(native: tuple[Path, dict[tuple[int, int], Episode]], root: Path) -> None:
    """Mappings Minari cannot take are refused with the reason, and leave no dataset: T
    observations for T actions, a vector reward, a source that names nothing, sources of
    different structure, missing roles for a store not recorded by RecordingVectorEnv, a
    malformed dataset id."""
    store, _ = native
    roles = {"observations": ["begin/obs", "after/obs"], "actions": "act/action", "rewards": "after/reward"}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"observations": ["after/obs"]}, "observations for"),
        ({"rewards": "after/reward2"}, "rewards: 'after/reward2' holds float32[2] per row"),
        ({"actions": "act/nope"}, "actions: 'act/nope' names no field of term 'act'"),
        ({"actions": "nope/x"}, "actions: 'nope/x' names no term of the run"),
        ({"observations": ["begin/obs", "act/action"]}, "differ in dtype or shape"),
        ({"rewards": None}, "name its rewards"),
        ({"terminations": "after/reward"}, "expected one bool per step"),
    ]
    for change, message in cases:
        with pytest.raises(ExportError, match=message.replace("[", r"\[").replace("]", r"\]")):
            export_minari(store, "native", "bad-v0", root=root, **{**roles, **change})
        assert not (root / "bad-v0").exists()
    with pytest.raises(ExportError, match="dataset_id: Malformed dataset ID"):
        export_minari(store, "native", "no version!", root=root, **roles)
    assert not root.exists() or sorted(root.iterdir()) == []


def test_interrupted_export_leaves_nothing(native: tuple[Path, dict[tuple[int, int], Episode]], root: Path) -> None:
    """An export stopped midway (Ctrl-C from the progress callback) leaves no dataset and no
    staging folder, and an earlier dataset it was to overwrite is kept."""
    store, expected = native
    roles: dict[str, Any] = {"observations": ["begin/obs", "after/obs"], "actions": "act/action",
                             "rewards": "after/reward"}
    first = export_minari(store, "native", "ns/keep-v0", root=root, limit=1, **roles)

    def interrupt(done: int, total: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    for dataset_id in ("ns/keep-v0", "ns/new-v0"):
        with pytest.raises(KeyboardInterrupt):
            export_minari(store, "native", dataset_id, root=root, overwrite=True, progress=interrupt, **roles)
    assert sorted(p.name for p in root.iterdir()) == ["ns"]
    assert sorted(p.name for p in (root / "ns").iterdir()) == ["keep-v0", "namespace_metadata.json"]
    assert_episodes(minari.load_dataset("ns/keep-v0"), [expected[first.episodes[0]]])


def test_cli(cartpole: tuple[Path, list[Episode]], root: Path, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> None:
    """``worldtap-store export --format minari``: 0 and a loadable dataset; 2 with one line for
    an existing dataset, a bad id, an option of the other format, a missing minari (naming the
    extra); 3 for an unknown run."""
    store, episodes = cartpole
    argv = ["export", str(store), "cli-v0", "--run", "cartpole", "--format", "minari", "--minari-root", str(root),
            "--worlds", "0,2"]
    assert cli_main(argv) == 0
    assert "-> " + str(root / "cli-v0") in capsys.readouterr().err
    reader = RunStore(store)
    table = reader.episodes("cartpole")
    assert minari.load_dataset("cli-v0").total_episodes == int(np.isin(table["world"], [0, 2]).sum())

    def fails(args: list[str], code: int, message: str) -> None:
        assert cli_main(args) == code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert message in err, err

    fails(argv, 2, "cli-v0' exists; pass overwrite (--overwrite)")
    fails([argv[0], argv[1], "bad id", *argv[3:]], 2, "Malformed dataset ID")
    fails([*argv[:2], "x-v0", *argv[3:], "--paths", "term"], 2, "--paths does not apply to --format minari")
    fails([argv[0], argv[1], "x-v0", "--run", "nope", *argv[5:]], 3, "run 'nope' not found")
    with monkeypatch.context() as patch:  # as if minari were not installed
        patch.setitem(sys.modules, "minari", None)
        fails([*argv[:2], "x-v0", *argv[3:]], 2, "pip install 'worldtap[export]'")
        with pytest.raises(MissingExtraError):
            export_minari(store, "cartpole", "x-v0", root=root)
    assert cli_main([*argv[:-2], "--overwrite", "--quiet"]) == 0
    assert_episodes(minari.load_dataset("cli-v0"), episodes)


@pytest.mark.parametrize("beside", [False, True])
def test_a_dict_key_holding_nul_is_refused(tmp_path: Path, root: Path, beside: bool) -> None:
    """Bug: HDF5 ends a name at its NUL. A field ``obs/a\\x00b`` alone was exported as a Dict
    space whose episodes Minari could not read (``iterate_episodes``: ``KeyError: 'a'``);
    beside ``obs/a`` the export failed deep in Minari's writer ("Can't broadcast (4, 2) -> (4,
    1)"). Now the export is refused, naming the field, and leaves no dataset."""
    broker = Broker(strict=True)
    daemon = StoreDaemon(tmp_path / "s.zarr", commit_interval=0.0)
    broker.subscribe("", daemon)
    rec = Recorder(2, broker=broker, run="r")

    def obs(n: int) -> dict[str, torch.Tensor]:
        return {"obs/a\x00b": torch.zeros(n, 2), **({"obs/a": torch.ones(n, 1)} if beside else {})}

    rec.add_term("begin", FunctionTerm(post_reset=lambda ids: obs(len(ids))))
    rec.add_term("act", FunctionTerm(pre_step=lambda: {"action": torch.zeros(2, 1)}))
    rec.add_term("after", FunctionTerm(post_step=lambda: {**obs(2), "reward": torch.ones(2)}))
    try:
        rec.record_post_reset(None)
        for _ in range(3):
            rec.record_pre_step()
            rec.record_post_step()
        rec.record_pre_reset([0, 1])
        rec.close()
    finally:
        daemon.close()
        broker.close()
    with pytest.raises(ExportError, match=r"observations: field begin/'obs/a\\x00b' would be a Dict space key "
                                          r"holding a NUL character"):
        export_minari(tmp_path / "s.zarr", "r", "nul-v0", root=root, observations=["begin/obs", "after/obs"],
                      actions="act/action", rewards="after/reward")
    assert not root.exists() or sorted(root.iterdir()) == []
