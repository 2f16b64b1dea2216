"""World index tensors checked on the device (no host sync): the same verdicts as the host
check, reported at a later call when the device has not answered yet, never lost."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Batch, Broker, EpisodeEnd, Message
from capture import FunctionTerm, Recorder, SelectorError, WorldsCheck, normalize_worlds


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), data=st.data())
def test_device_check_agrees_with_the_host_check(n: int, data: st.DataObject) -> None:
    """Any int index tensor: the device check refuses exactly what the host check refuses,
    and what both accept normalizes to the same indices."""
    values = data.draw(st.lists(st.integers(-3, n + 3), min_size=1, max_size=2 * n + 2))
    index = torch.tensor(values, dtype=data.draw(st.sampled_from([torch.int64, torch.int32, torch.int16])))
    try:
        expected = normalize_worlds(index, n, check="host")
    except SelectorError:
        expected = None
    check = WorldsCheck(n, "cpu", depth=4)
    if expected is None:
        with pytest.raises(SelectorError) as info:
            normalize_worlds(index, n, check="device", device_check=check)
        clamped = [min(max(v, 0), n - 1) for v in values]
        assert ("out of [0," in str(info.value)) == any(v < 0 or v >= n for v in values)
        assert ("duplicate" in str(info.value)) == (len(set(clamped)) != len(clamped))
    else:
        got = normalize_worlds(index, n, check="device", device_check=check)
        assert torch.equal(got, expected)
        assert got.dtype == torch.int64


class _LateEvent:
    """A CUDA event stand-in whose work lands only when the test says so."""

    def __init__(self) -> None:
        self.landed = False
        self.waited = 0

    def query(self) -> bool:
        return self.landed

    def synchronize(self) -> None:
        self.waited += 1
        self.landed = True

    def record(self, stream: Any = None) -> None:
        self.landed = False


def _late(check: WorldsCheck) -> list[_LateEvent]:
    events = [_LateEvent() for _ in range(check.depth)]
    check._events = list(events)
    return events


def test_a_bad_index_is_reported_once_its_verdict_lands_and_never_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA flow on CPU: verdicts are read only when their event says they landed; a bad
    index tensor is reported at the next call after that (not at its own call), and wait()
    reports one still in flight."""
    monkeypatch.setattr("torch.cuda.current_stream", lambda device=None: None)
    check = WorldsCheck(8, "cpu", depth=4)
    events = _late(check)
    good, bad = torch.tensor([1, 2]), torch.tensor([3, 9])
    assert torch.equal(check.check(good, "call 0"), good)
    clamped = check.check(bad, "call 1")  # in flight: nothing raised yet
    assert clamped.tolist() == [3, 7]  # in range, so no kernel can index out of bounds
    check.check(good, "call 2")
    events[0].landed = events[1].landed = True
    with pytest.raises(SelectorError, match=r"call 1: expected distinct world indices in \[0, 8\), got indices "
                                            r"out of \[0, 8\)"):
        check.check(good, "call 3")
    check.poll()  # reported once
    dup = torch.tensor([5, 5])
    check.check(dup, "call 4")
    with pytest.raises(SelectorError, match=r"call 4: .*duplicate indices"):
        check.wait()  # waits for what is still in flight
    assert all(e.landed for e in events)


def test_checks_in_flight_stay_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """More calls than slots with nothing landed: the oldest is waited for before its slot is
    reused, so no verdict is overwritten unread."""
    monkeypatch.setattr("torch.cuda.current_stream", lambda device=None: None)
    check = WorldsCheck(8, "cpu", depth=3)
    events = _late(check)
    check.check(torch.tensor([0, 8]), "call 0")  # bad
    check.check(torch.tensor([1]), "call 1")
    check.check(torch.tensor([2]), "call 2")
    with pytest.raises(SelectorError, match="call 0"):
        check.check(torch.tensor([3]), "call 3")  # slot 0 is needed again: its verdict is read
    assert events[0].waited == 1
    assert events[1].waited == 0
    check.wait()
    assert check.checks == 3


def test_recorder_device_check_refuses_bad_worlds_before_recording_on_cpu() -> None:
    """On CPU the verdict is there at once: a bad index tensor is refused at its own call and
    nothing of it is published, the episode state unchanged."""
    seen: list[Message] = []
    broker = Broker()
    broker.subscribe("", seen.append)
    rec = Recorder(6, broker=broker, run="r", worlds_check="device")
    rec.add_term("s", FunctionTerm(post_step=lambda: {"x": torch.arange(6.0)}))
    rec.record_post_step()
    for bad, what in ((torch.tensor([1, 6]), "out of"), (torch.tensor([2, 2]), "duplicate"),
                      (torch.tensor([-1]), "out of")):
        with pytest.raises(SelectorError, match=what):
            rec.record_pre_reset(bad, success=True)
        with pytest.raises(SelectorError, match=what):
            rec.record_post_step(bad)
    assert rec.episode_length.tolist() == [1] * 6
    rec.record_pre_reset(torch.tensor([4, 1]), success=torch.tensor([True, False]))
    rec.close()
    ends = [m for m in seen if isinstance(m, EpisodeEnd)]
    assert len(ends) == 1
    assert ends[0].worlds.tolist() == [4, 1]
    assert [m.seq for m in seen if isinstance(m, Batch)] == [1]


@pytest.mark.parametrize("mode", ["trusted", "host", "device", "auto"])
def test_every_mode_records_the_same_run(mode: str) -> None:
    """The check mode changes when a bad index is reported, never what a good run records."""
    def run(check: str) -> list[tuple[str, list[Any]]]:
        out: list[tuple[str, list[Any]]] = []
        broker = Broker()
        broker.subscribe("", lambda m: out.append((m.topic, [np.asarray(t).tolist() for t in
                                                             getattr(m, "fields", {}).values()]
                                                   + [getattr(m, "worlds", torch.empty(0)).tolist()])))
        rec = Recorder(5, broker=broker, run="r", worlds_check=check)  # type: ignore[arg-type]
        rec.add_term("s", FunctionTerm(post_step=lambda: {"x": torch.arange(5.0) * rec.step}))
        for step in range(6):
            rec.record_post_step(torch.tensor([0, 2, 4]) if step % 2 else None)
            if step % 3 == 2:
                rec.record_pre_reset(torch.tensor([step % 5, 1]), success=True)
        rec.close()
        return out

    assert run(mode) == run("host")


def test_unknown_check_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="worlds_check: expected one of auto, host, device, trusted, got 'fast'"):
        Recorder(2, worlds_check="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="check: expected one of"):
        normalize_worlds(torch.tensor([0]), 2, check="fast")  # type: ignore[arg-type]


def _schedule(device: torch.device, worlds_check: str) -> dict[int, dict[str, dict[str, torch.Tensor]]]:
    """A run with partial steps and resets of a few worlds every step (vectorized RL), index
    tensors on ``device``; what a Retention keeps of every world."""
    from consumers import Retention

    n = 64
    broker = Broker()
    retention = Retention(num_worlds=n, initial_capacity=256)
    retention.attach(broker)
    rec = Recorder(n, device, broker=broker, run="r", worlds_check=worlds_check)  # type: ignore[arg-type]
    state = torch.zeros(n, 3, device=device)
    rec.add_term("s", FunctionTerm(post_step=lambda: {"x": state}))
    rec.add_term("end", FunctionTerm(pre_reset=lambda idx: {"last": state.index_select(0, idx)}))
    gen = torch.Generator().manual_seed(7)
    plans = [(torch.randperm(n, generator=gen)[:40].to(device), torch.randperm(n, generator=gen)[:3].to(device))
             for _ in range(40)]
    success = torch.arange(n, device=device) % 2 == 0
    rec.record_post_step()  # the first batches fix the schemas
    rec.record_pre_reset(plans[0][1], success=success)
    sync_mode = torch.cuda.get_sync_debug_mode() if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.set_sync_debug_mode("error")  # any device sync below raises
    try:
        for active, resets in plans:
            state.add_(1.0)
            rec.record_post_step(active)
            rec.record_pre_reset(resets, success=success)
            rec.record_post_reset(resets)
    finally:
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(sync_mode)
    rec.check_worlds()
    rec.close()
    return {w: {t: {f: v.cpu() for f, v in fields.items()} for t, fields in retention.episode(w).items()}
            for w in range(n)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_record_calls_and_retention_never_sync_the_device() -> None:
    """Index tensors on the device through the record calls and Retention: no device sync on
    the step and reset paths (sync debug mode 'error'), and what is retained equals the CPU
    run of the same schedule."""
    device = torch.device("cuda", torch.cuda.current_device())
    got = _schedule(device, "auto")
    expected = _schedule(torch.device("cpu"), "host")
    assert got.keys() == expected.keys()
    for w in got:
        for term in expected[w]:
            for field, value in expected[w][term].items():
                assert torch.equal(got[w][term][field], value), (w, term, field)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bad_index_tensor_is_reported_without_a_device_assert() -> None:
    """An out-of-range index on CUDA: no device-side assert (the CUDA context stays usable);
    check_worlds() names the call."""
    device = torch.device("cuda", torch.cuda.current_device())
    rec = Recorder(8, device, run="r")
    rec.add_term("s", FunctionTerm(post_step=lambda: {"x": torch.ones(8, device=device)}))
    rec.record_post_step(torch.tensor([1, 8], device=device))
    with pytest.raises(SelectorError, match=r"worlds of a record call at step 0 of run 'r'.*out of \[0, 8\)"):
        rec.check_worlds()
    assert float(torch.ones(2, device=device).sum()) == 2.0  # the context still works
    rec.close()


def test_the_sync_free_schedule_retains_the_same_with_either_check_on_cpu() -> None:
    """The CUDA test's schedule on CPU: device-checked and host-checked runs retain the same."""
    a, b = _schedule(torch.device("cpu"), "device"), _schedule(torch.device("cpu"), "host")
    assert a.keys() == b.keys()
    assert any(v.shape[0] for w in a for fields in a[w].values() for v in fields.values())
    for w in a:
        assert a[w].keys() == b[w].keys()
        for term in a[w]:
            for field in a[w][term]:
                assert torch.equal(a[w][term][field], b[w][term][field])
