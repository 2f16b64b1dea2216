"""A named domain-randomization factor: a phase, an enabled flag and a rebuildable sampler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from broker.messages import BUILD, RUNTIME, Label, Phase

from ..errors import VariationError
from ..selectors import WorldSelector
from .config import SamplerCfg
from .samplers import SampleListener, Sampler

__all__ = ["Variation", "VariationCfg"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VariationCfg:
    """Configuration of a :class:`Variation`.

    Attributes:
        sampler: The sampler configuration (e.g. ``UniformCfg(0.5, 1.5, seed=3)``).
        phase: ``"build"``: drawn once, before the first step, and in effect for every
            episode of its worlds for the whole run; ``"runtime"``: drawn when worlds reset,
            in effect for the episode each world is then in.
        enabled: Disabled variations are skipped by ``VariationRecorder.attach``.
    """

    sampler: SamplerCfg
    phase: Phase = RUNTIME
    enabled: bool = True

    def __post_init__(self) -> None:
        if not callable(getattr(self.sampler, "build", None)):
            raise VariationError(
                f"sampler: expected a sampler configuration with build(), got {self.sampler!r}"
            )
        if self.phase not in (BUILD, RUNTIME):
            raise VariationError(f"phase: expected {BUILD!r} or {RUNTIME!r}, got {self.phase!r}")
        if not isinstance(self.enabled, bool):
            raise VariationError(f"enabled: expected a bool, got {self.enabled!r}")


class Variation:
    """One randomized factor (mass, friction, which object, ...) of every world.

    Listeners added with :meth:`add_sample_listener` belong to the variation: they are bound
    to its current sampler and re-bound, in order, to the sampler :meth:`apply_cfg` builds.
    Listeners added straight to ``variation.sampler`` are lost on ``apply_cfg``.

    Args:
        name: The variation's key (topic ``variation/<name>``): non-empty, no whitespace.
        cfg: Its configuration.
        device: Where the sampler draws.
    """

    def __init__(self, name: str, cfg: VariationCfg, *, device: torch.device | str = "cpu") -> None:
        if not isinstance(name, str) or not name or any(c.isspace() for c in name):
            raise VariationError(f"name: expected a non-empty key without whitespace, got {name!r}")
        self._name = name
        self._device = torch.device(device)
        self._listeners: list[SampleListener] = []
        self._cfg = self._check(cfg)
        self._sampler: Sampler[Any] = cfg.sampler.build(self._device)

    @staticmethod
    def _check(cfg: object) -> VariationCfg:
        if not isinstance(cfg, VariationCfg):
            raise VariationError(f"cfg: expected a VariationCfg, got {cfg!r}")
        return cfg

    @property
    def name(self) -> str:
        return self._name

    @property
    def cfg(self) -> VariationCfg:
        return self._cfg

    @property
    def phase(self) -> Phase:
        return self._cfg.phase

    @property
    def enabled(self) -> bool:
        return self._cfg.enabled

    @property
    def device(self) -> torch.device:
        return self._sampler.device

    @property
    def sampler(self) -> Sampler[Any]:
        """The current sampler; replaced by :meth:`apply_cfg`."""
        return self._sampler

    @property
    def labels(self) -> tuple[Label, ...] | None:
        """The current sampler's labels (categorical variations), else ``None``."""
        return self._sampler.labels

    def add_sample_listener(self, listener: SampleListener) -> None:
        """Call ``listener(value, worlds)`` after every draw, across ``apply_cfg`` swaps."""
        self._sampler.add_listener(listener)
        self._listeners.append(listener)

    def remove_sample_listener(self, listener: SampleListener) -> None:
        """Stop calling ``listener``.

        Raises:
            VariationError: ``listener`` was not added with :meth:`add_sample_listener`.
        """
        if listener not in self._listeners:
            raise VariationError(
                f"listener: {listener!r} is not a sample listener of variation {self._name!r}"
            )
        self._listeners.remove(listener)
        self._sampler.remove_listener(listener)

    def apply_cfg(self, cfg: VariationCfg) -> None:
        """Apply new ``cfg``: rebuild the sampler (a fresh generator seeded from ``cfg``) and
        move every sample listener onto it, in order; the old sampler notifies them no more.
        On error the old configuration stays in place."""
        cfg = self._check(cfg)
        sampler: Sampler[Any] = cfg.sampler.build(self._device)
        for listener in self._listeners:
            sampler.add_listener(listener)
        old, self._cfg, self._sampler = self._sampler, cfg, sampler
        for listener in self._listeners:
            old.remove_listener(listener)

    def sample(self, n: int, worlds: WorldSelector = None) -> torch.Tensor:
        """Draw ``n`` values for ``worlds`` from the current sampler (see ``Sampler.sample``)."""
        return self._sampler.sample(n, worlds)

    def __repr__(self) -> str:
        return f"Variation({self._name!r}, {self._cfg!r})"
