"""Live statistics: running per-field moments and episode outcomes, computed on the device.

Each batch is reduced with a fixed number of tensor operations per dtype and block of rows,
whatever the number of fields: the fields of one dtype are concatenated into one reused
``[rows, columns]`` buffer (on the CPU a block of at most ``_BLOCK_ROWS`` rows at a time, which
stays in the last-level cache across the passes over it; elsewhere the whole batch), whose columns are
reduced for the minimum and the maximum, then shifted and summed, and summed again squared. The
results go to a row of a window; its rows share one shift and add up, and when it is full (or
read) they are merged as one batch into float64 accumulators with Chan et al.'s update, and the
shift moves to their mean. The shift keeps the sums those of values near the data, so that a
large mean does not swamp a small variance; the running mean is kept as an offset from it.
Nothing is read back to the host until :meth:`LiveStatistics.summary`.

On the CPU, where numba is installed (``worldtap[fast]``), float32, float64 and bool fields
are instead reduced by hand-written kernels (:mod:`consumers._kernels`) that read each field
once and write its window row: no concatenation, no torch operation, one pass; a large batch
in parts on several threads, each part into a window row of its own. With
``LiveStatistics(kernel="compile")`` each dtype's fields are reduced by one function compiled
with :func:`torch.compile`, which also reads each field once: one fused kernel per field on the
CPU, about as many on CUDA.
"""

from __future__ import annotations

import itertools
import math
import types
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from broker import Batch, Broker, EpisodeEnd, Message, Subscription

from . import _kernels

__all__ = ["FieldStatistics", "LiveStatistics", "LiveSummary"]

_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint16, torch.uint32, torch.uint64})

_BLOCK_ROWS = 4096
"""On the CPU, the rows of a batch reduced together: a block of a few MiB stays in the
last-level cache between the passes over it. Not smaller: each pass is one torch operation,
and with several intra-op threads an operation on a block of 1024 rows cost more in waking
and joining the threads than in its work (4096 worlds of the seed payload, 2 threads: 1.0 ms a
batch in blocks of 1024 rows, 0.50 ms in one block; with 1 thread 0.55 and 0.52 ms)."""

_WINDOW_ROWS = 64
"""Blocks reduced about one shift before they are merged into the float64 accumulators."""

_ROW_SPLIT = 16
"""On the CPU, a block's minima and maxima are taken over ``[rows / 16, 16 * columns]`` (a
reduction over the outer dimension vectorizes along a wide inner one); the 16 partial results
per column are reduced when the window is merged."""

Fused = Callable[[list[torch.Tensor], torch.Tensor, torch.dtype], torch.Tensor]

KERNELS = ("auto", "eager", "numba", "compile")
"""The reductions :class:`LiveStatistics` offers (its ``kernel`` argument)."""

_NATIVE_DTYPES = frozenset({torch.float32, torch.float64})
"""The field dtypes the numba kernel reduces (in their own dtype)."""

_PART_BYTES = 512 * 1024
"""On the CPU with numba, the least bytes of a dtype's fields per thread for a batch to be
reduced on several threads (:func:`consumers._kernels.moments_parts`); a smaller batch is
reduced in the calling thread, where waking the others would cost more than they save. At most
``torch.get_num_threads()`` threads (the simulation's setting for its own CPU work)."""


def _moments(parts: list[torch.Tensor], shift: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """A window row (``[4, columns]``, float64) of a batch: per column the sum minus ``shift``,
    the sum of squares of that, the minimum and the maximum; ``parts`` are the fields, each
    ``[chunks, _CHUNK_ROWS, width]``, whose columns follow one another. Written to be compiled:
    each field's reductions become a loop or two over its values. A compiled sum adds each value
    to one running sum, ``k`` values ``k`` roundings (torch's own sums are pairwise), so the sums
    are taken over each chunk's rows in the compute dtype, then over the chunks in float64: a
    float32 sum's relative error stays below ``16 * 2**-24``, 1e-6."""
    s1, s2, lo, hi = [], [], [], []
    start = 0
    f64 = torch.float64
    for part in parts:
        x = part.to(compute)
        width = x.shape[2]
        d = x - shift[start:start + width]
        start += width
        s1.append(d.sum(1).to(f64).sum(0))
        s2.append((d * d).sum(1).to(f64).sum(0))
        lo.append(x.amin(1).amin(0).to(f64))
        hi.append(x.amax(1).amax(0).to(f64))
    return torch.stack([torch.cat(s1), torch.cat(s2), torch.cat(lo), torch.cat(hi)])


_CHUNK_ROWS = _kernels.CHUNK_ROWS


def _compiled_moments() -> Fused:
    """:func:`_moments` compiled for one group of fields. Each group compiles its own copy of the
    function, under its own name: torch.compile keeps the compiled variants of a function, their
    limit, and what it learnt from earlier calls (which sizes changed, and so are compiled as
    dynamic) per code object and name, and another group's field widths must not count as a
    change of this group's."""
    name = f"_moments_{next(_COPIES)}"
    code = _moments.__code__.replace(co_name=name, co_qualname=name)
    return torch.compile(types.FunctionType(code, _moments.__globals__, name))


_COPIES = itertools.count()


@dataclass(frozen=True, slots=True, eq=False)
class FieldStatistics:
    """Moments of one field over every world and step seen; arrays have the per-world shape."""

    count: int
    mean: np.ndarray
    std: np.ndarray
    min: np.ndarray
    max: np.ndarray


@dataclass(frozen=True, slots=True, eq=False)
class LiveSummary:
    """A snapshot of a :class:`LiveStatistics` consumer."""

    batches: int
    episodes: int
    successes: int
    mean_length: float
    fields: dict[str, FieldStatistics]

    @property
    def success_rate(self) -> float:
        return self.successes / self.episodes if self.episodes else float("nan")


def _compute_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a field is reduced in: float64 for float64 and wide integers, else float32.

    Raises:
        TypeError: The field is complex or of another non-real dtype.
    """
    if dtype == torch.float64 or (dtype in _INTEGERS and dtype.itemsize > 2):
        return torch.float64
    if dtype.is_floating_point or dtype == torch.bool or dtype in _INTEGERS:
        return torch.float32
    raise TypeError(f"field {key!r}: live statistics need a real dtype, got {dtype} "
                    f"(leave it out with LiveStatistics(fields=...))")


class _Group:
    """The fields of one dtype in a layout, reduced as one ``[rows, width]`` buffer per block.

    Each block of rows is shifted by ``shift`` (per column, in the compute dtype) before it is
    summed, and its column sums, sums of squares, minima and maxima fill one row of the window:
    ``window[r]`` is ``[2 + 2 * split, width]``, the shifted sums, the sums of squares, and the
    minima and the maxima of ``split`` groups of the block's rows. The rows of a window share the
    shift, so they add up: :meth:`totals` reduces them when the window is merged, and
    :meth:`reshift` then moves the shift to the merged rows' mean (the first shift is the first
    row seen). ``exact`` is the shift in float64 and ``offset`` the running mean minus ``exact``
    (views of the plan's float64 tensors). Bool columns are only counted: their sum is exact,
    their sum of squares the same, and min and max follow from it (they have no shift).

    With ``fused`` (a compiled :func:`_moments`), the whole chunks of ``_CHUNK_ROWS`` rows of a
    batch are reduced by that function straight from the fields, into one row, and the rows
    after them eagerly into the next; a batch of fewer than two chunks is reduced eagerly (so one
    compiled variant serves every size); ``split`` is then 1.

    With ``native`` (a numba kernel, for bool, float32 or float64 fields on the CPU), the whole
    batch is reduced into one row, straight from the fields, up to ``consumers._kernels.ARITY``
    fields a kernel call; ``split`` is then 1.
    A float batch of at least two ``_PART_BYTES`` is cut into parts of rows reduced on as many
    threads (at most ``torch.get_num_threads()`` and :func:`consumers._kernels.threads`), each
    into a row of its own.
    """

    __slots__ = ("buffer", "compiled", "compute", "exact", "filled", "fused", "host", "index", "native", "offset",
                 "shift", "slots", "split", "starts", "window", "work")

    def __init__(self, index: list[int], compute: torch.dtype, offset: torch.Tensor, exact: torch.Tensor,
                 fused: Fused | None, native: Callable[..., None] | None = None) -> None:
        self.index = index
        self.compute = compute
        self.offset = offset
        self.exact = exact
        self.fused = fused
        self.native = native
        # stays True if compiling fails: blocks stay whole batches
        self.compiled = fused is not None or native is not None
        self.buffer: torch.Tensor | None = None  # one block's concatenation, in the fields' dtype
        self.work: torch.Tensor | None = None    # its compute-dtype copy, when the dtypes differ
        self.shift: torch.Tensor | None = None  # repeated ``split`` times, for the wide view of a block
        self.split = 1
        self.window = torch.empty(0)
        # per window row: the row, and its shifted sums, sums of squares, minima and maxima
        self.slots: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.filled = 0
        self.starts: np.ndarray | None = None  # each field's first column, and the width (native, in parts)
        self.host: tuple[np.ndarray, np.ndarray | None] | None = None  # numpy views of window and shift (native)

    def rows(self, first: torch.Tensor, n: int) -> int:
        """The rows of an eager block: ``_BLOCK_ROWS`` on the CPU, the whole batch on other
        devices and for a compiled or native group."""
        if self.compiled or first.device.type != "cpu" or first.dtype == torch.bool:
            return n
        return min(n, _BLOCK_ROWS)

    def blocks(self, first: torch.Tensor, n: int) -> int:
        """The window rows a batch of ``n`` rows takes, at most."""
        if self.native is not None:
            return self.parts(first, n)[0]
        if self.compiled:  # the whole chunks, and the rows after them
            return 1 + bool(n % _CHUNK_ROWS)
        return -(-n // self.rows(first, n))

    def parts(self, first: torch.Tensor, n: int) -> tuple[int, int]:
        """The parts a native batch of ``n`` rows is reduced in, and the rows of each (the last
        part's fewer or as many): one part of ``n`` rows unless the batch is a float batch of at
        least two ``_PART_BYTES`` and several threads may reduce it."""
        size = n * self.offset.shape[0] * first.element_size()
        if first.dtype == torch.bool or size < 2 * _PART_BYTES:
            return 1, n
        count = min(torch.get_num_threads(), _kernels.threads(), size // _PART_BYTES)
        if count < 2:
            return 1, n
        rows = -(-n // count)
        return -(-n // rows), rows

    def fits(self, tensors: Sequence[torch.Tensor], n: int) -> bool:
        """Whether the window has a row for each block of a batch of ``n`` rows."""
        return not self.filled or self.filled + self.blocks(tensors[self.index[0]], n) <= len(self.slots)

    def reduce(self, tensors: Sequence[torch.Tensor], n: int) -> None:
        """Reduce a batch into the next rows of the window (which :meth:`fits` it)."""
        if self.native is not None:
            first = tensors[self.index[0]]
            if first.dtype == torch.bool:
                self._count(tensors, n)
                return
            parts = self._matrices(tensors, n)
            count, rows = self.parts(first, n)
            if len(self.slots) < self.filled + count:
                self._window(max(_WINDOW_ROWS, count), first.device)
            self._native(parts, self.filled, count, rows)
            self.filled += count
            return
        parts = self._matrices(tensors, n)
        first = parts[0]
        rows = self.rows(first, n)
        blocks = self.blocks(first, n)
        if not self.slots:
            self.split = _ROW_SPLIT if first.device.type == "cpu" and first.dtype != torch.bool and \
                not self.compiled else 1
        if len(self.slots) < self.filled + blocks:
            self._window(max(_WINDOW_ROWS, blocks), first.device)
        row = self.filled
        if first.dtype == torch.bool:
            self._buffer(first, rows)
            assert self.buffer is not None
            x = torch.cat(parts, dim=1, out=self.buffer[:n])
            torch.sum(x, 0, dtype=self.compute, out=self.slots[row][1])
        elif self.fused is not None and n >= 2 * _CHUNK_ROWS and self._fuse(parts, n, self.slots[row][0]):
            if n % _CHUNK_ROWS:
                self._block([p[n - n % _CHUNK_ROWS:] for p in parts], self.slots[row + 1])
        elif rows == n:
            self._block(parts, self.slots[row])
            blocks = 1
        else:
            for j, block in enumerate(zip(*(torch.split(t, rows) for t in parts), strict=True)):
                self._block(block, self.slots[row + j])
        self.filled += blocks

    def _matrices(self, tensors: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
        """The group's fields as ``[n, columns]``."""
        return [tensors[i] if tensors[i].dim() == 2 else tensors[i].reshape(n, -1) for i in self.index]

    def _fuse(self, parts: list[torch.Tensor], n: int, out: torch.Tensor) -> bool:
        """Reduce a batch's whole chunks of rows with the compiled function into ``out``; False
        (and eager from then on, with a warning) if it cannot be compiled here."""
        assert self.fused is not None
        whole = n - n % _CHUNK_ROWS
        # Views of the chunks: fresh objects, so that marking their first dimension dynamic
        # (one compiled variant for every batch size) leaves the caller's tensors alone.
        chunks = [p[:whole].view(-1, _CHUNK_ROWS, p.shape[1]) for p in parts]
        if self.shift is None:
            self.shift = torch.cat([p[0] for p in parts]).to(self.compute)
            self.exact.copy_(self.shift)
            for c in chunks:
                torch._dynamo.maybe_mark_dynamic(c, 0)
        try:
            row = self.fused(chunks, self.shift, self.compute)
        except Exception as exc:  # the compiler's failures have no common type; the eager
            # path then reduces this batch, and raises itself if the batch is at fault
            warnings.warn(f"LiveStatistics(kernel='compile'): torch.compile failed on this machine "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                          f"reducing without it", RuntimeWarning, stacklevel=2)
            self.fused = None
            return False
        out.copy_(row)
        return True

    def _native(self, parts: list[torch.Tensor], row: int, count: int, rows: int) -> None:
        """Reduce a batch of float fields with the numba kernels into the window's rows ``row``
        to ``row + count`` (one, or one per part of ``rows`` rows, see :meth:`parts`), on numpy
        views of the fields (no copy, unless a field is not contiguous: the kernels read it as
        contiguous chunks of rows); one call per :data:`consumers._kernels.ARITY` fields, on
        this thread or, in parts, on several. Bool fields are counted by :meth:`_count`."""
        if self.host is None:  # numpy views of the window and the shift, made once
            self.host = self.window.numpy(), self.shift.numpy() if self.shift is not None else None
        window, shift = self.host
        if shift is None:
            self.shift = torch.cat([p[0] for p in parts]).to(self.compute)
            self.exact.copy_(self.shift)
            self.starts = np.cumsum([0] + [p.shape[1] for p in parts], dtype=np.int64)
            self.host = window, shift = window, self.shift.numpy()
        assert self.starts is not None
        arrays = [p.detach().contiguous().numpy() for p in parts]
        extra: tuple[int, ...] = ()
        if count > 1:  # in parts, on several threads
            kernel, out, extra = _kernels.moments_parts(), window[row:row + count], (rows,)
        else:  # this group's own kernel: moments_group
            assert self.native is not None
            kernel, out = self.native, window[row]
        arity = _kernels.ARITY
        for a in range(0, len(arrays), arity):  # calls of ARITY arrays: one compiled variant
            chunk = arrays[a:a + arity]
            kernel(tuple(chunk + chunk[:1] * (arity - len(chunk))), len(chunk), shift,
                   self.starts[a:a + len(chunk) + 1], out, *extra)

    def _count(self, tensors: Sequence[torch.Tensor], n: int) -> None:
        """Count a batch's bool fields into the window's next row (native): a field of one
        column with numpy's count, a wider one with the numba counter, straight from numpy
        views of the fields (no copy, unless a field is not contiguous)."""
        if len(self.slots) < self.filled + 1:
            self._window(_WINDOW_ROWS, tensors[self.index[0]].device)
        if self.host is None:  # a numpy view of the window, made once
            self.host = self.window.numpy(), None
        counts, start = self.host[0][self.filled, 0], 0
        for i in self.index:
            t = tensors[i]
            end = start + t.numel() // n
            if end - start == 1:
                counts[start] = np.count_nonzero(t.numpy())
            else:
                typing.cast(_kernels.Counter, self.native)(t.contiguous().numpy().reshape(n, -1).view(np.uint8),
                                                            counts[start:end])
            start = end
        self.filled += 1

    def _buffer(self, first: torch.Tensor, rows: int) -> None:
        if self.buffer is not None and self.buffer.shape[0] >= rows:
            return
        width = self.offset.shape[0]
        self.buffer = torch.empty(rows, width, dtype=first.dtype, device=first.device)
        if first.dtype not in (self.compute, torch.bool):
            self.work = torch.empty(rows, width, dtype=self.compute, device=first.device)

    def _window(self, rows: int, device: torch.device) -> None:
        self.window = torch.empty(rows, 2 + 2 * self.split, self.offset.shape[0], dtype=self.compute, device=device)
        self.host = None
        split = self.split
        self.slots = [(w, w[0], w[1], w[2:2 + split].view(-1), w[2 + split:].view(-1)) for w in self.window]

    def _block(self, parts: list[torch.Tensor] | tuple[torch.Tensor, ...],
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """Reduce the same rows of every field into a row of the window: the sums minus
        ``shift``, the sums of squares, and the minima and maxima of each of ``split`` groups
        of the rows (on the CPU, a reduction over the outer dimension vectorizes along a wide
        inner one)."""
        rows, split = parts[0].shape[0], self.split
        self._buffer(parts[0], rows)
        assert self.buffer is not None
        width = self.buffer.shape[1]
        _, s1, s2, lo, hi = out
        x = torch.cat(parts, dim=1, out=self.buffer if rows == self.buffer.shape[0] else self.buffer[:rows])
        if self.work is not None:
            x = self.work[:rows].copy_(x)
        wide = x.view(rows // split, split * width) if rows % split == 0 else None
        if split == 1:
            torch.aminmax(x, dim=0, out=(lo, hi))
        elif wide is not None:
            torch.amin(wide, 0, out=lo)
            torch.amax(wide, 0, out=hi)
        else:
            lo.view(split, width).copy_(x.amin(0))
            hi.view(split, width).copy_(x.amax(0))
        if self.shift is None:
            self.shift = x[0].repeat(split)
            self.exact.copy_(x[0])
        if wide is not None:
            wide.sub_(self.shift)
        else:
            x.sub_(self.shift[:width])
        torch.sum(x, 0, out=s1)
        torch.sum(x.square_(), 0, out=s2)

    def totals(self, n: int) -> list[torch.Tensor]:
        """The window's rows, ``n`` rows of fields in all, as one batch; and empty the window.

        Returns:
            Per column: the sum minus ``shift`` and the sum of squares (float64), min and max.
        """
        rows, self.filled = self.filled, 0
        if self.shift is None:  # bool columns
            count = self.window[:rows, 0].sum(0, dtype=torch.float64)
            return [count, count, (count - (n - 1)).clamp_(min=0), count.clamp(max=1)]
        split, window = self.split, self.window[:rows]
        s1, s2 = window[:, :2].sum(0, dtype=torch.float64)
        return [s1, s2, window[:, 2:2 + split].amin((0, 1)), window[:, 2 + split:].amax((0, 1))]

    def reshift(self, s1: torch.Tensor, n: int) -> None:
        """Move ``shift`` to the merged rows' mean (``s1``: their shifted sum) and ``offset`` by
        the old shift minus the new (exact in float64), which keeps the running mean."""
        if self.shift is not None:  # None for bool columns
            width = self.offset.shape[0]
            self.shift.view(-1, width).add_(s1, alpha=1 / n)
            self.offset.add_(self.exact.sub_(self.shift[:width]))
            self.exact.copy_(self.shift[:width])


class _Plan:
    """The moments of every field of one topic and field layout (names, dtypes, shapes).

    The accumulator ``acc`` is ``[4, columns]`` float64 on the fields' device: the running mean
    minus ``exact`` (each column's current shift), the sum of squared deviations (M2), min and
    max. Each field owns a range of columns, each dtype a group of them. The ``pending`` rows in
    the groups' windows are merged into ``acc`` when a window is full and before it is read.
    """

    __slots__ = ("acc", "batch", "columns", "count", "exact", "groups", "pending", "rows")

    def __init__(self, keys: list[str], tensors: Sequence[torch.Tensor], kernel: str = "eager") -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}  # the fields are checked (LiveStatistics._check)
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        widths = [math.prod(t.shape[1:]) for t in tensors]
        starts = [0] * len(keys)
        spans: list[tuple[torch.dtype, list[int], int]] = []  # compute dtype, fields, first column
        start = 0
        for dtype, index in by_dtype.items():
            index = [i for i in index if widths[i]]
            if index:
                spans.append((_compute_dtype(keys[index[0]], dtype), index, start))
            for i in index:
                starts[i] = start
                start += widths[i]
        self.columns = {key: (starts[i], widths[i], tuple(t.shape[1:]))
                        for i, (key, t) in enumerate(zip(keys, tensors, strict=True))}
        device, f64 = tensors[0].device, torch.float64
        self.count = 0
        self.pending = 0
        self.acc = torch.zeros(4, start, dtype=f64, device=device)
        self.acc[2].fill_(math.inf)
        self.acc[3].fill_(-math.inf)
        self.exact = torch.zeros(start, dtype=f64, device=device)
        self.batch = torch.empty(4, start, dtype=f64, device=device)
        self.rows = (self.acc.unbind(0), self.batch.unbind(0))
        ends = [a for _, _, a in spans[1:]] + [start]
        self.groups = []
        for (compute, index, a), b in zip(spans, ends, strict=True):
            dtype = tensors[index[0]].dtype
            fused = _compiled_moments() if kernel == "compile" and dtype != torch.bool else None
            native: Callable[..., None] | None = None
            if kernel in ("auto", "numba") and device.type == "cpu" and _kernels.available():
                if dtype == torch.bool:
                    native = _kernels.counts()
                elif dtype in _NATIVE_DTYPES:
                    native = _kernels.moments_group()
            self.groups.append(_Group(index, compute, self.acc[0, a:b], self.exact[a:b], fused, native))

    def update(self, tensors: Sequence[torch.Tensor], n: int) -> None:
        """Reduce one batch of ``n`` rows into the groups' windows (no host synchronization)."""
        if not all(g.fits(tensors, n) for g in self.groups):
            self.merge()
        for g in self.groups:
            g.reduce(tensors, n)
        if self.groups:
            self.pending += n
        else:  # every field has zero elements per world
            self.count += n

    def merge(self) -> None:
        """Fold the windows' pending rows into the accumulators, as one batch of ``n`` rows.

        With ``delta`` the batch mean minus the running mean, the mean moves by
        ``delta * n / total`` and M2 grows by the batch's M2 plus ``delta**2 * count * n / total``
        (Chan et al.); the batch's M2 is ``s2 - s1**2 / n`` of its shifted sums.
        """
        n = self.pending
        if not n:
            return
        total = self.count + n
        sums = [g.totals(n) for g in self.groups]
        torch.cat([s[r] for r in range(4) for s in sums], out=self.batch.view(-1))
        (offset, m2, lo, hi), (mean, batch_m2, batch_lo, batch_hi) = self.rows
        mean.div_(n)  # the batch mean minus the shift
        batch_m2.addcmul_(mean, mean, value=-n)
        delta = mean.sub_(offset)
        offset.add_(delta, alpha=n / total)
        m2.add_(batch_m2).addcmul_(delta, delta, value=self.count * n / total)
        torch.minimum(lo, batch_lo, out=lo)
        torch.maximum(hi, batch_hi, out=hi)
        self.count, self.pending = total, 0
        for g, s in zip(self.groups, sums, strict=True):
            g.reshift(s[0], n)

    def host(self) -> dict[str, _HostMoments]:
        """Every field's moments, read back to the host in one transfer (after :meth:`merge`)."""
        self.merge()
        acc = torch.cat([self.acc, self.exact[None]]).cpu().numpy()
        out = {}
        for key, (start, width, shape) in self.columns.items():
            offset, m2, lo, hi, exact = (c.reshape(shape) for c in acc[:, start:start + width])
            out[key] = _HostMoments(self.count, exact + offset, np.maximum(m2, 0.0), lo, hi)
        return out


@dataclass(frozen=True, slots=True)
class _HostMoments:
    """One field's count, mean, sum of squared deviations (M2), min and max, on the host."""

    count: int
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    def merge(self, other: _HostMoments) -> _HostMoments:
        """Chan et al.'s combination of two disjoint sets of rows."""
        n = self.count + other.count
        delta = other.mean - self.mean
        return _HostMoments(n, self.mean + delta * (other.count / n),
                            self.m2 + other.m2 + delta * delta * (self.count * other.count / n),
                            np.minimum(self.min, other.min), np.maximum(self.max, other.max))

    def statistics(self) -> FieldStatistics:
        std = np.sqrt(self.m2 / max(self.count - 1, 1))
        return FieldStatistics(self.count, self.mean, std, self.min, self.max)


def _rows(what: str, worlds: torch.Tensor) -> int:
    """The number of worlds of a message (its 1-D ``worlds`` index); ValueError if not 1-D."""
    if worlds.dim() != 1:
        raise ValueError(f"{what} must be 1-D, got shape {tuple(worlds.shape)}")
    return worlds.shape[0]


class LiveStatistics:
    """Running mean, std, min and max of every field of the chosen topics, plus the episode
    count and success rate: the model of a live consumer that copies only what it needs.

    Nothing of a published tensor is kept: each batch is reduced on its own device, with a fixed
    number of tensor operations per dtype (and, on the CPU, per block of rows) whatever the
    number of fields and without waiting for the device, into float64 accumulators, so the memory
    is independent of run length. Bool, float16, bfloat16 and 8- and 16-bit integer fields are
    reduced in float32, float64 and wider integer fields in float64; batches are shifted by a
    recent mean before they are summed, so a mean far from zero does not cost the variance its
    precision. Min and max are exact. ``summary()`` reads the accumulators back to the host.

    The reduction (``kernel``):

    - ``"auto"`` (the default): ``"numba"`` where numba is installed, else ``"eager"``.
    - ``"eager"``: a handful of torch operations per dtype and batch (above).
    - ``"numba"``: float32, float64 and bool fields on the CPU are reduced by hand-written
      kernels that read each field once (at 4096 worlds of the benchmark payload, about 1.5x a
      one-thread memcpy of the batch); other fields as ``"eager"``. A batch of a dtype's fields
      of 1 MiB or more is cut into parts reduced on as many threads as torch uses
      (``torch.get_num_threads()``), where numba's threading layer is OpenMP or TBB (about 2x
      torch's two-thread memcpy of the same payload); torch's thread count is left as it was.
      The first batch compiles the kernels (a few seconds for the threaded one; cached on
      disk). Needs ``pip install 'worldtap[fast]'``.
    - ``"compile"``: each dtype's fields are reduced by a function compiled with
      :func:`torch.compile`, which reads each field once, on any device. The first batch of each
      field layout waits for the compilation (seconds); the compiled function serves every later
      batch size (batches of fewer than 32 worlds are reduced eagerly, rather than compiled for).
      Where torch.compile cannot compile (no C++ compiler for the CPU, no Triton for CUDA), a
      ``RuntimeWarning`` says so and the consumer reduces eagerly.

    Every kernel gives the same counts, minima and maxima, and means and standard deviations
    within the same bounds of float64 references.

    Args:
        fields: Only these ``"<term>/<field>"`` names (all when ``None``).
        every: Reduce one batch in ``every`` per topic (subsampling bounds the cost).
        kernel: One of :data:`KERNELS` (above).

    Each message is checked whole before anything is counted, so a refused one changes
    nothing (the subsampling's count of its topic included). The checks read shapes, dtypes
    and devices only, never values, so they cost no device synchronization.

    Raises:
        ValueError: ``every`` is not a positive int or ``kernel`` is not one of
            :data:`KERNELS`; on a batch, its worlds are not 1-D, a chosen field does not have
            one row per world, a field's per-world shape differs from the one reduced before,
            or the chosen fields are on different devices; on an episode end, its worlds are
            not 1-D or its ``success`` or ``length`` is not one value per world.
        ImportError: ``kernel="numba"`` and numba is not installed.
        TypeError: On a batch, a chosen field is complex or of another non-real dtype.
    """

    name = "live-statistics"

    def __init__(self, *, fields: Sequence[str] | None = None, every: int = 1, kernel: str = "auto") -> None:
        if every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel: expected one of {', '.join(map(repr, KERNELS))}, got {kernel!r}")
        if kernel == "numba" and not _kernels.available():
            raise ImportError("LiveStatistics(kernel='numba') needs numba: pip install 'worldtap[fast]'")
        self.fields = None if fields is None else frozenset(fields)
        self.every = every
        self.kernel = kernel
        self._plans: dict[tuple[object, ...], _Plan] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._seen: dict[str, int] = {}
        self._batches = 0
        self._episodes = 0
        self._successes: torch.Tensor | int = 0
        self._lengths: torch.Tensor | int = 0

    def attach(self, broker: Broker, prefix: str = "batch/") -> list[Subscription]:
        """Subscribe to ``prefix`` batches and to episode ends."""
        return [broker.subscribe(prefix, self, name=self.name),
                broker.subscribe("episode/", self, name=self.name)]

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self._batch(message)
        elif isinstance(message, EpisodeEnd):
            n = _rows("episode end: worlds", message.worlds)
            for name in ("success", "length"):
                t = getattr(message, name)
                if t.dim() != 1 or t.shape[0] != n:
                    raise ValueError(f"episode end: {name} has {t.numel()} values for {n} worlds "
                                     f"(shape {tuple(t.shape)}, expected ({n},))")
            successes, lengths = self._successes + message.success.sum(), self._lengths + message.length.sum()
            self._successes, self._lengths = successes, lengths
            self._episodes += n

    def _batch(self, batch: Batch) -> None:
        """Check a batch whole, then count it for the subsampling and reduce it if it is chosen:
        a refused batch changes nothing, its topic's count of batches included."""
        n = _rows(f"batch on {batch.topic!r}: worlds", batch.worlds)
        term, fields = batch.term, batch.fields
        names = list(fields) if self.fields is None else [f for f in fields if f"{term}/{f}" in self.fields]
        tensors = [fields[f] for f in names]
        layout: list[object] = [batch.topic]
        for f, t in zip(names, tensors, strict=True):
            shape = t.shape
            if not shape or shape[0] != n:
                raise ValueError(f"field {f'{term}/{f}'!r}: shape {tuple(shape)}, expected one row per "
                                 f"world of the batch ({n} rows)")
            layout.append((f, t.dtype, shape[1:], t.device))
        key = tuple(layout)
        plan = self._plans.get(key) if tensors else None
        keys = [f"{term}/{f}" for f in names] if plan is None and tensors else []
        if keys:
            self._check(keys, tensors)
        seen = self._seen.get(batch.topic, 0)
        self._seen[batch.topic] = seen + 1
        if seen % self.every or n == 0:
            return
        if keys:
            plan = self._plans[key] = _Plan(keys, tensors, self.kernel)
            for k, t in zip(keys, tensors, strict=True):
                self._shapes[k] = tuple(t.shape[1:])
        self._batches += 1
        if plan is None:
            return
        if torch.is_grad_enabled():
            with torch.no_grad():
                plan.update(tensors, n)
        else:  # the simulation's own setting (entering no_grad costs as much as a small field)
            plan.update(tensors, n)

    def _check(self, keys: list[str], tensors: list[torch.Tensor]) -> None:
        """Raise if the fields of a layout not seen before cannot be reduced together: a
        per-world shape differs from the one reduced before, a dtype has no moments, or the
        fields are on several devices."""
        for key, t in zip(keys, tensors, strict=True):
            shape = tuple(t.shape[1:])
            if self._shapes.get(key, shape) != shape:
                raise ValueError(f"field {key!r}: per-world shape {shape} differs from "
                                 f"{self._shapes[key]} seen before")
            _compute_dtype(key, t.dtype)
            if t.device != tensors[0].device:
                raise ValueError(f"field {key!r}: on {t.device}, the batch's other fields on {tensors[0].device}")

    def summary(self) -> LiveSummary:
        """A host snapshot (reads the device once per field layout)."""
        merged: dict[str, _HostMoments] = {}
        for plan in self._plans.values():
            for key, moments in plan.host().items():
                merged[key] = merged[key].merge(moments) if key in merged else moments
        episodes = self._episodes
        lengths = int(self._lengths)
        return LiveSummary(
            batches=self._batches,
            episodes=episodes,
            successes=int(self._successes),
            mean_length=lengths / episodes if episodes else float("nan"),
            fields={k: m.statistics() for k, m in merged.items()},
        )
