"""Stateful property test of the staging ring: slots acquired, staged, handed to a fake ZeroMQ
whose trackers finish in any order, refused and asked for again.

Invariants: a slot is never handed out while the simulation holds it or while its tracker is
pending; staged bytes are never overwritten while they are held or in flight (every byte is
checked); a slot that is free is never refused.
"""

from __future__ import annotations

import threading

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from trackers import FakeTracker

from broker.staging import Layout, Slot, StagingRing

SLOTS = 3
DTYPES = [torch.uint8, torch.int16, torch.int32, torch.float32, torch.float64]


def _tensor(message: int, index: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """``count`` elements whose bytes derive from the message and tensor numbers."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = (torch.arange(count * size, dtype=torch.int64) * 131 + message * 7 + index * 17) % 251
    return raw.to(torch.uint8).view(dtype)


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class StagingRingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ring = StagingRing(SLOTS, threading.Condition())
        self.acquired = 0  # the ring is used strictly in order: the next slot is acquired % SLOTS
        self.held: list[tuple[Slot, Layout, list[bytes]]] = []  # the simulation / sender own them
        self.in_flight: list[tuple[FakeTracker, Slot, Layout, list[bytes]]] = []  # ZeroMQ reads them

    def _staged(self, slot: Slot, layout: Layout) -> list[bytes]:
        return [bytes(slot.frame(off, nb)) for off, nb in layout]

    def _taken(self, slot: Slot) -> bool:
        return any(s is slot for s, _, _ in self.held) or any(s is slot for _, s, _, _ in self.in_flight)

    @rule(wait=st.booleans(), sizes=st.lists(st.integers(0, 200), min_size=1, max_size=4),
          dtype=st.sampled_from(DTYPES))
    def acquire_and_stage(self, wait: bool, sizes: list[int], dtype: torch.dtype) -> None:
        expected = self.ring.slots[self.acquired % SLOTS]
        slot = self.ring.acquire(wait, 0.0)
        if slot is None:
            assert self._taken(expected), "a free slot was refused"
            return
        assert slot is expected, "the ring left its order"
        assert not self._taken(slot), "a slot was handed out while held or while ZeroMQ reads it"
        self.acquired += 1
        tensors = [_tensor(self.acquired, i, n, dtype) for i, n in enumerate(sizes)]
        layout, event = self.ring.stage(slot, tensors)
        assert event is None
        want = [_bits(t) for t in tensors]
        assert self._staged(slot, layout) == want
        self.held.append((slot, layout, want))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), tracked=st.booleans())
    def hand_to_zeromq(self, data: st.DataObject, tracked: bool) -> None:
        """The sender releases a slot: sent zero-copy (a pending tracker), or copied / dropped."""
        slot, layout, want = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        if tracked:
            tracker = FakeTracker()
            self.ring.release(slot, tracker)
            self.in_flight.append((tracker, slot, layout, want))
        else:
            self.ring.release(slot, None)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def zeromq_finishes(self, data: st.DataObject) -> None:
        tracker, slot, layout, want = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        assert self._staged(slot, layout) == want, "ZeroMQ sent bytes that were overwritten"
        tracker.finished = True

    @invariant()
    def staged_bytes_are_intact(self) -> None:
        for slot, layout, want in self.held:
            assert self._staged(slot, layout) == want
        for _, slot, layout, want in self.in_flight:
            assert self._staged(slot, layout) == want

    @invariant()
    def pending_trackers_stay_with_their_slots(self) -> None:
        for tracker, slot, _, _ in self.in_flight:
            assert slot.tracker is tracker


StagingRingMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
test_staging_ring = StagingRingMachine.TestCase
