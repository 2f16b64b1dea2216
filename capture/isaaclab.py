"""A drop-in for Isaac Lab's ``RecorderManager`` that streams through worldtap.

:class:`IsaacLabRecorderManager` has the methods a manager-based Isaac Lab environment calls on
its recorder manager, with their signatures and meaning, and builds Isaac Lab's recorder terms
from an Isaac Lab recorder cfg. Instead of keeping each environment's episode in memory and
writing it to an HDF5 file, it publishes what the terms return as it is recorded (a
:class:`capture.Recorder` underneath), and ends each episode with an :class:`broker.EpisodeEnd`
when Isaac Lab would export or discard it. Isaac Lab is never imported here.

What "export" means with worldtap:

- An episode is *exported* when Isaac Lab's manager would export it: by ``export_episodes``
  (called by ``record_pre_reset`` unless ``force_export_or_skip`` or the cfg's
  ``export_in_record_pre_reset`` says otherwise, and by ``close`` with ``export_in_close``), and
  only if something was recorded for it (Isaac Lab skips empty episodes). Its ``EpisodeEnd``
  carries Isaac Lab's success (the environment's ``"success"`` termination term at
  ``record_pre_reset``, or what ``set_success_to_episodes`` set), the termination manager's
  ``terminated`` / ``time_outs`` at ``record_pre_reset`` as ``terminated`` / ``truncated``,
  the outcome ``exported`` = 1 and, when ``demo_ids`` are given, the outcome ``demo_id``.
- An episode that ``reset`` clears without an export (Isaac Lab throws it away) ends with
  every flag False and ``exported`` = 0.
- Where an exported episode goes is the storage daemon's ``--export`` mode, which filters on
  success exactly like the cfg's ``dataset_export_mode``: ``EXPORT_ALL`` is ``all``,
  ``EXPORT_SUCCEEDED_ONLY`` ``succeeded``, ``EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES``
  ``split`` (failed episodes in ``<store>_failed.zarr``), ``EXPORT_NONE`` ``none``. The run
  metadata's ``isaaclab`` entry records the cfg's mode and the matching daemon mode
  (``export``); run the daemon with that mode. Discarded episodes are dropped by
  ``succeeded`` (they did not succeed); under ``all`` and ``split`` they are stored with
  ``exported`` = 0, so filter on that outcome to read Isaac Lab's dataset exactly.

Topics: each hook of each term publishes on ``batch/<term>/<hook>``, its fields named by the
term's key (``batch/record_pre_step_actions/pre_step`` holds field ``actions``); see
:class:`capture.Term`.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import torch

from broker import Broker

from .recorder import Recorder
from .selectors import WorldSelector

__all__ = ["EXPORT_MODES", "DatasetExportMode", "IsaacLabRecorderManager"]


class DatasetExportMode(enum.IntEnum):
    """Isaac Lab's ``DatasetExportMode`` (same names and values), for cfgs built without Isaac
    Lab; Isaac Lab's own enum is accepted as well."""

    EXPORT_NONE = 0
    EXPORT_ALL = 1
    EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES = 2
    EXPORT_SUCCEEDED_ONLY = 3


EXPORT_MODES: Final[Mapping[DatasetExportMode, str]] = {
    DatasetExportMode.EXPORT_NONE: "none",
    DatasetExportMode.EXPORT_ALL: "all",
    DatasetExportMode.EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES: "split",
    DatasetExportMode.EXPORT_SUCCEEDED_ONLY: "succeeded",
}
"""Isaac Lab's export mode -> the storage daemon's ``--export`` mode that stores the same
episodes."""

_SETTINGS: Final = frozenset({
    "dataset_file_handler_class_type", "dataset_filename", "dataset_export_dir_path",
    "dataset_export_mode", "export_in_record_pre_reset", "export_in_close",
})
"""Attributes of an Isaac Lab recorder cfg that are settings, not terms."""


class IsaacLabRecorderManager:
    """Stands where a manager-based Isaac Lab environment calls its recorder manager.

    Attach it after building the environment: ``env.recorder_manager =
    IsaacLabRecorderManager(cfg, env, broker=broker)`` (on the unwrapped environment: a
    gymnasium wrapper's attribute is not the environment's). It builds every term of ``cfg``
    as Isaac Lab does (``term_cfg.class_type(term_cfg, env)``, in the cfg's order) and
    registers it on a :class:`capture.Recorder` (``recorder``), so live consumers, retention
    and the storage daemon receive what the terms return. Episode ends follow Isaac Lab's
    exports (module docstring). With no active term every method does nothing, as Isaac Lab's
    manager does.

    Close it (``close()``, or the environment's ``close()``, which deletes the manager and so
    closes it once nothing else refers to it): that publishes ``RunEnd``. Episodes neither
    exported nor discarded by then are not stored, as Isaac Lab writes none of them. Terms'
    ``close(file_path)`` hooks are not called: there is no dataset file.

    Args:
        cfg: An Isaac Lab recorder cfg (``RecorderManagerBaseCfg`` or a subclass), a
            dataclass or object of the same attributes, or a dict of term cfgs: every
            attribute but the settings (``dataset_export_mode``,
            ``export_in_record_pre_reset``, ``export_in_close``, ``dataset_filename``, ...) is
            a term cfg with a ``class_type``, or ``None``. Settings missing take Isaac Lab's
            defaults. Deep-copied, as Isaac Lab does.
        env: The environment (``num_envs``, ``device``; ``termination_manager`` for success
            and the termination flags when it has one). A wrapper is unwrapped first.
        broker, run, seed: The :class:`capture.Recorder`'s.
        metadata: User metadata of the run; the manager adds the key ``isaaclab``
            (``dataset_export_mode``, ``export``, ``export_in_record_pre_reset``,
            ``export_in_close``, ``dataset_filename``, ``env_name``).

    Raises:
        TypeError: A term cfg has no ``class_type``, or a term has no recorder hook.
        ValueError: ``dataset_export_mode`` is not one of Isaac Lab's modes, ``metadata``
            already has the key ``isaaclab``, or an argument of the recorder is invalid.
    """

    def __init__(
        self,
        cfg: object,
        env: object,
        *,
        broker: Broker | None = None,
        run: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> None:
        self._closed = True  # until built: a half-built manager's finalizer publishes nothing
        self.cfg = copy.deepcopy(cfg)
        self._env = getattr(env, "unwrapped", env)
        self.dataset_export_mode = _export_mode(_setting(self.cfg, "dataset_export_mode",
                                                         DatasetExportMode.EXPORT_ALL))
        self.export_in_record_pre_reset = bool(_setting(self.cfg, "export_in_record_pre_reset", True))
        self.export_in_close = bool(_setting(self.cfg, "export_in_close", False))
        user = dict(metadata or {})
        if "isaaclab" in user:
            raise ValueError("metadata: the key 'isaaclab' is the manager's (its export settings)")
        env_name = getattr(getattr(self._env, "cfg", None), "env_name", None)
        user["isaaclab"] = {
            "dataset_export_mode": self.dataset_export_mode.name,
            "export": EXPORT_MODES[self.dataset_export_mode],
            "export_in_record_pre_reset": self.export_in_record_pre_reset,
            "export_in_close": self.export_in_close,
            "dataset_filename": str(_setting(self.cfg, "dataset_filename", "dataset")),
            "env_name": env_name if isinstance(env_name, str) else None,
        }
        self.recorder = Recorder.from_env(self._env, broker, run=run, metadata=user, seed=seed)
        self._terms: dict[str, object] = {}
        for name, term_cfg in _cfg_items(self.cfg):
            if name in _SETTINGS or term_cfg is None:
                continue
            class_type = getattr(term_cfg, "class_type", None)
            if not callable(class_type):
                raise TypeError(f"cfg.{name}: expected a recorder term cfg with a class_type, got "
                                f"{type(term_cfg).__name__}")
            term = class_type(term_cfg, self._env)
            self.recorder.add_term(name, term)
            self._terms[name] = term
        n, device = self.recorder.num_worlds, self.recorder.device
        self._nonempty = np.zeros(n, np.bool_)  # host: has the world's episode any data yet
        self._success = torch.zeros(n, dtype=torch.bool, device=device)
        self._terminated = torch.zeros(n, dtype=torch.bool, device=device)
        self._truncated = torch.zeros(n, dtype=torch.bool, device=device)
        self._exported_successful_episode_count: dict[int, int] = {}
        self._exported_failed_episode_count: dict[int, int] = {}
        self._closed = False

    def __str__(self) -> str:
        names = list(self._terms)
        width = max([len("Name"), *map(len, names)])
        lines = [f"<IsaacLabRecorderManager> contains {len(names)} active terms "
                 f"(run {self.recorder.run!r}, export {EXPORT_MODES[self.dataset_export_mode]!r}).",
                 f"Index | {'Name':<{width}}"]
        lines += [f"{i:>5} | {name:<{width}}" for i, name in enumerate(names)]
        return "\n".join(lines) + "\n"

    def __del__(self) -> None:
        # Isaac Lab's environments close their recorder manager by deleting it. A broker closed
        # by then has no one left to tell.
        if not getattr(self, "_closed", True) and not self.recorder.broker.statistics().closed:
            self.close()

    # -- properties ----------------------------------------------------------------------

    @property
    def active_terms(self) -> list[str]:
        """Names of the active recorder terms, in the cfg's order."""
        return list(self._terms)

    @property
    def num_envs(self) -> int:
        return self.recorder.num_worlds

    @property
    def device(self) -> str:
        return str(self.recorder.device)

    @property
    def exported_successful_episode_count(self) -> int:
        """Number of exported episodes that succeeded, over every environment."""
        return sum(self._exported_successful_episode_count.values())

    @property
    def exported_failed_episode_count(self) -> int:
        """Number of exported episodes that did not succeed, over every environment."""
        return sum(self._exported_failed_episode_count.values())

    # -- the environment's calls ---------------------------------------------------------

    def reset(self, env_ids: WorldSelector = None) -> dict[str, torch.Tensor]:
        """Reset the terms (``term.reset(env_ids=[...])`` where a term has it) and clear the
        episodes of ``env_ids`` (default: all): one that holds data is discarded, ending with
        every flag False and ``exported`` = 0.

        Returns:
            An empty dict (nothing to log), as Isaac Lab's manager returns.

        Raises:
            ValueError: ``env_ids`` is not a valid world selector.
        """
        if not self._terms:
            return {}
        idx = self.recorder.select(env_ids, name="env_ids")
        ids = idx.tolist()
        for term in self._terms.values():
            reset = getattr(term, "reset", None)
            if callable(reset):
                reset(env_ids=ids)
        held = self._held(idx, ids)
        if held is not None:
            self.recorder.end_episodes(held, outcomes={"exported": 0.0})
        self._clear(idx, ids)
        return {}

    def record_pre_step(self) -> None:
        """Run the terms' ``record_pre_step`` (all environments)."""
        if self._terms:
            self._record_all(self.recorder.record_pre_step)

    def record_post_step(self) -> None:
        """Run the terms' ``record_post_step`` (all environments); the step advances."""
        if self._terms:
            self._record_all(self.recorder.record_post_step)

    def record_post_physics_decimation_step(self) -> None:
        """Run the terms' ``record_post_physics_decimation_step`` (all environments, after each
        physics step of the decimation loop)."""
        if self._terms:
            self._record_all(self.recorder.record_post_physics_decimation_step)

    def record_pre_reset(self, env_ids: WorldSelector, force_export_or_skip: bool | None = None) -> None:
        """Run the terms' ``record_pre_reset(env_ids)`` into the current episodes, take their
        success (the environment's ``"success"`` termination term, False without one) and
        termination flags, then export them when ``force_export_or_skip`` is true, or is
        ``None`` and the cfg's ``export_in_record_pre_reset`` is set.

        Raises:
            ValueError: ``env_ids`` is not a valid world selector.
        """
        if not self._terms:
            return
        idx = self.recorder.select(env_ids, name="env_ids")
        if idx.numel() == 0:
            return
        before = self.recorder.batch_count
        self.recorder.record_pre_reset(idx, end=False)
        if self.recorder.batch_count != before:
            self._nonempty[idx.tolist()] = True
        manager = getattr(self._env, "termination_manager", None)
        success = torch.zeros(idx.numel(), dtype=torch.bool, device=idx.device)
        if manager is not None and "success" in manager.active_terms:
            success |= self._rows(manager.get_term("success"), idx)
        self._success[idx] = success
        for flags, name in ((self._terminated, "terminated"), (self._truncated, "time_outs")):
            values = getattr(manager, name, None)
            flags[idx] = self._rows(values, idx) if isinstance(values, torch.Tensor) else False
        if force_export_or_skip or (force_export_or_skip is None and self.export_in_record_pre_reset):
            self.export_episodes(idx)

    def record_post_reset(self, env_ids: WorldSelector) -> None:
        """Run the terms' ``record_post_reset(env_ids)`` into the new episodes.

        Raises:
            ValueError: ``env_ids`` is not a valid world selector.
        """
        if not self._terms:
            return
        before = self.recorder.batch_count
        idx = self.recorder.record_post_reset(self.recorder.select(env_ids, name="env_ids"))
        if self.recorder.batch_count != before:
            self._nonempty[idx.tolist()] = True

    def set_success_to_episodes(self, env_ids: WorldSelector, success_values: torch.Tensor) -> None:
        """Set the success of the current episodes of ``env_ids`` (one value per environment,
        shape ``(len(env_ids),)`` or ``(len(env_ids), 1)``), used when they are exported.

        Raises:
            ValueError: ``env_ids`` is invalid, or ``success_values`` has not one value per
                environment.
        """
        if not self._terms:
            return
        idx = self.recorder.select(env_ids, name="env_ids")
        values = torch.as_tensor(success_values)
        if values.numel() != idx.numel() or (values.dim() and values.shape[0] != idx.numel()):
            raise ValueError(f"success_values: expected one value per environment ({idx.numel()}), "
                             f"got shape {tuple(values.shape)}")
        self._success[idx] = values.reshape(-1).to(device=self._success.device, dtype=torch.bool)

    def export_episodes(self, env_ids: WorldSelector = None, demo_ids: Sequence[int] | None = None) -> None:
        """Export the episodes of ``env_ids`` (default: all) that hold data: each ends with its
        success and termination flags, the outcome ``exported`` = 1 (and ``demo_id`` when
        ``demo_ids`` are given) and is counted; every episode of ``env_ids`` starts afresh.

        Raises:
            ValueError: ``env_ids`` is invalid, or ``demo_ids`` are not distinct ints, one per
                environment.
        """
        if not self._terms:
            return
        idx = self.recorder.select(env_ids, name="env_ids")
        ids = idx.tolist()
        outcomes: dict[str, object] = {"exported": 1.0}
        if demo_ids is not None:
            demos = demo_ids.tolist() if isinstance(demo_ids, torch.Tensor) else list(demo_ids)
            if len(demos) != len(ids):
                raise ValueError(f"demo_ids: expected one per environment ({len(ids)}), got {len(demos)}")
            if len(set(demos)) != len(demos) or not all(
                    isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in demos):
                raise ValueError(f"demo_ids: expected distinct ints, got {demos!r:.200}")
            outcomes["demo_id"] = [float(demos[i]) for i, e in enumerate(ids) if self._nonempty[e]]
        held = self._held(idx, ids)
        if held is not None:
            success = self._success.index_select(0, held)
            self.recorder.end_episodes(held, success=success, terminated=self._terminated.index_select(0, held),
                                       truncated=self._truncated.index_select(0, held), outcomes=outcomes)
            for env_id, ok in zip(held.tolist(), success.tolist(), strict=True):
                counts = self._exported_successful_episode_count if ok else self._exported_failed_episode_count
                counts[env_id] = counts.get(env_id, 0) + 1
        self._clear(idx, ids)

    def close(self, *, interrupted: bool = False) -> None:
        """Export every episode if the cfg's ``export_in_close`` is set (and its mode is not
        ``EXPORT_NONE``), then close the recorder (``RunEnd``). Idempotent.

        Args:
            interrupted: The run stopped before it was meant to (see :meth:`Recorder.close`).
        """
        if self._closed:
            return
        self._closed = True
        if self._terms and self.export_in_close and self.dataset_export_mode != DatasetExportMode.EXPORT_NONE:
            self.export_episodes()
        self.recorder.close(interrupted=interrupted)

    # -- internals -----------------------------------------------------------------------

    def _record_all(self, record: Any) -> None:
        """Run a record call of every environment; each episode holds data if it published."""
        before = self.recorder.batch_count
        record()
        if self.recorder.batch_count != before:
            self._nonempty[:] = True

    def _held(self, idx: torch.Tensor, ids: list[int]) -> torch.Tensor | None:
        """The worlds of ``idx`` whose episode holds data (``None`` when none does)."""
        keep = [i for i, e in enumerate(ids) if self._nonempty[e]]
        if not keep:
            return None
        if len(keep) == len(ids):
            return idx
        return idx.index_select(0, torch.tensor(keep, dtype=torch.int64, device=idx.device))

    def _clear(self, idx: torch.Tensor, ids: list[int]) -> None:
        self._nonempty[ids] = False
        for flags in (self._success, self._terminated, self._truncated):
            flags.index_fill_(0, idx, False)

    @staticmethod
    def _rows(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``values[idx]`` (a per-environment buffer of the environment) as bools on ``idx``'s
        device."""
        return values.index_select(0, idx.to(values.device)).to(device=idx.device, dtype=torch.bool)


def _export_mode(value: object) -> DatasetExportMode:
    """Isaac Lab's export mode (its enum, ours, or the int) as :class:`DatasetExportMode`."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(DatasetExportMode):
        return DatasetExportMode(int(value))
    raise ValueError(f"dataset_export_mode: expected one of Isaac Lab's DatasetExportMode values "
                     f"({', '.join(m.name for m in DatasetExportMode)}), got {value!r}")


def _setting(cfg: object, name: str, default: object) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _cfg_items(cfg: object) -> list[tuple[str, Any]]:
    """The attributes of a recorder cfg in Isaac Lab's order: a dict's items; otherwise a
    dataclass's fields (an Isaac Lab configclass is one), then the other public data attributes
    of its classes (bases first) and of the instance (a cfg class: of the class)."""
    if isinstance(cfg, Mapping):
        return [(str(k), v) for k, v in cfg.items()]
    names = dict.fromkeys(f.name for f in dataclasses.fields(cfg)) if dataclasses.is_dataclass(cfg) else {}
    for klass in reversed((cfg if isinstance(cfg, type) else type(cfg)).__mro__[:-1]):
        names.update(dict.fromkeys(name for name, value in vars(klass).items() if not name.startswith("_")
                                   and not callable(value) and not hasattr(value, "__get__")))
    if not isinstance(cfg, type):
        names.update(dict.fromkeys(name for name in vars(cfg) if not name.startswith("_")))
    return [(name, getattr(cfg, name)) for name in names if hasattr(cfg, name)]
