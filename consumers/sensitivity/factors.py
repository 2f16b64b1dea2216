"""Factors of an (X, Y) table, their fixed-bound bins, and conditional outcome rates per bin.

Bins come from each variation's declaration (never from the data, unless no declaration
exists): ``uniform`` and ``design`` split ``[low, high]`` linearly, ``log_uniform`` splits it
in log space, ``normal`` uses its clip bounds or ``mean ± 3 std`` where a bound is missing,
``choice`` gives one bin per label. A factor without a declaration is binned between the
data's minimum and maximum and flagged ``bounds="data"`` in every output. Values outside the
bounds are counted (``outside``) and fall into the end bins.

Intervals: binary outcomes (every value 0 or 1) get Wilson score intervals for the rate in each
bin; other outcomes get percentile bootstrap intervals for the mean (episodes resampled).
A bin holding fewer than :data:`MIN_BIN_EPISODES` episodes raises a sample-sufficiency warning.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ..sample_table import SampleArrays

__all__ = [
    "MIN_BIN_EPISODES",
    "Factor",
    "RateRow",
    "conditional_rates",
    "factors_of",
    "is_binary",
]

MIN_BIN_EPISODES: Final = 30
"""A bin with fewer episodes than this triggers the sample-sufficiency warning."""

_Z95: Final = 1.959963984540054
_COMPONENT = re.compile(r"^(?P<key>.+)\[(?P<index>\d+(?:,\d+)*)\]$")


@dataclass(frozen=True, slots=True)
class Factor:
    """One column of X as the analysis sees it.

    Attributes:
        name: The column name (``key`` or ``key[i]`` for a vector component).
        key: The variation key.
        kind: The declared sampler kind, or ``"data"`` when the run declares none.
        categorical: Codes of a ``choice`` variation (one bin per label; no ordering).
        edges: Bin edges (``len(labels) + 1`` half-integers for a categorical factor).
        labels: Label of each code of a categorical factor (else empty).
        bounds: ``"declared"`` or ``"data"`` (from the data's minimum and maximum).
    """

    name: str
    key: str
    kind: str
    categorical: bool
    edges: tuple[float, ...]
    labels: tuple[Any, ...] = ()
    bounds: str = "declared"

    @property
    def low(self) -> float:
        return self.edges[0]

    @property
    def high(self) -> float:
        return self.edges[-1]

    def bin_of(self, values: np.ndarray) -> np.ndarray:
        """The bin index of each value (values outside the bounds go to the end bins)."""
        edges = np.asarray(self.edges)
        return np.clip(np.searchsorted(edges, values, side="right") - 1, 0, len(edges) - 2)

    def outside(self, values: np.ndarray) -> int:
        """How many values lie outside the bounds (a tolerance of float32 rounding)."""
        tol = 1e-6 * max(1.0, abs(self.low), abs(self.high))
        return int(((values < self.low - tol) | (values > self.high + tol)).sum())


@dataclass(frozen=True, slots=True)
class RateRow:
    """The outcome in one bin of one factor.

    Attributes:
        statistic: ``"rate"`` (binary outcome, Wilson interval) or ``"mean"`` (bootstrap).
        value, ci_low, ci_high: The rate or mean and its 95% interval (NaN for an empty bin).
    """

    factor: str
    output: str
    bin: int
    low: float
    high: float
    center: float
    label: Any
    n: int
    statistic: str
    value: float
    ci_low: float
    ci_high: float


def _component(name: str) -> tuple[str, tuple[int, ...]]:
    m = _COMPONENT.match(name)
    if m is None:
        return name, ()
    return m["key"], tuple(int(i) for i in m["index"].split(","))


def _pick(bound: Any, index: tuple[int, ...], shape: list[int]) -> float | None:
    """One component of a declared bound (a float, or a list for vector variations)."""
    if bound is None:
        return None
    flat = np.asarray(bound, dtype=np.float64).reshape(-1)
    if flat.size == 1:
        return float(flat[0])
    if not index:
        return None
    where = int(np.ravel_multi_index(index, shape)) if len(shape) == len(index) else index[-1]
    return float(flat[where]) if where < flat.size else None


def _declared_range(decl: Mapping[str, Any], index: tuple[int, ...]) -> tuple[float, float] | None:
    shape = [int(s) for s in decl.get("shape", [])]
    kind = decl.get("kind")
    low, high = _pick(decl.get("low"), index, shape), _pick(decl.get("high"), index, shape)
    if kind == "normal":
        mean, std = _pick(decl.get("mean"), index, shape), _pick(decl.get("std"), index, shape)
        if mean is not None and std is not None:
            low = mean - 3 * std if low is None else low
            high = mean + 3 * std if high is None else high
    if low is None or high is None or not math.isfinite(low) or not math.isfinite(high):
        return None
    return low, high


def _labels(key: str, arrays: SampleArrays, codes: np.ndarray, decl: Mapping[str, Any] | None) -> tuple[Any, ...]:
    declared = list(decl.get("labels") or ()) if decl else []
    seen = arrays.labels.get(key)
    top = int(np.nanmax(codes)) + 1 if codes.size and not np.isnan(codes).all() else 0
    out: list[Any] = declared + [None] * max(0, top - len(declared))
    if seen is not None:
        for code in range(len(out)):
            if out[code] is None:
                hit = np.flatnonzero(codes == code)
                if hit.size:
                    out[code] = seen[hit[0]]
    return tuple(code if label is None else label for code, label in enumerate(out))


def factors_of(arrays: SampleArrays, declarations: Mapping[str, Mapping[str, Any]] | None,
               *, bins: int = 10) -> list[Factor]:
    """One :class:`Factor` per column of ``arrays.x``, with bins from ``declarations``
    (variation key -> declaration; keys without one are binned on the data's range)."""
    declarations = declarations or {}
    out: list[Factor] = []
    for j, name in enumerate(arrays.x_columns):
        key, index = (name, ()) if name in declarations or name in arrays.labels else _component(name)
        decl = declarations.get(key)
        if decl is not None and not isinstance(decl, Mapping):
            decl = None
        column = arrays.x[:, j]
        finite = column[np.isfinite(column)]
        if key in arrays.labels or (decl is not None and decl.get("kind") == "choice"):
            labels = _labels(key, arrays, column, decl)
            edges = tuple(float(e) for e in np.arange(len(labels) + 1) - 0.5)
            source = "declared" if decl is not None and decl.get("labels") else "data"
            out.append(Factor(name, key, str(decl.get("kind")) if decl else "data", True,
                              edges, labels, source))
            continue
        declared = _declared_range(decl, index) if decl is not None else None
        if declared is not None and declared[1] > declared[0]:
            low, high = declared
            kind, source = str(decl.get("kind")) if decl else "data", "declared"
        else:
            low = float(finite.min()) if finite.size else 0.0
            high = float(finite.max()) if finite.size else 1.0
            kind, source = (str(decl.get("kind")) if decl else "data"), "data"
            if high <= low:
                high = low + 1.0
        if kind == "log_uniform" and low > 0:
            edges = tuple(float(e) for e in np.geomspace(low, high, bins + 1))
        else:
            edges = tuple(float(e) for e in np.linspace(low, high, bins + 1))
        out.append(Factor(name, key, kind, False, edges, (), source))
    return out


def is_binary(y: np.ndarray) -> bool:
    """Whether every finite value of ``y`` is 0 or 1 (a rate, not a mean)."""
    finite = y[np.isfinite(y)]
    return bool(finite.size) and bool(np.isin(finite, (0.0, 1.0)).all())


def wilson(successes: float, n: int, z: float = _Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate (``(nan, nan)`` for ``n == 0``)."""
    if n == 0:
        return math.nan, math.nan
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def _bootstrap_mean(values: np.ndarray, rng: np.random.Generator, resamples: int) -> tuple[float, float]:
    if values.size == 0:
        return math.nan, math.nan
    if values.size == 1 or resamples < 2:
        return float(values[0]), float(values[0])
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return float(low), float(high)


def conditional_rates(factor: Factor, x: np.ndarray, y: np.ndarray, output: str, *,
                      rng: np.random.Generator, resamples: int = 200) -> list[RateRow]:
    """The outcome ``y`` in each bin of ``factor`` (rows where both are finite)."""
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    which = factor.bin_of(x)
    binary = is_binary(y)
    rows: list[RateRow] = []
    for b in range(len(factor.edges) - 1):
        sel = y[which == b]
        lo, hi = factor.edges[b], factor.edges[b + 1]
        center = b if factor.categorical else (
            math.sqrt(lo * hi) if factor.kind == "log_uniform" and lo > 0 else (lo + hi) / 2)
        label = factor.labels[b] if factor.categorical else None
        if binary:
            value = float(sel.mean()) if sel.size else math.nan
            ci = wilson(float(sel.sum()), int(sel.size))
        else:
            value = float(sel.mean()) if sel.size else math.nan
            ci = _bootstrap_mean(sel, rng, resamples)
        rows.append(RateRow(factor.name, output, b, lo, hi, float(center), label, int(sel.size),
                            "rate" if binary else "mean", value, ci[0], ci[1]))
    return rows
