"""Batched retention: every batch appended to preallocated buffers on the batch's device."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from broker import Batch, Broker, EpisodeEnd, Message, RunStart, SchemaError, Subscription, TopicSchema

from ._buffers import PerWorldBuffer, SharedAxisBuffer
from .errors import RetentionError, RetentionSchemaError

__all__ = ["FinishedEpisode", "Retention", "RetentionStatistics"]

EpisodeData = dict[str, dict[str, torch.Tensor]]
"""Term name -> field name -> ``[T, ...]`` tensor (an owned snapshot)."""

_RESET_HOOKS = ("pre_reset", "post_reset")


@dataclass(frozen=True, slots=True, eq=False)
class FinishedEpisode:
    """A finished episode handed to a retention sink. ``data`` is owned by the receiver."""

    run: str
    world: int
    episode: int
    success: bool
    terminated: bool
    truncated: bool
    length: int
    data: EpisodeData


@dataclass(frozen=True, slots=True)
class RetentionStatistics:
    """Counters of a :class:`Retention` consumer."""

    batches: int
    episodes_finished: int
    episodes_sunk: int
    grows: int
    topics: int
    bytes_allocated: int


def _readable(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values costs no device sync (it is in host memory)."""
    return t.is_cpu


class Retention:
    """Keeps each world's current episode in preallocated batched buffers.

    Subscribe it to a broker (``retention.attach(broker)``, or subscribe it to ``""``). Every
    :class:`broker.Batch` is copied into one ``[capacity, worlds, ...]`` tensor per field on the
    batch's device. The published tensors stay borrowed: nothing of them, the ``worlds`` index
    included, is referenced after the call, so a publisher may refill any of them in place.
    Each topic's schema (a :class:`broker.TopicSchema`) is fixed by its first batch and later
    batches are checked against it and copied by field name, in whatever order their mapping
    has the fields. Topics recorded every step share one time axis (one contiguous copy per
    field per step); topics recorded only at resets keep per-world counters. Capacity starts at
    ``initial_capacity`` and grows geometrically; a reset reuses the rows of the worlds it
    ended. No Python loop over worlds runs on the append path, and it reads the device (a CUDA
    sync) at most once per ``capacity / 2`` appends of a topic.

    ``episode(world)`` returns an owned snapshot of the world's current episode. With a
    ``sink``, each finished episode is snapshotted when its :class:`broker.EpisodeEnd` arrives
    and handed to the sink; without one, no snapshot is ever built for finished episodes, and
    their rows are simply reused.

    Args:
        num_worlds: Number of worlds; learned from ``RunStart`` when omitted.
        initial_capacity: Initial rows per world.
        growth: Capacity multiplier when full (> 1).
        sink: Called with every :class:`FinishedEpisode`.
        skip_empty: Do not hand episodes with no retained rows to the sink.
    """

    name = "retention"

    def __init__(
        self,
        *,
        num_worlds: int | None = None,
        initial_capacity: int = 32,
        growth: float = 2.0,
        sink: Callable[[FinishedEpisode], object] | None = None,
        skip_empty: bool = True,
    ) -> None:
        if isinstance(initial_capacity, bool) or not isinstance(initial_capacity, int) or initial_capacity < 1:
            raise ValueError(f"initial_capacity: expected a positive int, got {initial_capacity!r}")
        if not growth > 1.0:
            raise ValueError(f"growth: expected a factor > 1, got {growth!r}")
        if num_worlds is not None and (isinstance(num_worlds, bool) or num_worlds < 1):
            raise ValueError(f"num_worlds: expected a positive int, got {num_worlds!r}")
        self.num_worlds = num_worlds
        self.initial_capacity = initial_capacity
        self.growth = growth
        self.sink = sink
        self.skip_empty = skip_empty
        self.run: str | None = None
        self._topics: dict[str, SharedAxisBuffer | PerWorldBuffer] = {}
        self._batches = 0
        self._finished = 0
        self._sunk = 0
        self._grows = 0

    def attach(self, broker: Broker) -> list[Subscription]:
        """Subscribe to batches, episode ends and run starts of ``broker``."""
        return [broker.subscribe(p, self, name=self.name) for p in ("batch/", "episode/", "run/")]

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self.append(message)
        elif isinstance(message, EpisodeEnd):
            self.finish(message)
        elif isinstance(message, RunStart):
            self.run = message.run
            if self.num_worlds != message.num_worlds:
                self._topics.clear()
            self.num_worlds = message.num_worlds
            self.reset()

    # -- append path ---------------------------------------------------------------------

    def append(self, batch: Batch) -> None:
        """Copy ``batch`` into the buffers of its topic (``batch`` stays borrowed).

        Raises:
            RetentionError: The number of worlds is unknown, or ``batch.worlds`` is not a 1-D
                integer index of at most ``num_worlds`` worlds in ``[0, num_worlds)`` (the
                values are checked on CPU tensors, as a remote subscriber's are; on a CUDA
                device they are trusted, as reading them would wait for the device every step).
            RetentionSchemaError: The fields differ from the topic's schema (by name, dtype,
                per-world shape or leading dimension).
        """
        if self.num_worlds is None:
            raise RetentionError(
                f"topic {batch.topic!r}: the number of worlds is unknown; pass num_worlds= or "
                "attach before the run starts"
            )
        n = self.num_worlds
        worlds = batch.worlds
        self._check_worlds(batch.topic, worlds, n)
        if self.run is None:
            self.run = batch.run
        buf = self._topics.get(batch.topic)
        if buf is None:
            if not batch.fields:
                return
            try:
                schema = TopicSchema.of(batch.fields, topic=batch.topic)
            except SchemaError as exc:
                raise RetentionSchemaError(str(exc)) from exc
            cls = PerWorldBuffer if batch.hook in _RESET_HOOKS else SharedAxisBuffer
            device = batch.fields[schema.names[0]].device
            buf = cls(batch.topic, schema, n, self.initial_capacity, device, self.growth)
            buf.append(worlds.to(device=buf.device, dtype=torch.int64), batch.fields)
            self._topics[batch.topic] = buf  # only once its first batch fitted
        else:
            capacity = buf.capacity
            buf.append(worlds.to(device=buf.device, dtype=torch.int64), batch.fields)
            self._grows += buf.capacity != capacity
        self._batches += 1

    @staticmethod
    def _check_worlds(topic: str, worlds: object, n: int) -> None:
        """Raise ``RetentionError`` unless ``worlds`` is a 1-D integer index of at most ``n``
        worlds, each in ``[0, n)`` where the tensor is on the CPU (on a device its values are
        trusted: reading them is a sync). About 3 us on the CPU (one ``aminmax``)."""
        dtype = getattr(worlds, "dtype", None)
        if (not isinstance(worlds, torch.Tensor) or worlds.dim() != 1 or worlds.shape[0] > n
                or worlds.dtype.is_floating_point or worlds.dtype.is_complex or worlds.dtype == torch.bool):
            raise RetentionError(
                f"topic {topic!r}: expected worlds as a 1-D integer index of at most {n} worlds, "
                f"got dtype {dtype} shape {tuple(getattr(worlds, 'shape', ()))}"
            )
        if _readable(worlds) and worlds.shape[0]:
            lo, hi = torch.aminmax(worlds)
            low, high = int(lo), int(hi)
            if low < 0 or high >= n:
                raise RetentionError(f"topic {topic!r}: expected world indices in [0, {n}), got {low}..{high}")

    # -- episodes ------------------------------------------------------------------------

    def finish(self, end: EpisodeEnd) -> None:
        """End the episodes of ``end.worlds``: hand them to the sink (if any), then free rows.

        Raises:
            RetentionError: ``end.worlds`` is not an index of the run's worlds (checked as
                :meth:`append` checks a batch's), before anything changed.
        """
        worlds = end.worlds
        if self.num_worlds is not None:
            self._check_worlds(end.topic, worlds, self.num_worlds)
        if worlds.numel() == 0:
            return
        self._finished += worlds.numel()
        if self.sink is not None:
            keys = zip(worlds.tolist(), end.episodes.tolist(), end.success.tolist(),
                       end.terminated.tolist(), end.truncated.tolist(), end.length.tolist(),
                       strict=True)
            for w, ep, ok, term, trunc, length in keys:
                data = self.episode(w)
                if self.skip_empty and not any(
                    t.shape[0] for fields in data.values() for t in fields.values()
                ):
                    continue
                self.sink(FinishedEpisode(end.run, w, ep, bool(ok), bool(term), bool(trunc),
                                          int(length), data))
                self._sunk += 1
        for buf in self._topics.values():
            buf.restart(worlds.to(device=buf.device, dtype=torch.int64))

    def episode(self, world: int) -> EpisodeData:
        """An owned snapshot of ``world``'s current episode: term -> field -> ``[T, ...]``.

        Raises:
            RetentionError: ``world`` is out of range.
        """
        if self.num_worlds is None or not 0 <= int(world) < self.num_worlds:
            raise RetentionError(f"world: expected an index in [0, {self.num_worlds}), got {world!r}")
        return {topic.removeprefix("batch/"): buf.read(int(world)) for topic, buf in self._topics.items()}

    def episode_length(self, world: int, term: str) -> int:
        """Rows retained for ``world`` in term ``term`` (a device read).

        Raises:
            RetentionError: ``world`` is out of range or no batch of ``term`` was retained.
        """
        if self.num_worlds is None or not 0 <= int(world) < self.num_worlds:
            raise RetentionError(f"world: expected an index in [0, {self.num_worlds}), got {world!r}")
        buf = self._topics.get(f"batch/{term}")
        if buf is None:
            raise RetentionError(f"term: expected one of {sorted(t.removeprefix('batch/') for t in self._topics)}, "
                                 f"got {term!r}")
        return buf.length(int(world))

    def reset(self, worlds: torch.Tensor | None = None) -> None:
        """Drop the retained rows of ``worlds`` (all when ``None``) without a sink call."""
        for buf in self._topics.values():
            idx = (torch.arange(buf.num_worlds, device=buf.device) if worlds is None
                   else worlds.to(device=buf.device, dtype=torch.int64))
            buf.restart(idx)

    @property
    def capacity(self) -> Mapping[str, int]:
        """Topic -> current rows per world."""
        return {t: b.capacity for t, b in self._topics.items()}

    def statistics(self) -> RetentionStatistics:
        return RetentionStatistics(
            batches=self._batches,
            episodes_finished=self._finished,
            episodes_sunk=self._sunk,
            grows=self._grows,
            topics=len(self._topics),
            bytes_allocated=sum(b.nbytes() for b in self._topics.values()),
        )
