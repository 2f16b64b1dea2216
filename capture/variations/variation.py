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
from .seeds import derive_seed

__all__ = ["Variation", "VariationCfg"]


@dataclass(frozen=True, slots=True, kw_only=True)
class VariationCfg:
    """Configuration of a :class:`Variation`.

    Attributes:
        sampler: The sampler configuration (e.g. ``UniformCfg(0.5, 1.5, seed=3)``); left
            without a seed, its seed is derived from the run seed and the variation's key.
        phase: ``"build"``: drawn once, before the first step, and in effect for every
            episode of its worlds for the whole run; ``"runtime"``: drawn when worlds reset
            (after ``record_pre_reset`` and before the new episode's first step), in effect
            for the episode each world is then in. Draws in the middle of an episode are
            refused by the ``VariationRecorder``.
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
    to its current sampler and re-bound, in order, to the sampler :meth:`apply_cfg` (or
    :meth:`set_run_seed`) builds. Listeners added straight to ``variation.sampler`` are lost
    then.

    Seeds: a sampler configuration without a seed gets ``derive_seed(run_seed, name)``, with
    run seed 0 until :meth:`set_run_seed` (which ``VariationRecorder.attach`` calls with the
    recorder's seed) says otherwise. So two variations left at the default draw independent
    streams, and the same run seed gives the same streams again.

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
        self._run_seed = 0
        self._cfg = self._check(cfg)
        self._sampler: Sampler[Any] = self._build(self._cfg, self._run_seed)

    def _build(self, cfg: VariationCfg, run_seed: int) -> Sampler[Any]:
        sampler = cfg.sampler
        if sampler.seed is None:
            sampler = sampler.with_seed(derive_seed(run_seed, self._name))
        return sampler.build(self._device)

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

    @property
    def seed(self) -> int:
        """The seed the current sampler uses (given in its configuration, or derived)."""
        return self._sampler.seed

    @property
    def seed_derived(self) -> bool:
        """Whether the seed is derived from the run seed (the configuration gave none)."""
        return self._cfg.sampler.seed is None

    @property
    def run_seed(self) -> int:
        """The run seed a derived seed comes from (0 until :meth:`set_run_seed`)."""
        return self._run_seed

    def declaration(self) -> dict[str, Any]:
        """The current sampler's declaration with ``"phase"`` added: a plain dict
        (``kind``, ``phase``, ``shape``, ``seed`` actually used, and the distribution's
        bounds, moments or labels), as ``RunStart.variations`` carries it."""
        decl = self._sampler.cfg.declaration()
        return {"kind": decl.pop("kind"), "phase": self.phase, **decl}

    def reseed_error(self, run_seed: int) -> str | None:
        """Why :meth:`set_run_seed` would refuse ``run_seed``, or ``None`` if it would not."""
        if not self.seed_derived or derive_seed(run_seed, self._name) == self.seed:
            return None
        drawn = self._sampler.drawn
        if not drawn:
            return None
        return (
            f"variation {self._name!r}: cannot derive its seed from run seed {run_seed}: it has "
            f"already drawn {drawn} values from the seed derived from run seed {self._run_seed}, "
            f"and re-seeding would make the recorded stream differ from a replay of the run; "
            f"attach it before its first draw, or give its sampler configuration a seed"
        )

    def set_run_seed(self, run_seed: int) -> None:
        """Derive the sampler's seed from ``run_seed`` (and the key) from now on.

        When the configuration gives no seed and the derived seed changes, the sampler is
        rebuilt (a fresh generator; listeners kept, in order). A configuration with a seed
        keeps it.

        Raises:
            VariationError: ``run_seed`` is not an int in ``[0, 2**64)``, or the seed would
                change after the sampler has drawn.
        """
        seed = derive_seed(run_seed, self._name)  # validates run_seed
        error = self.reseed_error(run_seed)
        if error is not None:
            raise VariationError(error)
        if self.seed_derived and seed != self.seed:
            self._swap(self._cfg, self._build(self._cfg, run_seed))
        self._run_seed = run_seed

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
        """Apply new ``cfg``: rebuild the sampler (a fresh generator seeded from ``cfg``, or
        derived from the run seed) and move every sample listener onto it, in order; the old
        sampler notifies them no more. On error the old configuration stays in place."""
        cfg = self._check(cfg)
        self._swap(cfg, self._build(cfg, self._run_seed))

    def _swap(self, cfg: VariationCfg, sampler: Sampler[Any]) -> None:
        for listener in self._listeners:
            sampler.add_listener(listener)
        old, self._cfg, self._sampler = self._sampler, cfg, sampler
        for listener in self._listeners:
            old.remove_listener(listener)

    def sample(self, n: int, worlds: WorldSelector = None) -> torch.Tensor:
        """Draw ``n`` values for ``worlds`` from the current sampler (see ``Sampler.sample``).

        Raises:
            VariationError: The sampler refused the draw (named after this variation), or a
                listener refused it (e.g. the ``VariationRecorder``: a draw in the middle of
                an episode).
        """
        try:
            return self._sampler.sample(n, worlds)
        except VariationError as exc:
            prefix = f"variation {self._name!r}: "
            if str(exc).startswith(prefix):
                raise
            raise VariationError(prefix + str(exc)) from exc

    def __repr__(self) -> str:
        return f"Variation({self._name!r}, {self._cfg!r})"
