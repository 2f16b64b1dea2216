"""Live statistics: running per-field moments and episode outcomes, computed on the device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from broker import Batch, Broker, EpisodeEnd, Message, Subscription

__all__ = ["FieldStatistics", "LiveStatistics", "LiveSummary"]


@dataclass(frozen=True, slots=True, eq=False)
class FieldStatistics:
    """Moments of one field over every world and step seen; arrays have the per-world shape."""

    count: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class LiveSummary:
    """A snapshot of a :class:`LiveStatistics` consumer."""

    batches: int
    episodes: int
    successes: int
    mean_length: float
    fields: dict[str, FieldStatistics]

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")


def _batch_moments(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean, M2, min and max over the worlds dimension.

    Integer and bool fields are reduced in float32, float64 fields in float64; the results
    (one row) are accumulated in float64.
    """
    x = t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)
    # Plain sums reduce over dim 0 far faster on the CPU than var_mean/aminmax do.
    mean = x.sum(0).div_(x.shape[0])
    d = x - mean
    m2 = d.mul_(d).sum(0)
    f64 = torch.float64
    return mean.to(f64), m2.to(f64), x.amin(0).to(f64), x.amax(0).to(f64)


class _Moments:
    """Chan et al.'s parallel update of count, mean and M2, one batch at a time."""

    __slots__ = ("count", "m2", "max", "mean", "min")

    def __init__(self, t: torch.Tensor) -> None:
        self.count = t.shape[0]
        self.mean, self.m2, self.min, self.max = _batch_moments(t)

    def update(self, t: torch.Tensor) -> None:
        n_b = t.shape[0]
        mean_b, m2_b, lo, hi = _batch_moments(t)
        n = self.count + n_b
        delta = mean_b - self.mean
        self.mean.add_(delta, alpha=n_b / n)
        self.m2.add_(m2_b).add_(delta.square_(), alpha=self.count * n_b / n)
        torch.minimum(self.min, lo, out=self.min)
        torch.maximum(self.max, hi, out=self.max)
        self.count = n

    def snapshot(self) -> FieldStatistics:
        var = self.m2 / max(self.count - 1, 1)
        return FieldStatistics(self.count, self.mean.cpu().numpy(), var.sqrt().cpu().numpy(),
                               self.min.cpu().numpy(), self.max.cpu().numpy())


class LiveStatistics:
    """Running mean, std, min and max of every field of the chosen topics, plus the episode
    count and success rate: the model of a live consumer that copies only what it needs.

    Nothing of a published tensor is kept: each batch is reduced on its own device into a few
    per-field accumulators (float64; each batch is reduced in float32 unless it is float64), so
    the cost is a handful of reductions per batch and the memory is independent of run length.
    ``summary()`` reads the accumulators back to the host.

    Args:
        fields: Only these ``"<term>/<field>"`` names (all when ``None``).
        every: Reduce one batch in ``every`` per topic (subsampling bounds the cost).
    """

    name = "live-statistics"

    def __init__(self, *, fields: Sequence[str] | None = None, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        self.fields = None if fields is None else frozenset(fields)
        self.every = every
        self._moments: dict[str, _Moments] = {}
        self._seen: dict[str, int] = {}
        self._batches = 0
        self._episodes = 0
        self._successes: torch.Tensor | int = 0
        self._lengths: torch.Tensor | int = 0

    def attach(self, broker: Broker, prefix: str = "batch/") -> list[Subscription]:
        """Subscribe to ``prefix`` batches and to episode ends."""
        return [broker.subscribe(prefix, self, name=self.name),
                broker.subscribe("episode/", self, name=self.name)]

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self._batch(message)
        elif isinstance(message, EpisodeEnd):
            self._episodes += message.worlds.numel()
            self._successes = self._successes + message.success.sum()
            self._lengths = self._lengths + message.length.sum()

    def _batch(self, batch: Batch) -> None:
        seen = self._seen.get(batch.topic, 0)
        self._seen[batch.topic] = seen + 1
        if seen % self.every or batch.worlds.numel() == 0:
            return
        self._batches += 1
        term = batch.term
        for name, t in batch.fields.items():
            key = f"{term}/{name}"
            if self.fields is not None and key not in self.fields:
                continue
            acc = self._moments.get(key)
            if acc is None:
                self._moments[key] = _Moments(t)
            else:
                acc.update(t)

    def summary(self) -> LiveSummary:
        """A host snapshot (reads the device once per field)."""
        episodes = self._episodes
        lengths = int(self._lengths)
        return LiveSummary(
            batches=self._batches,
            episodes=episodes,
            successes=int(self._successes),
            mean_length=lengths / episodes if episodes else float("nan"),
            fields={k: m.snapshot() for k, m in self._moments.items()},
        )
