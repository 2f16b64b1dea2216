"""Live statistics: running per-field moments and episode outcomes, computed on the device.

Each batch is reduced with a fixed number of tensor operations per dtype, whatever the number
of fields: the fields of one dtype are concatenated into one reused ``[worlds, columns]`` buffer,
whose columns are reduced once each for the minimum and the maximum, then shifted by the previous
batch's mean and summed, and summed again squared. The shift keeps the sums those of values near
zero, so that a large mean does not swamp a small variance; Chan et al.'s update merges each
batch into float64 accumulators, whose running mean is kept as an offset from the shift. Nothing
is read back to the host until :meth:`LiveStatistics.summary`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from broker import Batch, Broker, EpisodeEnd, Message, Subscription

__all__ = ["FieldStatistics", "LiveStatistics", "LiveSummary"]

_INTEGERS = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                       torch.uint16, torch.uint32, torch.uint64})

_ROW_SPLIT = 256
"""On the CPU, min and max reduce a ``[n, c]`` group as ``[n / k, k * c]`` and then ``[k, c]``
(``k = gcd(n, 256, n // 16)`` when at least 16): a reduction over the outer dimension
vectorizes along a wide inner one."""


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


def _extremes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column minima and maxima of a contiguous ``[n, c]`` tensor (exact)."""
    n, width = x.shape
    k = math.gcd(n, _ROW_SPLIT, n // 16) if x.device.type == "cpu" else 1
    if k < 16:
        return x.amin(0), x.amax(0)
    wide = x.view(n // k, k * width)
    return wide.amin(0).view(k, width).amin(0), wide.amax(0).view(k, width).amax(0)


class _Group:
    """The fields of one dtype in a layout, reduced as one ``[n, width]`` buffer.

    Each batch is shifted by ``shift`` (per column, in the compute dtype) before it is summed:
    the first row seen, then the previous batch's mean. ``exact`` is ``shift`` in float64 and
    ``offset`` the running mean minus ``exact`` (views of the plan's float64 tensors). Bool
    columns are only counted: their sum is exact, their sum of squares the same, and min and max
    follow from it (their shift stays zero).
    """

    __slots__ = ("buffer", "compute", "exact", "index", "offset", "shift", "work")

    def __init__(self, index: list[int], compute: torch.dtype, offset: torch.Tensor, exact: torch.Tensor) -> None:
        self.index = index
        self.compute = compute
        self.offset = offset
        self.exact = exact
        self.buffer: torch.Tensor | None = None  # the concatenation, in the fields' dtype
        self.work: torch.Tensor | None = None    # its compute-dtype copy, when the dtypes differ
        self.shift: torch.Tensor | None = None

    def sums(self, tensors: Sequence[torch.Tensor], n: int) -> list[torch.Tensor]:
        """Per column: the sum of the batch minus ``shift``, the sum of its squares, min, max."""
        parts = [tensors[i] for i in self.index]
        parts = [t if t.dim() == 2 else t.reshape(n, -1) for t in parts]
        width = self.offset.shape[0]
        if self.buffer is None or self.buffer.shape[0] < n:
            first = parts[0]
            self.buffer = torch.empty(n, width, dtype=first.dtype, device=first.device)
            if first.dtype not in (self.compute, torch.bool):
                self.work = torch.empty(n, width, dtype=self.compute, device=first.device)
        x = torch.cat(parts, dim=1, out=self.buffer[:n])
        if x.dtype == torch.bool:
            count = x.sum(0, dtype=self.compute)
            return [count, count, (count - (n - 1)).clamp_(min=0), count.clamp(max=1)]
        if self.work is not None:
            x = self.work[:n].copy_(x)
        lo, hi = _extremes(x)
        if self.shift is None:
            self.shift = x[0].clone()
            self.exact.copy_(self.shift)
        s1 = x.sub_(self.shift).sum(0)
        s2 = x.square_().sum(0)
        return [s1, s2, lo, hi]

    def reshift(self, s1: torch.Tensor, n: int) -> None:
        """Move ``shift`` to the batch's mean (``s1``: its shifted sum) and ``offset`` by the
        old shift minus the new (exact in float64), which keeps the running mean."""
        if self.shift is not None:  # None for bool columns
            self.shift.add_(s1, alpha=1 / n)
            self.offset.add_(self.exact.sub_(self.shift))
            self.exact.copy_(self.shift)


class _Plan:
    """The moments of every field of one topic and field layout (names, dtypes, shapes).

    The accumulator ``acc`` is ``[4, columns]`` float64 on the fields' device: the running mean
    minus ``exact`` (each column's current shift), the sum of squared deviations (M2), min and
    max. Each field owns a range of columns, each dtype a group of them.
    """

    __slots__ = ("acc", "batch", "columns", "count", "exact", "groups", "rows", "stage")

    def __init__(self, keys: list[str], tensors: Sequence[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, (key, t) in enumerate(zip(keys, tensors, strict=True)):
            _compute_dtype(key, t.dtype)
            if t.device != tensors[0].device:
                raise ValueError(f"field {key!r}: on {t.device}, the batch's other fields on {tensors[0].device}")
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
        self.acc = torch.zeros(4, start, dtype=f64, device=device)
        self.acc[2].fill_(math.inf)
        self.acc[3].fill_(-math.inf)
        self.exact = torch.zeros(start, dtype=f64, device=device)
        self.batch = torch.empty(4, start, dtype=f64, device=device)
        self.rows = (self.acc.unbind(0), self.batch.unbind(0))
        ends = [a for _, _, a in spans[1:]] + [start]
        self.groups = [_Group(index, compute, self.acc[0, a:b], self.exact[a:b])
                       for (compute, index, a), b in zip(spans, ends, strict=True)]
        # The groups' sums are concatenated in their common dtype (a cat that converts is slow).
        common = torch.float64 if any(g.compute == f64 for g in self.groups) else torch.float32
        self.stage = self.batch.view(-1) if common == f64 else torch.empty(4 * start, dtype=common, device=device)

    def update(self, tensors: Sequence[torch.Tensor], n: int) -> None:
        """Fold one batch of ``n`` rows into the accumulators (no host synchronization).

        With ``delta`` the batch mean minus the running mean, the mean moves by
        ``delta * n / total`` and M2 grows by the batch's M2 plus ``delta**2 * count * n / total``
        (Chan et al.); the batch's M2 is ``s2 - s1**2 / n`` of its shifted sums.
        """
        total = self.count + n
        if not self.groups:  # every field has zero elements per world
            self.count = total
            return
        sums = [g.sums(tensors, n) for g in self.groups]
        torch.cat([s[r] for r in range(4) for s in sums], out=self.stage)
        if self.stage.dtype != torch.float64:
            self.batch.view(-1).copy_(self.stage)
        (offset, m2, lo, hi), (mean, batch_m2, batch_lo, batch_hi) = self.rows
        mean.div_(n)  # the batch mean minus the shift
        batch_m2.addcmul_(mean, mean, value=-n)
        delta = mean.sub_(offset)
        offset.add_(delta, alpha=n / total)
        m2.add_(batch_m2).addcmul_(delta, delta, value=self.count * n / total)
        torch.minimum(lo, batch_lo, out=lo)
        torch.maximum(hi, batch_hi, out=hi)
        self.count = total
        for g, s in zip(self.groups, sums, strict=True):
            g.reshift(s[0], n)

    def host(self) -> dict[str, _HostMoments]:
        """Every field's moments, read back to the host in one transfer."""
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


class LiveStatistics:
    """Running mean, std, min and max of every field of the chosen topics, plus the episode
    count and success rate: the model of a live consumer that copies only what it needs.

    Nothing of a published tensor is kept: each batch is reduced on its own device, with a fixed
    number of tensor operations per dtype whatever the number of fields and without waiting for
    the device, into float64 accumulators, so the memory is independent of run length. Bool,
    float16, bfloat16 and 8- and 16-bit integer fields are reduced in float32, float64 and wider
    integer fields in float64; each batch is shifted by the previous batch's mean before it is
    summed, so a mean far from zero does not cost the variance its precision. Min and max are
    exact. ``summary()`` reads the accumulators back to the host.

    Args:
        fields: Only these ``"<term>/<field>"`` names (all when ``None``).
        every: Reduce one batch in ``every`` per topic (subsampling bounds the cost).

    Raises:
        ValueError: ``every`` is not a positive int; on a batch, a field's per-world shape
            differs from the one seen before, or the chosen fields are on different devices.
        TypeError: On a batch, a chosen field is complex or of another non-real dtype.
    """

    name = "live-statistics"

    def __init__(self, *, fields: Sequence[str] | None = None, every: int = 1) -> None:
        if every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        self.fields = None if fields is None else frozenset(fields)
        self.every = every
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
            self._episodes += message.worlds.numel()
            self._successes = self._successes + message.success.sum()
            self._lengths = self._lengths + message.length.sum()

    def _batch(self, batch: Batch) -> None:
        seen = self._seen.get(batch.topic, 0)
        self._seen[batch.topic] = seen + 1
        n = batch.worlds.numel()
        if seen % self.every or n == 0:
            return
        term = batch.term
        keys: list[str] = []
        tensors: list[torch.Tensor] = []
        layout: list[object] = [batch.topic]
        for name, t in batch.fields.items():
            key = f"{term}/{name}"
            if self.fields is None or key in self.fields:
                keys.append(key)
                tensors.append(t)
                layout += (name, t.dtype, t.shape[1:], t.device)
        plan = self._plans.get(tuple(layout)) if tensors else None
        if plan is None and tensors:
            plan = self._plans[tuple(layout)] = self._plan(keys, tensors)
        self._batches += 1
        if plan is not None:
            with torch.no_grad():
                plan.update(tensors, n)

    def _plan(self, keys: list[str], tensors: list[torch.Tensor]) -> _Plan:
        for key, t in zip(keys, tensors, strict=True):
            shape = tuple(t.shape[1:])
            if self._shapes.get(key, shape) != shape:
                raise ValueError(f"field {key!r}: per-world shape {shape} differs from "
                                 f"{self._shapes[key]} seen before")
        plan = _Plan(keys, tensors)
        for key, t in zip(keys, tensors, strict=True):
            self._shapes[key] = tuple(t.shape[1:])
        return plan

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
