"""Record any gymnasium vector environment through a :class:`capture.recorder.Recorder`.

:class:`RecordingVectorEnv` wraps a ``gymnasium.vector.VectorEnv`` (gymnasium 1.x, imported
lazily) and drives the recorder from ``reset`` and ``step``. It records two terms:

- ``reset`` (topic ``batch/reset``, hook ``post_reset``): each episode's first observation,
  one row per episode, fields ``obs`` (a ``Box`` or other array space) or ``obs/<key>``
  (``Dict`` spaces; nested dicts give ``obs/<key>/<key>``) or ``obs/<i>`` (``Tuple`` spaces).
- ``step`` (topic ``batch/step``, hook ``post_step``): one row per transition, fields
  ``action`` (flattened like ``obs``), ``reward``, ``terminated``, ``truncated``, ``next_obs``
  (flattened like ``obs``) and, for each chosen info key ``k``, ``info/<k>`` (the value) and
  ``info/_<k>`` (gymnasium's mask: whether that world's info had ``k``; absent values are 0),
  plus the fields ``step_fields()`` returns (e.g. the physical parameters each world used).

An episode's observations are the ``reset`` row's ``obs`` followed by each ``step`` row's
``next_obs``; the last ``next_obs`` is the episode's final observation. A ``step`` row's
action was taken from the observation before it (the previous row's ``next_obs``, or ``obs``).

Episode boundaries, per ``env.metadata["autoreset_mode"]``:

- ``NEXT_STEP`` (gymnasium's default): a world whose step ``t`` returns ``terminated`` or
  ``truncated`` ends its episode right after step ``t`` (``record_pre_reset``; the ``step``
  row of ``t`` holds its final observation). The environment resets that world inside step
  ``t + 1``, ignoring its action there and returning its reset observation: nothing of that
  world's step ``t + 1`` is recorded as a transition of either episode (its action, zero
  reward and false flags are dropped, and it does not count in the episode length); its
  returned observation is recorded as the new episode's ``reset`` row.
- ``SAME_STEP``: a world done at step ``t`` is reset within step ``t``. Its ``step`` row of
  ``t`` takes ``next_obs`` from ``info["final_obs"]`` and its info keys from
  ``info["final_info"]`` (the ended step's own info); the episode ends, and the observation
  step ``t`` returned for it is recorded as the new episode's ``reset`` row.
- ``DISABLED``: worlds are reset only by ``reset(options={"reset_mask": mask})``; the
  episodes of the masked worlds end there (with the flags of their last step), and the reset
  observations start their new episodes.

In every mode, ``reset`` (of the masked worlds, or of all) ends the episode in progress of
each reset world with the flags of its last step: a world reset in the middle of an episode,
or again before it stepped, ends neither terminated nor truncated (and not successful). A
NEXT_STEP world that ended at the last step is not ended twice: the reset's observation is
its new episode's ``reset`` row.

Success and outcomes: each ended episode's success is ``success_fn(terminated, truncated,
info)`` read at the ended worlds (default: truncated and not terminated); its return (the sum
of its recorded rewards, float64) is recorded as the episode outcome ``"return"``.

Per-world randomization: every callback in ``on_reset`` is called with the indices of the
worlds whose new episode starts, after their old episode ended (the recorder's episode index
already names the new episode, so variation draws made there belong to it) and before the
environment steps the first step of that episode: at ``reset`` before ``env.reset``; under
``NEXT_STEP`` right after the step that reported the end, so before the step that resets the
world inside the environment; under ``SAME_STEP`` after that step (the environment has
already reset the world, but has not stepped it in the new episode).

Ownership: numpy arrays enter torch with ``torch.from_numpy`` (no copy; copied only when
torch cannot view them: read-only, negative strides or non-native byte order) and are moved
to the recorder's device; the batches borrow them for the publish call. Rows of only some
worlds (NEXT_STEP steps that reset worlds, the ``reset`` rows) are gathered copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeAlias

import numpy as np
import torch

from .errors import CaptureError
from .recorder import Recorder
from .terms import FunctionTerm

__all__ = ["RESET_TERM", "STEP_TERM", "OnReset", "RecordingVectorEnv", "SuccessFn", "default_success"]

RESET_TERM = "reset"
"""Term (topic ``batch/reset``) of each episode's first observation."""
STEP_TERM = "step"
"""Term (topic ``batch/step``) of every transition."""

OnReset: TypeAlias = Callable[[torch.Tensor], object]
"""Called with the int64 indices (on the recorder's device) of worlds whose new episode starts."""
SuccessFn: TypeAlias = Callable[[Any, Any, Mapping[str, Any]], Any]
"""``(terminated, truncated, info) -> success``: arrays of every world as the step returned
them (for SAME_STEP, ``info`` is ``info["final_info"]``); returns a bool array of every world,
read at the worlds whose episode ended."""

InfoSpec: TypeAlias = tuple[Any, Sequence[int]]
"""``(dtype, per-world shape)`` of an info key, e.g. ``(np.float32, ())``."""


def default_success(terminated: Any, truncated: Any, info: Mapping[str, Any]) -> Any:
    """An episode succeeds when it was truncated (time limit) without terminating."""
    return truncated & ~terminated


def _as_tensor(value: Any, device: torch.device, what: str) -> torch.Tensor:
    """``value`` as a tensor on ``device``; numpy arrays are viewed, not copied, when torch can."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    array = value if isinstance(value, np.ndarray) else np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{what}: expected a numeric or bool array, got dtype {array.dtype}")
    if (not array.flags.writeable or any(s < 0 for s in array.strides)
            or not array.dtype.isnative):
        array = np.array(array, dtype=array.dtype.newbyteorder("="), order="C")
    tensor = torch.from_numpy(array)
    return tensor if tensor.device == device else tensor.to(device)


def _flatten(value: Any, prefix: str) -> dict[str, Any]:
    """Flatten an observation or action: dicts to ``prefix/<key>``, tuples to ``prefix/<i>``."""
    if isinstance(value, Mapping):
        out: dict[str, Any] = {}
        for key, item in value.items():
            if not isinstance(key, str) or not key or "/" in key:
                raise ValueError(f"{prefix}: expected dict keys that are non-empty str without '/', got {key!r}")
            out.update(_flatten(item, f"{prefix}/{key}"))
        return out
    if isinstance(value, tuple):
        out = {}
        for i, item in enumerate(value):
            out.update(_flatten(item, f"{prefix}/{i}"))
        return out
    return {prefix: value}


def _to_numpy_bool(value: Any, n: int, what: str) -> np.ndarray:
    array = value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)
    if array.dtype != np.bool_ or array.shape != (n,):
        raise ValueError(f"{what}: expected a bool array of shape ({n},), got dtype {array.dtype} "
                         f"shape {array.shape}")
    return array


class RecordingVectorEnv:
    """A gymnasium vector environment whose resets and steps are recorded (see the module).

    ``reset``, ``step`` and ``close`` are the environment's, recorded; every other attribute
    (spaces, ``num_envs``, ``call``, ``render``, ...) is the wrapped environment's. What
    ``reset`` and ``step`` return is exactly what the environment returned.

    The wrapper registers the terms ``reset`` and ``step`` on ``recorder``. Other terms of the
    recorder run at every environment step for every world (they are not told which worlds'
    NEXT_STEP steps are resets).

    Call ``close()`` at the end: it closes the recorder (publishing ``RunEnd``, which tells the
    storage daemon the run is complete) and then the environment. Episodes in progress then are
    not ended (they are incomplete: neither a success nor a failure).

    Args:
        env: A ``gymnasium.vector.VectorEnv`` with ``num_envs == recorder.num_worlds``.
        recorder: The run's recorder.
        info_keys: Info keys to record (numeric arrays only), or a mapping key -> ``(dtype,
            per-world shape)`` for keys that may be absent from the first step's info.
        success_fn: Success of each ended episode (default :func:`default_success`).
        on_reset: Callbacks called with the worlds whose new episode starts (see the module).
        step_fields: Called after every environment step (before any episode ends there);
            returns name -> array or tensor of every world (nested mappings flatten with
            ``/``), recorded in the ``step`` rows of the worlds that took a transition. Record
            per-step simulator state this way rather than with a term of its own: a term's
            ``post_step`` sees every world, including NEXT_STEP reset steps.

    Raises:
        ValueError: ``env.num_envs`` differs from ``recorder.num_worlds``, or an info key is
            empty.
        TypeError: ``env`` is not a gymnasium vector environment.
    """

    def __init__(
        self,
        env: Any,
        recorder: Recorder,
        *,
        info_keys: Iterable[str] | Mapping[str, InfoSpec] = (),
        success_fn: SuccessFn | None = None,
        on_reset: Iterable[OnReset] = (),
        step_fields: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        try:
            import gymnasium
        except ImportError as exc:
            raise ImportError("RecordingVectorEnv needs gymnasium 1.x: pip install 'worldtap[demo]' "
                              "(or gymnasium>=1.0)") from exc
        if not isinstance(env, gymnasium.vector.VectorEnv):
            raise TypeError(f"env: expected a gymnasium.vector.VectorEnv, got {type(env).__name__}")
        if env.num_envs != recorder.num_worlds:
            raise ValueError(f"env: expected num_envs == recorder.num_worlds == {recorder.num_worlds}, "
                             f"got {env.num_envs}")
        mode = env.metadata.get("autoreset_mode", gymnasium.vector.AutoresetMode.NEXT_STEP)
        self._mode = gymnasium.vector.AutoresetMode(mode)
        self._modes = gymnasium.vector.AutoresetMode
        self.env = env
        self.recorder = recorder
        self.success_fn: SuccessFn = default_success if success_fn is None else success_fn
        self.on_reset: list[OnReset] = list(on_reset)
        self.step_fields = step_fields
        self._info_specs: dict[str, tuple[torch.dtype, tuple[int, ...]] | None] = {}
        keys = info_keys.items() if isinstance(info_keys, Mapping) else ((k, None) for k in info_keys)
        for key, spec in keys:
            if not isinstance(key, str) or not key or "/" in key:
                raise ValueError(f"info_keys: expected non-empty str keys without '/', got {key!r}")
            self._info_specs[key] = None if spec is None else (
                torch.from_numpy(np.zeros(0, dtype=spec[0])).dtype, tuple(int(d) for d in spec[1]))
        n = env.num_envs
        self.num_envs: int = n
        self._device = recorder.device
        self._open = np.zeros(n, np.bool_)     # an episode with its reset row is in progress
        self._pending = np.zeros(n, np.bool_)  # ended and drawn; its reset row comes next step
        self._return = torch.zeros(n, dtype=torch.float64, device=self._device)
        self._last: tuple[Any, Any, Mapping[str, Any]] = (np.zeros(n, np.bool_), np.zeros(n, np.bool_), {})
        self._stale = np.ones(n, np.bool_)  # reset since the last step: ``_last`` is not theirs
        self._reset_rows: dict[str, torch.Tensor] = {}
        self._step_rows: dict[str, torch.Tensor] | None = None
        self._closed = False
        recorder.add_term(RESET_TERM, FunctionTerm(post_reset=self._reset_hook))
        recorder.add_term(STEP_TERM, FunctionTerm(post_step=lambda: self._step_rows))

    @property
    def autoreset_mode(self) -> Any:
        """The environment's ``gymnasium.vector.AutoresetMode``."""
        return self._mode

    def __getattr__(self, name: str) -> Any:
        env = self.__dict__.get("env")
        if env is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(env, name)

    # -- the environment's API, recorded ---------------------------------------------------

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """Reset the environment (the worlds of ``options["reset_mask"]``, else all).

        The episodes in progress of the reset worlds end first, then ``on_reset`` runs for the
        worlds whose new episode had no draw yet, then the environment resets and the returned
        observations of the reset worlds are recorded as their new episodes' ``reset`` rows.
        """
        self._ensure_open()
        n = self.num_envs
        if options is not None and "reset_mask" in options:
            mask = _to_numpy_bool(options["reset_mask"], n, "options['reset_mask']").copy()
        else:
            mask = np.ones(n, np.bool_)
        ending = mask & self._open
        if ending.any():
            self._end(ending, *self._last, valid=~self._stale)
        drawing = mask & ~self._pending
        if drawing.any():
            self._draw(drawing)
        obs, info = self.env.reset(seed=seed, options=options)
        self._record_resets(obs, mask)
        self._stale |= mask
        return obs, info

    def step(self, actions: Any) -> tuple[Any, Any, Any, Any, Any]:
        """Step the environment and record the transitions of the worlds that took one, then
        end the episodes that ended (see the module for each autoreset mode)."""
        self._ensure_open()
        rec, mode, n = self.recorder, self._mode, self.num_envs
        rec.record_pre_step()
        obs, reward, terminated, truncated, info = self.env.step(actions)
        term = _to_numpy_bool(terminated, n, "terminated")
        trunc = _to_numpy_bool(truncated, n, "truncated")
        done = term | trunc
        resetting = self._pending.copy() if mode == self._modes.NEXT_STEP else np.zeros(n, np.bool_)
        same_step = mode == self._modes.SAME_STEP
        step_info = info.get("final_info", {}) if same_step and done.any() else info
        if resetting.any():  # their NEXT_STEP reset happened inside this step
            self._record_resets(obs, resetting)
        fields = self._transition(actions, reward, terminated, truncated, obs, info,
                                  done if same_step else None)
        active = ~resetting
        self._step_rows = fields
        try:  # worlds reset inside this step did not step in an episode: their rows are left out
            rec.record_post_step(None if active.all() else self._idx(active))
        finally:
            self._step_rows = None
        reward64 = fields["reward"].to(torch.float64)
        if active.all():
            self._return += reward64
        else:
            idx = self._idx(active)
            self._return.index_add_(0, idx, reward64.index_select(0, idx))
        ended = done & active
        if ended.any() and mode != self._modes.DISABLED:
            self._end(ended, terminated, truncated, step_info)
            self._draw(ended)
            if same_step:
                self._record_resets(obs, ended)
            else:
                self._pending |= ended
        self._last = (terminated, truncated, step_info)
        self._stale = (resetting | ended) if same_step else resetting
        return obs, reward, terminated, truncated, info

    def close(self, **kwargs: Any) -> None:
        """Close the recorder (``RunEnd``), then the environment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.recorder.close()
        finally:
            self.env.close(**kwargs)

    def __enter__(self) -> RecordingVectorEnv:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RecordingVectorEnv({self.env!r}, run={self.recorder.run!r}, mode={self._mode.name})"

    # -- internals -------------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise CaptureError(f"RecordingVectorEnv of run {self.recorder.run!r} is closed")

    def _idx(self, mask: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.flatnonzero(mask)).to(self._device)

    def _tensors(self, value: Any, prefix: str) -> dict[str, torch.Tensor]:
        return {name: _as_tensor(v, self._device, name) for name, v in _flatten(value, prefix).items()}

    def _reset_hook(self, worlds: torch.Tensor) -> dict[str, torch.Tensor]:
        if worlds.numel() == self.num_envs:  # every world, in order: no gather
            return self._reset_rows
        return {name: t.index_select(0, worlds) for name, t in self._reset_rows.items()}

    def _record_resets(self, obs: Any, mask: np.ndarray) -> None:
        """Record ``obs`` of the worlds in ``mask`` as their new episodes' ``reset`` rows."""
        self._reset_rows = self._tensors(obs, "obs")
        try:
            self.recorder.record_post_reset(self._idx(mask))
        finally:
            self._reset_rows = {}
        self._open |= mask
        self._pending &= ~mask

    def _draw(self, mask: np.ndarray) -> None:
        idx = self._idx(mask)
        for callback in self.on_reset:
            callback(idx)

    def _end(self, mask: np.ndarray, terminated: Any, truncated: Any, info: Mapping[str, Any],
             valid: np.ndarray | None = None) -> None:
        """End the episodes of the worlds in ``mask`` with the flags and info of their last step;
        worlds not in ``valid`` have not stepped in this episode: neither flag, no success."""
        n, idx = self.num_envs, self._idx(mask)
        keep = np.ones(n, np.bool_) if valid is None else valid
        values = [_to_numpy_bool(self.success_fn(terminated, truncated, info), n,
                                 "success_fn(terminated, truncated, info)"),
                  _to_numpy_bool(terminated, n, "terminated"), _to_numpy_bool(truncated, n, "truncated")]
        success, term, trunc = (torch.from_numpy((v & keep)[mask]).to(self._device) for v in values)
        self.recorder.record_pre_reset(
            idx, success=success, terminated=term, truncated=trunc,
            outcomes={"return": self._return.index_select(0, idx)},
        )
        self._return.index_fill_(0, idx, 0.0)
        self._open &= ~mask

    def _transition(self, actions: Any, reward: Any, terminated: Any, truncated: Any, obs: Any,
                    info: Mapping[str, Any], final: np.ndarray | None) -> dict[str, torch.Tensor]:
        """The ``step`` row of every world; ``final``: SAME_STEP worlds whose ``next_obs`` and
        info come from ``info["final_obs"]`` / ``info["final_info"]``."""
        dev = self._device
        fields = self._tensors(actions, "action")
        fields["reward"] = _as_tensor(reward, dev, "reward")
        fields["terminated"] = _as_tensor(terminated, dev, "terminated")
        fields["truncated"] = _as_tensor(truncated, dev, "truncated")
        next_obs = self._tensors(obs, "next_obs")
        if final is not None and final.any():
            next_obs = {name: t.clone() for name, t in next_obs.items()}
            final_obs = info["final_obs"]
            for w in np.flatnonzero(final).tolist():
                for name, v in _flatten(final_obs[w], "next_obs").items():
                    next_obs[name][w] = _as_tensor(v, dev, name)
        fields.update(next_obs)
        final_info = info.get("final_info", {}) if final is not None and final.any() else None
        for key in self._info_specs:
            if final_info is not None and key not in info and key in final_info:
                # every world that reported it reset in this step: its spec comes from the final rows
                f_value, f_mask = self._info(final_info, key)
                value, mask = self._info(info, key)
            else:
                value, mask = self._info(info, key)
                if final_info is not None:
                    f_value, f_mask = self._info(final_info, key)
            if final is not None and final_info is not None:
                pick = torch.from_numpy(final).to(dev)
                value = torch.where(pick.view(-1, *([1] * (value.dim() - 1))), f_value, value)
                mask = torch.where(pick, f_mask, mask)
            fields[f"info/{key}"], fields[f"info/_{key}"] = value, mask
        if self.step_fields is not None:
            extra = self.step_fields()
            if not isinstance(extra, Mapping):
                raise TypeError(f"step_fields(): expected a mapping of name -> array, got {type(extra).__name__}")
            for key, value in extra.items():
                for name, leaf in _flatten(value, key).items():
                    if name in fields or not isinstance(key, str) or not key or "/" in key:
                        raise ValueError(f"step_fields(): field {name!r} is empty, contains '/' or names a "
                                         f"field the wrapper records ({sorted(fields)})")
                    fields[name] = _as_tensor(leaf, dev, f"step_fields() field {name!r}")
        return fields

    def _info(self, info: Mapping[str, Any], key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Value and mask of info ``key`` for every world (zeros and False when absent)."""
        n, dev, what = self.num_envs, self._device, f"info[{key!r}]"
        spec = self._info_specs[key]
        if key not in info:
            if spec is None:
                raise ValueError(f"info_keys: key {key!r} is absent from the first step's info; give its "
                                 f"dtype and per-world shape, e.g. info_keys={{{key!r}: (np.float32, ())}}")
            return (torch.zeros((n, *spec[1]), dtype=spec[0], device=dev),
                    torch.zeros(n, dtype=torch.bool, device=dev))
        value = _as_tensor(info[key], dev, what)
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(f"{what}: expected a leading dimension of num_envs={n}, got shape {tuple(value.shape)}")
        if spec is None:
            self._info_specs[key] = (value.dtype, tuple(value.shape[1:]))
        mask_value = info.get(f"_{key}")
        if mask_value is None:
            mask = torch.ones(n, dtype=torch.bool, device=dev)
        else:
            mask = _as_tensor(_to_numpy_bool(mask_value, n, f"info[{'_' + key!r}]"), dev, what)
        return value, mask
