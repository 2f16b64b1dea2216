"""The publisher's staging ring: reusable host buffers that messages are copied into once.

A slot is owned by the simulation thread from :meth:`StagingRing.acquire` until it is handed to
the sender thread, then by the sender until :meth:`StagingRing.release`, and then by ZeroMQ
until the slot's message tracker is done (frames are sent zero-copy out of the slot). Only then
is the slot reused, so the bytes a subscriber receives are the bytes that were staged: a slot
whose tracker is still pending is refused (and keeps its tracker) however often it is asked for.
"""

from __future__ import annotations

import collections
import ctypes
import threading
import time
from typing import Any, Final, Protocol

import numpy as np
import torch
import zmq

__all__ = ["PLANS_PER_SLOT", "Layout", "Plan", "Slot", "Staged", "StagingRing", "Tracker"]

_ALIGN: Final = 64
PLANS_PER_SLOT: Final = 16
"""Message shapes whose layout a slot remembers (least recently used first out): per-step
batches repeat a few shapes; reset batches and episode ends bring a new shape almost every time."""

Layout = list[tuple[int, int]]
"""``(offset, nbytes)`` of each staged tensor inside its slot."""


# The CPU staging copy keeps the GIL. numpy and torch give it up for large copies, and
# taking it back from the sender thread's Python costs up to the interpreter's switch
# interval (5 ms by default) per copy; a message is several copies. One thread, no OpenMP
# workers either (on a machine busy with the simulation, ZeroMQ and the sender they only wait
# for each other).
def _libc_memmove_holding_gil() -> Any:
    address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
    assert address is not None
    return ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(address)


_memmove_holding_gil: Final = _libc_memmove_holding_gil()

_SAME_SIZE_INT: Final = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (a lazily negated or conjugated one is materialized first);
    dtypes numpy lacks (bfloat16, float8) are viewed as integers of their size (staging
    copies bits)."""
    t = t.detach().resolve_neg().resolve_conj()
    try:
        return t.numpy()
    except TypeError:
        return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


class Tracker(Protocol):
    """What the ring needs of a :class:`zmq.MessageTracker`: whether ZeroMQ is done with the
    frames, and a wait that raises :class:`zmq.NotDone` when it is not done in time."""

    @property
    def done(self) -> bool: ...

    def wait(self, timeout: float | int = -1) -> Any: ...


PlanKey = tuple[tuple[torch.dtype, torch.Size], ...]


class Slot:
    """One staging buffer (pinned when it has held CUDA tensors)."""

    __slots__ = ("array", "buffer", "busy", "event", "plans", "recent", "tracker")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        # (dtype, shape) of every tensor -> its plan: messages of one topic repeat their shapes.
        # Bounded (LRU): variable-shape messages would otherwise add a plan each.
        self.plans: collections.OrderedDict[PlanKey, Plan] = collections.OrderedDict()
        self.recent: Plan | None = None  # the most recently used plan (last in ``plans``)
        self.array: Any = None  # numpy view of ``buffer``, for zero-copy frames
        self.busy = False
        self.tracker: Tracker | None = None
        self.event: Any = None  # torch.cuda.Event of the last staging copy

    def ensure(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """The buffer, reallocated if it is too small (or not pinned when it must be)."""
        if self.buffer is None or self.buffer.numel() < nbytes or (pinned and not self.buffer.is_pinned()):
            self.buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=pinned)
            self.array = self.buffer.numpy()
            self.plans.clear()
            self.recent = None
        return self.buffer

    def frame(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of staged bytes."""
        return self.array[offset:offset + nbytes].data  # type: ignore[no-any-return]


class Plan:
    """How one message shape is laid out in a slot: each tensor's ``(offset, nbytes)``, and
    destination views (torch, and numpy and addresses for the CPU path) of the non-empty ones."""

    __slots__ = ("addresses", "host", "layout", "nonempty", "pinned", "views")

    def __init__(self, layout: Layout, views: list[torch.Tensor], host: list[np.ndarray],
                 nonempty: list[int], pinned: bool) -> None:
        self.layout, self.views, self.host, self.nonempty, self.pinned = layout, views, host, nonempty, pinned
        self.addresses = [int(h.ctypes.data) for h in host]


class Staged:
    """A message waiting for the sender thread: its topic, run, header and (if it has tensors) slot."""

    __slots__ = ("control", "event", "header", "layout", "nbytes", "run", "slot", "topic")

    def __init__(self, topic: bytes, run: str, header: bytes, slot: Slot | None, layout: Layout,
                 event: Any, control: bool) -> None:
        self.topic, self.run, self.header, self.slot, self.layout = topic, run, header, slot, layout
        self.event, self.control = event, control
        self.nbytes = len(topic) + len(header) + sum(nb for _, nb in layout)


class StagingRing:
    """A bounded ring of :class:`Slot`, used strictly in order.

    Args:
        slots: Number of slots (messages that may be staged or in flight at once).
        cond: The condition the owner's sender thread notifies when it releases a slot.
    """

    def __init__(self, slots: int, cond: threading.Condition) -> None:
        self.slots = [Slot() for _ in range(slots)]
        self._next = 0
        self._cond = cond
        self._streams: dict[torch.device, Any] = {}
        self.closed = False

    def acquire(self, wait: bool, timeout: float) -> Slot | None:
        """The next slot, once ZeroMQ is done with it; ``None`` if it is still in use and
        ``wait`` is false, after ``timeout`` seconds (the caller decides what that means), or
        once the ring is closed. A refused slot keeps its pending tracker: it is asked for
        again next time (the ring is used strictly in order)."""
        slot = self.slots[self._next]
        deadline = time.monotonic() + timeout
        with self._cond:
            while slot.busy and not self.closed:
                remaining = deadline - time.monotonic()
                if not wait or remaining <= 0:
                    return None
                self._cond.wait(remaining)
            if self.closed:
                return None
            slot.busy = True
        tracker = slot.tracker
        if tracker is not None and not tracker.done:
            try:
                if not wait:
                    raise zmq.NotDone
                tracker.wait(max(deadline - time.monotonic(), 0.0))
            except zmq.NotDone:
                self.release(slot, tracker)  # ZeroMQ may still be reading it
                return None
        slot.tracker = None
        self._next = (self._next + 1) % len(self.slots)
        return slot

    def release(self, slot: Slot, tracker: Tracker | None) -> None:
        """Give ``slot`` back; it is reused once ``tracker`` (if any) is done."""
        with self._cond:
            slot.tracker = tracker
            slot.busy = False
            self._cond.notify_all()

    def stage(self, slot: Slot, tensors: list[torch.Tensor]) -> tuple[Layout, Any]:
        """Copy ``tensors`` into ``slot`` (64-byte aligned). Returns the layout and, for CUDA
        tensors, the event the sender must wait on before reading the slot (else ``None``)."""
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        key = tuple((t.dtype, t.shape) for t in tensors)
        plans = slot.plans
        plan = plans.get(key)
        if plan is None or (cuda is not None and not plan.pinned):
            plan = self._plan(slot, tensors, pinned=cuda is not None)
            plans[key] = plan  # after _plan: a reallocated buffer clears the plans
            plans.move_to_end(key)
            if len(plans) > PLANS_PER_SLOT:
                plans.popitem(last=False)
            slot.recent = plan
        elif plan is not slot.recent:  # a repeated shape is already the most recent
            plans.move_to_end(key)
            slot.recent = plan
        if cuda is not None:
            return plan.layout, self._stage_cuda(slot, plan.views, [tensors[i] for i in plan.nonempty], cuda)
        for dst, address, i in zip(plan.host, plan.addresses, plan.nonempty, strict=True):
            src = tensors[i]
            if src.is_contiguous() and not (src.is_neg() or src.is_conj()):
                _memmove_holding_gil(address, src.data_ptr(), dst.nbytes)
            else:  # strided: numpy copies element by element (bits, whatever the dtype)
                np.copyto(dst, _host_array(src), casting="no")
        return plan.layout, None

    @staticmethod
    def _plan(slot: Slot, tensors: list[torch.Tensor], pinned: bool) -> Plan:
        layout: Layout = []
        offset = 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append((offset, nbytes))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        buffer = slot.ensure(offset, pinned=pinned)
        nonempty = [i for i, (_, nb) in enumerate(layout) if nb]
        views = [buffer[layout[i][0]:layout[i][0] + layout[i][1]].view(tensors[i].dtype).view(tensors[i].shape)
                 for i in nonempty]
        return Plan(layout, views, [_host_array(v) for v in views], nonempty, pinned and buffer.is_pinned())

    def _stage_cuda(self, slot: Slot, views: list[torch.Tensor], sources: list[torch.Tensor],
                    device: torch.device) -> Any:
        """Copy into the pinned slot on a side stream. The simulation's stream waits for the
        copy on the GPU (so it may overwrite the tensors at once); the simulation thread does
        not wait; the sender thread waits on the slot's event."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        current = torch.cuda.current_stream(device)
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            if views:
                torch._foreach_copy_(views, sources, non_blocking=True)
        if slot.event is None:
            slot.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        slot.event.record(stream)
        current.wait_event(slot.event)
        return slot.event

    def close(self) -> None:
        """Wake and fail every waiter (the sender thread has stopped)."""
        with self._cond:
            self.closed = True
            for slot in self.slots:
                slot.busy = False
            self._cond.notify_all()
