"""ZmqPublisher -> Subscriber over real loopback sockets (tcp:// and ipc://)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from broker import (
    Batch,
    Broker,
    BrokerClosedError,
    EpisodeEnd,
    Gap,
    RunEnd,
    RunStart,
    SendTimeoutError,
    Subscriber,
    SubscriberTimeoutError,
    VariationSample,
    ZmqPublisher,
    encode,
)
from broker.wire import SUBSCRIBER_HELLO

MakePub = Callable[..., ZmqPublisher]
MakeSub = Callable[..., Subscriber]
Check = Callable[..., int]
BIG = 20_000  # floats per world: 4 worlds x 80 kB per frame, above pyzmq's zero-copy threshold


def _messages(batch: Callable[..., Batch]) -> list[Any]:
    w = torch.arange(4)
    e = torch.zeros(4, dtype=torch.int64)
    flags = torch.tensor([True, False, False, True])
    return [
        RunStart("run-a", 0, 0, 4, "cpu", {}, {"task": "lift"}),
        batch(1),
        VariationSample("run-a", 2, 1, "mass", "runtime", w, e, torch.rand(4, 2)),
        EpisodeEnd("run-a", 3, 1, w, e, flags, ~flags, flags, torch.tensor([3, 3, 3, 3])),
        batch(4, width=BIG),
        # no worlds (an empty data frame), and odd sizes of several dtypes between 64-byte offsets
        Batch("run-a", 5, 2, "batch/empty", w[:0], e[:0], {"x": torch.zeros(0, 3)}),
        Batch("run-a", 6, 2, "batch/mixed", w, e, {
            "b": torch.rand(4, 3) > 0.5, "h": torch.randn(4, 5).to(torch.bfloat16), "z": torch.zeros(4, 0),
            "i": torch.arange(28, dtype=torch.int16).reshape(4, 7), "d": torch.randn(4, 3, dtype=torch.float64)}),
        RunEnd("run-a", 7, 2, 4, "cpu"),
    ]


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    for name in a.__slots__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            if not torch.equal(x, y):
                return False
        elif name == "fields":
            if x.keys() != y.keys() or not all(torch.equal(x[k], y[k]) for k in x):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("publisher_binds", [True, False], ids=["pub-binds", "sub-binds"])
def test_every_kind_round_trips(make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
                                broker: Broker, batch: Callable[..., Batch], drain: Callable[..., list[Any]],
                                join: Callable[..., None], publisher_binds: bool) -> None:
    if publisher_binds:
        pub = make_pub(free_endpoint())
        sub = make_sub(pub.endpoints[0])
    else:
        sub = make_sub(free_endpoint(), bind=True)
        pub = make_pub(sub.endpoints[0], bind=False)
    join(pub, sub)
    broker.subscribe("", pub)
    sent = _messages(batch)
    for m in sent:
        broker.publish(m)
    got = drain(sub)
    assert len(got) == len(sent)
    assert all(_same(a, b) for a, b in zip(sent, got, strict=True))
    pub.close()
    stats = pub.statistics()
    assert stats.published == stats.messages == len(sent)
    assert stats.drops == 0
    assert stats.closed
    assert sub.statistics().bytes == stats.bytes
    assert sub.statistics().received == len(sent)


def test_publisher_sends_one_data_frame_unless_the_staged_rows_are_spread(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], broker: Broker,
        numbered: Callable[..., Batch], check_numbered: Callable[..., int], drain: Callable[..., list[Any]],
        join: Callable[..., None], monkeypatch: pytest.MonkeyPatch) -> None:
    """Protocol 2 (one data frame) for every message staged as the wire lays it out; protocol 1
    (a frame per tensor) for a reset batch of fewer worlds than its staging plan has room for.
    Either way every message arrives byte for byte as published."""
    import broker.zmq_subscriber as zmq_subscriber

    seen: list[tuple[int, int]] = []  # (protocol version, frames) of each message received
    decode = zmq_subscriber.decode_envelope

    def spy(frames: list[Any], **kwargs: Any) -> Any:
        seen.append((msgpack.unpackb(bytes(frames[1]))["v"], len(frames)))
        return decode(frames, **kwargs)

    monkeypatch.setattr(zmq_subscriber, "decode_envelope", spy)
    pub = make_pub(free_endpoint(), slots=1)  # one slot: its plan for the shape keeps room for 64 rows
    sub = make_sub(pub.endpoints[0])
    join(pub, sub)
    broker.subscribe("", pub)
    worlds = [64, 3, 64, 1, 64]  # per-step batches of every world, resets of a few between them
    for seq, n in enumerate(worlds, 1):
        broker.publish(numbered(seq, worlds=n))
    got = drain(sub)
    assert [check_numbered(item) for item in got] == [1, 2, 3, 4, 5]
    assert seen == [(2, 3), (1, 6), (2, 3), (1, 6), (2, 3)]


def test_source_may_change_right_after_publish(make_pub: MakePub, make_sub: MakeSub,
                                               free_endpoint: Callable[[], str], broker: Broker,
                                               batch: Callable[..., Batch]) -> None:
    pub = make_pub(free_endpoint())
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    broker.subscribe("", pub)
    message = batch(7, width=BIG)
    for _ in range(3):
        broker.publish(message)
        message.fields["x"].fill_(-1.0)  # the simulator overwrites its buffers at once
        message.fields["x"].fill_(7.0)
    message.fields["x"].fill_(-1.0)
    got = [sub.recv(timeout=5) for _ in range(3)]
    assert all(isinstance(g, Batch) and bool((g.fields["x"] == 7.0).all()) for g in got)


def test_lossless_with_a_slow_subscriber(make_pub: MakePub, make_sub: MakeSub,
                                         free_endpoint: Callable[[], str], broker: Broker,
                                         numbered: Callable[..., Batch], check_numbered: Check) -> None:
    pub = make_pub(free_endpoint(), slots=2, hwm=1, send_timeout=20)
    sub = make_sub(pub.endpoints[0], hwm=1)
    pub.wait_for_subscribers(1, timeout=10)
    broker.subscribe("", pub)
    n = 150  # 150 x 320 kB: far more than the queues and socket buffers hold

    def produce() -> None:
        for i in range(n):
            broker.publish(numbered(i, width=BIG))

    producer = threading.Thread(target=produce)
    producer.start()
    seqs = []
    try:
        while len(seqs) < n:
            item = sub.recv(timeout=10)
            seqs.append(check_numbered(item))  # every byte its own
            if len(seqs) % 10 == 0:
                time.sleep(0.02)  # deliberately slow
    finally:
        producer.join(30)
    assert seqs == list(range(n))
    stats = pub.statistics()
    assert stats.drops == 0
    assert stats.messages == n
    assert sub.statistics().gaps == 0


def test_drop_mode_drops_equal_reported_gaps(make_pub: MakePub, make_sub: MakeSub,
                                             free_endpoint: Callable[[], str], broker: Broker,
                                             numbered: Callable[..., Batch], check_numbered: Check) -> None:
    pub = make_pub(free_endpoint(), policy="drop", slots=1, hwm=1)
    sub = make_sub(pub.endpoints[0], hwm=1)
    pub.wait_for_subscribers(1, timeout=10)
    broker.subscribe("", pub)
    n = 200
    for i in range(n):
        broker.publish(numbered(i, width=BIG))  # never waits: drops instead
    broker.publish(RunEnd("run-a", n, n, 4, "cpu"))  # run/ messages are never dropped
    received, gaps = [], []
    while True:
        item = sub.recv(timeout=10)
        assert item is not None, "RunEnd never arrived"
        if isinstance(item, RunEnd):
            break
        (gaps if isinstance(item, Gap) else received).append(item)
    assert [check_numbered(m) for m in received] == sorted({m.seq for m in received})  # whole, in order
    pub.close()
    drops = pub.statistics().drops
    assert drops > 0
    assert sum(g.missing for g in gaps) == drops == n - len(received)
    assert sub.statistics().missing == drops
    assert sub.statistics().gaps == len(gaps)
    assert all(g.topic == "batch/obs" and g.run == "run-a" and g.publisher == pub.id for g in gaps)


def test_slow_joiner_misses_nothing_after_wait_for_subscribers(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], broker: Broker,
        numbered: Callable[..., Batch], check_numbered: Check, drain: Callable[..., list[Any]]) -> None:
    pub = make_pub(free_endpoint())
    broker.subscribe("", pub)
    with pytest.raises(SubscriberTimeoutError, match=r"expected 1 subscriber\(s\) on .* within 0.1 s, 0 joined"):
        pub.wait_for_subscribers(1, timeout=0.1)
    subs = [make_sub(pub.endpoints[0], topics=("batch/",)), make_sub(pub.endpoints[0])]
    pub.wait_for_subscribers(2, timeout=10)
    for i in range(30):
        broker.publish(numbered(i))
    for sub in subs:
        got = drain(sub)
        assert [check_numbered(m) for m in got] == list(range(30))


def test_joining_late_is_a_gap(make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
                               broker: Broker, numbered: Callable[..., Batch], check_numbered: Check,
                               close_and_drain: Callable[..., list[Any]]) -> None:
    pub = make_pub(free_endpoint())
    broker.subscribe("", pub)
    for i in range(5):
        broker.publish(numbered(i))  # nobody has joined: lost to the slow joiner...
    assert pub.flush(timeout=5)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    broker.publish(numbered(5))
    got = close_and_drain(pub, sub)  # ... and a RunEnd is sent for run-a
    assert got[0] == Gap("run-a", "batch/obs", 0, 5, pub.id)  # ... which the subscriber reports
    assert check_numbered(got[1]) == 5
    assert isinstance(got[2], RunEnd)
    assert got[2].seq == 6
    assert len(got) == 3


def test_a_restarted_publisher_or_a_new_run_is_not_a_gap(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
        numbered: Callable[..., Batch], check_numbered: Check, close_and_drain: Callable[..., list[Any]],
        join: Callable[..., None]) -> None:
    sub = make_sub(free_endpoint(), bind=True)  # a daemon that publishers connect to
    seen = []
    for _ in range(2):  # the same run name, published again by a restarted publisher
        pub = make_pub(sub.endpoints[0], bind=False)
        join(pub, sub)
        for i in range(3):
            pub(numbered(i))
        pub(numbered(3, run="run-b"))  # and a new run
        got = [m for m in close_and_drain(pub, sub) if not isinstance(m, RunEnd)]
        seen += [(m.run, check_numbered(m, run=m.run)) for m in got]
    assert seen == [("run-a", 0), ("run-a", 1), ("run-a", 2), ("run-b", 3)] * 2
    assert sub.statistics().gaps == 0
    assert sub.statistics().publishers == 2


@contextlib.contextmanager
def _raw_publisher(endpoint: str, make_sub: MakeSub, **kwargs: Any) -> Iterator[tuple[zmq.Socket[Any], Subscriber]]:
    """A raw XPUB socket (playing a misbehaving publisher) and a Subscriber that has joined it."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    try:
        raw.bind(endpoint)
        sub = make_sub(raw.getsockopt_string(zmq.LAST_ENDPOINT), **kwargs)
        while raw.poll(10_000) and SUBSCRIBER_HELLO not in raw.recv():
            pass
        yield raw, sub
    finally:
        raw.close(linger=0)
        ctx.term()


def test_gaps_are_exact_for_any_topic_choice(make_sub: MakeSub, free_endpoint: Callable[[], str],
                                             batch: Callable[..., Batch],
                                             drain: Callable[..., list[Any]]) -> None:
    """A raw socket plays a publisher that lost messages of one topic, including its tail."""
    with _raw_publisher(free_endpoint(), make_sub, topics=("batch/a",)) as (raw, sub_a):
        for topic, n in [("batch/a", 0), ("batch/b", 0), ("batch/b", 1), ("batch/a", 1), ("batch/a", 3)]:
            raw.send_multipart(encode(batch(n, topic=topic), publisher="P", number=n))
        raw.send_multipart(encode(RunEnd("run-a", 9, 9, 4, "cpu"), publisher="P", number=0,
                                  streams={"batch/a": 6, "batch/b": 2, "run/start": 1}))
        got = drain(sub_a)
    assert [g if isinstance(g, Gap) else (g.topic, g.seq) for g in got] == [
        ("batch/a", 0), ("batch/a", 1),
        Gap("run-a", "batch/a", 2, 3, "P"),  # number 2 never arrived
        ("batch/a", 3),
        Gap("run-a", "batch/a", 4, 6, "P"),  # the tail: 4 and 5, reported at run/end
    ]  # batch/b and run/ topics were not chosen: no gaps for them, RunEnd itself not delivered
    assert sub_a.statistics().missing == 3


@pytest.mark.parametrize("version", [1, 2])
def test_bad_messages_are_counted_and_skipped(make_sub: MakeSub, free_endpoint: Callable[[], str],
                                              batch: Callable[..., Batch], version: int) -> None:
    good = [bytes(f) for f in encode(batch(1), publisher="P", version=version)]
    head = msgpack.unpackb(good[1])
    bad = [
        [b"batch/obs"],  # missing header
        good[:-1],  # truncated
        [*good, b"extra"],
        [good[0], msgpack.packb({**head, "v": 99}), *good[2:]],
        [good[0], msgpack.packb({**head, "fields": [["x", "complex64", [4, 3], 2], head["fields"][1]]}), *good[2:]],
        [good[0], msgpack.packb({**head, "pad": "x" * 2000}), *good[2:]],  # oversized header
        [b"batch/obs", b"\x00\x01\x02random"],
    ]
    with _raw_publisher(free_endpoint(), make_sub, max_header_size=1024) as (raw, sub):
        for frames in bad:
            raw.send_multipart(frames)
        raw.send_multipart(good)
        item = sub.recv(timeout=5)
    assert isinstance(item, Batch)
    assert item.seq == 1
    stats = sub.statistics()
    assert stats.bad_messages == len(bad)
    assert stats.received == 1
    assert dict(stats.bad_reasons) == {"missing frames": 2, "extra frames": 1, "version": 1, "dtype": 1,
                                       "header size": 1, "header": 1}


def test_close_flushes_and_sends_run_end(make_pub: MakePub, make_sub: MakeSub,
                                         free_endpoint: Callable[[], str], broker: Broker,
                                         batch: Callable[..., Batch], drain: Callable[..., list[Any]]) -> None:
    pub = make_pub(free_endpoint())
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    broker.subscribe("", pub)
    declaration = {"kind": "uniform", "phase": "runtime", "shape": [], "seed": 5, "low": 0.0, "high": 1.0}
    broker.publish(RunStart("run-a", 0, 0, 4, "cpu", {}, {"task": "lift"}, variations={"mass": declaration},
                            seed=9, wall_time=1.0))
    for i in range(1, 21):
        broker.publish(batch(i, width=BIG))
    before = time.time()
    closer = threading.Thread(target=pub.close)  # right away: everything queued is still delivered
    closer.start()
    got = drain(sub)
    closer.join(10)
    pub.close()  # idempotent
    assert [m.seq for m in got] == list(range(22))
    end = got[-1]
    assert isinstance(end, RunEnd)
    assert end.step == 20
    assert end.num_worlds == 4
    assert end.metadata == {"task": "lift"}
    # The run's own RunEnd never came: the one close() makes says so, and keeps the run's fields.
    assert end.interrupted is True
    assert (end.variations, end.seed) == ({"mass": declaration}, 9)
    assert end.wall_time >= before
    with pytest.raises(BrokerClosedError, match=r"publish on topic 'batch/obs' after close\(\)"):
        pub(batch(30))


def test_close_raises_when_it_cannot_deliver(make_pub: MakePub, make_sub: MakeSub,
                                             free_endpoint: Callable[[], str],
                                             batch: Callable[..., Batch]) -> None:
    pub = make_pub(free_endpoint(), hwm=1, slots=16)
    sub = make_sub(pub.endpoints[0], hwm=1)  # never reads
    pub.wait_for_subscribers(1, timeout=10)
    for i in range(14):  # 14 x 1.3 MB: more than the socket buffers hold, less than the ring
        pub(batch(i, width=BIG * 4))
    # Whether the kernel's socket buffers took the messages decides which step runs out of
    # time: handing them to the socket, or the subscriber's confirmation of the run's end.
    with pytest.raises(SendTimeoutError, match=r"(could not be sent within the close\(\) timeout|close\(\) "
                                                 r"could not deliver every message|did not confirm the end "
                                                 r"of run\(s\) \['run-a'\]).* too slow or gone"):
        pub.close(timeout=0.5)
    assert sub.statistics().received == 0


def test_block_policy_times_out_with_a_clear_error(make_pub: MakePub, make_sub: MakeSub,
                                                   free_endpoint: Callable[[], str],
                                                   batch: Callable[..., Batch]) -> None:
    pub = make_pub(free_endpoint(), slots=1, hwm=1, send_timeout=0.3)
    sub = make_sub(pub.endpoints[0], hwm=1)  # never reads
    pub.wait_for_subscribers(1, timeout=10)
    start = time.monotonic()
    def flood() -> None:
        for i in range(2000):
            pub(batch(i, width=BIG))

    with pytest.raises(SendTimeoutError, match=r"within send_timeout=0.3 s.* too slow or gone"):
        flood()
    assert time.monotonic() - start < 10
    with pytest.raises(SendTimeoutError):
        pub.close(timeout=0.2)
    assert pub.statistics().closed
    assert sub.statistics().received == 0


def test_iteration_ends_when_closed_from_another_thread(make_pub: MakePub, make_sub: MakeSub,
                                                        free_endpoint: Callable[[], str],
                                                        batch: Callable[..., Batch]) -> None:
    pub = make_pub(free_endpoint())
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    pub(batch(0))
    timer = threading.Timer(0.3, sub.close)
    timer.start()
    try:
        items = list(sub)
    finally:
        timer.join()
    assert [i.seq for i in items] == [0]
    with pytest.raises(BrokerClosedError, match=r"recv\(\) after close\(\)"):
        sub.recv(timeout=0)


def test_max_message_size_protects_the_receiver(make_pub: MakePub, make_sub: MakeSub,
                                                free_endpoint: Callable[[], str],
                                                numbered: Callable[..., Batch], check_numbered: Check) -> None:
    pub = make_pub(free_endpoint(), policy="drop")
    sub = make_sub(pub.endpoints[0], max_message_size=10_000)
    pub.wait_for_subscribers(1, timeout=10)
    assert sub._socket.getsockopt(zmq.MAXMSGSIZE) == 10_000  # ZeroMQ's own bound, per frame
    pub(numbered(0, width=BIG))  # over the limit the subscriber announced: never sent...
    pub(numbered(1))
    assert sub.recv(timeout=5) == Gap("run-a", "batch/obs", 0, 1, pub.id)  # ... a gap instead
    assert check_numbered(sub.recv(timeout=5)) == 1
    assert pub.statistics().oversized == 1


@pytest.mark.parametrize("subscriber_binds", [True, False], ids=["sub-binds", "pub-binds"])
def test_close_waits_until_a_lagging_subscriber_has_read_everything(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], broker: Broker,
        numbered: Callable[..., Batch], check_numbered: Check, join: Callable[..., None],
        subscriber_binds: bool) -> None:
    """ZeroMQ drops what a peer has not read when the connection closes: close() must wait for
    the subscriber's confirmation of RunEnd, or a lagging store loses the tail of a run."""
    if subscriber_binds:
        sub = make_sub(free_endpoint(), bind=True, hwm=2)
        pub = make_pub(sub.endpoints[0], bind=False, send_timeout=20)
        join(pub, sub)
    else:
        pub = make_pub(free_endpoint(), send_timeout=20)
        sub = make_sub(pub.endpoints[0], hwm=2)
        pub.wait_for_subscribers(1, timeout=10)
    broker.subscribe("", pub)
    n = 300
    received: list[Any] = []

    def lagging_reader() -> None:
        time.sleep(0.5)  # the publisher closes while much is still unread
        while not received or not isinstance(received[-1], RunEnd):
            item = sub.recv(timeout=10)
            if item is None:
                return
            received.append(item)
            time.sleep(0.001)

    reader = threading.Thread(target=lagging_reader)
    reader.start()
    broker.publish(RunStart("run-a", 0, 0, 4, "cpu"))
    for i in range(1, n + 1):
        broker.publish(numbered(i))
    broker.publish(RunEnd("run-a", n + 1, n, 4, "cpu"))
    pub.close(timeout=20)
    reader.join(30)
    assert [type(m).__name__ for m in received] == ["RunStart"] + ["Batch"] * n + ["RunEnd"]
    assert [check_numbered(m) for m in received[1:-1]] == list(range(1, n + 1))


def test_a_dropped_connection_is_made_again_while_messages_keep_arriving(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
        numbered: Callable[..., Batch], check_numbered: Check) -> None:
    """The subscriber reads its connection monitor while busy too (every few milliseconds),
    not only before it waits: a connection ZeroMQ dropped for an oversized frame is made again
    while another publisher's stream never leaves the subscriber idle."""
    pub = make_pub(free_endpoint())
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    stop = threading.Event()
    streamer: threading.Thread | None = None
    try:
        raw.setsockopt(zmq.LINGER, 0)
        raw.bind(free_endpoint())
        raw_endpoint = raw.getsockopt(zmq.LAST_ENDPOINT).decode()
        sub = make_sub([pub.endpoints[0], raw_endpoint], max_message_size=10_000)
        pub.wait_for_subscribers(1, timeout=10)
        assert raw.poll(10_000), "the subscriber never subscribed to the raw publisher"
        raw.recv()

        def stream() -> None:  # a message every 5 ms: the subscriber's waits never run out
            seq = 0
            while not stop.is_set():
                pub(numbered(seq))
                seq += 1
                time.sleep(0.005)

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert check_numbered(sub.recv(timeout=10)) == 0
        raw.send_multipart([b"batch/obs", b"x" * 20_000])  # over max_message_size: dropped
        received, deadline = 1, time.monotonic() + 10
        while sub.statistics().reconnects == 0 and time.monotonic() < deadline:
            assert check_numbered(sub.recv(timeout=5)) == received  # never idle, nothing lost
            received += 1
        assert sub.statistics().reconnects == 1
    finally:
        stop.set()
        if streamer is not None:
            streamer.join(10)
        raw.close(linger=0)
        ctx.term()
