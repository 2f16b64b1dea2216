"""CUDA staging: pinned host slots, a side stream and an event (needs a GPU; skipped without)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from broker import Batch, Subscriber, ZmqPublisher

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_batches_arrive_intact_while_the_simulation_overwrites_them(
        make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber]) -> None:
    pub = make_pub("tcp://127.0.0.1:*", slots=4)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    device = torch.device("cuda", torch.cuda.current_device())
    worlds = torch.arange(4096, device=device)
    episodes = torch.zeros(4096, dtype=torch.int64, device=device)
    state = torch.empty(4096, 37, device=device)
    big = torch.empty(4096, 4096, device=device)
    for i in range(20):
        state.fill_(float(i))
        pub(Batch("run", i, i, "batch/obs", worlds, episodes, {"state": state, "done": state[:, 0] > 5}))
        big.normal_()  # queue work so the copy is still pending...
        state.fill_(-1.0)  # ...when the simulation overwrites the source on its stream
    for i in range(20):
        item = sub.recv(timeout=10)
        assert isinstance(item, Batch)
        assert item.seq == i
        assert item.fields["state"].device.type == "cpu"
        assert bool((item.fields["state"] == float(i)).all())
        assert bool((item.fields["done"] == (i > 5)).all())
    assert pub._ring.slots[0].buffer is not None
    assert pub._ring.slots[0].buffer.is_pinned()


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def test_the_simulation_stream_waits_for_the_device_copy_only(
        make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber]) -> None:
    """With the side stream held up (a long sleep kernel queued on it), the current stream
    finishes the staging's device copy and goes on: its work completes while the slot's
    device-to-host copy is still pending. The bytes that arrive are those published, though
    the producer overwrote its tensor right after publishing."""
    pub = make_pub("tcp://127.0.0.1:*", slots=2)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    device = _device()
    worlds = torch.arange(1024, device=device)
    episodes = torch.zeros(1024, dtype=torch.int64, device=device)
    state = torch.full((1024, 64), 1.0, device=device)
    for seq in range(2):  # each slot's plans, buffers and event, and the streams, made beforehand
        # (allocating pinned memory may synchronize the device while the side stream sleeps)
        pub(Batch("run", seq, seq, "batch/obs", worlds, episodes, {"state": state}))
        first = sub.recv(timeout=10)
        assert isinstance(first, Batch)
        assert bool((first.fields["state"] == 1.0).all())
    side = pub._ring._stream(device)
    with torch.cuda.stream(side):
        torch.cuda._sleep(4_000_000_000)  # type: ignore[no-untyped-call]  # seconds of GPU cycles on the side stream
    state.fill_(2.0)
    pub(Batch("run", 2, 2, "batch/obs", worlds, episodes, {"state": state}))  # into slot 0 again
    state.fill_(-1.0)  # the producer's next write, right after publishing
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record(torch.cuda.current_stream(device))
    done.synchronize()  # the current stream's work, the device copy included
    slot = pub._ring.slots[0]
    assert slot.event is not None
    assert not slot.event.query(), "the current stream waited for the device-to-host copy"
    second = sub.recv(timeout=30)
    assert isinstance(second, Batch)
    assert second.seq == 2
    assert bool((second.fields["state"] == 2.0).all())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_one_slot_stages_the_messages_of_two_devices_in_turn(
        make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber]) -> None:
    """Bug: a slot's event, made for its first CUDA message, records on that device only (a
    CUDA event belongs to one device): the slot's next message from another device raised."""
    pub = make_pub("tcp://127.0.0.1:*", slots=1)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    for seq, index in enumerate([0, 1, 0]):
        device = torch.device("cuda", index)
        pub(Batch("run", seq, seq, "batch/obs", torch.arange(16, device=device),
                  torch.zeros(16, dtype=torch.int64, device=device),
                  {"x": torch.full((16, 3), float(seq), device=device)}))
        got = sub.recv(timeout=10)
        assert isinstance(got, Batch)
        assert got.seq == seq
        assert bool((got.fields["x"] == float(seq)).all())


def test_a_staging_that_fails_midway_waits_for_the_copies_it_queued(
        make_pub: Callable[..., ZmqPublisher], monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging that raises after queueing copies on the device waits for them before the
    slot goes back to the ring (the next message would be staged over a copy in flight)."""
    pub = make_pub("tcp://127.0.0.1:*", slots=1)
    device = _device()
    copy, synchronize = torch._foreach_copy_, torch.cuda.synchronize
    waited: list[object] = []

    def fails_after_queueing(*args: object, **kwargs: object) -> None:
        copy(*args, **kwargs)  # type: ignore[arg-type]
        raise RuntimeError("staging failed")

    def noted(device: object = None) -> None:
        waited.append(device)
        synchronize(device)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_foreach_copy_", fails_after_queueing)
    monkeypatch.setattr(torch.cuda, "synchronize", noted)
    with pytest.raises(RuntimeError, match="staging failed"):
        pub(Batch("run", 0, 0, "batch/obs", torch.arange(8, device=device),
                  torch.zeros(8, dtype=torch.int64, device=device), {"x": torch.ones(8, 3, device=device)}))
    assert waited == [device]
    assert not pub._ring.slots[0].busy
    assert pub.statistics().failed == 1


def test_staging_events_are_blocking(make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender thread sleeps on the staging event (a blocking event) instead of spinning."""
    made: list[dict[str, object]] = []
    real = torch.cuda.Event

    def event(**kwargs: object) -> torch.cuda.Event:
        made.append(kwargs)
        return real(**kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(torch.cuda, "Event", event)
    pub = make_pub("tcp://127.0.0.1:*", slots=2)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    device = _device()
    pub(Batch("run", 0, 0, "batch/obs", torch.arange(8, device=device), torch.zeros(8, dtype=torch.int64, device=device),
              {"x": torch.ones(8, 3, device=device)}))
    assert isinstance(sub.recv(timeout=10), Batch)
    assert made
    assert all(kw.get("blocking") is True for kw in made)


@pytest.mark.parametrize("device_buffer", [True, False], ids=["device-slot", "direct"])
def test_mixed_and_variable_shape_messages_arrive_byte_exact(
        make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber],
        monkeypatch: pytest.MonkeyPatch, device_buffer: bool) -> None:
    """Reset batches of a varying number of worlds (plans with unused rows), a host tensor among
    device tensors, strided sources, bfloat16, and a slot with no device buffer (out of device
    memory): every message's bytes as published, though each source is overwritten at once."""
    if not device_buffer:
        from broker.staging import Slot
        monkeypatch.setattr(Slot, "ensure_device", lambda self, nbytes, device, side: None)
    pub = make_pub("tcp://127.0.0.1:*", slots=3)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    device = _device()
    gen = torch.Generator(device=device).manual_seed(0)
    expected = []
    for i, k in enumerate([5, 300, 17, 1, 4096, 64, 2000, 3]):
        worlds = torch.randperm(4096, device=device, generator=gen)[:k]
        wide = torch.randn(k, 8, device=device, generator=gen)
        fields = {"strided": wide[:, ::2], "half": wide.to(torch.bfloat16),
                  "host": torch.arange(k * 2, dtype=torch.int32).reshape(k, 2) + i}
        episodes = torch.full((k,), i, dtype=torch.int64, device=device)
        expected.append((worlds.cpu(), {f: t.cpu().clone() for f, t in fields.items()}))
        pub(Batch("run", i, i, "batch/reset", worlds, episodes, fields, "pre_reset"))
        wide.fill_(float("nan"))
        worlds.fill_(-1)
        fields["host"].fill_(-7)
    for i, (worlds, fields) in enumerate(expected):
        got = sub.recv(timeout=10)
        assert isinstance(got, Batch)
        assert got.seq == i
        assert torch.equal(got.worlds, worlds)
        for f, t in fields.items():
            assert got.fields[f].dtype == t.dtype
            assert torch.equal(got.fields[f].view(torch.uint8) if t.dtype == torch.bfloat16 else got.fields[f],
                               t.view(torch.uint8) if t.dtype == torch.bfloat16 else t), (i, f)
    slots = pub._ring.slots
    assert all((s.device_buffer is not None) == device_buffer for s in slots if s.buffer is not None)


@pytest.mark.parametrize("device_buffer", [True, False])
def test_the_padding_of_a_cuda_data_frame_is_zero(device_buffer: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device buffer's padding goes to the host in the span copy: it is zeroed on the device
    when a layout is staged after another (or first), as the host buffer's is; without a device
    buffer the host's own zeroing holds. Buffers pre-filled with 0xAB stand for stale memory."""
    import threading

    from test_staging import _bits, _padding

    from broker import staging

    if not device_buffer:
        monkeypatch.setattr(staging.Slot, "ensure_device", lambda self, nbytes, device, side: None)
    ring = staging.StagingRing(1, threading.Condition())
    slot = ring.acquire(False, 0.0)
    assert slot is not None
    device = torch.device("cuda", torch.cuda.current_device())
    a = [torch.full((100,), -1, dtype=torch.int8, device=device), torch.ones(1, dtype=torch.int8, device=device)]
    b = [torch.full((10,), 7, dtype=torch.int8, device=device), torch.full((50,), 9, dtype=torch.int8, device=device)]
    for i, tensors in enumerate((a, b, a, b)):
        if i == 0:
            _, first = ring.stage(slot, tensors)  # allocates the buffers; then make them stale
            first.synchronize()
            assert slot.buffer is not None
            slot.buffer.fill_(0xAB)
            if slot.device_buffer is not None:
                slot.device_buffer.fill_(0xAB)
            slot.padded = slot.device_padded = None
        layout, event = ring.stage(slot, tensors)
        event.synchronize()
        views, packed = slot.frames(layout)
        assert packed
        assert [bytes(views[0][o:o + n]) for o, n in layout] == [_bits(t.cpu()) for t in tensors]
        padding = _padding(views[0], layout)
        assert padding == bytes(len(padding))
