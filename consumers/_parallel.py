"""The moments kernel of :mod:`consumers._kernels` over a group of fields, up to
:data:`consumers._kernels.ARITY` fields a call: on the calling thread (:func:`moments_group`), or
with a batch's rows cut into parts that numba's threading layer reduces each on a thread of its
own into a window row of its own (:func:`moments_parts`; the window's rows add up, see
:class:`consumers.live_stats._Group`).

Imported by :func:`consumers._kernels.moments_group` and :func:`consumers._kernels.moments_parts`
only, once numba is known to import.
"""

from __future__ import annotations

from typing import Any

import numba

from . import _kernels

_moments = _kernels.moments()


@numba.njit(nogil=True, cache=True, boundscheck=False)
def moments_group(fields: Any, count: int, shift: Any, starts: Any, out: Any) -> None:  # pragma: no cover (compiled)
    """Reduce the first ``count`` arrays of ``fields`` (as :func:`moments_parts` takes them) whole,
    on the calling thread, into ``out`` (``[4, columns]``): one call for up to
    :data:`consumers._kernels.ARITY` fields, where a call per field costs the dispatch and the
    slicing of its outputs in Python each time."""
    for i in range(count):
        a, b = starts[i], starts[i + 1]
        _moments(fields[i], shift[a:b], out[0, a:b], out[1, a:b], out[2, a:b], out[3, a:b])


@numba.njit(parallel=True, nogil=True, cache=True, boundscheck=False)
def moments_parts(fields: Any, count: int, shift: Any, starts: Any, out: Any,
                  rows: int) -> None:  # pragma: no cover (compiled)
    """Reduce the first ``count`` arrays of ``fields`` (a tuple of :data:`consumers._kernels.ARITY`
    ``[n, columns_i]`` C-contiguous arrays of one dtype; the others repeat one of them and are
    not read), the columns ``starts[i]:starts[i + 1]`` of the group, in parts of ``rows`` rows:
    part ``t`` (rows ``t * rows`` to ``(t + 1) * rows``, the last one shorter) writes the shifted
    sums, sums of squares, minima and maxima of its rows to ``out[t]`` (``[parts, 4, columns]``),
    as :func:`consumers._kernels.moments` does for a whole field. Every part has a row."""
    n = fields[0].shape[0]
    for t in numba.prange(out.shape[0]):
        r0 = t * rows
        r1 = min(n, r0 + rows)
        for i in range(count):
            a, b = starts[i], starts[i + 1]
            _moments(fields[i][r0:r1], shift[a:b], out[t, 0, a:b], out[t, 1, a:b], out[t, 2, a:b], out[t, 3, a:b])
