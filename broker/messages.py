"""Message types carried by the broker, in process and on the wire.

Every message carries the publishing run's id (``run``), the publisher's sequence number
(``seq``) and the global simulation step (``step``). Tensors inside a message are *borrowed*:
they belong to the publisher and are valid only for the duration of the delivery call. A
consumer that keeps anything must copy it.

The tensor-carrying messages are generic in their array type: ``Batch`` (``Batch[torch.Tensor]``)
holds torch tensors, as everything in process does; ``Batch[np.ndarray]`` holds numpy arrays, as
the wire decoder builds them with ``arrays="numpy"`` (bfloat16 as :class:`broker.BFloat16Bits`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, TypeAlias

import numpy as np

from .schema import FieldSpec

if TYPE_CHECKING:
    import torch
    from typing_extensions import TypeVar

    A = TypeVar("A", bound=torch.Tensor | np.ndarray, default=torch.Tensor)
else:
    from typing import TypeVar

    A = TypeVar("A")

__all__ = [
    "BUILD",
    "RUNTIME",
    "Batch",
    "EpisodeEnd",
    "FieldSpec",
    "Message",
    "MessageOf",
    "NumpyMessage",
    "Phase",
    "RESERVED_OUTCOMES",
    "RunEnd",
    "RunStart",
    "TOPIC_EPISODE_END",
    "TOPIC_RUN_END",
    "TOPIC_RUN_START",
    "VariationSample",
    "batch_topic",
    "variation_topic",
]

TOPIC_EPISODE_END: Final = "episode/end"
TOPIC_RUN_START: Final = "run/start"
TOPIC_RUN_END: Final = "run/end"

Phase: TypeAlias = Literal["build", "runtime"]
BUILD: Final = "build"
RUNTIME: Final = "runtime"

Hook: TypeAlias = Literal["pre_step", "post_step", "pre_reset", "post_reset", "post_physics_decimation_step"]
"""The lifecycle points a :class:`Batch` comes from (``post_physics_decimation_step``: after each
physics step inside an environment step, Isaac Lab's decimation loop)."""

Label: TypeAlias = str | int | float | bool

RESERVED_OUTCOMES: Final = frozenset({
    "run", "world", "episode", "index", "success", "terminated", "truncated", "length", "end_step",
    "end_seq", "segments", "segment_start", "segment_count",
})
"""Names an :attr:`EpisodeEnd.outcomes` entry may not have: the columns that episode tables (the
store's, the (X, Y) table's) already hold. Receivers reject an outcome named so."""


def batch_topic(term: str) -> str:
    """Topic on which the batches of recorder term ``term`` are published."""
    return f"batch/{term}"


def variation_topic(key: str) -> str:
    """Topic on which the samples of variation ``key`` are published."""
    return f"variation/{key}"


@dataclass(frozen=True, slots=True, eq=False)
class Batch(Generic[A]):
    """One batch of fields for a set of worlds, published on ``batch/<term>``.

    Attributes:
        topic: ``batch/<term name>``.
        worlds: 1-D int64 index tensor of the worlds in the batch.
        episodes: 1-D int64 tensor, the current episode index of each world in ``worlds``.
        fields: Name -> tensor whose first dimension is ``len(worlds)``. Borrowed.
        hook: The lifecycle point that produced the batch.
    """

    run: str
    seq: int
    step: int
    topic: str
    worlds: A
    episodes: A
    fields: Mapping[str, A]
    hook: Hook = "post_step"

    @property
    def term(self) -> str:
        return self.topic.removeprefix("batch/")


@dataclass(frozen=True, slots=True, eq=False)
class EpisodeEnd(Generic[A]):
    """The end of the current episode of ``worlds`` (published on ``episode/end``).

    Attributes:
        worlds: 1-D int64 index tensor of the worlds whose episode ended.
        episodes: The index of the episode that ended, per world.
        success, terminated, truncated: 1-D bool tensors, per world.
        length: 1-D int64 tensor, number of steps in the episode, per world.
        outcomes: (keyword only) Extra numeric episode outcomes, name -> 1-D numeric (bool, integer or float)
            tensor of ``len(worlds)`` values, e.g. ``{"return": ...}``; names are non-empty and
            not in :data:`RESERVED_OUTCOMES`. Borrowed.
    """

    run: str
    seq: int
    step: int
    worlds: A
    episodes: A
    success: A
    terminated: A
    truncated: A
    length: A
    outcomes: Mapping[str, A] = field(default_factory=dict, kw_only=True)
    topic: str = TOPIC_EPISODE_END


@dataclass(frozen=True, slots=True, eq=False)
class VariationSample(Generic[A]):
    """One draw of a domain-randomization variation (published on ``variation/<key>``).

    Attributes:
        key: The variation's name.
        phase: ``"build"`` (drawn once before the scene exists; applies to every episode of
            the worlds for the whole run) or ``"runtime"`` (drawn when worlds reset; applies
            to the episode each world is in).
        worlds: 1-D int64 index tensor of the worlds the draw was made for.
        episodes: Episode index of each world at the time of the draw.
        value: Tensor whose first dimension is ``len(worlds)``. For categorical variations
            it holds int64 codes into ``labels``.
        labels: For categorical variations, the label of each code; otherwise ``None``.
    """

    run: str
    seq: int
    step: int
    key: str
    phase: Phase
    worlds: A
    episodes: A
    value: A
    labels: tuple[Label, ...] | None = None
    topic: str = ""

    def __post_init__(self) -> None:
        if not self.topic:
            object.__setattr__(self, "topic", variation_topic(self.key))


@dataclass(frozen=True, slots=True, eq=False)
class RunStart:
    """The start of a run (published on ``run/start``).

    Attributes:
        num_worlds: Number of parallel worlds.
        device: Device the recorder's tensors live on (e.g. ``"cuda:0"``).
        schema: Topic -> field -> spec (each a :class:`broker.TopicSchema`'s ``fields``), for the
            topics known when the run started.
        metadata: User metadata (msgpack-able values only).
        variations, seed, wall_time: Keyword only.
        variations: Variation key -> declaration (a msgpack-able dict: ``kind``, ``phase``,
            ``shape``, ``seed`` and, where they apply, ``low``/``high``, ``mean``/``std``,
            ``labels``/``weights``), for the variations declared so far.
        seed: The run seed the variations' default seeds derive from, or ``None``.
        wall_time: Unix seconds when the message was made (:func:`time.time`).
    """

    run: str
    seq: int
    step: int
    num_worlds: int
    device: str
    schema: Mapping[str, Mapping[str, FieldSpec]] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    variations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, kw_only=True)
    seed: int | None = field(default=None, kw_only=True)
    wall_time: float = field(default=0.0, kw_only=True)
    topic: str = TOPIC_RUN_START


@dataclass(frozen=True, slots=True, eq=False)
class RunEnd:
    """The end of a run (published on ``run/end``), with the schema of every topic seen.

    Its fields are :class:`RunStart`'s; ``variations`` repeats every declaration of the run
    (a superset of RunStart's) and ``wall_time`` is when the run ended. ``interrupted``: the
    run stopped before it was meant to (the store marks it ``interrupted``, not ``complete``).
    """

    run: str
    seq: int
    step: int
    num_worlds: int
    device: str
    schema: Mapping[str, Mapping[str, FieldSpec]] = field(default_factory=dict)
    metadata: Mapping[str, Any] = field(default_factory=dict)
    variations: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, kw_only=True)
    seed: int | None = field(default=None, kw_only=True)
    wall_time: float = field(default=0.0, kw_only=True)
    interrupted: bool = field(default=False, kw_only=True)
    topic: str = TOPIC_RUN_END


Message: TypeAlias = Batch | EpisodeEnd | VariationSample | RunStart | RunEnd
"""A message whose tensors are torch tensors (what the in-process broker carries)."""
MessageOf: TypeAlias = Batch[A] | EpisodeEnd[A] | VariationSample[A] | RunStart | RunEnd
"""A message whose tensors are of array type ``A`` (``MessageOf[np.ndarray]``)."""
NumpyMessage: TypeAlias = MessageOf[np.ndarray]
"""A message whose tensors are numpy arrays (``broker.wire.decode(..., arrays="numpy")``)."""
