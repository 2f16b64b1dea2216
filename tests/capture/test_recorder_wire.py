"""The recorder's run data over real ZeroMQ sockets: declarations, seed, times and outcomes
arrive at a remote subscriber as they were published, byte for byte."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from broker import Broker, EpisodeEnd, Message, RunEnd, RunStart, Subscriber, VariationSample, ZmqPublisher
from capture import Recorder
from capture.variations import ChoiceCfg, DesignCfg, UniformCfg, Variation, VariationCfg, VariationRecorder


@pytest.fixture
def link() -> Iterator[tuple[Broker, ZmqPublisher, Subscriber]]:
    broker = Broker(strict=True)
    publisher = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=5.0)
    subscriber = Subscriber(publisher.endpoints[0], confirm_run_ends=False)
    try:
        broker.subscribe("", publisher)
        publisher.wait_for_subscribers(1, timeout=10.0)  # readiness, not a sleep
        yield broker, publisher, subscriber
    finally:
        with contextlib.suppress(Exception):
            publisher.close(timeout=0.5)
        subscriber.close()
        broker.close()


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def test_declarations_seed_times_and_outcomes_arrive_as_published(
    link: tuple[Broker, ZmqPublisher, Subscriber],
) -> None:
    """Catches run data the recorder publishes but the wire drops or alters: declarations
    (nested lists, None, 64-bit seeds), the run seed, the wall-clock times as exact floats,
    and each outcome's float64 bytes."""
    broker, _, subscriber = link
    sent: list[Message] = []
    broker.subscribe("", sent.append)
    recorder = Recorder(3, broker=broker, run="wire", seed=2**63 + 5)
    vr = VariationRecorder(recorder)
    vr.attach([
        Variation("mass", VariationCfg(sampler=UniformCfg([1, 2], [2, 3]), phase="build")),
        Variation("object", VariationCfg(sampler=ChoiceCfg(["cube", "ball"], [1, 3]))),
    ])
    recorder.start()
    doe = Variation("doe", VariationCfg(sampler=DesignCfg(np.linspace(0, 1, 6), low=0, high=1)))
    vr.attach(doe)  # declared after RunStart: RunEnd carries it
    doe.sample(3)
    recorder.record_post_step()
    recorder.record_pre_reset([2, 0], success=True, outcomes={"return": [1.25, -3.5], "steps": 7})
    doe.sample(2, [2, 0])
    recorder.close()
    received: list[Message] = []
    deadline = time.monotonic() + 20.0
    while not any(isinstance(m, RunEnd) for m in received):
        assert time.monotonic() < deadline, f"no RunEnd after {len(received)} messages"
        got = subscriber.recv(timeout=1.0)
        if isinstance(got, RunStart | RunEnd | EpisodeEnd | VariationSample):
            received.append(got)
    (start,), (end,) = [m for m in sent if isinstance(m, RunStart)], [m for m in sent if isinstance(m, RunEnd)]
    (rstart,), (rend,) = [m for m in received if isinstance(m, RunStart)], [m for m in received if isinstance(m, RunEnd)]
    assert dict(rstart.variations) == dict(start.variations) == {
        k: v for k, v in recorder.variations.items() if k != "doe"}
    assert dict(rend.variations) == dict(end.variations) == recorder.variations
    assert rend.variations["doe"]["low"] == 0.0
    assert rstart.seed == rend.seed == 2**63 + 5
    assert (rstart.wall_time, rend.wall_time) == (start.wall_time, end.wall_time)
    (sent_end,), (got_end,) = [m for m in sent if isinstance(m, EpisodeEnd)], [m for m in received if isinstance(m, EpisodeEnd)]
    assert list(got_end.outcomes) == list(sent_end.outcomes) == ["return", "steps"]
    for name, value in sent_end.outcomes.items():
        assert got_end.outcomes[name].dtype == torch.float64
        assert _bytes(got_end.outcomes[name]) == _bytes(value)
    assert _bytes(got_end.outcomes["return"]) == np.array([1.25, -3.5]).tobytes()
    sent_doe = [m for m in sent if isinstance(m, VariationSample) and m.key == "doe"]
    got_doe = [m for m in received if isinstance(m, VariationSample) and m.key == "doe"]
    assert [_bytes(m.value) for m in got_doe] == [_bytes(m.value) for m in sent_doe]
    assert _bytes(torch.cat([m.value for m in got_doe])) == np.linspace(0, 1, 6, dtype=np.float32)[:5].tobytes()
