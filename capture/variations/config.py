"""Sampler configurations: small frozen dataclasses, validated on construction.

A configuration fully determines its sampler's stream: the same configuration (``seed``
included) built on the same device type draws the same values. Building it (``cfg.build()``)
gives a fresh sampler with its own ``torch.Generator``. Every bad value raises
:class:`capture.errors.VariationError` (a ``ValueError``) naming the parameter and the value.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

import torch

from broker.messages import Label

from ..errors import VariationError

if TYPE_CHECKING:
    from .samplers import ChoiceSampler, LogUniformSampler, NormalSampler, Sampler, UniformSampler

__all__ = ["Bounds", "ChoiceCfg", "LogUniformCfg", "NormalCfg", "SamplerCfg", "UniformCfg"]

Bounds: TypeAlias = float | Sequence[float]
"""A scalar, or a vector of per-component values (a per-world value of shape ``(d,)``).
Stored normalized: a ``float`` or a ``tuple`` of floats."""

_U64 = 2**64


class SamplerCfg(Protocol):
    """What every sampler configuration provides."""

    @property
    def seed(self) -> int: ...

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-world shape of one draw (``()`` for scalars)."""
        ...

    def build(self, device: torch.device | str = "cpu") -> Sampler[Any]:
        """A new sampler drawing on ``device``, its generator seeded with ``seed``."""
        ...


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounds(name: str, value: object) -> float | tuple[float, ...]:
    """Normalize a scalar or a 1-D sequence/tensor of finite reals."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if _is_number(value):
        number = float(value)  # type: ignore[arg-type]
        if not math.isfinite(number):
            raise VariationError(f"{name}: expected a finite number, got {value!r}")
        return number
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = list(value)
        if not items:
            raise VariationError(f"{name}: expected a number or a non-empty vector, got {value!r}")
        bad = [v for v in items if not _is_number(v) or not math.isfinite(float(v))]
        if bad:
            raise VariationError(f"{name}: expected finite numbers, got {bad[0]!r} in {value!r}")
        return tuple(float(v) for v in items)
    raise VariationError(f"{name}: expected a number or a sequence of numbers, got {value!r}")


def _shape_of(bounds: Bounds) -> tuple[int, ...]:
    return () if isinstance(bounds, float | int) else (len(bounds),)


def _as_tuple(bounds: Bounds) -> tuple[float, ...]:
    return (float(bounds),) if isinstance(bounds, float | int) else tuple(bounds)


def _same_shape(names: tuple[str, str], a: Bounds, b: Bounds) -> None:
    if _shape_of(a) != _shape_of(b):
        raise VariationError(
            f"{names[0]} and {names[1]}: expected the same shape, got {names[0]}={a!r} "
            f"(shape {_shape_of(a)}) and {names[1]}={b!r} (shape {_shape_of(b)})"
        )


def _ordered(low: Bounds, high: Bounds, *, strict_positive: bool = False) -> None:
    pairs = list(zip(_as_tuple(low), _as_tuple(high), strict=True))
    if strict_positive and any(lo <= 0 for lo, _ in pairs):
        raise VariationError(f"low: expected values > 0 for a log-uniform draw, got low={low!r}")
    if any(lo > hi for lo, hi in pairs):
        raise VariationError(f"low, high: expected low <= high, got low={low!r} > high={high!r}")


def _seed(value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _U64:
        raise VariationError(f"seed: expected an int in [0, 2**64), got {value!r}")
    return value


def _init_range(cfg: UniformCfg | LogUniformCfg, *, strict_positive: bool) -> None:
    """Validate and normalize the ``low``/``high`` bounds and the seed of a range config."""
    low, high = _bounds("low", cfg.low), _bounds("high", cfg.high)
    _same_shape(("low", "high"), low, high)
    _ordered(low, high, strict_positive=strict_positive)
    object.__setattr__(cfg, "low", low)
    object.__setattr__(cfg, "high", high)
    object.__setattr__(cfg, "seed", _seed(cfg.seed))


def check_label(name: str, value: object) -> Label:
    """``value`` if msgpack carries it as a plain scalar (str, bool, 64-bit int, float)."""
    if isinstance(value, bool | str | float):
        return value
    if isinstance(value, int) and -(2**63) <= value < _U64:
        return value
    raise VariationError(
        f"{name}: expected a label msgpack carries as a plain scalar (str, int, float or bool), "
        f"got {type(value).__name__} {value!r}; pass labels=[...] to name non-scalar choices"
    )


@dataclass(frozen=True, slots=True)
class UniformCfg:
    """Uniform draws in ``[low, high]``, per component when the bounds are vectors."""

    low: Bounds
    high: Bounds
    seed: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        _init_range(self, strict_positive=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.low)

    def build(self, device: torch.device | str = "cpu") -> UniformSampler:
        from .samplers import UniformSampler

        return UniformSampler.from_cfg(self, device=device)


@dataclass(frozen=True, slots=True)
class LogUniformCfg:
    """Draws whose logarithm is uniform in ``[log low, log high]``; bounds must be positive."""

    low: Bounds
    high: Bounds
    seed: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        _init_range(self, strict_positive=True)

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.low)

    def build(self, device: torch.device | str = "cpu") -> LogUniformSampler:
        from .samplers import LogUniformSampler

        return LogUniformSampler.from_cfg(self, device=device)


@dataclass(frozen=True, slots=True)
class NormalCfg:
    """Normal draws ``N(mean, std)``, clipped to ``[low, high]`` where those are given."""

    mean: Bounds
    std: Bounds
    low: Bounds | None = None
    high: Bounds | None = None
    seed: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        mean, std = _bounds("mean", self.mean), _bounds("std", self.std)
        _same_shape(("mean", "std"), mean, std)
        if any(s < 0 for s in _as_tuple(std)):
            raise VariationError(f"std: expected values >= 0, got std={std!r}")
        low = None if self.low is None else _bounds("low", self.low)
        high = None if self.high is None else _bounds("high", self.high)
        if low is not None:
            _same_shape(("mean", "low"), mean, low)
        if high is not None:
            _same_shape(("mean", "high"), mean, high)
        if low is not None and high is not None:
            _ordered(low, high)
        for name, value in (("mean", mean), ("std", std), ("low", low), ("high", high)):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "seed", _seed(self.seed))

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.mean)

    def build(self, device: torch.device | str = "cpu") -> NormalSampler:
        from .samplers import NormalSampler

        return NormalSampler.from_cfg(self, device=device)


@dataclass(frozen=True, slots=True)
class ChoiceCfg:
    """Categorical draws among ``choices`` (any objects), optionally weighted.

    Each draw is recorded as an int64 code into ``choices`` and, on the wire and in tables, by
    ``labels[code]``. Labels default to the choices themselves, which then must be plain
    scalars (str, int, float, bool); give ``labels`` explicitly for other choices.
    """

    choices: Sequence[Any]
    weights: Sequence[float] | None = None
    labels: Sequence[Label] | None = None
    seed: int = field(default=0, kw_only=True)

    def __post_init__(self) -> None:
        if isinstance(self.choices, str | bytes) or not isinstance(self.choices, Sequence):
            raise VariationError(f"choices: expected a sequence of choices, got {self.choices!r}")
        choices = tuple(self.choices)
        if not choices:
            raise VariationError("choices: expected at least one choice, got an empty sequence")
        source, base = (choices, "choices") if self.labels is None else (self.labels, "labels")
        if isinstance(source, str | bytes) or not isinstance(source, Sequence):
            raise VariationError(f"labels: expected a sequence of labels, got {source!r}")
        labels = tuple(check_label(f"{base}[{i}]", v) for i, v in enumerate(source))
        if len(labels) != len(choices):
            raise VariationError(
                f"labels: expected {len(choices)} labels (one per choice), got {len(labels)}"
            )
        typed = [(type(v), v) for v in labels]
        if len(set(typed)) != len(typed):
            dup = next(v for i, v in enumerate(labels) if (type(v), v) in typed[:i])
            raise VariationError(f"{base}: expected distinct labels, got {dup!r} more than once")
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "labels", labels)
        object.__setattr__(self, "weights", self._weights(len(choices)))
        object.__setattr__(self, "seed", _seed(self.seed))

    def _weights(self, n: int) -> tuple[float, ...] | None:
        if self.weights is None:
            return None
        weights = _bounds("weights", self.weights)
        if isinstance(weights, float) or len(weights) != n:
            raise VariationError(
                f"weights: expected {n} weights (one per choice), got {self.weights!r}"
            )
        if any(w < 0 for w in weights) or not sum(weights) > 0:
            raise VariationError(
                f"weights: expected non-negative weights with a positive sum, got {self.weights!r}"
            )
        return weights

    @property
    def shape(self) -> tuple[int, ...]:
        return ()

    def build(self, device: torch.device | str = "cpu") -> ChoiceSampler:
        from .samplers import ChoiceSampler

        return ChoiceSampler.from_cfg(self, device=device)
