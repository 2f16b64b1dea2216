"""Isaac Lab 2.3.2, re-created for the tests without Isaac Sim: the recorder term base class and
term cfg, the stock recorder terms (``isaaclab/envs/mdp/recorders/recorders.py``), a stand-in
of ``ManagerBasedRLEnv`` that calls its recorder manager in the order ``step()``, ``reset()``
and ``_reset_idx()`` do (``envs/manager_based_rl_env.py``, ``envs/manager_based_env.py``), and
a reference recorder manager: ``managers/recorder_manager.py`` and
``utils/datasets/episode_data.py`` transcribed, writing episodes to in-memory dataset files.

The reference is what worldtap's recording is compared with: the episodes Isaac Lab's manager
would write to its dataset files, key by key and value by value.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

# -- isaaclab.managers.recorder_manager / manager_term_cfg --------------------------------------


class DatasetExportMode(enum.IntEnum):
    """Isaac Lab's own enum (a separate class from ``capture.isaaclab``'s, as Isaac Lab's is)."""

    EXPORT_NONE = 0
    EXPORT_ALL = 1
    EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES = 2
    EXPORT_SUCCEEDED_ONLY = 3


@dataclasses.dataclass
class RecorderTermCfg:
    class_type: type[RecorderTerm]


class RecorderTerm:
    """``RecorderTerm``: every hook records nothing unless overridden (``ManagerTermBase`` keeps
    ``cfg`` and ``_env``)."""

    def __init__(self, cfg: RecorderTermCfg, env: Any) -> None:
        self.cfg = cfg
        self._env = env

    def reset(self, env_ids: Sequence[int] | None = None) -> None:
        pass

    def record_pre_reset(self, env_ids: Sequence[int] | None) -> tuple[str | None, Any]:
        return None, None

    def record_post_reset(self, env_ids: Sequence[int] | None) -> tuple[str | None, Any]:
        return None, None

    def record_pre_step(self) -> tuple[str | None, Any]:
        return None, None

    def record_post_step(self) -> tuple[str | None, Any]:
        return None, None

    def record_post_physics_decimation_step(self) -> tuple[str | None, Any]:
        return None, None

    def close(self, file_path: str) -> None:
        pass


# -- isaaclab.envs.mdp.recorders.recorders (verbatim but for type hints) ------------------------


class InitialStateRecorder(RecorderTerm):
    def record_post_reset(self, env_ids: Sequence[int] | None) -> tuple[str | None, Any]:
        def extract_env_ids_values(value: Any) -> Any:
            nonlocal env_ids
            if isinstance(value, dict):
                return {k: extract_env_ids_values(v) for k, v in value.items()}
            return value[env_ids]

        return "initial_state", extract_env_ids_values(self._env.scene.get_state(is_relative=True))


class PostStepStatesRecorder(RecorderTerm):
    def record_post_step(self) -> tuple[str | None, Any]:
        return "states", self._env.scene.get_state(is_relative=True)


class PreStepActionsRecorder(RecorderTerm):
    def record_pre_step(self) -> tuple[str | None, Any]:
        return "actions", self._env.action_manager.action


class PreStepFlatPolicyObservationsRecorder(RecorderTerm):
    def record_pre_step(self) -> tuple[str | None, Any]:
        return "obs", self._env.obs_buf["policy"]


# -- terms of the tests' own ---------------------------------------------------------------------


class PhysicsJointVelocityRecorder(RecorderTerm):
    """Records at physics rate, inside the decimation loop."""

    def record_post_physics_decimation_step(self) -> tuple[str | None, Any]:
        return "physics/joint_velocity", self._env.scene.joint_vel


class JointPosRecorder(RecorderTerm):
    """Key ``obs/joint_pos`` from two hooks (post_reset: the first observation; post_step:
    every next one), and a different key from a third (pre_reset)."""

    def record_post_reset(self, env_ids: Sequence[int] | None) -> tuple[str | None, Any]:
        return "obs/joint_pos", self._env.scene.joint_pos[env_ids]

    def record_post_step(self) -> tuple[str | None, Any]:
        return "obs/joint_pos", self._env.scene.joint_pos

    def record_pre_reset(self, env_ids: Sequence[int] | None) -> tuple[str | None, Any]:
        return "final/joint_pos", self._env.scene.joint_pos[env_ids]


class EveryOtherStepRecorder(RecorderTerm):
    """Returns ``(None, None)`` on every other call: nothing is recorded then."""

    def __init__(self, cfg: RecorderTermCfg, env: Any) -> None:
        super().__init__(cfg, env)
        self.calls = 0

    def record_post_step(self) -> tuple[str | None, Any]:
        self.calls += 1
        if self.calls % 2:
            return None, None
        return "sparse", {"step": self._env.episode_length_buf.clone(), "pos": self._env.scene.joint_pos}


def stock_cfg(mode: int = DatasetExportMode.EXPORT_ALL, **settings: Any) -> Any:
    """Isaac Lab's ``ActionStateRecorderManagerCfg`` (minus the processed actions) plus a
    physics-rate term."""
    return _cfg(mode, settings, record_initial_state=InitialStateRecorder,
                record_post_step_states=PostStepStatesRecorder, record_pre_step_actions=PreStepActionsRecorder,
                record_pre_step_flat_policy_observations=PreStepFlatPolicyObservationsRecorder,
                record_physics_joint_velocity=PhysicsJointVelocityRecorder)


def custom_cfg(mode: int = DatasetExportMode.EXPORT_ALL, **settings: Any) -> Any:
    """Actions, the key ``obs/joint_pos`` from two hooks and ``final/joint_pos`` from a third,
    and a term that records nothing every other step."""
    return _cfg(mode, settings, record_pre_step_actions=PreStepActionsRecorder,
                record_joint_pos=JointPosRecorder, record_sparse=EveryOtherStepRecorder)


def _cfg(mode: int, settings: dict[str, Any], **terms: type[RecorderTerm]) -> Any:
    """A ``RecorderManagerBaseCfg`` subclass instance (a dataclass, as a configclass is)."""
    fields: list[Any] = [
        ("dataset_file_handler_class_type", type, MemoryDatasetFileHandler),
        ("dataset_export_dir_path", str, "/tmp/isaaclab/logs"),
        ("dataset_filename", str, "dataset"),
        ("dataset_export_mode", DatasetExportMode, DatasetExportMode(mode)),
        ("export_in_record_pre_reset", bool, True),
        ("export_in_close", bool, False),
    ]
    fields += [(name, RecorderTermCfg, dataclasses.field(default_factory=lambda c=cls: RecorderTermCfg(c)))
               for name, cls in terms.items()]
    cfg = dataclasses.make_dataclass("RecorderManagerCfg", fields)()
    for name, value in settings.items():
        setattr(cfg, name, value)
    return cfg


# -- isaaclab.utils.datasets.episode_data -------------------------------------------------------


class EpisodeData:
    def __init__(self) -> None:
        self._data: dict[str, Any] = {}
        self.env_id: int | None = None
        self.success: bool | None = None

    @property
    def data(self) -> dict[str, Any]:
        return self._data

    def is_empty(self) -> bool:
        return not bool(self._data)

    def add(self, key: str, value: Any) -> None:
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                self.add(f"{key}/{sub_key}", sub_value)
            return
        sub_keys = key.split("/")
        current_dataset_pointer = self._data
        for sub_key_index in range(len(sub_keys)):
            if sub_key_index == len(sub_keys) - 1:
                if sub_keys[sub_key_index] not in current_dataset_pointer:
                    current_dataset_pointer[sub_keys[sub_key_index]] = [value.clone()]
                else:
                    current_dataset_pointer[sub_keys[sub_key_index]].append(value.clone())
                break
            if sub_keys[sub_key_index] not in current_dataset_pointer:
                current_dataset_pointer[sub_keys[sub_key_index]] = dict()
            current_dataset_pointer = current_dataset_pointer[sub_keys[sub_key_index]]

    def pre_export(self) -> None:
        def pre_export_helper(data: dict[str, Any]) -> None:
            for key, value in data.items():
                if isinstance(value, list):
                    data[key] = torch.stack(value)
                elif isinstance(value, dict):
                    pre_export_helper(value)

        pre_export_helper(self._data)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """A nested dict of tensors as ``{"a/b": tensor}`` (HDF5 paths of the dataset file)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


class MemoryDatasetFileHandler:
    """Isaac Lab's dataset file handler interface, writing episodes to a list (``order``: when
    it was written, counted over every handler)."""

    writes = itertools.count()

    def __init__(self) -> None:
        self.path = ""
        self.episodes: list[dict[str, Any]] = []
        self._demo_count = 0

    def create(self, file_path: str, env_name: str | None = None) -> None:
        self.path = file_path

    def add_env_args(self, env_args: dict[str, Any]) -> None:
        pass

    def write_episode(self, episode: EpisodeData, demo_id: int | None = None) -> None:
        if episode.is_empty():
            return
        name = f"demo_{demo_id}" if demo_id is not None else f"demo_{self._demo_count}"
        self.episodes.append({"demo": name, "env_id": episode.env_id, "success": episode.success,
                              "data": flatten(episode.data), "order": next(self.writes)})
        self._demo_count += 1

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


# -- isaaclab.managers.recorder_manager.RecorderManager (the reference) -------------------------

_SETTINGS = ["dataset_file_handler_class_type", "dataset_filename", "dataset_export_dir_path",
             "dataset_export_mode", "export_in_record_pre_reset", "export_in_close"]


class ReferenceRecorderManager:
    """Isaac Lab's ``RecorderManager``, its logic as written (ManagerBase's deep copy of the cfg
    and ``_prepare_terms`` included)."""

    def __init__(self, cfg: Any, env: Any) -> None:
        import copy

        self._term_names: list[str] = []
        self._terms: dict[str, RecorderTerm] = {}
        self.cfg = copy.deepcopy(cfg)
        self._env = env
        for term_name, term_cfg in self.cfg.__dict__.items():
            if term_name in _SETTINGS or term_cfg is None:
                continue
            self._term_names.append(term_name)
            self._terms[term_name] = term_cfg.class_type(term_cfg, env)
        self._episodes = {env_id: EpisodeData() for env_id in range(env.num_envs)}
        self._dataset_file_handler = None
        if cfg.dataset_export_mode != DatasetExportMode.EXPORT_NONE:
            self._dataset_file_handler = cfg.dataset_file_handler_class_type()
            self._dataset_file_handler.create("dataset")
        self._failed_episode_dataset_file_handler = None
        if cfg.dataset_export_mode == DatasetExportMode.EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES:
            self._failed_episode_dataset_file_handler = cfg.dataset_file_handler_class_type()
            self._failed_episode_dataset_file_handler.create("dataset_failed")
        self._exported_successful_episode_count: dict[int, int] = {}
        self._exported_failed_episode_count: dict[int, int] = {}

    @property
    def files(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The episodes written to the dataset file and to the failed one."""
        return tuple(h.episodes if h is not None else []  # type: ignore[return-value]
                     for h in (self._dataset_file_handler, self._failed_episode_dataset_file_handler))

    @property
    def active_terms(self) -> list[str]:
        return self._term_names

    @property
    def exported_successful_episode_count(self) -> int:
        return sum(self._exported_successful_episode_count.values())

    @property
    def exported_failed_episode_count(self) -> int:
        return sum(self._exported_failed_episode_count.values())

    def reset(self, env_ids: Any = None) -> dict[str, torch.Tensor]:
        if len(self.active_terms) == 0:
            return {}
        if env_ids is None:
            env_ids = list(range(self._env.num_envs))
        if isinstance(env_ids, torch.Tensor):
            env_ids = env_ids.tolist()
        for term in self._terms.values():
            term.reset(env_ids=env_ids)
        for env_id in env_ids:
            self._episodes[env_id] = EpisodeData()
        return {}

    def add_to_episodes(self, key: str | None, value: Any, env_ids: Any = None) -> None:
        if len(self.active_terms) == 0:
            return
        if key is None:
            return
        if env_ids is None:
            env_ids = list(range(self._env.num_envs))
        if isinstance(env_ids, torch.Tensor):
            env_ids = env_ids.tolist()
        if isinstance(value, dict):
            for sub_key, sub_value in value.items():
                self.add_to_episodes(f"{key}/{sub_key}", sub_value, env_ids)
            return
        for value_index, env_id in enumerate(env_ids):
            if env_id not in self._episodes:
                self._episodes[env_id] = EpisodeData()
                self._episodes[env_id].env_id = env_id
            self._episodes[env_id].add(key, value[value_index])

    def set_success_to_episodes(self, env_ids: Any, success_values: torch.Tensor) -> None:
        if len(self.active_terms) == 0:
            return
        if env_ids is None:
            env_ids = list(range(self._env.num_envs))
        if isinstance(env_ids, torch.Tensor):
            env_ids = env_ids.tolist()
        for value_index, env_id in enumerate(env_ids):
            self._episodes[env_id].success = success_values[value_index].item()

    def record_pre_step(self) -> None:
        if len(self.active_terms) == 0:
            return
        for term in self._terms.values():
            key, value = term.record_pre_step()
            self.add_to_episodes(key, value)

    def record_post_step(self) -> None:
        if len(self.active_terms) == 0:
            return
        for term in self._terms.values():
            key, value = term.record_post_step()
            self.add_to_episodes(key, value)

    def record_post_physics_decimation_step(self) -> None:
        if len(self.active_terms) == 0:
            return
        for term in self._terms.values():
            key, value = term.record_post_physics_decimation_step()
            self.add_to_episodes(key, value)

    def record_pre_reset(self, env_ids: Any, force_export_or_skip: bool | None = None) -> None:
        if len(self.active_terms) == 0:
            return
        if env_ids is None:
            env_ids = list(range(self._env.num_envs))
        if isinstance(env_ids, torch.Tensor):
            env_ids = env_ids.tolist()
        for term in self._terms.values():
            key, value = term.record_pre_reset(env_ids)
            self.add_to_episodes(key, value, env_ids)
        success_results = torch.zeros(len(env_ids), dtype=bool, device=self._env.device)  # type: ignore[call-overload]
        if hasattr(self._env, "termination_manager") and "success" in self._env.termination_manager.active_terms:
            success_results |= self._env.termination_manager.get_term("success")[env_ids]
        self.set_success_to_episodes(env_ids, success_results)
        if force_export_or_skip or (force_export_or_skip is None and self.cfg.export_in_record_pre_reset):
            self.export_episodes(env_ids)

    def record_post_reset(self, env_ids: Any) -> None:
        if len(self.active_terms) == 0:
            return
        for term in self._terms.values():
            key, value = term.record_post_reset(env_ids)
            self.add_to_episodes(key, value, env_ids)

    def export_episodes(self, env_ids: Any = None, demo_ids: Sequence[int] | None = None) -> None:
        if len(self.active_terms) == 0:
            return
        if env_ids is None:
            env_ids = list(range(self._env.num_envs))
        if isinstance(env_ids, torch.Tensor):
            env_ids = env_ids.tolist()
        for i, env_id in enumerate(env_ids):
            if env_id in self._episodes and not self._episodes[env_id].is_empty():
                self._episodes[env_id].pre_export()
                self._episodes[env_id].env_id = env_id  # (the dataset names no env; kept to compare)
                episode_succeeded = self._episodes[env_id].success
                target = None
                if (self.cfg.dataset_export_mode == DatasetExportMode.EXPORT_ALL) or (
                    self.cfg.dataset_export_mode == DatasetExportMode.EXPORT_SUCCEEDED_ONLY and episode_succeeded
                ):
                    target = self._dataset_file_handler
                elif self.cfg.dataset_export_mode == DatasetExportMode.EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES:
                    if episode_succeeded:
                        target = self._dataset_file_handler
                    else:
                        target = self._failed_episode_dataset_file_handler
                if target is not None:
                    target.write_episode(self._episodes[env_id], demo_ids[i] if demo_ids is not None else None)
                if episode_succeeded:
                    self._exported_successful_episode_count[env_id] = (
                        self._exported_successful_episode_count.get(env_id, 0) + 1)
                else:
                    self._exported_failed_episode_count[env_id] = self._exported_failed_episode_count.get(env_id, 0) + 1
            self._episodes[env_id] = EpisodeData()

    def close(self) -> None:
        if len(self.active_terms) == 0:
            return
        if self._dataset_file_handler is not None and self.cfg.export_in_close:
            self.export_episodes()


# -- the environment ------------------------------------------------------------------------------


class _Scene:
    """One articulation (two joints) and one rigid object per environment."""

    def __init__(self, num_envs: int, device: str, generator: torch.Generator) -> None:
        self.generator = generator
        self.env_origins = torch.arange(num_envs * 3, dtype=torch.float32).reshape(num_envs, 3).to(device)
        self.joint_pos = torch.zeros(num_envs, 2, device=device)
        self.joint_vel = torch.zeros(num_envs, 2, device=device)
        self.root_pose = torch.zeros(num_envs, 7, device=device)
        self.cube_pose = torch.zeros(num_envs, 7, device=device)

    def get_state(self, is_relative: bool = False) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
        robot = {"root_pose": self.root_pose.clone(), "root_velocity": torch.zeros_like(self.root_pose[:, :6]),
                 "joint_position": self.joint_pos.clone(), "joint_velocity": self.joint_vel.clone()}
        cube = {"root_pose": self.cube_pose.clone(), "root_velocity": torch.zeros_like(self.cube_pose[:, :6])}
        if is_relative:
            robot["root_pose"][:, :3] -= self.env_origins
            cube["root_pose"][:, :3] -= self.env_origins
        return {"articulation": {"robot": robot}, "rigid_object": {"cube": cube}}

    def randomize(self, env_ids: torch.Tensor) -> None:
        n = len(env_ids)
        draw = torch.rand(n, 18, generator=self.generator).to(self.joint_pos.device)
        self.joint_pos[env_ids] = draw[:, :2] * 0.6 - 0.3
        self.joint_vel[env_ids] = 0.0
        self.root_pose[env_ids] = draw[:, 2:9] + self.env_origins[env_ids].repeat(1, 3)[:, :7]
        self.cube_pose[env_ids] = draw[:, 9:16] + self.env_origins[env_ids].repeat(1, 3)[:, :7]

    def write_data_to_sim(self) -> None:
        pass

    def update(self, dt: float) -> None:
        pass

    def reset(self, env_ids: torch.Tensor | Sequence[int] | None = None) -> None:
        pass


class _ActionManager:
    def __init__(self, env: StandInRLEnv) -> None:
        self._env = env
        self._action = torch.zeros(env.num_envs, 2, device=env.device)

    @property
    def action(self) -> torch.Tensor:
        return self._action

    def process_action(self, action: torch.Tensor) -> None:
        self._action[:] = action

    def apply_action(self) -> None:
        self._env.scene.joint_vel.mul_(0.5).add_(self._action)

    def reset(self, env_ids: Any = None) -> dict[str, Any]:
        self._action[env_ids] = 0.0
        return {}


class _ObservationManager:
    def __init__(self, env: StandInRLEnv) -> None:
        self._env = env

    def compute(self, update_history: bool = False) -> dict[str, torch.Tensor]:
        return {"policy": torch.cat([self._env.scene.joint_pos, self._env.scene.joint_vel], dim=-1)}

    def reset(self, env_ids: Any = None) -> dict[str, Any]:
        return {}


class _TerminationManager:
    """Terms ``time_out`` (a time out), ``success`` and ``fail`` (on the first joint)."""

    active_terms: ClassVar[list[str]] = ["time_out", "success", "fail"]

    def __init__(self, env: StandInRLEnv, max_episode_length: int) -> None:
        self._env = env
        self.max_episode_length = max_episode_length
        self._term_dones = torch.zeros(env.num_envs, 3, dtype=torch.bool, device=env.device)
        self._truncated_buf = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
        self._terminated_buf = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)

    @property
    def time_outs(self) -> torch.Tensor:
        return self._truncated_buf

    @property
    def terminated(self) -> torch.Tensor:
        return self._terminated_buf

    def compute(self) -> torch.Tensor:
        self._truncated_buf[:] = False
        self._terminated_buf[:] = False
        joint = self._env.scene.joint_pos[:, 0]
        values = [self._env.episode_length_buf >= self.max_episode_length, joint > 0.5, joint < -0.5]
        for i, (value, time_out) in enumerate(zip(values, (True, False, False), strict=True)):
            if time_out:
                self._truncated_buf |= value
            else:
                self._terminated_buf |= value
            self._term_dones[:, i] = value
        return self._truncated_buf | self._terminated_buf

    def get_term(self, name: str) -> torch.Tensor:
        return self._term_dones[:, self.active_terms.index(name)]

    def reset(self, env_ids: Any = None) -> dict[str, Any]:
        return {}


class _EventManager:
    available_modes: ClassVar[list[str]] = ["reset"]

    def __init__(self, env: StandInRLEnv) -> None:
        self._env = env

    def apply(self, mode: str, env_ids: Any = None, dt: float | None = None,
              global_env_step_count: int | None = None) -> None:
        if mode == "reset":
            self._env.scene.randomize(env_ids)

    def reset(self, env_ids: Any = None) -> dict[str, Any]:
        return {}


class _Idle:
    """Reward, curriculum and command managers: called where Isaac Lab calls them."""

    def compute(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(0)

    def reset(self, env_ids: Any = None) -> dict[str, Any]:
        return {}


class _Sim:
    def __init__(self, env: StandInRLEnv) -> None:
        self._env = env

    def is_playing(self) -> bool:
        return True

    def has_gui(self) -> bool:
        return False

    def has_rtx_sensors(self) -> bool:
        return False

    def step(self, render: bool = False) -> None:
        scene = self._env.scene
        scene.joint_pos.add_(scene.joint_vel * self._env.physics_dt)

    def forward(self) -> None:
        pass

    def render(self) -> None:
        pass


class NoRecorderManager:
    """Isaac Lab's ``RecorderManager`` built from an empty cfg: no active terms."""

    active_terms: ClassVar[list[str]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: {}


class StandInRLEnv:
    """``ManagerBasedRLEnv``'s ``step``, ``reset`` (``ManagerBasedEnv.reset``) and ``_reset_idx``
    with their calls in the source's order; the managers are small deterministic stand-ins.
    Attach a recorder manager as Isaac Lab users do: ``env.recorder_manager = ...``."""

    def __init__(self, num_envs: int = 6, device: str = "cpu", *, decimation: int = 3,
                 max_episode_length: int = 8, seed: int = 0) -> None:
        self.num_envs = num_envs
        self.device = device
        self.cfg = SimpleNamespace(decimation=decimation, env_name="Isaac-StandIn-v0", num_rerenders_on_reset=0,
                                   sim=SimpleNamespace(dt=0.05, render_interval=decimation))
        self.physics_dt = self.cfg.sim.dt
        self.step_dt = self.cfg.sim.dt * decimation
        self.sim = _Sim(self)
        self.scene = _Scene(num_envs, device, torch.Generator().manual_seed(seed))
        self.recorder_manager: Any = NoRecorderManager()
        self.action_manager = _ActionManager(self)
        self.observation_manager = _ObservationManager(self)
        self.event_manager = _EventManager(self)
        self.termination_manager = _TerminationManager(self, max_episode_length)
        self.reward_manager = self.curriculum_manager = self.command_manager = _Idle()
        self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long, device=device)
        self.common_step_counter = 0
        self._sim_step_counter = 0
        self.obs_buf: dict[str, torch.Tensor] = {}
        self.extras: dict[str, Any] = {}
        self.reset_buf = torch.zeros(num_envs, dtype=torch.bool, device=device)

    @property
    def unwrapped(self) -> StandInRLEnv:
        return self

    def step(self, action: torch.Tensor) -> tuple[Any, ...]:
        self.action_manager.process_action(action.to(self.device))
        self.recorder_manager.record_pre_step()
        is_rendering = self.sim.has_gui() or self.sim.has_rtx_sensors()
        for _ in range(self.cfg.decimation):
            self._sim_step_counter += 1
            self.action_manager.apply_action()
            self.scene.write_data_to_sim()
            self.sim.step(render=False)
            self.recorder_manager.record_post_physics_decimation_step()
            if self._sim_step_counter % self.cfg.sim.render_interval == 0 and is_rendering:
                self.sim.render()
            self.scene.update(dt=self.physics_dt)
        self.episode_length_buf += 1
        self.common_step_counter += 1
        self.reset_buf = self.termination_manager.compute()
        self.reset_terminated = self.termination_manager.terminated
        self.reset_time_outs = self.termination_manager.time_outs
        self.reward_buf = self.reward_manager.compute(dt=self.step_dt)
        if len(self.recorder_manager.active_terms) > 0:
            self.obs_buf = self.observation_manager.compute()
            self.recorder_manager.record_post_step()
        reset_env_ids = self.reset_buf.nonzero(as_tuple=False).squeeze(-1)
        if len(reset_env_ids) > 0:
            self.recorder_manager.record_pre_reset(reset_env_ids)
            self._reset_idx(reset_env_ids)
            self.recorder_manager.record_post_reset(reset_env_ids)
        self.command_manager.compute(dt=self.step_dt)
        self.obs_buf = self.observation_manager.compute(update_history=True)
        return self.obs_buf, self.reward_buf, self.reset_terminated, self.reset_time_outs, self.extras

    def reset(self, seed: int | None = None, env_ids: Sequence[int] | torch.Tensor | None = None,
              options: dict[str, Any] | None = None) -> tuple[Any, ...]:
        if env_ids is None:
            env_ids = torch.arange(self.num_envs, dtype=torch.int64, device=self.device)
        self.recorder_manager.record_pre_reset(env_ids)
        self._reset_idx(env_ids)
        self.scene.write_data_to_sim()
        self.sim.forward()
        self.recorder_manager.record_post_reset(env_ids)
        self.obs_buf = self.observation_manager.compute(update_history=True)
        return self.obs_buf, self.extras

    def _reset_idx(self, env_ids: Any) -> None:
        env_ids = torch.as_tensor(env_ids, dtype=torch.int64, device=self.device)
        self.curriculum_manager.compute(env_ids=env_ids)
        self.scene.reset(env_ids)
        if "reset" in self.event_manager.available_modes:
            env_step_count = self._sim_step_counter // self.cfg.decimation
            self.event_manager.apply(mode="reset", env_ids=env_ids, global_env_step_count=env_step_count)
        self.extras["log"] = dict()
        for manager in (self.observation_manager, self.action_manager, self.reward_manager,
                        self.curriculum_manager, self.command_manager, self.event_manager,
                        self.termination_manager, self.recorder_manager):
            self.extras["log"].update(manager.reset(env_ids))
        self.episode_length_buf[env_ids] = 0

    def close(self) -> None:
        del self.recorder_manager


class Tee:
    """Hands every recorder-manager call of the environment to several managers, in order (the
    reference first), so they record the very same run."""

    def __init__(self, *managers: Any) -> None:
        self.managers = managers

    @property
    def active_terms(self) -> list[str]:
        return list(self.managers[0].active_terms)

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            results = [getattr(m, name)(*args, **kwargs) for m in self.managers]
            return results[0]

        return call


def actions(num_envs: int, steps: int, seed: int) -> list[torch.Tensor]:
    """The policy's actions: a fixed random sequence."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(num_envs, 2, generator=generator) * 0.8 for _ in range(steps)]
