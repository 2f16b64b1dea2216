"""Given-data sensitivity indices (SALib's PAWN, RBD-FAST and delta) with 95% intervals.

Every method takes the rows of an (X, Y) table as they are (no designed sample needed) and
returns one index per column of X with a 95% confidence interval:

- ``pawn`` (:func:`SALib.analyze.pawn.analyze`, the median KS distance over ``slides``
  conditioning intervals): fits every factor and every output. A categorical factor is
  conditioned on each of its labels instead of on quantile slides (codes have no order). SALib
  gives no interval: it comes from a bootstrap over episodes (percentile interval shifted by
  the bootstrap's bias estimate), whose replicates use a vectorized twin of SALib's statistic
  (the same slides, the same KS distance; a test checks the two agree).
- ``rbd_fast`` (:func:`SALib.analyze.rbd_fast.analyze`, first-order effect): fits ordered
  (non-categorical) factors; the interval is SALib's own (``S1 ± S1_conf``).
- ``delta`` (:func:`SALib.analyze.delta.analyze`, Borgonovo's moment-independent delta, the
  ``raw`` bootstrap): fits ordered factors and non-binary outputs only (its kernel density
  estimate degenerates on a 0/1 outcome); the interval is SALib's own
  (``delta_raw ± delta_raw_conf``). It is slow (seconds per factor), so it is not a default.

Where a method does not fit a factor or an output, its index is NaN and a note says why.
SALib is imported on first use; its warnings are collected as notes and its use of numpy's
global random state is undone.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ._deps import require
from .errors import SensitivityError

__all__ = ["DEFAULT_METHODS", "METHODS", "MethodResult", "compute", "pawn_statistic"]

METHODS: Final = ("pawn", "rbd_fast", "delta")
DEFAULT_METHODS: Final = ("pawn", "rbd_fast")
_SLIDES: Final = 10
_HARMONICS: Final = 10


@dataclass(slots=True)
class MethodResult:
    """One method's indices for every column of X (NaN where it does not fit)."""

    index: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    notes: list[str] = field(default_factory=list)


def _nan(d: int) -> MethodResult:
    return MethodResult(np.full(d, np.nan), np.full(d, np.nan), np.full(d, np.nan))


@contextlib.contextmanager
def _contained(notes: list[str], what: str) -> Iterator[None]:
    """Run SALib code with its warnings collected and numpy's global RNG state restored."""
    state = np.random.get_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            np.random.set_state(state)
    for w in caught[:5]:
        notes.append(f"{what}: {str(w.message).strip()}")


def _problem(d: int) -> dict[str, Any]:
    # Neutral names: SALib's delta rejects some suffixes, and bounds only matter to samplers.
    return {"num_vars": d, "names": [f"x{i}" for i in range(d)], "bounds": [[0.0, 1.0]] * d}


def pawn_statistic(x: np.ndarray, y: np.ndarray, categorical: Sequence[bool],
                   levels: Sequence[int], slides: int = _SLIDES) -> np.ndarray:
    """The PAWN index (median KS distance over conditioning slides) of each column of ``x``.

    Equal to SALib's ``pawn.analyze(...)["median"]`` for ordered columns: the same slides
    ``[q_s, q_{s+1})`` between quantiles (so the top slide leaves out the maximum, as SALib's
    does), the KS distance between the slide's outcomes and all outcomes. A categorical
    column is conditioned on each code ``0 .. levels[j] - 1``.
    """
    n, d = x.shape
    values, codes = np.unique(y, return_inverse=True)
    u = values.size
    overall = np.cumsum(np.bincount(codes, minlength=u)) / n
    step = 1 / slides
    fractions = np.arange(0, 1 + step, step)
    out = np.full(d, np.nan)
    for j in range(d):
        col = x[:, j]
        if categorical[j]:
            k = int(levels[j])
            sid = col.astype(np.int64)
            valid = (sid >= 0) & (sid < k)
        else:
            k = slides
            quantile = np.nanquantile if np.isnan(col).any() else np.quantile
            q = quantile(col, fractions)[: slides + 1]
            sid = np.searchsorted(q, col, side="right") - 1
            valid = (sid >= 0) & (sid < slides)
            valid &= col < q[np.clip(sid + 1, 0, slides)]
        hist = np.bincount(sid[valid] * u + codes[valid], minlength=k * u).reshape(k, u)
        counts = hist.sum(axis=1)
        full = counts > 0
        if not full.any():
            continue
        cdf = np.cumsum(hist[full], axis=1) / counts[full, None]
        out[j] = float(np.median(np.abs(cdf - overall).max(axis=1)))
    return out


def _pawn(x: np.ndarray, y: np.ndarray, categorical: Sequence[bool], levels: Sequence[int],
          rng: np.random.Generator, resamples: int) -> MethodResult:
    d = x.shape[1]
    result = _nan(d)
    ordered = [j for j in range(d) if not categorical[j]]
    point = pawn_statistic(x, y, categorical, levels)
    if ordered:
        pawn = require("SALib.analyze.pawn")
        with _contained(result.notes, "pawn"):
            si = pawn.analyze(_problem(len(ordered)), x[:, ordered], y, S=_SLIDES)
        point[ordered] = np.asarray(si["median"], dtype=np.float64)
    reps = np.empty((resamples, d))
    n = x.shape[0]
    for b in range(resamples):
        idx = rng.integers(0, n, size=n)
        reps[b] = pawn_statistic(x[idx], y[idx], categorical, levels)
    result.index = point
    if resamples >= 2:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            # Resampled slides hold repeated episodes, which inflates KS distances: the
            # percentile interval is shifted by the bootstrap's estimate of that bias.
            bias = np.nanmean(reps, axis=0) - point
            low, high = np.nanpercentile(reps, [2.5, 97.5], axis=0)
        result.ci_low, result.ci_high = low - bias, high - bias
    return result


def _rbd_fast(x: np.ndarray, y: np.ndarray, categorical: Sequence[bool], seed: int,
              resamples: int) -> MethodResult:
    d = x.shape[1]
    result = _nan(d)
    ordered = [j for j in range(d) if not categorical[j]]
    if len(categorical) > len(ordered):
        result.notes.append("rbd_fast: not applied to categorical factors (it needs an order)")
    if not ordered:
        return result
    if x.shape[0] <= 4 * _HARMONICS:
        result.notes.append(f"rbd_fast: needs more than {4 * _HARMONICS} episodes, got {x.shape[0]}")
        return result
    rbd = require("SALib.analyze.rbd_fast")
    with _contained(result.notes, "rbd_fast"):
        si = rbd.analyze(_problem(len(ordered)), x[:, ordered], y, M=_HARMONICS,
                         num_resamples=max(resamples, 2), conf_level=0.95, seed=seed)
    s1 = np.asarray(si["S1"], dtype=np.float64)
    conf = np.asarray(si["S1_conf"], dtype=np.float64)
    result.index[ordered] = s1
    result.ci_low[ordered] = s1 - conf
    result.ci_high[ordered] = s1 + conf
    return result


def _delta(x: np.ndarray, y: np.ndarray, categorical: Sequence[bool], binary: bool, seed: int,
           resamples: int) -> MethodResult:
    d = x.shape[1]
    result = _nan(d)
    if binary:
        result.notes.append("delta: not applied to a binary output (its density estimate "
                            "degenerates on two values)")
        return result
    ordered = [j for j in range(d) if not categorical[j]]
    if len(categorical) > len(ordered):
        result.notes.append("delta: not applied to categorical factors (it needs an order)")
    if not ordered:
        return result
    delta = require("SALib.analyze.delta")
    with _contained(result.notes, "delta"):
        si = delta.analyze(_problem(len(ordered)), x[:, ordered], y,
                           num_resamples=max(resamples, 2), conf_level=0.95,
                           seed=seed % (2**32 - 1) + 1, method="delta")
    value = np.asarray(si["delta_raw"], dtype=np.float64)
    conf = np.asarray(si["delta_raw_conf"], dtype=np.float64)
    result.index[ordered] = value
    result.ci_low[ordered] = value - conf
    result.ci_high[ordered] = value + conf
    return result


def compute(method: str, x: np.ndarray, y: np.ndarray, *, categorical: Sequence[bool],
            levels: Sequence[int], binary: bool, seed: int, resamples: int) -> MethodResult:
    """The indices of ``method`` for every column of ``x`` (complete rows only) on output ``y``.

    Raises:
        SensitivityError: ``method`` is unknown.
        MissingDependencyError: SALib is not installed.
    """
    if method not in METHODS:
        raise SensitivityError(f"method: expected one of {', '.join(METHODS)}, got {method!r}")
    d = x.shape[1]
    if x.shape[0] < 2 or math.isclose(float(np.ptp(y)) if y.size else 0.0, 0.0):
        result = _nan(d)
        result.notes.append(f"{method}: the output is constant over {x.shape[0]} episodes")
        return result
    if method == "pawn":
        return _pawn(x, y, categorical, levels, np.random.default_rng(seed), resamples)
    if method == "rbd_fast":
        return _rbd_fast(x, y, categorical, seed, resamples)
    return _delta(x, y, categorical, binary, seed, resamples)
