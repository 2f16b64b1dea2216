"""The in-memory record of a variation's draws, and the lookups behind it.

Every tensor kept here is an owned copy made at draw time, on the recorder's device; mutating
the sampler's output or a published message afterwards cannot change it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from broker.messages import BUILD, Label, Phase

__all__ = ["EpisodeSample", "VariationDraw", "VariationRecord", "VariationSummary"]


@dataclass(frozen=True, slots=True, eq=False)
class VariationDraw:
    """One recorded draw of a variation.

    Attributes:
        seq: The publisher sequence number of its ``VariationSample``.
        step: The global step at the draw.
        phase: ``"build"`` or ``"runtime"``.
        worlds: 1-D int64 index of the worlds drawn for.
        episodes: Each world's episode index at the draw.
        value: The drawn values, first dimension ``len(worlds)`` (codes for categorical).
        labels: For categorical variations, the label of each code; otherwise ``None``.
    """

    seq: int
    step: int
    phase: Phase
    worlds: torch.Tensor
    episodes: torch.Tensor
    value: torch.Tensor
    labels: tuple[Label, ...] | None = None


@dataclass(frozen=True, slots=True, eq=False)
class EpisodeSample:
    """The value of one variation in effect for one episode of one world.

    Attributes:
        key: The variation's key.
        phase: Phase of the draw it came from (``"build"`` when it is the build-time value).
        seq, step: Sequence number and step of that draw.
        value: The world's value (per-world shape), an owned copy.
        label: For categorical variations, the label of the code in ``value``.
    """

    key: str
    phase: Phase
    seq: int
    step: int
    value: torch.Tensor
    label: Label | None = None


@dataclass(frozen=True, slots=True, eq=False)
class VariationSummary:
    """A variation's record in brief: draws, world-values, per-world shape, first and last."""

    key: str
    count: int
    samples: int
    shape: tuple[int, ...] | None
    first: VariationDraw | None
    last: VariationDraw | None


class VariationRecord:
    """Every draw of one variation, in draw order.

    Args:
        key: The variation's key.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self._draws: list[VariationDraw] = []
        self._samples = 0

    @property
    def draws(self) -> tuple[VariationDraw, ...]:
        return tuple(self._draws)

    @property
    def count(self) -> int:
        """Number of draws."""
        return len(self._draws)

    @property
    def samples(self) -> int:
        """Number of world-values over all draws."""
        return self._samples

    @property
    def shape(self) -> tuple[int, ...] | None:
        """Per-world shape of the last draw (``None`` before the first)."""
        return tuple(self._draws[-1].value.shape[1:]) if self._draws else None

    def append(self, draw: VariationDraw) -> None:
        """Keep ``draw``; its tensors must already be owned copies."""
        self._draws.append(draw)
        self._samples += int(draw.worlds.shape[0])

    def clear(self) -> None:
        self._draws.clear()
        self._samples = 0

    def summary(self) -> VariationSummary:
        first = self._draws[0] if self._draws else None
        last = self._draws[-1] if self._draws else None
        return VariationSummary(self.key, self.count, self._samples, self.shape, first, last)

    def sample_for_episode(self, world: int, episode: int) -> EpisodeSample | None:
        """The value in effect for episode ``episode`` of world ``world``.

        That is the last run-time draw made for that world while it was in that episode,
        else the last build-time draw for that world, else ``None``. Reads the host.
        """
        build: tuple[VariationDraw, int] | None = None
        for draw in reversed(self._draws):
            hit = draw.worlds == world
            if draw.phase != BUILD:
                hit &= draw.episodes == episode
            rows = hit.nonzero().flatten().tolist()
            if not rows:
                continue
            if draw.phase != BUILD:
                return self._episode_sample(draw, rows[0])
            if build is None:
                build = (draw, rows[0])
        return None if build is None else self._episode_sample(*build)

    def _episode_sample(self, draw: VariationDraw, row: int) -> EpisodeSample:
        value = draw.value[row].clone()
        label = None if draw.labels is None else draw.labels[int(value)]
        return EpisodeSample(self.key, draw.phase, draw.seq, draw.step, value, label)

    def __repr__(self) -> str:
        return f"VariationRecord({self.key!r}, count={self.count}, shape={self.shape})"
