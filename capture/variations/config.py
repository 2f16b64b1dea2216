"""Sampler configurations: small frozen dataclasses, validated on construction.

A configuration fully determines its sampler's stream: the same configuration (``seed``
included) built on the same device type draws the same values. Building it (``cfg.build()``)
gives a fresh sampler with its own ``torch.Generator``. Every bad value raises
:class:`capture.errors.VariationError` (a ``ValueError``) naming the parameter and the value.

Seeds: ``seed=None`` (the default) means "derive": a :class:`capture.variations.Variation`
seeds its sampler with :func:`derive_seed` of the run seed and its key, so variations left at
the default draw independent, reproducible streams. ``cfg.declaration()`` describes the
distribution as a plain (msgpack/JSON-able) dict, which travels in ``RunStart``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeAlias

import numpy as np
import torch

from broker.messages import Label

from ..errors import VariationError

if TYPE_CHECKING:
    from .samplers import (
        ChoiceSampler,
        DesignSampler,
        LogUniformSampler,
        NormalSampler,
        Sampler,
        UniformSampler,
    )

__all__ = [
    "Bounds",
    "ChoiceCfg",
    "DesignCfg",
    "LogUniformCfg",
    "NormalCfg",
    "SamplerCfg",
    "UniformCfg",
]

Bounds: TypeAlias = float | Sequence[float]
"""A scalar, or a vector of per-component values (a per-world value of shape ``(d,)``).
Stored normalized: a ``float`` or a ``tuple`` of floats."""

_U64 = 2**64


class SamplerCfg(Protocol):
    """What every sampler configuration provides."""

    @property
    def seed(self) -> int | None:
        """The generator's seed; ``None``: derived from the run seed and the variation key."""
        ...

    @property
    def shape(self) -> tuple[int, ...]:
        """Per-world shape of one draw (``()`` for scalars)."""
        ...

    def build(self, device: torch.device | str = "cpu") -> Sampler[Any]:
        """A new sampler drawing on ``device``, its generator seeded with ``seed``
        (``derive_seed(0, "")`` when ``seed`` is ``None``)."""
        ...

    def with_seed(self, seed: int) -> Self:
        """The same configuration with ``seed``."""
        ...

    def declaration(self) -> dict[str, Any]:
        """The distribution as a plain dict: ``kind``, ``shape`` (a list), ``seed`` and, where
        they apply, ``low``/``high``, ``mean``/``std``, ``labels``/``weights``."""
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


def _optional_seed(value: object) -> int | None:
    return None if value is None else _seed(value)


def _plain(bounds: Bounds | None) -> float | list[float] | None:
    """Bounds as the declaration carries them: a float, a list of floats, or ``None``."""
    if bounds is None:
        return None
    return float(bounds) if isinstance(bounds, float | int) else [float(b) for b in bounds]


def _init_range(cfg: UniformCfg | LogUniformCfg, *, strict_positive: bool) -> None:
    """Validate and normalize the ``low``/``high`` bounds and the seed of a range config."""
    low, high = _bounds("low", cfg.low), _bounds("high", cfg.high)
    _same_shape(("low", "high"), low, high)
    _ordered(low, high, strict_positive=strict_positive)
    object.__setattr__(cfg, "low", low)
    object.__setattr__(cfg, "high", high)
    object.__setattr__(cfg, "seed", _optional_seed(cfg.seed))


def _range_declaration(cfg: UniformCfg | LogUniformCfg, kind: str) -> dict[str, Any]:
    return {"kind": kind, "shape": list(cfg.shape), "seed": cfg.seed, "low": _plain(cfg.low),
            "high": _plain(cfg.high)}


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
    seed: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _init_range(self, strict_positive=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.low)

    def build(self, device: torch.device | str = "cpu") -> UniformSampler:
        from .samplers import UniformSampler

        return UniformSampler.from_cfg(self, device=device)

    def with_seed(self, seed: int) -> Self:
        return dataclasses.replace(self, seed=seed)

    def declaration(self) -> dict[str, Any]:
        return _range_declaration(self, "uniform")


@dataclass(frozen=True, slots=True)
class LogUniformCfg:
    """Draws whose logarithm is uniform in ``[log low, log high]``; bounds must be positive."""

    low: Bounds
    high: Bounds
    seed: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _init_range(self, strict_positive=True)

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.low)

    def build(self, device: torch.device | str = "cpu") -> LogUniformSampler:
        from .samplers import LogUniformSampler

        return LogUniformSampler.from_cfg(self, device=device)

    def with_seed(self, seed: int) -> Self:
        return dataclasses.replace(self, seed=seed)

    def declaration(self) -> dict[str, Any]:
        return _range_declaration(self, "log_uniform")


@dataclass(frozen=True, slots=True)
class NormalCfg:
    """Normal draws ``N(mean, std)``, clipped to ``[low, high]`` where those are given."""

    mean: Bounds
    std: Bounds
    low: Bounds | None = None
    high: Bounds | None = None
    seed: int | None = field(default=None, kw_only=True)

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
        object.__setattr__(self, "seed", _optional_seed(self.seed))

    @property
    def shape(self) -> tuple[int, ...]:
        return _shape_of(self.mean)

    def build(self, device: torch.device | str = "cpu") -> NormalSampler:
        from .samplers import NormalSampler

        return NormalSampler.from_cfg(self, device=device)

    def with_seed(self, seed: int) -> Self:
        return dataclasses.replace(self, seed=seed)

    def declaration(self) -> dict[str, Any]:
        return {"kind": "normal", "shape": list(self.shape), "seed": self.seed,
                "low": _plain(self.low), "high": _plain(self.high), "mean": _plain(self.mean),
                "std": _plain(self.std)}


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
    seed: int | None = field(default=None, kw_only=True)

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
        object.__setattr__(self, "seed", _optional_seed(self.seed))

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

    def with_seed(self, seed: int) -> Self:
        return dataclasses.replace(self, seed=seed)

    def declaration(self) -> dict[str, Any]:
        weights = None if self.weights is None else [float(w) for w in self.weights]
        return {"kind": "choice", "shape": [], "seed": self.seed, "labels": list(self.labels or ()),
                "weights": weights}


@dataclass(frozen=True, slots=True, eq=False)
class DesignCfg:
    """Values taken in order from a given design, e.g. a SALib Sobol or Latin-hypercube matrix.

    Each draw of ``n`` values returns the design's next ``n`` rows, row ``i`` for the ``i``-th
    requested world; a fresh sampler starts at row 0, so one design is one designed experiment.
    A 1-D design ``(n,)`` gives scalar values, a 2-D design ``(n, d)`` per-world vectors of
    shape ``(d,)``. Values are kept as float32 (every numeric sampler's dtype), an owned copy.

    Attributes:
        values: The design: a 1-D or 2-D array of finite reals (numpy, torch or nested
            sequences); normalized to a CPU float32 tensor.
        low, high: Bounds of the design space (e.g. the ``bounds`` of a SALib problem); every
            value must lie within them. Default: the design's own minimum and maximum (per
            column for a 2-D design). They go into the declaration.
        seed: Recorded in the declaration like every sampler's; designs draw no random numbers.
    """

    values: Any
    low: Bounds | None = None
    high: Bounds | None = None
    seed: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        values = self._values(self.values)
        shape: tuple[int, ...] = tuple(values.shape[1:])
        low = self._normal(values.amin(0)) if self.low is None else self._bound("low", self.low, shape)
        high = self._normal(values.amax(0)) if self.high is None else self._bound("high", self.high, shape)
        _ordered(low, high)
        # compared in float32, as the draws are: a bound is met by its own float32 rounding
        lo = torch.tensor(low, dtype=torch.float32)
        hi = torch.tensor(high, dtype=torch.float32)
        outside = ((values < lo) | (values > hi)).reshape(len(values), -1).any(1)
        if bool(outside.any()):
            row = int(outside.nonzero()[0, 0])
            raise VariationError(
                f"values: expected every value within [low, high] = [{low!r}, {high!r}], "
                f"got row {row} = {values[row].tolist()!r}"
            )
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "low", low)
        object.__setattr__(self, "high", high)
        object.__setattr__(self, "seed", _optional_seed(self.seed))

    @staticmethod
    def _values(values: object) -> torch.Tensor:
        if isinstance(values, torch.Tensor):
            values = values.detach().cpu().numpy()
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as exc:  # ragged nested sequences
            raise VariationError(f"values: expected a 1-D or 2-D array of numbers, got {values!r}") from exc
        if array.dtype.kind not in "iuf":
            raise VariationError(
                f"values: expected a 1-D or 2-D array of real numbers, got dtype {array.dtype}"
            )
        if array.ndim not in (1, 2) or array.shape[0] == 0 or 0 in array.shape:
            raise VariationError(
                f"values: expected a non-empty 1-D (n,) or 2-D (n, d) design, got shape {array.shape}"
            )
        if not np.isfinite(array).all():
            raise VariationError("values: expected finite numbers, got nan or inf in the design")
        return torch.from_numpy(np.array(array, dtype=np.float32))

    @staticmethod
    def _bound(name: str, value: Bounds, shape: tuple[int, ...]) -> float | tuple[float, ...]:
        bounds = _bounds(name, value)
        if _shape_of(bounds) != shape:
            raise VariationError(
                f"{name}: expected the shape of one design row {shape}, got {name}={bounds!r} "
                f"(shape {_shape_of(bounds)})"
            )
        return bounds

    @staticmethod
    def _normal(bounds: torch.Tensor) -> float | tuple[float, ...]:
        return float(bounds) if bounds.dim() == 0 else tuple(float(b) for b in bounds.tolist())

    @property
    def rows(self) -> int:
        """Number of rows (draws of one world) in the design."""
        return int(self.values.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.values.shape[1:])

    def build(self, device: torch.device | str = "cpu") -> DesignSampler:
        from .samplers import DesignSampler

        return DesignSampler.from_cfg(self, device=device)

    def with_seed(self, seed: int) -> Self:
        return dataclasses.replace(self, seed=seed)

    def declaration(self) -> dict[str, Any]:
        return {"kind": "design", "shape": list(self.shape), "seed": self.seed,
                "low": _plain(self.low), "high": _plain(self.high)}
