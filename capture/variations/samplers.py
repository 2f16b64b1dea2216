"""Seeded samplers that notify listeners of every draw.

``Sampler.sample(n, worlds)`` is a template method: a subclass draws in ``_sample(n)`` and the
base passes the result to every listener, in registration order, as ``(value, worlds)``.

Ownership: the tensor ``sample`` returns is new on every call and belongs to the caller.
Listeners receive that same tensor, borrowed for the duration of the call, and copy what
they keep (the caller may write into it as soon as ``sample`` returns).

Reproducibility: each sampler owns a ``torch.Generator`` on its device, seeded from its
configuration, so the same configuration on the same device type draws the same stream.
CPU and CUDA generators produce different streams for the same seed. A configuration whose
seed is ``None`` is built with ``derive_seed(0, "")``: every such standalone sampler draws the
same stream, so give a seed, or use a :class:`capture.variations.Variation`, whose key enters
the derived seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeAlias, TypeVar

import torch

from broker.messages import Label

from ..errors import VariationError
from ..selectors import WorldSelector
from .config import (
    Bounds,
    ChoiceCfg,
    DesignCfg,
    LogUniformCfg,
    NormalCfg,
    SamplerCfg,
    UniformCfg,
)
from .seeds import derive_seed

__all__ = [
    "ChoiceSampler",
    "DesignSampler",
    "LogUniformSampler",
    "NormalSampler",
    "SampleListener",
    "Sampler",
    "UniformSampler",
]

SampleListener: TypeAlias = Callable[[torch.Tensor, WorldSelector], object]
"""Called with ``(value, worlds)`` after every draw; ``value`` is borrowed for the call."""

C = TypeVar("C", bound=SamplerCfg)


def _device(device: torch.device | str) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Sampler(ABC, Generic[C]):
    """Base of every sampler: owns the configuration, the generator and the listeners.

    Args:
        cfg: The validated configuration; its ``seed`` seeds the generator (``None``:
            ``derive_seed(0, "")``).
        device: Where draws are made and returned.
    """

    def __init__(self, cfg: C, *, device: torch.device | str = "cpu") -> None:
        seed = cfg.seed
        if seed is None:
            seed = derive_seed(0, "")
            cfg = cfg.with_seed(seed)
        self._cfg = cfg
        self._device = _device(device)
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed)
        self._listeners: list[SampleListener] = []
        self._drawn = 0

    @property
    def cfg(self) -> C:
        """The frozen configuration this sampler was built from, with the seed it uses."""
        return self._cfg

    @property
    def seed(self) -> int:
        """The seed of the generator."""
        seed = self._cfg.seed
        assert seed is not None  # resolved in __init__
        return seed

    @property
    def drawn(self) -> int:
        """Number of values drawn so far (over every ``sample`` call)."""
        return self._drawn

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-world shape of one draw; ``sample(n)`` returns shape ``(n, *shape)``."""
        return self._cfg.shape

    @property
    def labels(self) -> tuple[Label, ...] | None:
        """For categorical samplers, the label of each code; otherwise ``None``."""
        return None

    @property
    def listeners(self) -> tuple[SampleListener, ...]:
        return tuple(self._listeners)

    def add_listener(self, listener: SampleListener) -> None:
        """Call ``listener(value, worlds)`` after every draw, after those added before it."""
        if not callable(listener):
            raise TypeError(f"listener: expected a callable (value, worlds), got {listener!r}")
        self._listeners.append(listener)

    def remove_listener(self, listener: SampleListener) -> None:
        """Stop calling ``listener``.

        Raises:
            VariationError: ``listener`` is not registered on this sampler.
        """
        try:
            self._listeners.remove(listener)
        except ValueError:
            raise VariationError(f"listener: {listener!r} is not registered") from None

    def sample(self, n: int, worlds: WorldSelector = None) -> torch.Tensor:
        """Draw ``n`` values (for the worlds ``worlds``, passed through to the listeners).

        Returns:
            A new tensor of shape ``(n, *shape)`` on ``device``, owned by the caller.

        Raises:
            VariationError: ``n`` is not a non-negative int.
            Exception: Whatever a listener raises (the draw has been made by then).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise VariationError(f"n: expected a non-negative int, got {n!r}")
        value = self._sample(n)
        self._drawn += n
        for listener in tuple(self._listeners):
            listener(value, worlds)
        return value

    @abstractmethod
    def _sample(self, n: int) -> torch.Tensor:
        """Draw ``n`` values with ``self._generator`` on ``self.device``."""

    def _tensor(self, bounds: Bounds) -> torch.Tensor:
        return torch.tensor(bounds, dtype=torch.float32, device=self._device)

    def _rand(self, n: int) -> torch.Tensor:
        return torch.rand((n, *self.shape), generator=self._generator, device=self._device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._cfg!r}, device={str(self._device)!r})"


class UniformSampler(Sampler[UniformCfg]):
    """Uniform float32 draws in ``[low, high]`` (per component for vector bounds)."""

    def __init__(
        self, low: Bounds, high: Bounds, *, seed: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(UniformCfg(low, high, seed=seed), device=device)
        self._low = self._tensor(self._cfg.low)
        self._high = self._tensor(self._cfg.high)

    @classmethod
    def from_cfg(cls, cfg: UniformCfg, *, device: torch.device | str = "cpu") -> UniformSampler:
        return cls(cfg.low, cfg.high, seed=cfg.seed, device=device)

    def _sample(self, n: int) -> torch.Tensor:
        value = self._rand(n).mul_(self._high - self._low).add_(self._low)
        return torch.clamp(value, self._low, self._high)


class LogUniformSampler(Sampler[LogUniformCfg]):
    """Float32 draws whose logarithm is uniform in ``[log low, log high]``."""

    def __init__(
        self, low: Bounds, high: Bounds, *, seed: int | None = None, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__(LogUniformCfg(low, high, seed=seed), device=device)
        self._low = self._tensor(self._cfg.low)
        self._high = self._tensor(self._cfg.high)
        self._log_low = self._low.log()
        self._log_span = self._high.log() - self._log_low

    @classmethod
    def from_cfg(
        cls, cfg: LogUniformCfg, *, device: torch.device | str = "cpu"
    ) -> LogUniformSampler:
        return cls(cfg.low, cfg.high, seed=cfg.seed, device=device)

    def _sample(self, n: int) -> torch.Tensor:
        value = self._rand(n).mul_(self._log_span).add_(self._log_low).exp_()
        return torch.clamp(value, self._low, self._high)


class NormalSampler(Sampler[NormalCfg]):
    """Float32 draws from ``N(mean, std)``, clipped to ``[low, high]`` where given."""

    def __init__(
        self,
        mean: Bounds,
        std: Bounds,
        low: Bounds | None = None,
        high: Bounds | None = None,
        *,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(NormalCfg(mean, std, low, high, seed=seed), device=device)
        cfg = self._cfg
        self._mean = self._tensor(cfg.mean)
        self._std = self._tensor(cfg.std)
        self._low = None if cfg.low is None else self._tensor(cfg.low)
        self._high = None if cfg.high is None else self._tensor(cfg.high)

    @classmethod
    def from_cfg(cls, cfg: NormalCfg, *, device: torch.device | str = "cpu") -> NormalSampler:
        return cls(cfg.mean, cfg.std, cfg.low, cfg.high, seed=cfg.seed, device=device)

    def _sample(self, n: int) -> torch.Tensor:
        noise = torch.randn((n, *self.shape), generator=self._generator, device=self._device)
        value = noise.mul_(self._std).add_(self._mean)
        if self._low is None and self._high is None:
            return value
        return torch.clamp(value, self._low, self._high)


class ChoiceSampler(Sampler[ChoiceCfg]):
    """Categorical draws among ``choices``, returned as int64 codes (indices into them).

    ``decode(codes)`` maps codes back to the choices; ``labels[code]`` is what records,
    messages and tables carry for each code.
    """

    def __init__(
        self,
        choices: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        labels: Sequence[Label] | None = None,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(ChoiceCfg(choices, weights, labels, seed=seed), device=device)
        cfg = self._cfg
        self._choices = tuple(cfg.choices)
        self._labels = tuple(cfg.labels or ())
        self._weights = None if cfg.weights is None else self._tensor(cfg.weights)

    @classmethod
    def from_cfg(cls, cfg: ChoiceCfg, *, device: torch.device | str = "cpu") -> ChoiceSampler:
        return cls(cfg.choices, cfg.weights, labels=cfg.labels, seed=cfg.seed, device=device)

    @property
    def choices(self) -> tuple[Any, ...]:
        return self._choices

    @property
    def labels(self) -> tuple[Label, ...]:
        return self._labels

    def decode(self, codes: torch.Tensor) -> list[Any]:
        """The choice behind each code (reads ``codes`` to the host)."""
        return [self._choices[int(c)] for c in codes.reshape(-1).tolist()]

    def _sample(self, n: int) -> torch.Tensor:
        if self._weights is None:
            k = len(self._choices)
            return torch.randint(k, (n,), generator=self._generator, device=self._device)
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self._device)
        return torch.multinomial(self._weights, n, replacement=True, generator=self._generator)


class DesignSampler(Sampler[DesignCfg]):
    """Float32 values taken in order from a design: each draw returns the next rows.

    Row ``i`` of a draw goes to the ``i``-th requested world. A draw that asks for more rows
    than are left raises :class:`VariationError` and takes none.
    """

    def __init__(
        self,
        values: Any,
        low: Bounds | None = None,
        high: Bounds | None = None,
        *,
        seed: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(DesignCfg(values, low, high, seed=seed), device=device)
        self._values: torch.Tensor = self._cfg.values.to(self._device)
        self._next = 0

    @classmethod
    def from_cfg(cls, cfg: DesignCfg, *, device: torch.device | str = "cpu") -> DesignSampler:
        return cls(cfg.values, cfg.low, cfg.high, seed=cfg.seed, device=device)

    @property
    def rows(self) -> int:
        """Number of rows in the design."""
        return self._cfg.rows

    @property
    def remaining(self) -> int:
        """Number of rows not drawn yet."""
        return self.rows - self._next

    def _sample(self, n: int) -> torch.Tensor:
        if n > self.remaining:
            raise VariationError(
                f"design: expected a draw of at most the {self.remaining} rows left "
                f"({self._next} of {self.rows} used), got a draw of {n}; give a design with at "
                f"least {self._next + n} rows"
            )
        value = self._values[self._next:self._next + n].clone()
        self._next += n
        return value
