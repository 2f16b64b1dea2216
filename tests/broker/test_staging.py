"""The staging ring copies every tensor's bits exactly, whatever its dtype or strides; it never hands
out a slot ZeroMQ may still read; its plan cache stays bounded."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from trackers import FakeTracker

from broker import staging, wire
from broker.staging import StagingRing

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn]


def _staged_bytes(ring: StagingRing, tensors: list[torch.Tensor]) -> list[bytes]:
    slot = ring.acquire(True, 1.0)
    assert slot is not None
    layout, event = ring.stage(slot, tensors)
    assert event is None
    out = [bytes(slot.frame(off, nb)) for off, nb in layout]
    ring.release(slot, None)
    return out


def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stage_copies_bits_of_every_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (5, 3, 2 * 8), dtype=torch.uint8, generator=g)
    t = raw.view(dtype) if dtype != torch.bool else raw > 127
    ring = StagingRing(2, threading.Condition())
    assert _staged_bytes(ring, [t]) == [_bits(t)]


def test_stage_handles_strided_empty_zero_d_and_grad_tensors() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = [base[:, ::3], base.t(), torch.zeros(0, 4), torch.tensor(7, dtype=torch.int64),
               torch.ones(3, requires_grad=True), base[1:4].to(torch.bfloat16)[:, 1::2],
               base[2],  # contiguous, at an offset into its storage
               torch.arange(5.0)._neg_view()]  # a lazily negated view: its values, not its bits
    ring = StagingRing(1, threading.Condition())
    for _ in range(2):  # the second pass reuses the cached plan
        assert _staged_bytes(ring, tensors) == [_bits(t.resolve_neg()) for t in tensors]
        base.add_(1)


def test_staging_host_tensors_never_gives_up_the_gil() -> None:
    """The staging copy keeps the GIL: where the simulation thread gives it up, the publisher's
    sender thread (or any other) may take it and hold it for a switch interval. A thread
    spinning in Python counts while it holds the GIL; with a long switch interval it only runs
    during the staging of a message if a copy gives the GIL up (numpy's copyto and torch's
    copy_ do for large copies: with copyto in place of the memmove, it ran 110 million times)."""
    tensors = [torch.arange(4096 * 37, dtype=torch.float32).reshape(4096, 37), torch.ones(4096, dtype=torch.bool),
               torch.arange(4096)]  # contiguous and plain (a lazy view is materialized by torch first)
    ring = StagingRing(1, threading.Condition())
    _staged_bytes(ring, tensors)  # the plan and the buffer are made once: staging from here on
    slot = ring.acquire(True, 1.0)
    assert slot is not None
    count = [0]
    stop, started = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        while not stop.is_set():
            count[0] += 1

    interval = sys.getswitchinterval()
    spinner = threading.Thread(target=spin, daemon=True)
    try:
        sys.setswitchinterval(0.5)
        spinner.start()
        started.wait(10)
        before = count[0]
        layout, _ = ring.stage(slot, tensors)
        during = count[0] - before
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        spinner.join(10)
        ring.release(slot, None)
    assert during == 0, f"the spinning thread ran {during} times while a message was staged"
    assert [bytes(slot.frame(off, nb)) for off, nb in layout] == [_bits(t) for t in tensors]


def test_overwriting_the_source_after_staging_changes_nothing_staged() -> None:
    t = torch.arange(8, dtype=torch.float32)
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(True, 1.0)
    assert slot is not None
    layout, _ = ring.stage(slot, [t])
    t.fill_(-1)
    assert bytes(slot.frame(*layout[0])) == _bits(torch.arange(8, dtype=torch.float32))


def test_a_slot_zeromq_still_reads_is_refused_until_its_tracker_is_done() -> None:
    """A refused slot used to forget its tracker: the next message was copied into bytes
    ZeroMQ was still sending."""
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(False, 0.0)
    assert slot is not None
    layout, _ = ring.stage(slot, [torch.arange(100, dtype=torch.int64)])
    tracker = FakeTracker()
    ring.release(slot, tracker)
    for wait in (False, True, False, True):  # drop policy, and block policy after a timeout
        assert ring.acquire(wait, 0.0) is None
    assert slot.tracker is tracker
    assert bytes(slot.frame(*layout[0])) == _bits(torch.arange(100, dtype=torch.int64))
    tracker.finished = True
    assert ring.acquire(False, 0.0) is slot
    assert slot.tracker is None


def test_a_closed_ring_hands_out_nothing() -> None:
    ring = StagingRing(2, threading.Condition())
    ring.close()
    assert ring.acquire(True, 0.0) is None
    assert ring.acquire(False, 0.0) is None


def test_plans_stay_bounded_for_variable_shapes_and_repeated_shapes_stay_cached() -> None:
    """Episode ends and reset batches bring a new shape almost every time: the plan cache used
    to keep one plan per shape forever (about 15k plans, +150 MiB after 20k episode ends)."""
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(False, 0.0)
    assert slot is not None
    ring.stage(slot, [torch.zeros(16_384, dtype=torch.int64)])  # 128 kB: no reallocation below
    steady = [torch.arange(4 * 37, dtype=torch.float32).reshape(4, 37), torch.ones(4, dtype=torch.bool)]
    ring.stage(slot, steady)
    hot = slot.recent
    for n in range(1, 3001):  # a reset of n worlds, then the per-step batch again
        reset = [torch.arange(n, dtype=torch.int64), torch.arange(n, dtype=torch.int64) * -3,
                 torch.arange(n) % 2 == 0]
        layout, _ = ring.stage(slot, reset)
        assert [bytes(slot.frame(*lo)) for lo in layout] == [_bits(t) for t in reset]
        assert len(slot.plans) <= staging.PLANS_PER_SLOT
        layout, _ = ring.stage(slot, steady)
        assert slot.recent is hot  # the per-step shape is planned once, whatever came between
        assert [bytes(slot.frame(*lo)) for lo in layout] == [_bits(t) for t in steady]


def test_messages_that_differ_only_in_their_number_of_worlds_share_one_plan() -> None:
    """Keyed by exact shapes, every reset batch or episode end of a new number of worlds made a
    plan of its own (views per tensor) and pushed the per-step plans out. Keyed by dtypes and
    trailing shapes, they share one plan that grows by doubling; what is staged is still each
    message's bits, nothing of a larger message before it."""
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(False, 0.0)
    assert slot is not None
    sizes = [n * 37 % 200 for n in range(200)]  # 0..199, in a scrambled order
    kinds = set()
    for n in sizes:
        tensors = [torch.arange(n, dtype=torch.int64) - n, (torch.arange(3 * n, dtype=torch.float32) / 7).reshape(n, 3),
                   torch.arange(n) % 3 == 0,
                   torch.arange(2 * n, dtype=torch.int16).reshape(2, n).t()]  # strided: copied by numpy
        layout, _ = ring.stage(slot, tensors)
        want = [_bits(t) for t in tensors]
        assert [bytes(slot.frame(*lo)) for lo in layout] == want
        views, packed = slot.frames(layout)
        if packed:  # one protocol 2 data frame: each tensor where the wire's layout puts it
            offsets, end = wire.packed_layout([nb for _, nb in layout])
            assert [v.nbytes for v in views] == [end]
            assert [bytes(views[0][o:o + nb]) for o, (_, nb) in zip(offsets, layout, strict=True)] == want
            kinds.add("packed")
        else:  # a plan with room for more rows: a frame per tensor
            assert [bytes(f) for f in views] == want
            kinds.add("per tensor")
    assert kinds == {"packed", "per tensor"}
    assert len(slot.plans) == 1
    assert ring.plans_built == 5  # room for 1 row (0 first), 37, 74, 148, 296: not one per size


def test_a_device_buffer_given_up_takes_its_plans_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """When a slot gives its device buffer up (a larger message) and no new one can be
    allocated (out of device memory), no plan that points into the old one may stay: a later
    message of an old plan's shape would stage through a buffer the slot no longer has."""
    from broker.staging import Plan

    ring = StagingRing(1, threading.Condition())
    slot = ring.slots[0]
    slot.device_buffer = torch.empty(64, dtype=torch.uint8)  # stands in for a device buffer
    slot.plans[("old",)] = Plan([0], [8], 1, [None], 0, False, torch.device("cpu"), [None])
    slot.recent = slot.plans[("old",)]

    def out_of_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.cuda.OutOfMemoryError("injected")

    monkeypatch.setattr(torch, "empty", out_of_memory)
    assert slot.ensure_device(1 << 20, torch.device("cpu"), side=None) is None
    assert slot.device_buffer is None
    assert not slot.plans
    assert slot.recent is None


def _padding(frame: memoryview, layout: list[tuple[int, int]]) -> bytes:
    """The bytes of a protocol 2 data frame that belong to no tensor."""
    used = bytearray(frame.nbytes)
    for offset, nbytes in layout:
        used[offset:offset + nbytes] = b"\x01" * nbytes
    return bytes(b for b, u in zip(bytes(frame), used, strict=True) if not u)


def test_the_padding_a_data_frame_carries_is_zero() -> None:
    """A protocol 2 data frame sends the padding between tensors: it must not carry what the
    buffer held before (memory it was allocated over, or another message's tensors, perhaps of
    a topic this subscriber never asked for). Each layout's padding is zeroed when it is staged
    after another layout (or first)."""
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(False, 0.0)
    assert slot is not None
    slot.ensure(1 << 16, pinned=False).fill_(0xAB)  # whatever the allocation held
    a = [torch.full((100,), -1, dtype=torch.int8), torch.ones(1, dtype=torch.int8)]  # at 0 and 128
    b = [torch.full((10,), 7, dtype=torch.int8), torch.full((50,), 9, dtype=torch.int8)]  # at 0 and 64
    for tensors in (a, b, a, b):  # each writes into the other's padding
        layout, _ = ring.stage(slot, tensors)
        views, packed = slot.frames(layout)
        assert packed
        assert [bytes(views[0][o:o + n]) for o, n in layout] == [_bits(t) for t in tensors]
        padding = _padding(views[0], layout)
        assert padding == bytes(len(padding))
        assert len(padding) in (28, 54)
