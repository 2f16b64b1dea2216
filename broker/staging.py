"""The publisher's staging ring: reusable host buffers that messages are copied into once.

A slot is owned by the simulation thread from :meth:`StagingRing.acquire` until it is handed to
the sender thread, then by the sender until :meth:`StagingRing.release`, and then by ZeroMQ
until the slot's message tracker is done (frames are sent zero-copy out of the slot). Only then
is the slot reused, so the bytes a subscriber receives are the bytes that were staged: a slot
whose tracker is still pending is refused (and keeps its tracker) however often it is asked for.

CUDA tensors are staged in two copies. On the simulation's current stream they are copied
device to device into the slot's device buffer (microseconds: the simulation may overwrite its
tensors as soon as ``stage`` returns, and its stream never waits for a host copy); a side
stream then copies that buffer to the slot's pinned host buffer and records the slot's event
(a blocking event: the sender thread sleeps on it rather than spinning a core). The device
buffer is only written again once the slot is reused, that is after the sender waited on the
event. Where the device buffer cannot be allocated (out of device memory), the slot copies
device to host directly on the side stream and the current stream waits for that copy.
"""

from __future__ import annotations

import collections
import ctypes
import math
import threading
import time
from typing import Any, Final, Protocol

import numpy as np
import torch
import zmq

from .wire import ALIGN, packed_layout

__all__ = ["PLANS_PER_SLOT", "Layout", "Plan", "Slot", "Staged", "StagingRing", "Tracker"]

_ALIGN: Final = ALIGN  # the wire's: a message staged for all its rows is one protocol 2 data frame
_SPAN_SLACK: Final = 1 << 20
"""Bytes of padding or unused rows a single device-to-host copy of a slot's span may carry
rather than one copy per tensor."""
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


PlanKey = tuple[Any, ...]
"""What messages that share a :class:`Plan` have in common: each tensor's dtype and shape, less the
leading dimension when every tensor has one and they all agree (a batch's worlds)."""


class Slot:
    """One staging buffer (pinned when it has held CUDA tensors)."""

    __slots__ = ("array", "buffer", "busy", "device_buffer", "device_padded", "event", "event_device", "framed",
                 "packed", "padded", "plans", "recent", "tracker", "views")

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.device_buffer: torch.Tensor | None = None  # CUDA staging: the device-side copy
        # PlanKey -> its plan: messages of one topic repeat their dtypes and (trailing) shapes.
        # Bounded (LRU): messages of ever new shapes would otherwise add a plan each.
        self.plans: collections.OrderedDict[PlanKey, Plan] = collections.OrderedDict()
        self.recent: Plan | None = None  # the most recently used plan (last in ``plans``)
        self.array: Any = None  # numpy view of ``buffer``, for zero-copy frames
        self.busy = False
        self.tracker: Tracker | None = None
        self.event: Any = None  # torch.cuda.Event of the last staging copy
        self.event_device: torch.device | None = None  # the device it records on
        self.framed: Layout | None = None  # the layout whose frames ``views`` holds
        self.views: list[memoryview] = []
        self.packed = False  # whether ``views`` is the one data frame of protocol 2
        # The layouts whose padding is zero in the host and the device buffer: a protocol 2
        # data frame carries the padding between tensors, which must never carry stale bytes
        # (another topic's message, or whatever memory the buffer was allocated over).
        self.padded: Layout | None = None
        self.device_padded: Layout | None = None

    def ensure(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """The buffer, reallocated if it is too small (or not pinned when it must be)."""
        if self.buffer is None or self.buffer.numel() < nbytes or (pinned and not self.buffer.is_pinned()):
            self.buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, pin_memory=pinned)
            self.array = self.buffer.numpy()
            self.plans.clear()
            self.recent = None
            self.framed = self.padded = None
        return self.buffer

    def ensure_device(self, nbytes: int, device: torch.device, side: Any) -> torch.Tensor | None:
        """The device buffer on ``device`` (reallocated if too small or elsewhere; the plans
        are dropped then, their views point into the old one), or ``None`` when it cannot be
        allocated. ``side``: the stream that reads it (the allocator waits for that stream's
        reads before it reuses the memory of a buffer given up)."""
        old = self.device_buffer
        if old is not None and old.device == device and old.numel() >= nbytes:
            return old
        if old is not None:  # given up, even if no other can be allocated: no plan may use it
            self.device_buffer = None
            self.plans.clear()
            self.recent = None
        try:
            buffer = torch.empty(max(nbytes, 4096), dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            return None
        buffer.record_stream(side)
        self.device_buffer = buffer
        self.device_padded = None
        self.plans.clear()
        self.recent = None
        return buffer

    def frame(self, offset: int, nbytes: int) -> memoryview:
        """A zero-copy view of staged bytes."""
        return self.array[offset:offset + nbytes].data  # type: ignore[no-any-return]

    def frames(self, layout: Layout) -> tuple[list[memoryview], bool]:
        """Zero-copy views of the staged tensors of ``layout`` (a layout :meth:`StagingRing.stage`
        returned for this slot; a plan hands out the same layout object while the leading
        dimension stays, so the views are made once), and whether they are the one data frame
        of wire protocol 2 (the tensors lie as :func:`broker.wire.packed_layout` places them:
        always but for a plan with room for more rows than the message has), else one frame
        per tensor (protocol 1)."""
        if layout is not self.framed:
            end = _data_frame_end(layout)
            self.packed = end is not None
            if end is not None:
                self.views = [self.frame(0, end)]
            else:
                self.views = [self.frame(offset, nbytes) for offset, nbytes in layout]
            self.framed = layout
        return self.views, self.packed


def _data_frame_end(layout: Layout) -> int | None:
    """The length of the protocol 2 data frame the tensors of ``layout`` make, or ``None`` when
    they do not lie where that frame has them."""
    offsets, end = packed_layout([nbytes for _, nbytes in layout])
    packed = all(o == offset for o, (offset, nbytes) in zip(offsets, layout, strict=True) if nbytes)
    return end if packed else None


def _zero_gaps(buffer: Any, layout: Layout) -> None:
    """Zero the padding between the tensors of a packed ``layout`` in ``buffer`` (a numpy array
    or a torch tensor of bytes); nothing for another layout: its padding is never sent."""
    if _data_frame_end(layout) is None:
        return
    end = None
    for offset, nbytes in layout:
        if nbytes:
            if end is not None and offset > end:
                buffer[end:offset] = 0
            end = offset + nbytes


class Plan:
    """How messages of one :data:`PlanKey` are laid out in a slot: each tensor's offset (room
    for ``capacity`` leading rows when the leading dimension varies) and bytes per row, and
    destination views (torch, and numpy for strided sources) of those with any bytes."""

    __slots__ = ("address", "capacity", "device", "device_views", "host", "layout", "offsets", "pinned",
                 "row_bytes", "rows", "views")

    def __init__(self, offsets: list[int], row_bytes: list[int], capacity: int, views: list[torch.Tensor | None],
                 address: int, pinned: bool, device: torch.device | None = None,
                 device_views: list[torch.Tensor | None] | None = None) -> None:
        self.offsets, self.row_bytes, self.capacity, self.views = offsets, row_bytes, capacity, views
        self.host: list[Any] = [None if v is None else _host_array(v) for v in views]  # numpy, or None
        self.address, self.pinned = address, pinned
        # CUDA plans: the device the message's tensors are on, and views of the slot's device
        # buffer at the same offsets (``None`` when the slot copies directly to the host).
        self.device, self.device_views = device, device_views
        self.rows = -1
        self.layout: Layout = []

    def layout_for(self, rows: int) -> Layout:
        """The layout of a message of ``rows`` leading rows (the same object while ``rows`` stays)."""
        if rows != self.rows:
            self.layout = [(offset, rows * size) for offset, size in zip(self.offsets, self.row_bytes, strict=True)]
            self.rows = rows
        return self.layout


def _rows(shapes: list[torch.Size]) -> int | None:
    """The leading dimension of every shape when each has one and they all agree, else ``None``."""
    first = shapes[0][0] if shapes and len(shapes[0]) else None
    if first is None or not all(len(s) and s[0] == first for s in shapes):
        return None
    return int(first)


class Staged:
    """A message waiting for the sender thread: its topic, run, header and (if it has tensors)
    slot and the frames of the slot's bytes to send (:meth:`Slot.frames`)."""

    __slots__ = ("control", "event", "frames", "header", "nbytes", "run", "slot", "topic")

    def __init__(self, topic: bytes, run: str, header: bytes, slot: Slot | None, frames: list[memoryview],
                 event: Any, control: bool) -> None:
        self.topic, self.run, self.header, self.slot, self.frames = topic, run, header, slot, frames
        self.event, self.control = event, control
        self.nbytes = len(topic) + len(header) + sum(f.nbytes for f in frames)  # on the wire


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
        self.plans_built = 0
        """Plans made so far (a new message shape, more rows than planned for, a reallocated
        buffer): each costs a few views per tensor."""

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
        tensors, the event the sender must wait on before reading the slot (else ``None``).

        Messages that differ only in their leading dimension (reset batches, episode ends) share
        one plan, with room for the most rows seen (grown by doubling)."""
        cuda = next((t.device for t in tensors if t.is_cuda), None)
        shapes = [t.shape for t in tensors]
        rows = _rows(shapes)
        if rows is None:
            key: PlanKey = tuple([(t.dtype, s) for t, s in zip(tensors, shapes, strict=True)])
        else:
            key = (*[(t.dtype, s[1:]) for t, s in zip(tensors, shapes, strict=True)], "rows")
        plans = slot.plans
        plan = plans.get(key)
        if plan is None or (cuda is not None and plan.device != cuda) or (rows or 1) > plan.capacity:
            if rows is None or plan is None:
                capacity = rows or 1
            else:  # grown by doubling, so that growing numbers of rows rebuild it a few times only
                capacity = max(rows, 2 * plan.capacity) if rows > plan.capacity else plan.capacity
            plan = self._plan(slot, tensors, shapes, rows is not None, capacity, cuda)
            plans[key] = plan  # after _plan: a reallocated buffer clears the plans
            plans.move_to_end(key)
            if len(plans) > PLANS_PER_SLOT:
                plans.popitem(last=False)
            slot.recent = plan
        elif plan is not slot.recent:  # a repeated shape is already the most recent
            plans.move_to_end(key)
            slot.recent = plan
        layout = plan.layout_for(1 if rows is None else rows)
        if cuda is not None:
            try:
                return layout, self._stage_cuda(slot, plan, layout, tensors, rows, cuda)
            except BaseException:  # copies it queued may still read or write the slot's buffers
                torch.cuda.synchronize(cuda)
                raise
        address = plan.address
        for src, (offset, nbytes), host in zip(tensors, layout, plan.host, strict=True):
            if not nbytes:
                continue
            if src.is_contiguous() and not (src.is_neg() or src.is_conj()):
                _memmove_holding_gil(address + offset, src.data_ptr(), nbytes)
            else:  # strided: numpy copies element by element (bits, whatever the dtype)
                np.copyto(host if rows is None else host[:rows], _host_array(src), casting="no")
        self._zero_padding(slot, layout)
        return layout, None

    @staticmethod
    def _zero_padding(slot: Slot, layout: Layout) -> None:
        """Zero the host buffer's padding between the tensors of ``layout`` (when another
        layout was staged in the slot since, or none yet: tensors only ever write their own bytes)."""
        if slot.padded is not layout:
            _zero_gaps(slot.array, layout)
            slot.padded = layout

    def _plan(self, slot: Slot, tensors: list[torch.Tensor], shapes: list[torch.Size], leading: bool,
              capacity: int, cuda: torch.device | None) -> Plan:
        """A plan for ``capacity`` leading rows (``leading``: the shapes' first dimension varies
        between messages of the plan) or for exactly these shapes; ``cuda``: the device of a
        message with CUDA tensors (the host buffer is pinned and a device buffer laid out alike)."""
        pinned = cuda is not None
        self.plans_built += 1
        offsets: list[int] = []
        row_bytes: list[int] = []
        offset = 0
        for t, shape in zip(tensors, shapes, strict=True):
            size = t.element_size() * (math.prod(shape[1:]) if leading else math.prod(shape))
            offsets.append(offset)
            row_bytes.append(size)
            offset += -(-(size * capacity) // _ALIGN) * _ALIGN
        device_buffer = None if cuda is None else slot.ensure_device(offset, cuda, self._stream(cuda))
        buffer = slot.ensure(offset, pinned=pinned)

        def views_of(buffer: torch.Tensor) -> list[torch.Tensor | None]:
            return [buffer[o:o + size * capacity].view(t.dtype).view((capacity, *shape[1:]) if leading else shape)
                    if size else None
                    for t, shape, o, size in zip(tensors, shapes, offsets, row_bytes, strict=True)]

        return Plan(offsets, row_bytes, capacity, views_of(buffer), int(buffer.data_ptr()),
                    pinned and buffer.is_pinned(), cuda, None if device_buffer is None else views_of(device_buffer))

    def _stream(self, device: torch.device) -> Any:
        """The side stream of ``device`` that copies staged tensors to the host."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _stage_cuda(self, slot: Slot, plan: Plan, layout: Layout, tensors: list[torch.Tensor], rows: int | None,
                    device: torch.device) -> Any:
        """Stage a message with tensors on ``device`` (see the module docstring); returns the
        event the sender waits on before it reads the slot."""
        stream = self._stream(device)
        current = torch.cuda.current_stream(device)
        sliced = rows is not None and rows != plan.capacity
        on_device: list[int] = []  # tensors on ``device``: through the device buffer, if any
        for i, (src, (_, nbytes)) in enumerate(zip(tensors, layout, strict=True)):
            if not nbytes:
                continue
            if src.device == device:
                on_device.append(i)
            elif not src.is_cuda:  # a host tensor of the message: straight into the slot
                host = plan.host[i]
                np.copyto(host[:rows] if sliced else host, _host_array(src), casting="no")
            else:  # another device's tensor: rare, copied synchronously
                view = plan.views[i]
                assert view is not None
                (view[:rows] if sliced else view).copy_(src)
        self._zero_padding(slot, layout)  # no copy in flight writes it: the sender waited on the event
        if slot.event is None or slot.event_device != device:  # an event records on one device only
            slot.event = torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
            slot.event_device = device
        if plan.device_views is None:  # no device buffer: device to host on the side stream
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                if on_device:
                    torch._foreach_copy_([self._rows(plan.views[i], rows, sliced) for i in on_device],
                                         [tensors[i] for i in on_device], non_blocking=True)
            slot.event.record(stream)
            current.wait_event(slot.event)  # the sources may be overwritten once it is done
            return slot.event
        dev = slot.device_buffer
        if slot.device_padded is not layout and dev is not None:  # the span copy carries it to the host
            _zero_gaps(dev, layout)
            slot.device_padded = layout
        if on_device:  # device to device on the simulation's stream: ordered before its next writes
            torch._foreach_copy_([self._rows(plan.device_views[i], rows, sliced) for i in on_device],
                                 [tensors[i] for i in on_device], non_blocking=True)
        stream.wait_stream(current)  # the side stream waits for the device copy only
        with torch.cuda.stream(stream):
            if on_device:
                first, last = layout[on_device[0]][0], layout[on_device[-1]][0] + layout[on_device[-1]][1]
                used_bytes = sum(layout[i][1] for i in on_device)
                host, dev = slot.buffer, slot.device_buffer
                assert host is not None
                assert dev is not None
                whole = len(on_device) == sum(1 for _, nbytes in layout if nbytes)
                if whole and last - first - used_bytes <= max(used_bytes >> 2, _SPAN_SLACK):
                    # one copy of the span (alignment padding and a few unused rows included)
                    host[first:last].copy_(dev[first:last], non_blocking=True)
                else:  # host tensors lie between them, or the span is mostly unused rows
                    for i in on_device:
                        offset, nbytes = layout[i]
                        host[offset:offset + nbytes].copy_(dev[offset:offset + nbytes], non_blocking=True)
        slot.event.record(stream)
        return slot.event

    @staticmethod
    def _rows(view: torch.Tensor | None, rows: int | None, sliced: bool) -> torch.Tensor:
        assert view is not None
        return view[:rows] if sliced else view

    def close(self) -> None:
        """Wake and fail every waiter (the sender thread has stopped)."""
        with self._cond:
            self.closed = True
            for slot in self.slots:
                slot.busy = False
            self._cond.notify_all()
