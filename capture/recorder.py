"""The Recorder: runs terms at lifecycle points and publishes their batches to a broker."""

from __future__ import annotations

import copy
import itertools
import numbers
import time
import uuid
from collections.abc import Callable, Mapping
from types import MappingProxyType, TracebackType
from typing import Any, NamedTuple

import numpy as np
import torch

from broker import (
    Batch,
    Broker,
    EpisodeEnd,
    FieldSpec,
    Message,
    RunEnd,
    RunStart,
    TopicSchema,
    batch_topic,
)
from broker import SchemaError as BrokerSchemaError
from broker.messages import RESERVED_OUTCOMES, Hook

from .errors import RecorderClosedError, SchemaError, TermError
from .selectors import CHECK_MODES, CheckMode, WorldsCheck, WorldSelector, normalize_worlds
from .terms import HOOKS, ISAACLAB_PREFIX, flatten_fields, pair_fields

__all__ = ["Recorder"]

_NUMERIC = frozenset({
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
})


class _Call(NamedTuple):
    """One term's hook at one lifecycle point."""

    topic: str
    term: str
    fn: Callable[..., Any]
    isaaclab: bool
    """The hook follows Isaac Lab's protocol: it returns ``(key, value)`` and reset hooks take
    ``env_ids`` as a list of ints."""


class Recorder:
    """Runs recorder terms at the simulation's lifecycle points and publishes what they return.

    Call ``record_pre_step()`` / ``record_post_step()`` around every step,
    ``record_post_physics_decimation_step()`` after each physics step inside one (if any term
    records there), and ``record_pre_reset(worlds, ...)`` / ``record_post_reset(worlds)`` around
    every reset. Each term hook's mapping is published as one :class:`broker.Batch` on
    ``batch/<term name>`` (an Isaac Lab term's ``(key, value)`` on ``batch/<term name>/<hook>``,
    see :class:`capture.Term`); the tensors are passed through uncopied (borrowed by the
    consumers for the call).

    Episodes: every world has a running episode index kept on ``device``. ``record_pre_reset``
    publishes an :class:`broker.EpisodeEnd` for those worlds and advances their index; batches
    and variation samples recorded afterwards for those worlds belong to the new episode.

    Schema: each topic's :class:`broker.TopicSchema` (field names, dtypes, per-world shapes) is
    fixed by its first batch; every later batch is checked against it by field name, never by
    the order of the term's mapping, and one that differs raises :class:`SchemaError` (also a
    :class:`broker.SchemaError`, the type retention and the storage daemon raise) naming the
    field. Nothing of the refused batch is published.

    Call ``close()`` at the end of a run: it publishes :class:`broker.RunEnd`, which tells the
    storage daemon the run is complete.

    Variations: ``declare_variation`` (called by ``VariationRecorder.attach``) registers each
    variation's declaration; ``RunStart`` carries those declared before it, and ``RunEnd``
    repeats every declaration of the run, so one declared after the run started (an attach
    after the first record call) travels in ``RunEnd`` only; the storage keeps ``RunEnd``'s.
    Both messages carry the run ``seed`` (the variations' default seeds derive from it) and
    their wall-clock time (``time.time()``).

    Args:
        num_worlds: Number of parallel worlds.
        device: Device of the simulator's tensors.
        broker: Where to publish; a private strict-less broker is created when omitted.
        run: Run id; a random hex id when omitted.
        metadata: User metadata for ``RunStart`` (msgpack-able values only if sent over ZeroMQ).
        seed: The run seed, in ``[0, 2**64)``, recorded with the run; variations without a
            seed of their own derive theirs from it and their key.
        worlds_check: How world index tensors given to the record calls are checked (see
            :mod:`capture.selectors`): ``"auto"`` (default: on the device, without a sync,
            for index tensors on a CUDA device; on the host otherwise), ``"host"`` (reported
            at the call; a device sync per call on CUDA), ``"device"`` (reported at a later
            call or at :meth:`check_worlds`/:meth:`close`), ``"trusted"`` (no check).
    """

    def __init__(
        self,
        num_worlds: int,
        device: torch.device | str = "cpu",
        broker: Broker | None = None,
        *,
        run: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        seed: int = 0,
        worlds_check: CheckMode = "auto",
    ) -> None:
        if isinstance(num_worlds, bool) or not isinstance(num_worlds, int) or num_worlds <= 0:
            raise ValueError(f"num_worlds: expected a positive int, got {num_worlds!r}")
        if worlds_check not in CHECK_MODES:
            raise ValueError(f"worlds_check: expected one of {', '.join(CHECK_MODES)}, got {worlds_check!r}")
        self.worlds_check: CheckMode = worlds_check
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), got {seed!r}")
        self.seed = seed
        self.num_worlds = num_worlds
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.broker = broker if broker is not None else Broker()
        self.run = run if run is not None else uuid.uuid4().hex[:16]
        self.metadata: Mapping[str, Any] = MappingProxyType(dict(metadata or {}))
        self._terms: dict[str, object] = {}
        self._hooks: dict[str, list[_Call]] = {hook: [] for hook in HOOKS}
        self._topics: set[str] = set()
        self._batches = 0
        self._schemas: dict[str, TopicSchema] = {}
        self._variations: dict[str, dict[str, Any]] = {}
        self._all = torch.arange(num_worlds, device=self.device, dtype=torch.int64)
        self._episode = torch.zeros(num_worlds, device=self.device, dtype=torch.int64)
        self._length = torch.zeros(num_worlds, device=self.device, dtype=torch.int64)
        self._false = torch.zeros(num_worlds, device=self.device, dtype=torch.bool)
        on_device = worlds_check == "device" or (worlds_check == "auto" and self.device.type == "cuda")
        self._device_check = WorldsCheck(num_worlds, self.device) if on_device else None
        self._seq = itertools.count()
        self._step = 0
        self._started = False
        self._closed = False

    # -- configuration -------------------------------------------------------------------

    @classmethod
    def from_env(
        cls,
        env: object,
        broker: Broker | None = None,
        *,
        run: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        seed: int = 0,
    ) -> Recorder:
        """A recorder for the worlds of ``env``: ``num_worlds`` is ``env.num_envs`` and
        ``device`` is ``env.device`` (read from ``env.unwrapped`` when a wrapper lacks them), or
        ``"cpu"`` when the environment has no device (gymnasium vector environments). Isaac
        Lab's environments have both. The other arguments are :class:`Recorder`'s.

        Raises:
            TypeError: ``env`` has no ``num_envs``.
            ValueError: ``num_envs`` is not a positive int (or an argument is invalid).
        """
        num_envs = _env_attribute(env, "num_envs")
        if num_envs is None:
            raise TypeError(f"env: expected an environment with num_envs (an Isaac Lab or gymnasium "
                            f"vector environment), got {type(env).__name__}")
        device = _env_attribute(env, "device")
        return cls(num_envs, "cpu" if device is None else device, broker, run=run, metadata=metadata,
                   seed=seed)

    def add_term(self, name: str, term: object) -> None:
        """Register ``term`` under ``name``: a worldtap term (see :class:`capture.Term`), whose
        batches go to topic ``batch/<name>``, or an Isaac Lab recorder term (hooks
        ``record_<point>``), whose batches go to ``batch/<name>/<point>``, one topic per hook.

        Raises:
            ValueError: ``name`` is empty, contains whitespace (or ``/`` for an Isaac Lab
                term), is already registered, or one of its topics is already taken.
            TypeError: ``term`` has none of the hooks, or hooks of both protocols.
        """
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise ValueError(f"name: expected a non-empty term name without whitespace, got {name!r}")
        if name in self._terms:
            raise ValueError(f"name: a term named {name!r} is already registered")
        native = [hook for hook in HOOKS if callable(getattr(term, hook, None))]
        isaaclab = [hook for hook in HOOKS if callable(getattr(term, ISAACLAB_PREFIX + hook, None))]
        if native and isaaclab:
            raise TypeError(f"term {name!r}: expected the hooks of one protocol, got worldtap's "
                            f"{', '.join(native)} and Isaac Lab's "
                            f"{', '.join(ISAACLAB_PREFIX + h for h in isaaclab)}")
        if not native and not isaaclab:
            raise TypeError(f"term {name!r}: expected at least one of the hooks {', '.join(HOOKS)} "
                            f"(or Isaac Lab's {ISAACLAB_PREFIX}<hook>)")
        if isaaclab and "/" in name:
            raise ValueError(f"name: an Isaac Lab term's name may not contain '/', got {name!r}")
        calls = {hook: _Call(batch_topic(f"{name}/{hook}"), name, getattr(term, ISAACLAB_PREFIX + hook), True)
                 for hook in isaaclab}
        calls.update({hook: _Call(batch_topic(name), name, getattr(term, hook), False) for hook in native})
        taken = sorted({call.topic for call in calls.values()} & self._topics)
        if taken:
            raise ValueError(f"name: term {name!r} would publish on {taken[0]!r}, another term's topic")
        self._terms[name] = term
        for hook, call in calls.items():
            self._hooks[hook].append(call)
            self._topics.add(call.topic)

    @property
    def terms(self) -> Mapping[str, object]:
        return MappingProxyType(self._terms)

    def declare_variation(self, key: str, declaration: Mapping[str, Any]) -> None:
        """Register the declaration of variation ``key`` (sampler kind, phase, shape, seed,
        bounds or labels; a msgpack-able mapping), replacing an earlier one of that key.

        It travels in ``RunStart`` if the run has not started yet, and in ``RunEnd`` always
        (the last declaration of each key).

        Raises:
            ValueError: ``key`` is empty or contains whitespace, or ``declaration`` is not a
                mapping with str keys.
            RecorderClosedError: The recorder is closed.
        """
        self._ensure_open()
        if not isinstance(key, str) or not key or any(c.isspace() for c in key):
            raise ValueError(f"key: expected a non-empty variation key without whitespace, got {key!r}")
        if not isinstance(declaration, Mapping) or not all(isinstance(k, str) for k in declaration):
            raise ValueError(
                f"declaration of {key!r}: expected a mapping with str keys, got {declaration!r}"
            )
        self._variations[key] = copy.deepcopy(dict(declaration))

    @property
    def variations(self) -> dict[str, dict[str, Any]]:
        """Variation key -> declaration, for every declaration so far (a deep copy)."""
        return copy.deepcopy(self._variations)

    # -- state ---------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Global step counter: number of ``record_post_step`` calls so far."""
        return self._step

    @property
    def batch_count(self) -> int:
        """Number of batches published so far (a record call that published nothing leaves it
        as it was)."""
        return self._batches

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def episode_index(self) -> torch.Tensor:
        """A copy of every world's current episode index (int64, on ``device``)."""
        return self._episode.clone()

    @property
    def episode_length(self) -> torch.Tensor:
        """A copy of every world's current episode length in steps (int64, on ``device``)."""
        return self._length.clone()

    def episodes_of(self, worlds: torch.Tensor) -> torch.Tensor:
        """The current episode index of each world in the normalized index tensor ``worlds``."""
        return self._episode.index_select(0, worlds)

    def lengths_of(self, worlds: torch.Tensor) -> torch.Tensor:
        """The current episode length (steps) of each world in the normalized index tensor
        ``worlds``."""
        return self._length.index_select(0, worlds)

    def select(self, worlds: WorldSelector, *, name: str = "worlds") -> torch.Tensor:
        """Normalize a world selector (see :mod:`capture.selectors`) on this recorder's device."""
        deferred = self._device_check is not None and isinstance(worlds, torch.Tensor)
        return normalize_worlds(worlds, self.num_worlds, self.device, name=name, all_worlds=self._all,
                                check=self.worlds_check, device_check=self._device_check,
                                what=f"{name} of a record call at step {self._step} of run {self.run!r}"
                                if deferred else None)

    def _defer_check(self, verdict: torch.Tensor, explain: Callable[[int], Exception]) -> bool:
        """Queue ``verdict`` (0-dim, 0 for sound) with the device-checked selectors, read back
        without a sync (see :meth:`capture.WorldsCheck.defer`); ``False`` (nothing queued)
        when this recorder checks on the host, and the caller checks at once."""
        if self._device_check is None or self.device.type != "cuda":
            return False
        self._device_check.defer(verdict, explain)
        return True

    def check_worlds(self) -> None:
        """Wait for the world index tensors checked on the device so far (``worlds_check``
        ``"device"``, or ``"auto"`` on CUDA) and raise for the first bad one; a no-op when
        they are checked on the host.

        Raises:
            SelectorError: An index tensor given earlier held an index out of range or a
                duplicate.
        """
        if self._device_check is not None:
            self._device_check.wait()

    def schema(self) -> dict[str, dict[str, FieldSpec]]:
        """Topic -> field -> spec, for every topic that has published a batch (fields in each
        :class:`broker.TopicSchema`'s canonical order, sorted by name). A fresh copy."""
        return {topic: dict(schema.fields) for topic, schema in self._schemas.items()}

    def next_seq(self) -> int:
        """Reserve the next publisher sequence number (for components publishing for this run)."""
        return next(self._seq)

    def publish(self, message: Message) -> None:
        """Publish a message of this run (starting the run first if needed)."""
        self._ensure_open()
        if not self._started:
            self.start()
        self.broker.publish(message)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Publish ``RunStart``. Called implicitly by the first record call. Idempotent."""
        self._ensure_open()
        if self._started:
            return
        self._started = True
        self.broker.publish(
            RunStart(self.run, self.next_seq(), self._step, self.num_worlds, str(self.device),
                     self.schema(), self.metadata, variations=self.variations, seed=self.seed,
                     wall_time=time.time())
        )

    def record_pre_step(self) -> None:
        """Run every term's ``pre_step`` hook and publish the results."""
        self._run_hook("pre_step", None)

    def record_post_step(self, worlds: WorldSelector = None) -> None:
        """Run every term's ``post_step`` hook, publish the results, then advance the step.

        Args:
            worlds: The worlds that took this step (default: all). Only their rows of each
                term's batch are published and only their episode lengths advance; the others
                did not step in an episode (a vectorized environment that resets a world
                inside a step, gymnasium's ``NEXT_STEP`` autoreset, is the common case). The
                hooks still return every world's rows.
        """
        if worlds is None:
            self._run_hook("post_step", None)
            self._length.add_(1)
        else:
            idx = self.select(worlds)
            self._ensure_open()
            if idx.numel():
                self._run_hook("post_step", None, rows=idx)
                self._length.index_add_(0, idx, torch.ones_like(idx))
        self._step += 1

    def record_post_physics_decimation_step(self) -> None:
        """Run every term's ``post_physics_decimation_step`` hook and publish the results: call
        it after each physics step inside an environment step (Isaac Lab's decimation loop).
        Neither the step counter nor the episode lengths advance; its rows carry the step they
        happen in."""
        self._run_hook("post_physics_decimation_step", None)

    def record_pre_reset(
        self,
        worlds: WorldSelector = None,
        *,
        success: torch.Tensor | bool | None = None,
        terminated: torch.Tensor | bool | None = None,
        truncated: torch.Tensor | bool | None = None,
        outcomes: Mapping[str, object] | None = None,
        end: bool = True,
    ) -> torch.Tensor:
        """End the current episode of ``worlds``.

        Runs the ``pre_reset`` hooks (their batches belong to the ending episode), publishes
        ``EpisodeEnd`` with the flags, then advances those worlds' episode index (see
        :meth:`end_episodes` for the flags and ``outcomes``). The flags are keyword-only:
        ``record_pre_reset(worlds, True)`` is a ``TypeError``, never a silent success.

        Args:
            end: ``False``: only run the ``pre_reset`` hooks; the episode goes on (later rows
                still belong to it) until :meth:`end_episodes`, and no flag may be given.

        Returns:
            The normalized world index tensor (empty selections record nothing).

        Raises:
            ValueError: A flag or an outcome has the wrong type, dtype or length, an outcome's
                name is invalid, or flags come with ``end=False``; the episode does not end then.
        """
        idx = self.select(worlds)
        self._ensure_open()
        if not end:
            given = [n for n, v in (("success", success), ("terminated", terminated),
                                    ("truncated", truncated), ("outcomes", outcomes)) if v is not None]
            if given:
                raise ValueError(f"{given[0]}: flags and outcomes end an episode; with end=False pass "
                                 f"them to end_episodes")
        if idx.numel() == 0:
            return idx
        if not end:
            self._run_hook("pre_reset", idx)
            return idx
        flags, extra = self._end_values(idx, success, terminated, truncated, outcomes)
        self._run_hook("pre_reset", idx)
        self._publish_end(idx, flags, extra)
        return idx

    def end_episodes(
        self,
        worlds: WorldSelector = None,
        *,
        success: torch.Tensor | bool | None = None,
        terminated: torch.Tensor | bool | None = None,
        truncated: torch.Tensor | bool | None = None,
        outcomes: Mapping[str, object] | None = None,
    ) -> torch.Tensor:
        """End the current episode of ``worlds`` without running any hook: publish
        ``EpisodeEnd`` with the flags, then advance those worlds' episode index; what is
        recorded after it for those worlds belongs to the next episode.

        Flags are a bool, or a bool tensor of length ``len(worlds)`` (one flag per selected
        world, in the selector's order) or ``num_worlds`` (indexed by world); ``None`` is False.
        When every world is selected the two lengths agree and the flags are read in the
        selector's order.

        ``outcomes`` maps a name (non-empty, no ``/`` or whitespace, not one of
        :data:`broker.messages.RESERVED_OUTCOMES`, which receivers reject) to extra numeric episode
        outcomes (e.g. ``{"return": returns}``): a number for every selected world, or a 1-D
        numeric (bool, integer or float) tensor, numpy array or sequence of length
        ``len(worlds)`` or ``num_worlds``, read like the flags. They are published in
        ``EpisodeEnd.outcomes`` as new float64 tensors on the recorder's device. On a CUDA
        recorder, pass flags and outcomes as tensors on its device: host values are copied
        there from pageable memory, a copy that waits for the work queued on the current stream.

        Returns:
            The normalized world index tensor (empty selections end nothing).

        Raises:
            ValueError: A flag or an outcome has the wrong type, dtype or length, or an
                outcome's name is invalid; the episode does not end then.
        """
        idx = self.select(worlds)
        self._ensure_open()
        if idx.numel() == 0:
            return idx
        flags, extra = self._end_values(idx, success, terminated, truncated, outcomes)
        self._publish_end(idx, flags, extra)
        return idx

    def record_post_reset(self, worlds: WorldSelector = None) -> torch.Tensor:
        """Run the ``post_reset`` hooks for ``worlds`` (recorded into their new episode)."""
        idx = self.select(worlds)
        if idx.numel():
            self._run_hook("post_reset", idx)
        return idx

    def close(self, *, interrupted: bool = False) -> None:
        """Publish ``RunEnd`` (with the schema of every topic seen) and stop recording.
        Idempotent. The broker is not closed: it belongs to whoever passed it in.

        Args:
            interrupted: The run stopped before it was meant to (Ctrl-C, an error): the store
                marks it ``interrupted`` rather than ``complete``. Leaving a ``with`` block on an
                exception closes it so.
        """
        if self._closed:
            return
        if not isinstance(interrupted, bool):
            raise TypeError(f"interrupted: expected a bool, got {interrupted!r}")
        if not self._started:
            self.start()
        self.broker.publish(
            RunEnd(self.run, self.next_seq(), self._step, self.num_worlds, str(self.device),
                   self.schema(), self.metadata, variations=self.variations, seed=self.seed,
                   wall_time=time.time(), interrupted=interrupted)
        )
        self._closed = True
        if not interrupted:  # a bad index tensor checked on the device is reported at the latest here
            self.check_worlds()

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(interrupted=exc_type is not None)

    # -- internals -----------------------------------------------------------------------

    def _ensure_open(self) -> None:
        if self._closed:
            raise RecorderClosedError(f"recorder of run {self.run!r} is closed")

    def _end_values(
        self, idx: torch.Tensor, success: torch.Tensor | bool | None, terminated: torch.Tensor | bool | None,
        truncated: torch.Tensor | bool | None, outcomes: Mapping[str, object] | None,
    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The checked flags and outcomes of an ``EpisodeEnd`` for ``idx`` (checked before any
        hook runs, so a bad one records nothing)."""
        flags = [self._flag(v, idx, n) for v, n in ((success, "success"), (terminated, "terminated"),
                                                     (truncated, "truncated"))]
        return flags, self._outcomes(outcomes, idx)

    def _publish_end(self, idx: torch.Tensor, flags: list[torch.Tensor], extra: dict[str, torch.Tensor]) -> None:
        """Publish ``EpisodeEnd`` for ``idx`` and advance their episode index."""
        if not self._started:
            self.start()
        episodes = self._episode.index_select(0, idx)
        self.broker.publish(
            EpisodeEnd(self.run, self.next_seq(), self._step, idx, episodes, flags[0], flags[1],
                       flags[2], self._length.index_select(0, idx), outcomes=extra)
        )
        self._episode.index_add_(0, idx, torch.ones_like(idx))
        self._length.index_fill_(0, idx, 0)

    def _flag(self, value: torch.Tensor | bool | None, idx: torch.Tensor, name: str) -> torch.Tensor:
        n = idx.numel()
        if value is None or value is False:
            return self._false[:n]
        if value is True:
            return torch.ones(n, device=self.device, dtype=torch.bool)
        if not isinstance(value, torch.Tensor):
            value = torch.as_tensor(value)
        if value.dtype != torch.bool or value.dim() != 1 or value.shape[0] not in (n, self.num_worlds):
            raise ValueError(
                f"{name}: expected a bool, or a bool tensor of shape ({n},) or ({self.num_worlds},), "
                f"got dtype {value.dtype} shape {tuple(value.shape)}"
            )
        value = value.to(self.device)
        if value.shape[0] == self.num_worlds and n != self.num_worlds:
            value = value.index_select(0, idx)
        return value.clone()

    def _outcomes(self, outcomes: Mapping[str, object] | None, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        if outcomes is None:
            return {}
        if not isinstance(outcomes, Mapping):
            raise ValueError(f"outcomes: expected a mapping of name -> values, got {outcomes!r}")
        return {self._outcome_name(name): self._outcome(name, value, idx)
                for name, value in outcomes.items()}

    @staticmethod
    def _outcome_name(name: object) -> str:
        if not isinstance(name, str) or not name or "/" in name or any(c.isspace() for c in name):
            raise ValueError(
                f"outcomes: expected names that are non-empty strings without '/' or whitespace, "
                f"got {name!r}"
            )
        if name in RESERVED_OUTCOMES:  # the episode tables' own columns: receivers reject it
            raise ValueError(f"outcomes: {name!r} is reserved for a column episode tables hold already "
                             f"(reserved: {', '.join(sorted(RESERVED_OUTCOMES))}); choose another name")
        return name

    def _outcome(self, name: str, value: object, idx: torch.Tensor) -> torch.Tensor:
        n = idx.numel()
        expected = (f"outcomes[{name!r}]: expected a number, or a 1-D numeric tensor or array of "
                    f"length {n} or {self.num_worlds}")
        if isinstance(value, numbers.Real):  # bool, int, float, numpy scalars
            return torch.full((n,), float(value), dtype=torch.float64, device=self.device)
        if not isinstance(value, torch.Tensor):
            try:
                array = np.asarray(value)  # arrays and sequences; strings and objects fail below
            except (TypeError, ValueError) as exc:  # ragged sequences
                raise ValueError(f"{expected}, got {value!r}") from exc
            if array.dtype.kind not in "biuf":
                raise ValueError(f"{expected}, got {type(value).__name__} of dtype {array.dtype}")
            value = torch.from_numpy(np.array(array, dtype=np.float64))
        if value.dtype not in _NUMERIC:
            raise ValueError(f"{expected}, got a tensor of dtype {value.dtype}")
        if value.dim() == 0:
            return torch.full((n,), float(value), dtype=torch.float64, device=self.device)
        if value.dim() != 1 or value.shape[0] not in (n, self.num_worlds):
            raise ValueError(f"{expected}, got shape {tuple(value.shape)}")
        value = value.detach().to(device=self.device, dtype=torch.float64, copy=True)
        if value.shape[0] == self.num_worlds and n != self.num_worlds:
            value = value.index_select(0, idx)
        return value

    def _run_hook(self, hook: Hook, idx: torch.Tensor | None, *, rows: torch.Tensor | None = None) -> None:
        """Run ``hook`` of every term (called with ``idx`` for reset hooks; an Isaac Lab term
        with ``idx`` as a list of ints) and publish each batch; ``rows``: publish only these
        worlds' rows of the (every-world) batches."""
        calls = self._hooks[hook]
        if not calls:
            return
        self._ensure_open()
        if not self._started:
            self.start()
        worlds = self._all if idx is None else idx
        n = worlds.shape[0]
        env_ids: list[int] | None = None
        episodes: torch.Tensor | None = None
        for call in calls:
            if call.isaaclab:
                if idx is not None and env_ids is None:
                    env_ids = idx.tolist()  # what Isaac Lab's manager hands its terms
                out = call.fn() if idx is None else call.fn(env_ids)
                fields = pair_fields(out, call.term, hook)
                if fields is None:
                    continue
                # Isaac Lab's manager pairs row i with the i-th world and ignores extra rows.
                fields = {f: t[:n] if t.dim() and t.shape[0] > n else t for f, t in fields.items()}
            else:
                out = call.fn() if idx is None else call.fn(idx)
                if out is None:
                    continue
                fields = flatten_fields(out, call.term)
            if not fields:
                continue
            self._check(call.topic, fields, n)
            if rows is not None:
                fields = {f: t.index_select(0, rows) for f, t in fields.items()}
            if episodes is None:
                at = idx if rows is None else rows
                episodes = self._episode if at is None else self._episode.index_select(0, at)
            self.broker.publish(Batch(self.run, self.next_seq(), self._step, call.topic,
                                      worlds if rows is None else rows, episodes, fields, hook))
            self._batches += 1

    def _check(self, topic: str, fields: dict[str, torch.Tensor], n: int) -> None:
        """Check a term's batch: leading worlds dimension and device (:class:`TermError`), then
        the topic's schema by name (fixed by the first batch; :class:`SchemaError`)."""
        for f, t in fields.items():
            self._check_leading(topic, f, t, n)
        try:
            schema = self._schemas.get(topic)
            if schema is None:
                self._schemas[topic] = TopicSchema.of(fields, topic=topic)
            else:
                schema.check(fields, topic=topic)
        except BrokerSchemaError as exc:
            raise SchemaError(str(exc)) from exc

    def _check_leading(self, topic: str, f: str, t: torch.Tensor, n: int) -> None:
        if t.dim() == 0 or t.shape[0] != n:
            raise TermError(
                f"topic {topic!r} field {f!r}: expected a leading worlds dimension of {n}, "
                f"got shape {tuple(t.shape)}"
            )
        if t.device != self.device:
            raise TermError(
                f"topic {topic!r} field {f!r}: expected a tensor on {self.device}, got one on {t.device}"
            )


def _env_attribute(env: object, name: str) -> Any:
    """``env.<name>``, else ``env.unwrapped.<name>`` (gymnasium wrappers do not forward
    attributes), else ``None``."""
    value = getattr(env, name, None)
    if value is None:
        value = getattr(getattr(env, "unwrapped", None), name, None)
    return value
