"""Hand-written CPU reductions for :class:`~consumers.LiveStatistics`, compiled by numba: the
moments of a float field (:func:`moments`) and the count of a bool field (:func:`counts`).

numba is optional (``pip install 'worldtap[fast]'``): :func:`available` says whether it
imports; each kernel is compiled at its first use (under a second, cached on disk where numba
can write its cache).

Where numba's threading layer may be called from any thread (OpenMP or TBB, not numba's own
workqueue, which aborts when two threads launch at once), :func:`moments_parts` reduces a large
batch's rows in parts on several threads (:func:`threads` says how many it may use).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ARITY", "CHUNK_ROWS", "available", "counts", "moments", "moments_group", "moments_parts", "threads"]

CHUNK_ROWS = 16
"""Rows read as one wide row, and values each accumulator sums in the compute dtype before its
sum is added to a float64 total: a float32 chunk sum has at most 16 roundings, a relative error
below ``16 * 2**-24``."""

ARITY = 8
"""Arrays in each call of :func:`moments_group` and :func:`moments_parts`: a group of more
fields takes several calls, and a call of fewer repeats one of them (not read). A tuple's
length is part of the type numba compiles for, so a fixed one makes one compiled variant per
dtype serve every field layout (seconds of compilation each, and numba refuses tuples of more
than 100 arrays in a parallel loop)."""

Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]
Counter = Callable[[np.ndarray, np.ndarray], None]

_compiled: Kernel | None = None
_counter: Counter | None = None
_importable: bool | None = None
_group: Callable[..., None] | None = None
_parts: Callable[..., None] | None = None
_threads: int | None = None
_forked = False

SAFE_LAYERS = frozenset({"omp", "tbb"})
"""numba's threading layers that any thread may launch at any time (its ``workqueue`` layer
aborts the process when two threads launch parallel work at once)."""


def _after_fork() -> None:  # a child of a fork keeps its parent's threading layer, whose
    global _forked            # threads did not come with it: numba terminates a child that
    _forked = True            # launches GNU OpenMP work its parent started


os.register_at_fork(after_in_child=_after_fork)


def available() -> bool:
    """Whether numba is installed and imports here (it is imported once, at the first call)."""
    global _importable
    if _importable is None:
        try:
            import numba  # noqa: F401
        except ImportError:
            _importable = False
        else:
            _importable = True
    return _importable


def _moments(x: Any, shift: Any, s1: Any, s2: Any, lo: Any, hi: Any) -> None:  # pragma: no cover (compiled)
    """One pass over ``x`` (``[rows, columns]``, C-contiguous, rows >= 1): per column the sum of
    ``x - shift``, the sum of its squares, the minimum and the maximum, written to ``s1``, ``s2``,
    ``lo`` and ``hi``. A NaN anywhere in a column makes its minimum and maximum NaN, as
    :func:`torch.amin` and :func:`torch.amax` do.

    The rows are read ``CHUNK_ROWS`` at a time as one wide row of ``CHUNK_ROWS * columns``
    contiguous values, so the inner loop is long and vectorizes whatever the field's width (a
    loop over a narrow row spends its time in its scalar remainder); each of the wide row's
    values has its own accumulators, and the ``CHUNK_ROWS`` accumulators of a column are added
    at the end. The inner loop takes four wide rows at once, so each accumulator is loaded and
    stored once per four values (one at a time, the stores bound the loop). Sums are taken
    over ``CHUNK_ROWS`` wide rows in the compute dtype (``shift``'s; four rows summed pairwise,
    then added), then in float64. The minimum and the maximum are selections (``v < m``),
    which vectorize but pass over a NaN; a column whose sum is not finite is searched for NaN
    at the end.
    """
    n, w = x.shape
    groups = n // CHUNK_ROWS
    width = CHUNK_ROWS * w
    wide = x[:groups * CHUNK_ROWS].reshape(groups, width)
    first = x[0]
    sh = np.empty(width, shift.dtype)
    a = np.empty(width, x.dtype)
    b = np.empty(width, x.dtype)
    for k in range(CHUNK_ROWS):
        sh[k * w:(k + 1) * w] = shift
        a[k * w:(k + 1) * w] = first
        b[k * w:(k + 1) * w] = first
    c1 = np.zeros(width, shift.dtype)
    c2 = np.zeros(width, shift.dtype)
    t1 = np.zeros(width, np.float64)
    t2 = np.zeros(width, np.float64)
    for g0 in range(0, groups, CHUNK_ROWS):
        end = min(g0 + CHUNK_ROWS, groups)
        g = g0
        while g + 4 <= end:
            r0, r1, r2, r3 = wide[g], wide[g + 1], wide[g + 2], wide[g + 3]
            for j in range(width):
                s = sh[j]
                v0, v1, v2, v3 = r0[j], r1[j], r2[j], r3[j]
                d0, d1, d2, d3 = v0 - s, v1 - s, v2 - s, v3 - s
                c1[j] += (d0 + d1) + (d2 + d3)
                c2[j] += (d0 * d0 + d1 * d1) + (d2 * d2 + d3 * d3)
                m = a[j]
                m = v0 if v0 < m else m
                m = v1 if v1 < m else m
                m = v2 if v2 < m else m
                a[j] = v3 if v3 < m else m
                m = b[j]
                m = v0 if v0 > m else m
                m = v1 if v1 > m else m
                m = v2 if v2 > m else m
                b[j] = v3 if v3 > m else m
            g += 4
        for h in range(g, end):  # the last chunk's wide rows after its fours
            row = wide[h]
            for j in range(width):
                v = row[j]
                d = v - sh[j]
                c1[j] += d
                c2[j] += d * d
                m = a[j]
                a[j] = v if v < m else m
                m = b[j]
                b[j] = v if v > m else m
        for j in range(width):
            t1[j] += c1[j]
            t2[j] += c2[j]
            c1[j] = 0
            c2[j] = 0
    for j in range(w):
        u1 = 0.0
        u2 = 0.0
        p = first[j]
        q = first[j]
        for k in range(CHUNK_ROWS):
            u1 += t1[k * w + j]
            u2 += t2[k * w + j]
            m = a[k * w + j]
            p = m if m < p else p
            m = b[k * w + j]
            q = m if m > q else q
        for r in range(groups * CHUNK_ROWS, n):  # the rows after the whole chunks
            v = x[r, j]
            d = v - shift[j]
            u1 += d
            u2 += d * d
            p = v if v < p else p
            q = v if v > q else q
        s1[j] = u1
        s2[j] = u2
        lo[j] = p
        hi[j] = q
        if not np.isfinite(u1):  # a NaN or an infinity in the column: is there a NaN?
            for r in range(n):
                if np.isnan(x[r, j]):
                    lo[j] = np.nan
                    hi[j] = np.nan
                    break


def _counts(x: Any, out: Any) -> None:  # pragma: no cover (compiled)
    """Per column of ``x`` (``[rows, columns]`` of 0 and 1, a bool field viewed as uint8), the
    number of ones, written to ``out``. Rows are read as wide rows, as :func:`_moments` does
    (a field of one column would otherwise be a loop of one value per row)."""
    n, w = x.shape
    groups = n // CHUNK_ROWS
    width = CHUNK_ROWS * w
    wide = x[:groups * CHUNK_ROWS].reshape(groups, width)
    t = np.zeros(width, np.int64)
    for g in range(groups):
        row = wide[g]
        for j in range(width):
            t[j] += row[j]
    for j in range(w):
        u = 0
        for k in range(CHUNK_ROWS):
            u += t[k * w + j]
        for r in range(groups * CHUNK_ROWS, n):  # the rows after the whole chunks
            u += x[r, j]
        out[j] = u


def counts() -> Counter:
    """The compiled count of a bool field's true values per column (as :func:`moments`).

    Raises:
        ImportError: numba is not installed.
    """
    global _counter
    if _counter is None:
        import numba

        _counter = numba.njit(nogil=True, cache=True, boundscheck=False)(_counts)
    return _counter


def moments() -> Kernel:
    """The compiled kernel (compiled once per process; each new dtype or memory layout of its
    arguments compiles a variant at its first call).

    Raises:
        ImportError: numba is not installed.
    """
    global _compiled
    if _compiled is None:
        import numba

        # No fastmath: it would let the compiler drop the NaN tests of the minimum and maximum.
        _compiled = numba.njit(nogil=True, cache=True, boundscheck=False)(_moments)
    return _compiled


def threads() -> int:
    """The threads :func:`moments_parts` may use: numba's, where its threading layer is one of
    :data:`SAFE_LAYERS`, else 1 (and 1 in a child of a fork). Starting the threading layer
    once (at the first call) chooses it for the process, as numba's first parallel work would;
    torch's thread count stays what it was.

    Raises:
        ImportError: numba is not installed.
    """
    global _threads
    if _forked:
        return 1
    if _threads is None:
        import numba
        import torch

        kept = torch.get_num_threads()
        count = numba.get_num_threads()  # starts the threading layer, which sets OpenMP's thread
        torch.set_num_threads(kept)      # count for the process: torch's would change with it
        _threads = count if numba.threading_layer() in SAFE_LAYERS else 1  # type: ignore[attr-defined]
    return _threads


def moments_group() -> Callable[..., None]:
    """The compiled :func:`consumers._parallel.moments_group`: the moments of up to
    :data:`ARITY` fields of a group (a tuple of exactly that many arrays, and how many of them
    to read) over all their rows, on the calling thread, into an output ``[4, columns]``.

    Raises:
        ImportError: numba is not installed.
    """
    global _group
    if _group is None:
        from . import _parallel

        _group = _parallel.moments_group
    return _group


def moments_parts() -> Callable[..., None]:
    """The compiled :func:`consumers._parallel.moments_parts`: the moments of up to
    :data:`ARITY` fields of a group (a tuple of exactly that many arrays, and how many of them
    to read) in parts of rows, a part per thread, each into its own row of an output
    ``[parts, 4, columns]``. Use it only where :func:`threads` is above 1.

    Raises:
        ImportError: numba is not installed.
    """
    global _parts
    if _parts is None:
        from . import _parallel

        _parts = _parallel.moments_parts
    return _parts
