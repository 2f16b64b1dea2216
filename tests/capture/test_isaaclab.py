"""Isaac Lab's recorder terms and recorder manager, worldtap's way.

A stand-in of Isaac Lab's manager-based RL environment (``isaaclab_standin``: its ``step``,
``reset`` and ``_reset_idx`` call order) drives Isaac Lab's stock recorder terms through two
recorder managers at once: a transcription of Isaac Lab's own (the reference: the episodes it
would write to its dataset files) and :class:`capture.isaaclab.IsaacLabRecorderManager`. What
worldtap publishes, consumed by :class:`consumers.Retention` or rebuilt from the stream by a
broker subscriber, must be those episodes, key by key and value by value, with their success.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
import torch
from isaaclab_standin import (
    DatasetExportMode,
    EveryOtherStepRecorder,
    InitialStateRecorder,
    JointPosRecorder,
    PreStepActionsRecorder,
    RecorderTerm,
    RecorderTermCfg,
    ReferenceRecorderManager,
    StandInRLEnv,
    Tee,
    actions,
    custom_cfg,
    stock_cfg,
)

from broker import Batch, Broker, EpisodeEnd, Message, RunEnd, RunStart, decode, encode
from capture import FunctionTerm, Recorder, TermError
from capture.isaaclab import EXPORT_MODES, IsaacLabRecorderManager
from consumers import FinishedEpisode, Retention


class StreamEpisodes:
    """A broker subscriber that rebuilds Isaac Lab's episodes from what worldtap publishes: per
    world, each field's rows appended in publish order under the field's name (whatever topic
    carries it), ended by each ``EpisodeEnd`` with its flags and outcomes."""

    def __init__(self) -> None:
        self.current: dict[int, dict[str, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))
        self.ended: list[dict[str, Any]] = []
        self.topics: dict[str, set[str]] = defaultdict(set)

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self.topics[message.topic].add(message.hook)
            for i, world in enumerate(message.worlds.tolist()):
                for name, t in message.fields.items():
                    self.current[world][name].append(t[i].clone())
        elif isinstance(message, EpisodeEnd):
            outcomes = {k: v.tolist() for k, v in message.outcomes.items()}
            for i, world in enumerate(message.worlds.tolist()):
                rows = self.current.pop(world, {})
                self.ended.append({
                    "env_id": world, "success": bool(message.success[i]),
                    "terminated": bool(message.terminated[i]), "truncated": bool(message.truncated[i]),
                    "outcomes": {k: v[i] for k, v in outcomes.items()},
                    "data": {k: torch.stack(v) for k, v in rows.items()},
                })


def assert_same_episodes(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    """Same episodes in the same order: environment, success, keys, and every value's bytes."""
    assert [(e["env_id"], bool(e["success"])) for e in got] == [(e["env_id"], bool(e["success"])) for e in want]
    for g, w in zip(got, want, strict=True):
        assert sorted(g["data"]) == sorted(w["data"]), (g["env_id"], sorted(g["data"]), sorted(w["data"]))
        for key, value in w["data"].items():
            assert g["data"][key].dtype == value.dtype, key
            np.testing.assert_array_equal(g["data"][key].cpu().numpy(), value.cpu().numpy(), err_msg=key)


def drive(env: StandInRLEnv, steps: int, *, seed: int = 1, partial_reset_at: int | None = None) -> None:
    """Isaac Lab's usual loop: reset every environment, step; one ``env.reset(env_ids=...)`` of
    two environments mid-run (as Isaac Lab's own recorder test does)."""
    env.reset()
    for i, action in enumerate(actions(env.num_envs, steps, seed)):
        env.step(action)
        if i == partial_reset_at:
            env.reset(env_ids=torch.tensor([1, env.num_envs - 1]))


@pytest.fixture
def env() -> StandInRLEnv:
    return StandInRLEnv(num_envs=6, decimation=3, max_episode_length=8, seed=3)


@pytest.mark.parametrize("device", [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)])
def test_stock_terms_record_what_isaaclab_exports(broker: Broker, device: str) -> None:
    """Catches any difference between Isaac Lab's exported episodes and what worldtap records
    with the stock terms (initial state at post_reset, states at post_step, actions and flat
    policy observations at pre_step, a physics-rate term): a value recorded at the wrong
    lifecycle point or for the wrong environment, an episode split at the wrong call, a lost
    first row after a reset, success not taken from the "success" termination term."""
    env = StandInRLEnv(num_envs=6, device=device, decimation=3, max_episode_length=8, seed=3)
    finished: list[FinishedEpisode] = []
    retention = Retention(sink=finished.append)
    retention.attach(broker)
    stream = StreamEpisodes()
    broker.subscribe("", stream)
    cfg = stock_cfg(DatasetExportMode.EXPORT_ALL)
    reference = ReferenceRecorderManager(cfg, env)
    manager = IsaacLabRecorderManager(cfg, env, broker=broker, run="stock")
    env.recorder_manager = Tee(reference, manager)
    drive(env, 40, partial_reset_at=17)
    env.recorder_manager.close()

    main, _ = reference.files
    assert len(main) > 20
    assert {e["success"] for e in main} == {True, False}
    via_retention = [{"env_id": e.world, "success": e.success,
                      "data": {k: v for fields in e.data.values() for k, v in fields.items()}} for e in finished]
    assert_same_episodes(via_retention, main)
    assert_same_episodes(stream.ended, main)
    assert all(e["outcomes"] == {"exported": 1.0} for e in stream.ended)
    # terminated / truncated are the termination manager's at the reset
    assert {(e["terminated"], e["truncated"]) for e in stream.ended} >= {(True, False), (False, True)}
    assert manager.exported_successful_episode_count == reference.exported_successful_episode_count > 0
    assert manager.exported_failed_episode_count == reference.exported_failed_episode_count > 0
    assert dict(stream.topics) == {
        "batch/record_initial_state/post_reset": {"post_reset"},
        "batch/record_post_step_states/post_step": {"post_step"},
        "batch/record_pre_step_actions/pre_step": {"pre_step"},
        "batch/record_pre_step_flat_policy_observations/pre_step": {"pre_step"},
        "batch/record_physics_joint_velocity/post_physics_decimation_step": {"post_physics_decimation_step"},
    }


def test_keys_from_several_hooks_and_none_results(broker: Broker, env: StandInRLEnv) -> None:
    """Catches an Isaac Lab term whose hooks return different keys (one topic per hook keeps
    one schema per topic), the key "obs/joint_pos" recorded from two hooks in call order (first
    observation at post_reset, then each step's), a key recorded only at pre_reset, and
    ``(None, None)`` results (nothing recorded, no empty rows)."""
    stream = StreamEpisodes()
    broker.subscribe("", stream)
    cfg = custom_cfg(DatasetExportMode.EXPORT_ALL)
    reference = ReferenceRecorderManager(cfg, env)
    manager = IsaacLabRecorderManager(cfg, env, broker=broker)
    env.recorder_manager = Tee(reference, manager)
    drive(env, 30, seed=5, partial_reset_at=11)
    manager.close()

    main, _ = reference.files
    assert len(main) > 10
    assert_same_episodes(stream.ended, main)
    # env.reset() at the start exports what pre_reset recorded for every env, as Isaac Lab does
    assert [set(e["data"]) for e in main[:env.num_envs]] == [{"final/joint_pos"}] * env.num_envs
    assert {"actions", "obs/joint_pos", "final/joint_pos", "sparse/step", "sparse/pos"} == set(main[-1]["data"])
    assert set(stream.topics) == {
        "batch/record_pre_step_actions/pre_step", "batch/record_joint_pos/post_reset",
        "batch/record_joint_pos/post_step", "batch/record_joint_pos/pre_reset", "batch/record_sparse/post_step",
    }


def test_recorded_only_in_record_demos_style(broker: Broker, env: StandInRLEnv) -> None:
    """Isaac Lab's record_demos flow: ``export_in_record_pre_reset=False`` and
    ``EXPORT_SUCCEEDED_ONLY``; the script marks success and exports itself
    (``record_pre_reset(ids, force_export_or_skip=False)``, ``set_success_to_episodes``,
    ``export_episodes(ids, demo_ids)``), and resets clear the other episodes without an
    export. Catches: an episode ended by ``record_pre_reset`` that must go on, a discarded
    episode that looks exported or successful, a wrong ``demo_id``, success not taken from
    ``set_success_to_episodes``, ``force_export_or_skip=True`` not exporting."""
    stream = StreamEpisodes()
    broker.subscribe("", stream)
    cfg = custom_cfg(DatasetExportMode.EXPORT_SUCCEEDED_ONLY, export_in_record_pre_reset=False)
    reference = ReferenceRecorderManager(cfg, env)
    manager = IsaacLabRecorderManager(cfg, env, broker=broker)
    env.recorder_manager = tee = Tee(reference, manager)
    env.reset()
    steps = actions(env.num_envs, 20, seed=9)
    for i, action in enumerate(steps):
        env.step(action)
        if i == 4:  # the operator says env 2 succeeded: record, mark, export, reset it
            tee.record_pre_reset([2], force_export_or_skip=False)
            tee.set_success_to_episodes([2], torch.tensor([[True]]))
            tee.export_episodes([2], demo_ids=[7])
            env.reset(env_ids=[2])
        if i == 9:  # a forced export of env 0 (its success: the termination term's, False)
            tee.record_pre_reset(torch.tensor([0]), force_export_or_skip=True)
            env.reset(env_ids=[0])
    manager.close()

    main, _ = reference.files
    exported = [e for e in stream.ended if e["outcomes"]["exported"] == 1.0]
    assert_same_episodes([e for e in exported if e["success"]], main)
    assert [e["demo"] for e in main] == ["demo_7"]
    assert [(e["env_id"], e["outcomes"].get("demo_id")) for e in exported] == [(2, 7.0), (0, None)]
    discarded = [e for e in stream.ended if e["outcomes"]["exported"] == 0.0]
    assert len(discarded) >= env.num_envs  # every reset by the environment discarded an episode
    assert not any(e["success"] or e["terminated"] or e["truncated"] for e in discarded)
    assert manager.exported_successful_episode_count == reference.exported_successful_episode_count == 1
    assert manager.exported_failed_episode_count == reference.exported_failed_episode_count == 1


def test_export_in_close_and_the_environment_closing(broker: Broker, env: StandInRLEnv) -> None:
    """Catches a manager that Isaac Lab's ``env.close()`` (``del self.recorder_manager``) does
    not close (the run would stay open in the store), and ``export_in_close`` not exporting
    the episodes in progress."""
    stream = StreamEpisodes()
    messages: list[Message] = []
    broker.subscribe("", stream)
    broker.subscribe("run/", messages.append)
    cfg = stock_cfg(DatasetExportMode.EXPORT_ALL, export_in_close=True)
    reference = ReferenceRecorderManager(cfg, env)
    env.recorder_manager = Tee(reference, IsaacLabRecorderManager(cfg, env, broker=broker))
    drive(env, 5)
    reference.close()
    env.recorder_manager = env.recorder_manager.managers[1]  # as an Isaac Lab env holds it
    before = len(stream.ended)
    env.close()
    gc.collect()
    assert [type(m) for m in messages] == [RunStart, RunEnd]
    assert len(stream.ended) == before + env.num_envs  # every episode in progress, exported at close
    assert_same_episodes(stream.ended, reference.files[0])


def test_positional_flag_is_a_type_error(broker: Broker) -> None:
    """Isaac Lab's ``record_pre_reset(env_ids, False)`` means "do not export"; ported to a
    Recorder it used to mean ``success=False`` silently. Flags are keyword-only now."""
    got: list[Message] = []
    broker.subscribe("", got.append)
    recorder = Recorder(3, broker=broker)
    with pytest.raises(TypeError):
        recorder.record_pre_reset([0], False)  # type: ignore[misc]
    with pytest.raises(TypeError):
        recorder.end_episodes([0], True)  # type: ignore[misc]
    assert not [m for m in got if isinstance(m, EpisodeEnd)]
    assert recorder.episode_index.tolist() == [0, 0, 0]


def test_pre_reset_without_end_and_end_episodes(broker: Broker) -> None:
    """Catches ``record_pre_reset(end=False)`` ending the episode or not running the hooks,
    flags silently ignored with ``end=False``, and ``end_episodes`` running hooks."""
    got: list[Message] = []
    broker.subscribe("", got.append)
    recorder = Recorder(3, broker=broker)
    state = torch.arange(6.0).reshape(3, 2)
    recorder.add_term("final", FunctionTerm(pre_reset=lambda w: {"x": state[w]}))
    recorder.record_post_step()
    assert recorder.record_pre_reset([2, 0], end=False).tolist() == [2, 0]
    with pytest.raises(ValueError, match="success"):
        recorder.record_pre_reset([1], success=True, end=False)
    recorder.end_episodes([0, 2], success=torch.tensor([True, False]), outcomes={"exported": 1})
    kinds = [(type(m).__name__, getattr(m, "hook", None)) for m in got]
    assert kinds == [("RunStart", None), ("Batch", "pre_reset"), ("EpisodeEnd", None)]
    batch, end = got[1], got[2]
    assert isinstance(batch, Batch)
    assert isinstance(end, EpisodeEnd)
    np.testing.assert_array_equal(batch.fields["x"].numpy(), state[[2, 0]].numpy())
    assert end.worlds.tolist() == [0, 2]
    assert end.success.tolist() == [True, False]
    assert end.length.tolist() == [1, 1]
    assert end.outcomes["exported"].tolist() == [1.0, 1.0]
    assert recorder.episode_index.tolist() == [1, 0, 1]


class _Reset(RecorderTerm):
    """Returns every environment's rows from a reset hook (Isaac Lab's own recorder test does):
    Isaac Lab pairs row i with env_ids[i]."""

    def record_pre_reset(self, env_ids: Any) -> tuple[str | None, Any]:
        self.seen = env_ids
        return "pre", torch.arange(self._env.num_envs * 2.0).reshape(-1, 2)


def test_isaaclab_term_on_a_recorder(broker: Broker) -> None:
    """An Isaac Lab term added to a plain Recorder: catches a lost key path, env_ids handed
    over as anything but Isaac Lab's list of ints, extra rows not ignored the way Isaac Lab
    ignores them, and bad results or names accepted silently."""
    got: list[Batch] = []
    broker.subscribe("batch/", got.append)
    env = StandInRLEnv(num_envs=4)
    recorder = Recorder.from_env(env, broker)
    term = _Reset(RecorderTermCfg(_Reset), env)
    recorder.add_term("reset", term)
    recorder.add_term("joint", JointPosRecorder(RecorderTermCfg(JointPosRecorder), env))
    recorder.record_pre_reset(torch.tensor([3, 1]))
    assert term.seen == [3, 1]
    assert all(type(i) is int for i in term.seen)
    by_topic = {b.topic: b for b in got}
    np.testing.assert_array_equal(by_topic["batch/reset/pre_reset"].fields["pre"].numpy(), [[0.0, 1.0], [2.0, 3.0]])
    np.testing.assert_array_equal(by_topic["batch/joint/pre_reset"].fields["final/joint_pos"].numpy(),
                                  env.scene.joint_pos[[3, 1]].numpy())

    class Bad(RecorderTerm):
        def __init__(self, out: Any) -> None:
            self.out = out

        def record_post_step(self) -> Any:
            return self.out

    for name, out, match in [("a", torch.zeros(4), "pair"), ("b", (1, torch.zeros(4)), "key 1"),
                             ("c", ("k", None), "value None"), ("d", ("k", {"x": 1}), "expected a tensor")]:
        bad = Recorder(4, broker=Broker())
        bad.add_term(name, Bad(out))
        with pytest.raises(TermError, match=match):
            bad.record_post_step()
    with pytest.raises(ValueError, match="'/'"):
        recorder.add_term("a/b", PreStepActionsRecorder(RecorderTermCfg(PreStepActionsRecorder), env))
    with pytest.raises(ValueError, match="another term's topic"):
        recorder.add_term("joint/post_step", FunctionTerm(post_step=lambda: {}))

    class Both(RecorderTerm):
        def post_step(self) -> None:
            return None

    with pytest.raises(TypeError, match="one protocol"):
        recorder.add_term("both", Both(RecorderTermCfg(Both), env))
    with pytest.raises(TypeError, match="record_<hook>"):
        recorder.add_term("none", object())


def test_physics_rate_hook_native_and_on_the_wire(broker: Broker) -> None:
    """Catches the decimation hook not running, advancing the step or episode length, or not
    surviving the wire codec (a receiver that refuses the new hook name)."""
    got: list[Batch] = []
    broker.subscribe("batch/", got.append)
    retention = Retention()
    retention.attach(broker)
    recorder = Recorder(2, broker=broker)
    counter = torch.zeros(2, 1)
    recorder.add_term("physics", FunctionTerm(post_physics_decimation_step=lambda: {"q": counter}))
    for _ in range(2):
        for _ in range(3):
            counter += 1
            recorder.record_post_physics_decimation_step()
        recorder.record_post_step()
    assert recorder.step == 2
    assert recorder.episode_length.tolist() == [2, 2]
    assert [(b.hook, b.step) for b in got] == [("post_physics_decimation_step", s) for s in (0, 0, 0, 1, 1, 1)]
    np.testing.assert_array_equal(retention.episode(1)["physics"]["q"].numpy().ravel(), [1, 2, 3, 4, 5, 6])
    batch = got[0]
    back = decode([bytes(f) for f in encode(batch)])
    assert isinstance(back, Batch)
    assert back.hook == "post_physics_decimation_step"


def test_from_env(broker: Broker) -> None:
    """Catches worlds or device not read from the environment (Isaac Lab's, a gymnasium vector
    environment's, through a wrapper), and a missing ``num_envs`` accepted."""
    recorder = Recorder.from_env(StandInRLEnv(num_envs=5), broker, run="r", seed=4)
    assert (recorder.num_worlds, recorder.device, recorder.run, recorder.seed) == (5, torch.device("cpu"), "r", 4)
    vec = gym.make_vec("CartPole-v1", num_envs=3, vectorization_mode="vector_entry_point")
    try:
        recorder = Recorder.from_env(vec)
        assert (recorder.num_worlds, recorder.device.type) == (3, "cpu")
    finally:
        vec.close()

    class Wrapper:
        unwrapped = StandInRLEnv(num_envs=2, device="meta")

    recorder = Recorder.from_env(Wrapper())
    assert (recorder.num_worlds, recorder.device) == (2, torch.device("meta"))
    with pytest.raises(TypeError, match="num_envs"):
        Recorder.from_env(object())


class IsaacLabTestCfg:
    """Isaac Lab's own recorder-manager test cfg shape: term cfgs as class attributes."""

    class DummyStepRecorderTermCfg(RecorderTermCfg):
        pass

    dataset_export_mode = DatasetExportMode.EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES
    record_reset_term = RecorderTermCfg(InitialStateRecorder)
    record_step_term = RecorderTermCfg(EveryOtherStepRecorder)


def test_cfg_forms_settings_and_metadata(broker: Broker, env: StandInRLEnv) -> None:
    """Catches cfg attributes taken for terms (settings, nested classes) or terms missed (class
    attributes, dict cfgs), the cfg's order lost, export settings not reaching the run's
    metadata, and bad cfgs accepted."""
    starts: list[RunStart] = []
    broker.subscribe("run/start", starts.append)
    manager = IsaacLabRecorderManager(IsaacLabTestCfg(), env, broker=broker, metadata={"task": "lift"})
    assert manager.active_terms == ["record_reset_term", "record_step_term"]
    assert "record_step_term" in str(manager)
    assert "2 active terms" in str(manager)
    manager.record_post_step()
    manager.close()
    assert starts[0].metadata == {"task": "lift", "isaaclab": {
        "dataset_export_mode": "EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES", "export": "split",
        "export_in_record_pre_reset": True, "export_in_close": False, "dataset_filename": "dataset",
        "env_name": "Isaac-StandIn-v0"}}
    assert set(EXPORT_MODES.values()) == {"all", "succeeded", "split", "none"}
    as_dict = IsaacLabRecorderManager({"b": RecorderTermCfg(PreStepActionsRecorder), "export_in_close": True,
                                       "a": None}, env, broker=Broker())
    assert as_dict.active_terms == ["b"]
    assert as_dict.export_in_close
    as_dict.close()
    with pytest.raises(TypeError, match=r"cfg\.x: expected a recorder term cfg"):
        IsaacLabRecorderManager({"x": 3}, env, broker=Broker())
    for mode in (7, "EXPORT_ALL", True):
        cfg = stock_cfg()
        cfg.dataset_export_mode = mode
        with pytest.raises(ValueError, match="dataset_export_mode"):
            IsaacLabRecorderManager(cfg, env, broker=Broker())
    with pytest.raises(ValueError, match="metadata"):
        IsaacLabRecorderManager(stock_cfg(), env, broker=Broker(), metadata={"isaaclab": 1})


def test_no_active_terms_records_nothing(broker: Broker, env: StandInRLEnv) -> None:
    """Isaac Lab's manager without terms does nothing; catches episodes ended or batches
    published anyway."""
    got: list[Message] = []
    broker.subscribe("", got.append)
    env.recorder_manager = manager = IsaacLabRecorderManager({}, env, broker=broker)
    drive(env, 12)
    manager.export_episodes()
    assert manager.reset() == {}
    assert manager.active_terms == []
    assert got == []
    manager.close()


def test_env_ids_forms_and_bad_ones(broker: Broker, env: StandInRLEnv) -> None:
    """Catches env_ids forms Isaac Lab passes (tensors, lists, None) or worldtap accepts
    (numpy arrays, masks) refused, and bad ones taken."""
    stream = StreamEpisodes()
    broker.subscribe("", stream)
    manager = IsaacLabRecorderManager(custom_cfg(), env, broker=broker)
    for ids in (torch.tensor([0, 1]), [2], np.array([3]), torch.tensor([False] * 5 + [True]), None):
        manager.record_post_reset(ids)
        manager.record_pre_reset(ids)
    assert sorted(e["env_id"] for e in stream.ended) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 5, 5]
    with pytest.raises(ValueError, match="env_ids"):
        manager.record_pre_reset([6])
    with pytest.raises(ValueError, match="success_values"):
        manager.set_success_to_episodes([0, 1], torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="demo_ids"):
        manager.export_episodes([0, 1], demo_ids=[4, 4])
    manager.close()
