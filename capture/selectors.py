"""World selectors: every accepted way of naming a set of worlds, normalized once.

Accepted forms: ``None`` (all worlds), an int, a sequence (list or tuple) of ints, ``range``,
``slice``, a 1-D integer tensor or numpy array, a 1-D boolean mask of length ``num_worlds``.
Everything becomes a 1-D int64 index tensor on the recorder's device, in the order given.
Anything else (an index out of ``[0, num_worlds)``, a duplicate, a non-integer dtype, a mask
of another length, a slice with a zero step or non-int bounds) raises :class:`SelectorError`
(a ``ValueError``) naming the argument, what was expected and what was received.

Checking an index tensor's values needs them. ``check="host"`` reads them (on CUDA a device
sync per call: vectorized RL resets some world nearly every step). ``check="device"`` (the
default for index tensors already on a CUDA device, see :class:`WorldsCheck`) checks them
with a few kernels on the device and reads the verdict later without a sync: a bad index
tensor raises :class:`SelectorError` at a later call (as soon as the check's copy has landed,
and at the latest at :meth:`WorldsCheck.wait`, which ``Recorder.close`` calls); its indices
are clamped into range meanwhile so that no device-side assert fires. ``check="trusted"``
checks nothing (an out-of-range index then fails inside a kernel). A boolean mask always
costs one device read: the number of worlds it selects sizes everything after it (pass the
index tensor your environment already made when that matters). An int, a sequence, a range, a
slice or a numpy array is made into a tensor on the host, and on a CUDA recorder copied to the
device from pageable memory: a copy that waits for the work already queued on the current
stream, so on a per-step path pass an index tensor already on the device.
"""

from __future__ import annotations

import collections
import itertools
import numbers
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal, TypeAlias

import numpy as np
import torch

from .errors import SelectorError

__all__ = ["CheckMode", "WorldSelector", "WorldsCheck", "normalize_worlds"]

WorldSelector: TypeAlias = (
    int | Sequence[int] | range | slice | torch.Tensor | np.ndarray | None
)
CheckMode: TypeAlias = Literal["auto", "host", "device", "trusted"]
"""How index tensors are checked: ``auto`` (``device`` for tensors on a CUDA device, else
``host``), ``host``, ``device`` or ``trusted`` (module docstring)."""
CHECK_MODES: Final = ("auto", "host", "device", "trusted")
_OUT_OF_RANGE: Final = 1
_DUPLICATE: Final = 2


class WorldsCheck:
    """Checks of index tensors on their device, read back without a device sync.

    Each :meth:`check` queues a few kernels that compute a verdict (out of range, duplicates)
    and a non-blocking copy of it into a pinned host slot behind a CUDA event; :meth:`poll`
    reads the verdicts whose copies have landed (``event.query()``, no sync) and raises for the
    first bad one. On CPU the verdict is read at once. At most ``depth`` checks are in flight;
    a check that would reuse a slot whose copy is still pending waits for it (a blocking event).

    Args:
        num_worlds: Indices must lie in ``[0, num_worlds)``.
        device: The device the index tensors are on.
        depth: Checks in flight at most.
    """

    def __init__(self, num_worlds: int, device: torch.device | str, depth: int = 64) -> None:
        self.num_worlds = num_worlds
        self.device = torch.device(device)
        self.depth = depth
        cuda = self.device.type == "cuda"
        self._counts = torch.zeros(num_worlds, dtype=torch.int32, device=self.device)
        self._ones = torch.ones(num_worlds, dtype=torch.int32, device=self.device)
        self._host = torch.zeros(depth, dtype=torch.int32, pin_memory=cuda)
        self._events: list[Any] = [torch.cuda.Event(blocking=True) if cuda else None  # type: ignore[no-untyped-call]
                                   for _ in range(depth)]
        # (slot, what its verdict means when it is not 0)
        self._pending: collections.deque[tuple[int, Callable[[int], Exception]]] = collections.deque()
        self._next = 0
        self.checks = 0
        """Index tensors checked so far."""

    def check(self, index: torch.Tensor, what: str) -> torch.Tensor:
        """Queue the check of the int64 index tensor ``index`` (on this device), described by
        ``what`` in a later error; returns ``index`` clamped into ``[0, num_worlds)``.

        Raises:
            SelectorError: An earlier check (or, on CPU, this one) found a bad index tensor.
        """
        self._reserve()
        n = self.num_worlds
        k = index.shape[0]
        outside = ((index < 0) | (index >= n)).any()
        clamped = index.clamp(0, n - 1)
        if k > self._ones.shape[0]:  # more indices than worlds: a duplicate or one out of range
            self._ones = torch.ones(k, dtype=torch.int32, device=self.device)
        counts = self._counts
        counts.zero_()
        counts.index_add_(0, clamped, self._ones[:k])
        verdict = outside.to(torch.int32) * _OUT_OF_RANGE + (counts > 1).any().to(torch.int32) * _DUPLICATE
        self._queue(verdict, lambda code: self._selector_error(code, what))
        self.checks += 1
        return clamped

    def defer(self, verdict: torch.Tensor, explain: Callable[[int], Exception]) -> None:
        """Queue any other check computed on this device: ``verdict`` (a 0-dim integer tensor,
        0 for sound) is read without a sync like the index checks', and a non-zero value is
        raised as ``explain(value)`` by :meth:`poll`/:meth:`wait`.

        Raises:
            Exception: An earlier deferred check failed (or, on CPU, this one): what its
                ``explain`` returned.
        """
        self._reserve()
        self._queue(verdict.to(torch.int32), explain)

    def _reserve(self) -> None:
        """Raise for verdicts landed so far, and free the next slot (waiting for its verdict
        when every slot is in flight)."""
        self.poll()
        if len(self._pending) == self.depth:
            self.poll(wait=True, upto=1)

    def _queue(self, verdict: torch.Tensor, explain: Callable[[int], Exception]) -> None:
        slot = self._next
        self._next = (slot + 1) % self.depth
        event = self._events[slot]
        self._host[slot].copy_(verdict, non_blocking=event is not None)
        if event is not None:
            event.record(torch.cuda.current_stream(self.device))
        self._pending.append((slot, explain))
        if event is None:
            self.poll()

    def _selector_error(self, verdict: int, what: str) -> SelectorError:
        problems = [text for bit, text in ((_OUT_OF_RANGE, f"indices out of [0, {self.num_worlds})"),
                                            (_DUPLICATE, "duplicate indices")) if verdict & bit]
        return SelectorError(
            f"{what}: expected distinct world indices in [0, {self.num_worlds}), got "
            f"{' and '.join(problems)} (checked on the device without a sync, so on CUDA reported "
            f"after the call, whose indices were clamped into range and whose records are not "
            f"reliable; check='host' finds it at the call)")

    def poll(self, wait: bool = False, upto: int | None = None) -> None:
        """Read the verdicts that have landed (all of them, or the oldest ``upto``, when
        ``wait``) and raise for the first bad one.

        Raises:
            SelectorError: A checked index tensor held an index out of range or a duplicate
                (or what a :meth:`defer` check's ``explain`` returned).
        """
        read = 0
        while self._pending and (upto is None or read < upto):
            slot, explain = self._pending[0]
            event = self._events[slot]
            if event is not None and not event.query():
                if not wait:
                    return
                event.synchronize()
            self._pending.popleft()
            read += 1
            verdict = int(self._host[slot])
            if verdict:
                raise explain(verdict)

    def wait(self) -> None:
        """Read every verdict in flight (waits for them) and raise for the first bad one.

        Raises:
            SelectorError: A checked index tensor held an index out of range or a duplicate.
        """
        self.poll(wait=True)


def _describe(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _check_indices(index: list[int], num_worlds: int, name: str) -> None:
    bad = [i for i in index if i < 0 or i >= num_worlds]
    if bad:
        raise SelectorError(
            f"{name}: expected world indices in [0, {num_worlds}), got {_describe(bad)} "
            f"out of range"
        )
    if len(set(index)) != len(index):
        dups = sorted(i for i, count in Counter(index).items() if count > 1)
        raise SelectorError(f"{name}: expected distinct world indices, got duplicates {_describe(dups)}")


def _check_range(rng: range, num_worlds: int, name: str) -> None:
    """Check a range's bounds without materializing it (``range(10**12)`` is one argument)."""
    if not rng or (min(rng[0], rng[-1]) >= 0 and max(rng[0], rng[-1]) < num_worlds):
        return
    # A range is monotonic: its out-of-range values are a prefix and/or a suffix, so the first
    # few of them are found within num_worlds + 9 steps.
    bad = list(itertools.islice((i for i in rng if i < 0 or i >= num_worlds), 9))
    raise SelectorError(f"{name}: expected world indices in [0, {num_worlds}), got {_describe(bad)} out of range")


def normalize_worlds(
    selector: WorldSelector,
    num_worlds: int,
    device: torch.device | str = "cpu",
    *,
    name: str = "worlds",
    all_worlds: torch.Tensor | None = None,
    check: CheckMode = "auto",
    device_check: WorldsCheck | None = None,
    what: str | None = None,
) -> torch.Tensor:
    """Normalize ``selector`` into a 1-D int64 index tensor on ``device``.

    Args:
        selector: One of the accepted forms (module docstring).
        num_worlds: Number of worlds; indices must lie in ``[0, num_worlds)``.
        device: Device of the returned tensor.
        name: The argument's name, used in error messages.
        all_worlds: Cached ``arange(num_worlds)`` to return for ``None``.
        check: How an index tensor's values are checked (module docstring); ``device`` needs
            ``device_check`` (else it checks on the host).
        device_check: The :class:`WorldsCheck` of ``device``, for ``check`` ``device``/``auto``.
        what: How a deferred error names this call (default: ``name``).

    Returns:
        The index tensor; empty when the selection is empty.

    Raises:
        SelectorError: (a ``ValueError``) out of range, duplicates, wrong dtype, wrong mask
            length, or a form that is not accepted; the message names ``name``.
    """
    device = torch.device(device)
    if selector is None:
        if all_worlds is not None:
            return all_worlds
        return torch.arange(num_worlds, device=device, dtype=torch.int64)
    if isinstance(selector, bool | np.bool_):
        raise SelectorError(f"{name}: expected world indices or a boolean mask, got the bool {selector!r}")
    if isinstance(selector, numbers.Integral):
        value = int(selector)
        _check_indices([value], num_worlds, name)
        return torch.tensor([value], device=device, dtype=torch.int64)
    if isinstance(selector, slice):
        try:
            selector = range(*selector.indices(num_worlds))
        except (TypeError, ValueError):
            raise SelectorError(
                f"{name}: expected a slice of int bounds and a non-zero int step, got {selector!r}"
            ) from None
    if isinstance(selector, range):
        _check_range(selector, num_worlds, name)
        return torch.tensor(selector, device=device, dtype=torch.int64)
    if isinstance(selector, np.ndarray):
        if selector.dtype.kind not in "biu":
            raise SelectorError(f"{name}: expected an integer or bool array, got dtype {selector.dtype}")
        # Native byte order (torch refuses the other one), contiguous (torch needs strides >= 0).
        selector = torch.from_numpy(np.ascontiguousarray(selector, dtype=selector.dtype.newbyteorder("=")))
    if isinstance(selector, torch.Tensor):
        return _normalize_tensor(selector, num_worlds, device, name, check, device_check, what)
    if isinstance(selector, Sequence) and not isinstance(selector, str | bytes):
        items = list(selector)
        wrong = [v for v in items if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral)]
        if wrong:
            raise SelectorError(
                f"{name}: expected a sequence of int world indices, got element {wrong[0]!r} "
                f"of type {type(wrong[0]).__name__}"
            )
        index = [int(v) for v in items]
        _check_indices(index, num_worlds, name)
        return torch.tensor(index, device=device, dtype=torch.int64)
    raise SelectorError(
        f"{name}: expected None, an int, a sequence of ints, a range, a slice, an integer tensor "
        f"or a boolean mask, got {type(selector).__name__} {selector!r}"
    )


def _normalize_tensor(t: torch.Tensor, num_worlds: int, device: torch.device, name: str, check: CheckMode,
                      device_check: WorldsCheck | None, what: str | None) -> torch.Tensor:
    if t.dtype == torch.bool:
        if t.dim() != 1 or t.shape[0] != num_worlds:
            raise SelectorError(
                f"{name}: expected a boolean mask of shape ({num_worlds},), got shape {tuple(t.shape)}"
            )
        return t.to(device).nonzero().flatten()
    if t.is_floating_point() or t.is_complex():
        raise SelectorError(f"{name}: expected an integer or bool tensor, got dtype {t.dtype}")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise SelectorError(f"{name}: expected a 1-D index tensor, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return torch.empty(0, device=device, dtype=torch.int64)
    if check not in CHECK_MODES:
        raise ValueError(f"check: expected one of {', '.join(CHECK_MODES)}, got {check!r}")
    if check == "trusted":
        return t.to(device=device, dtype=torch.int64)
    on_device = check == "device" or (check == "auto" and t.device.type == "cuda")
    if (on_device and device_check is not None and device_check.device == device
            and device_check.num_worlds == num_worlds):
        return device_check.check(t.to(device=device, dtype=torch.int64), what or name)
    # One host read of the index to validate it.
    _check_indices(t.tolist(), num_worlds, name)
    return t.to(device=device, dtype=torch.int64)
