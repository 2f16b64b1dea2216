"""Losses over real sockets are counted, raised and reported as gaps; what arrives is byte-exact.

Every test here publishes :func:`numbered` batches on one topic of one run, so a batch's ``seq``
is also its wire number: a received batch must be byte for byte the batch of its number, and
every number that did not arrive must lie inside a :class:`Gap` reported in its place.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zmq
from waiting import wait_until

from broker import (
    Batch,
    BrokerError,
    Gap,
    PublisherStatistics,
    RunEnd,
    SendTimeoutError,
    Subscriber,
    SubscriberTimeoutError,
    WireFormatError,
    ZmqPublisher,
    decode,
    encode,
)
from broker.staging import Slot
from broker.wire import SUBSCRIBER_ACK, SUBSCRIBER_HELLO
from broker.zmq_publisher import hello_subscription

MakePub = Callable[..., ZmqPublisher]
MakeSub = Callable[..., Subscriber]
Numbered = Callable[..., Batch]
Check = Callable[..., int]
BIG = 20_000  # 4 worlds x 20k: 320 kB and 640 kB frames, sent zero-copy out of the staging slots


def _walk(items: list[Any], n: int, check: Check) -> list[int]:
    """Check the batches and gaps of stream ``batch/obs`` (numbers ``0..n-1``) in order: each
    batch is byte-exact and has the next number, each gap starts at the next number, and the
    stream ends at ``n``. Returns the numbers received."""
    expected, got = 0, []
    for item in items:
        if isinstance(item, Gap):
            assert (item.run, item.topic) == ("run-a", "batch/obs"), item
            assert item.expected == expected, (item, expected)
            assert item.received > item.expected, item
            expected = item.received
        elif isinstance(item, Batch):
            seq = check(item)
            assert seq == expected, f"batch {seq} arrived where number {expected} was due"
            got.append(seq)
            expected += 1
    assert expected == n, f"the stream ended at {expected}, {n} were published"
    return got


def _accounted(stats: PublisherStatistics) -> None:
    assert stats.closed
    assert stats.queued == 0
    assert stats.published == stats.messages + stats.drops + stats.failed, stats


class _Reader(threading.Thread):
    """Receives until ``RunEnd`` (or nothing arrives for ``idle`` s), ``lag`` seconds per item."""

    def __init__(self, sub: Subscriber, lag: float = 0.0, idle: float = 10.0) -> None:
        super().__init__(name="test-reader", daemon=True)
        self.sub, self.lag, self.idle = sub, lag, idle
        self.items: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.items or not isinstance(self.items[-1], RunEnd):
                item = self.sub.recv(timeout=self.idle)
                if item is None:
                    return
                self.items.append(item)
                if self.lag:
                    time.sleep(self.lag)  # a subscriber that lags behind the publisher
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.error = exc

    def result(self) -> list[Any]:
        self.join(30)
        assert not self.is_alive()
        assert self.error is None, self.error
        return self.items


def _close_while_reading(pub: ZmqPublisher, sub: Subscriber, **close: Any) -> tuple[list[Any], BaseException | None]:
    """``pub.close()`` on another thread while ``sub`` receives until ``RunEnd`` here: what
    arrived and what close() raised."""
    raised: list[BaseException] = []

    def closer() -> None:
        try:
            pub.close(**close)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=closer, name="test-closer")
    thread.start()
    reader = _Reader(sub, idle=5.0)
    reader.run()
    thread.join(30)
    assert not thread.is_alive()
    assert reader.error is None, reader.error
    return reader.items, (raised[0] if raised else None)


# -- item 1: a slot ZeroMQ still reads is never refilled ------------------------------------------

def test_a_slot_whose_framing_failed_goes_back_only_once_its_staging_copies_are_done(
        make_pub: MakePub, numbered: Numbered, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: when a publish failed after its staging copies were queued (the slot's frames, the
    header), the slot went back to the ring at once, while a CUDA device-to-host copy could
    still be writing it: the next message staged there would be torn. Now the publisher waits
    on the copies' event first. Here the staging hands back a stand-in event that notes when
    it is waited on."""
    pub = make_pub("tcp://127.0.0.1:*", slots=2)
    order: list[str] = []

    class InFlight:
        def synchronize(self) -> None:
            order.append("copies done")

    stage, release = pub._ring.stage, pub._ring.release

    def staged(slot: Slot, tensors: list[torch.Tensor]) -> tuple[Any, Any]:
        return stage(slot, tensors)[0], InFlight()

    def released(slot: Slot, tracker: Any) -> None:
        order.append("slot released")
        release(slot, tracker)

    def frames(self: Slot, layout: Any) -> Any:
        raise RuntimeError("framing failed")

    monkeypatch.setattr(pub._ring, "stage", staged)
    monkeypatch.setattr(pub._ring, "release", released)
    monkeypatch.setattr(Slot, "frames", frames)
    with pytest.raises(RuntimeError, match="framing failed"):
        pub(numbered(1))
    assert order == ["copies done", "slot released"]
    assert not any(slot.busy for slot in pub._ring.slots)
    assert pub.statistics().failed == 1


def test_drop_policy_with_a_lagging_subscriber_delivers_whole_messages_and_gaps(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: in ``drop`` policy a refused staging slot forgot its pending ZeroMQ tracker, so the
    next message was copied into bytes ZeroMQ was still sending: a lagging subscriber received
    one message's header over another's data. Also: drops are counted and are exactly the gaps."""
    pub = make_pub(free_endpoint(), policy="drop", slots=2, hwm=1)
    sub = make_sub(pub.endpoints[0], hwm=1)
    pub.wait_for_subscribers(1, timeout=10)
    reader = _Reader(sub, lag=0.02)
    n = 80
    for i in range(n):
        if i == n // 2:
            reader.start()  # late, and then slow
        pub(numbered(i, width=BIG))  # never waits: drops while the subscriber lags
    pub(RunEnd("run-a", n, n, 4, "cpu"))  # run/ messages are never dropped
    items = reader.result()
    pub.close(timeout=5)
    got = _walk(items, n, check_numbered)
    assert isinstance(items[-1], RunEnd)
    stats = pub.statistics()
    _accounted(stats)
    assert 0 < stats.drops < n
    assert stats.failed == 0
    assert stats.drops == n - len(got) == sub.statistics().missing


def test_block_policy_after_send_timeouts_delivers_whole_messages_and_gaps(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: after a ``block``-policy send timeout, under a non-strict broker that carries on,
    the slot refused for its pending tracker was refilled while ZeroMQ still sent it (torn
    messages); the message that timed out acquiring a slot was counted nowhere, so
    ``published != messages + drops``."""
    pub = make_pub(free_endpoint(), slots=2, hwm=1, send_timeout=0.2)
    sub = make_sub(pub.endpoints[0], hwm=1)
    pub.wait_for_subscribers(1, timeout=10)
    errors: list[BrokerError] = []

    def publish(i: int) -> None:
        try:
            pub(numbered(i, width=4 * BIG))
        except BrokerError as exc:  # what a non-strict broker does: log, count, carry on
            errors.append(exc)

    def slot_timed_out() -> bool:
        return any("no staging slot freed within send_timeout=0.2 s" in str(e) for e in errors)

    n = 0
    while not slot_timed_out():  # nobody reads: the socket and then the ring time out
        assert n < 100, errors
        publish(n)
        n += 1
    for _ in range(3):
        publish(n)
        n += 1
    reader = _Reader(sub)
    reader.start()
    for _ in range(12):
        publish(n)
        n += 1
    pub(RunEnd("run-a", n, n, 4, "cpu"))
    closed: SendTimeoutError | None = None
    try:
        pub.close(timeout=5)
    except SendTimeoutError as exc:
        closed = exc
    items = reader.result()
    got = _walk(items, n, check_numbered)
    assert closed is not None, "close() must raise the losses"
    assert re.search(r"message\(s\) were lost .*send timeout", str(closed))
    stats = pub.statistics()
    _accounted(stats)
    assert stats.drops + stats.failed == n - len(got) == sub.statistics().missing > 0
    assert stats.send_timeouts >= sum(isinstance(e, SendTimeoutError) for e in errors) > 0


# -- item 2: every loss is counted, kept and raised ---------------------------------------------

def _reported(exc: BaseException) -> int:
    """How many errors ``exc`` reports: itself, its ``also:`` notes and ``... and N more``."""
    notes = getattr(exc, "__notes__", [])
    more = sum(int(m.group(1)) for n in notes if (m := re.search(r"and (\d+) more error", n)))
    return 1 + sum(n.startswith("also: ") for n in notes) + more


def test_socket_send_timeouts_are_all_reported_and_show_as_gaps(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: the sender thread kept one error, so a second send timeout overwrote the first (one
    loss never raised); after a timeout close() must raise again, statistics() show the loss,
    and the subscriber see a gap at exactly the numbers lost."""
    n = 10  # 4.8 MB each, far more than the queues and socket buffers hold, as many as the slots
    pub = make_pub(free_endpoint(), slots=n, hwm=1, send_timeout=0.4, topics=("batch/obs",))
    sub = make_sub(pub.endpoints[0], hwm=1)  # does not read until the end
    pub.wait_for_subscribers(1, timeout=10)
    raised: list[SendTimeoutError] = []
    for i in range(n):  # quicker than one send timeout: the sender thread keeps its errors
        try:
            pub(numbered(i, width=100_000))
        except SendTimeoutError as exc:
            raised.append(exc)

    def handled() -> bool:
        s = pub.statistics()
        return s.messages + s.drops + s.failed == s.published and s.queued == 0

    wait_until(handled, "the sender thread to hand on or time out every message")
    timeouts = pub.statistics().send_timeouts
    assert timeouts >= 2
    try:
        pub(numbered(n, topic="batch/other"))  # the next call (a topic not forwarded) raises what is kept
    except SendTimeoutError as exc:
        raised.append(exc)
    assert all("could not be sent within send_timeout=0.4 s" in str(e) for e in raised)
    assert max(map(_reported, raised)) >= 2  # errors that came while no call was made...
    assert sum(map(_reported, raised)) == timeouts  # ... are all reported
    items, error = _close_while_reading(pub, sub, timeout=5)
    assert isinstance(error, SendTimeoutError)
    assert re.search(rf"{timeouts} of {n + 1} message\(s\) were lost \({timeouts} send timeout", " ".join([str(error), *getattr(error, "__notes__", [])]))
    stats = pub.statistics()
    _accounted(stats)
    assert stats.drops == stats.send_timeouts == timeouts
    got = _walk(items, n, check_numbered)
    assert n - len(got) == timeouts == sub.statistics().missing
    assert isinstance(items[-1], RunEnd)


# -- item 3: a publisher that connects counts live subscribers only ---------------------------------

_RAW_CHILD = r"""
import os, sys
import msgpack, zmq
endpoint, out, hello = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
sock = zmq.Context().socket(zmq.SUB)
for prefix in (b"", hello):  # what a worldtap Subscriber announces: topics first, then its hello
    sock.setsockopt(zmq.SUBSCRIBE, prefix)
sock.bind(endpoint)
print("ready", flush=True)
for n in range(1_000_000):
    frames = sock.recv_multipart()
    with open(os.path.join(out, f"{n}.msg"), "wb") as f:
        f.write(msgpack.packb(frames))
    print("message", n, flush=True)
"""

_SUBSCRIBER_CHILD = r"""
import os, sys
import msgpack
from broker import Batch, Gap, RunEnd, Subscriber, encode
endpoint, out = sys.argv[1], sys.argv[2]
print("imported", flush=True)
sys.stdin.readline()  # bind when told: the endpoint is someone else's until then
sub = Subscriber(endpoint, bind=True, heartbeat=0.5)
print("ready", sub.id, flush=True)
while True:
    item = sub.recv(timeout=0.05)
    if isinstance(item, Batch):
        with open(os.path.join(out, f"{item.seq}.msg"), "wb") as f:
            f.write(msgpack.packb([bytes(x) for x in encode(item)]))
    elif isinstance(item, Gap):
        print("gap", item.expected, item.received, flush=True)
    elif isinstance(item, RunEnd):
        print("end", flush=True)  # confirmed on receipt; keep receiving until killed
"""


class _Child:
    """A process that runs ``script`` with ``args`` and reports on stdout, one line per event."""

    def __init__(self, script: str, *args: str) -> None:
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue[str] = queue.Queue()
        self._pump_thread = threading.Thread(target=self._pump, name="test-child-stdout", daemon=True)
        self._pump_thread.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for text in self.proc.stdout:
            self.lines.put(text.strip())
        self.lines.put("")  # end of output

    def line(self, prefix: str, timeout: float = 60.0) -> str:
        """The child's next stdout line starting with ``prefix`` (its readiness signals)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                text = self.lines.get(timeout=max(deadline - time.monotonic(), 0.0))
            except queue.Empty:
                raise AssertionError(f"the child did not print {prefix!r} in time") from None
            assert text, f"the child exited (rc {self.proc.poll()}) before printing {prefix!r}"
            if text.startswith(prefix):
                return text

    def tell(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        """SIGKILL: no close, no goodbye."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def close(self) -> None:
        self.kill()
        self._pump_thread.join(10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def child() -> Iterator[Callable[..., _Child]]:
    """Child processes, killed and reaped at teardown whatever happened."""
    made: list[_Child] = []

    def make(script: str, *args: str) -> _Child:
        made.append(_Child(script, *args))
        return made[-1]

    yield make
    for c in made:
        c.close()


def _free_tcp_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _received(folder: Path) -> list[Any]:
    """The messages a child wrote, decoded, in the order it received them."""
    files = sorted(folder.glob("*.msg"), key=lambda p: int(p.stem))
    return [decode(msgpack.unpackb(p.read_bytes())) for p in files]


def test_killed_bound_subscribers_stop_counting_and_close_succeeds(
        make_pub: MakePub, child: Callable[..., _Child], tmp_path: Path, numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: a publisher connected to a subscriber that binds (a storage daemon) counted every
    killed daemon as a subscriber forever (8-9 with one alive), so ``wait_for_subscribers(1)``
    returned with none alive and ``close()`` timed out although the live daemon had everything.

    The killed subscribers are raw SUB sockets that announce themselves as a worldtap
    Subscriber does (fast to start); the live one, started in parallel, is a real Subscriber."""
    endpoint = _free_tcp_endpoint()
    live_out = tmp_path / "live"
    live_out.mkdir()
    live = child(_SUBSCRIBER_CHILD, endpoint, str(live_out))  # imports torch while the others die
    pub = make_pub(endpoint, bind=False, heartbeat=0.5, send_timeout=10)
    published, peak = 0, 0

    def count() -> int:
        nonlocal peak
        now = pub.statistics().subscribers
        peak = max(peak, now)
        return now

    for life in range(3):
        out = tmp_path / f"life{life}"
        out.mkdir()
        doomed = child(_RAW_CHILD, endpoint, str(out), hello_subscription(f"doomed{life}", 1 << 30).hex())
        doomed.line("ready")
        pub.wait_for_subscribers(1, timeout=15)
        assert count() == 1
        pub(numbered(published))
        doomed.line("message")  # it has received it
        published += 1
        doomed.kill()
        wait_until(lambda: count() == 0, "the killed subscriber to stop counting", timeout=15)
        with pytest.raises(SubscriberTimeoutError, match=r"expected 1 subscriber\(s\) .* 0 joined"):
            pub.wait_for_subscribers(1, timeout=0.3)
        assert [check_numbered(m) for m in _received(out)] == [published - 1]
    live.line("imported")
    live.tell("bind")
    live.line("ready")
    pub.wait_for_subscribers(1, timeout=15)
    assert count() == 1
    first = published
    for _ in range(20):
        pub(numbered(published))
        published += 1
    pub.close(timeout=15)  # returns once the live subscriber has confirmed the RunEnd
    assert live.line("gap") == f"gap 0 {first}"  # it joined late
    live.line("end")
    assert peak == 1
    stats = pub.statistics()
    _accounted(stats)
    assert stats.drops == stats.failed == 0
    assert [check_numbered(m) for m in _received(live_out)] == list(range(first, published))


# -- item 26: size limits bound whole messages; an oversized one is a counted gap ----------------

def test_a_message_over_the_subscribers_limit_is_a_counted_gap_not_a_lost_connection(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: a frame over the subscriber's ``max_message_size`` made libzmq drop the connection:
    the messages after it vanished with no gap, and the publisher counted no drop. Also bounded
    as a whole: a message of many small frames whose total is over the limit."""
    pub = make_pub(free_endpoint(), policy="drop")
    sub = make_sub(pub.endpoints[0], max_message_size=20_000)
    pub.wait_for_subscribers(1, timeout=10)
    many = numbered(2)
    many.fields.update({f"f{k}": torch.full((4, 8), k, dtype=torch.int64) for k in range(100)})  # 100 x 256 B
    pub(numbered(0))
    pub(numbered(1, width=BIG))  # one 320 kB frame
    pub(many)  # 100 frames of 256 B, 26 kB in all
    for i in range(3, 6):
        pub(numbered(i))
    pub(RunEnd("run-a", 6, 6, 4, "cpu"))
    items, error = _close_while_reading(pub, sub, timeout=5)
    assert error is None
    assert [type(i).__name__ for i in items] == ["Batch", "Gap", "Batch", "Batch", "Batch", "RunEnd"]
    assert items[1] == Gap("run-a", "batch/obs", 1, 3, pub.id)
    assert _walk(items, 6, check_numbered) == [0, 3, 4, 5]
    stats = pub.statistics()
    _accounted(stats)
    assert stats.drops == stats.oversized == 2
    sub_stats = sub.statistics()
    assert sub_stats.reconnects == 0  # the connection was never lost
    assert sub_stats.bad_messages == 0
    assert sub_stats.missing == 2


def test_a_foreign_many_frame_message_over_the_limit_is_bounded_as_a_whole(
        make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered, check_numbered: Check,
        drain: Callable[..., list[Any]]) -> None:
    """Bug: ``MAXMSGSIZE`` bounds a frame, not a message: a message of many small frames far
    over the limit was accepted whole. A sender that ignores the announced limit (a raw socket
    here) gets it counted as too large, and its number shows as a gap."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    try:
        raw.bind(free_endpoint())
        sub = make_sub(raw.getsockopt_string(zmq.LAST_ENDPOINT), max_message_size=20_000)
        while raw.poll(10_000) and SUBSCRIBER_HELLO not in raw.recv():
            pass
        many = numbered(1)
        many.fields.update({f"f{k}": torch.full((4, 64), k, dtype=torch.int64) for k in range(200)})  # 400 kB
        for number, message in enumerate([numbered(0), many, numbered(2)]):
            raw.send_multipart(encode(message, publisher="P", number=number, version=1))
        items = drain(sub)
    finally:
        raw.close(linger=0)
        ctx.term()
    assert [type(i).__name__ for i in items] == ["Batch", "Gap", "Batch"]
    assert items[1] == Gap("run-a", "batch/obs", 1, 2, "P")
    assert [check_numbered(i) for i in items if isinstance(i, Batch)] == [0, 2]
    stats = sub.statistics()
    assert dict(stats.bad_reasons) == {"too large": 1}
    assert stats.received == 2


# -- item 9 (transport half): a run's end is confirmed when the subscriber says so --------------

def test_an_unconfirmed_run_end_is_sent_again_to_the_subscriber_that_rejoins_with_its_id(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: a subscriber confirmed ``RunEnd`` on receipt, so a store killed before committing
    the run's tail lost it for good. With ``confirm_run_ends=False`` the confirmation waits for
    ``confirm_run_end``; the publisher sends the unconfirmed ``RunEnd`` again to the subscriber
    that re-joins with the same ``id``."""
    pub = make_pub(free_endpoint(), send_timeout=15)
    a = make_sub(pub.endpoints[0], id="d1", confirm_run_ends=False)
    pub.wait_for_subscribers(1, timeout=10)
    for i in range(5):
        pub(numbered(i))
    pub(RunEnd("run-a", 5, 5, 4, "cpu"))
    items = _Reader(a)
    items.run()
    _walk(items.items, 5, check_numbered)
    assert isinstance(items.items[-1], RunEnd)
    a.close()  # gone before it confirmed (a killed daemon)
    wait_until(lambda: pub.statistics().subscribers == 0, "the first subscriber to be gone")
    b = make_sub(pub.endpoints[0], id="d1", confirm_run_ends=False)
    pub.wait_for_subscribers(1, timeout=10)
    raised: list[BaseException] = []

    def closer() -> None:
        try:
            pub.close(timeout=15)
        except BaseException as exc:
            raised.append(exc)

    closing = threading.Thread(target=closer, name="test-closer")
    closing.start()
    try:
        again = _Reader(b)
        again.run()
        assert again.error is None
        assert again.items[:-1] == [Gap("run-a", "batch/obs", 0, 5, pub.id)]  # a fresh delivery...
        end = again.items[-1]
        assert isinstance(end, RunEnd)
        assert (end.run, end.seq, end.step) == ("run-a", 5, 5)
        closing.join(0.3)
        assert closing.is_alive()  # ... that close() waits for
        b.confirm_run_end("run-x")  # unknown: nothing
        b.confirm_run_end("run-a")
    finally:
        closing.join(20)
    assert not closing.is_alive()
    assert raised == []
    stats = pub.statistics()
    _accounted(stats)
    assert stats.resent_run_ends >= 1
    assert stats.drops == stats.failed == 0


def test_confirm_run_end_confirms_once_asked_and_duplicates_accordingly(
        make_sub: MakeSub, free_endpoint: Callable[[], str]) -> None:
    """With ``confirm_run_ends=False``: nothing is confirmed on receipt, a copy of a RunEnd not
    yet confirmed is skipped without confirming, ``confirm_run_end`` confirms it to its
    publisher, and a copy that comes after that is confirmed again (the first confirmation
    may have been lost)."""
    ctx = zmq.Context()
    raw = ctx.socket(zmq.XPUB)
    try:
        raw.bind(free_endpoint())
        sub = make_sub(raw.getsockopt_string(zmq.LAST_ENDPOINT), id="store-1", confirm_run_ends=False)
        while raw.poll(10_000) and SUBSCRIBER_HELLO not in raw.recv():
            pass
        end = encode(RunEnd("run-a", 3, 3, 4, "cpu"), publisher="P", number=0)
        ack = b"\x01" + SUBSCRIBER_ACK + b"P/run-a/store-1"

        def acks(wait: float) -> int:
            """Confirmations the raw publisher sees within ``wait`` s (while ``sub`` receives)."""
            seen, deadline = 0, time.monotonic() + wait
            while time.monotonic() < deadline:
                assert sub.recv(timeout=0.02) is None
                while raw.poll(0):
                    seen += raw.recv() == ack
            return seen

        raw.send_multipart(end)
        got = sub.recv(timeout=5)
        assert isinstance(got, RunEnd)
        raw.send_multipart(end)  # a copy: skipped, not confirmed
        assert acks(0.3) == 0
        sub.confirm_run_end("run-a")
        assert acks(0.3) == 1
        sub.confirm_run_end("run-a")  # confirmed already: nothing
        raw.send_multipart(end)  # a copy after the confirmation: confirmed again
        assert acks(0.3) == 1
        assert sub.statistics().duplicates == 2
        assert sub.statistics().received == 1
    finally:
        raw.close(linger=0)
        ctx.term()


# -- reconnects: a connection cut mid-message loses whole messages only, reported as a gap -------

def test_a_cut_connection_loses_whole_messages_only_and_they_are_a_gap(
        make_pub: MakePub, make_sub: MakeSub, make_relay: Callable[[str], Any], numbered: Numbered,
        check_numbered: Check) -> None:
    """A network failure in the middle of a message (the relay drops the bytes of message 5 and
    resets both connections): the publisher reconnects, the subscriber receives only whole,
    byte-exact messages, every number lost with the connection is a gap, and close() gets the
    run's end confirmed over the new connection."""
    sub = make_sub("tcp://127.0.0.1:*", bind=True)
    relay = make_relay(sub.endpoints[0])
    pub = make_pub(relay.endpoint, bind=False, send_timeout=10)
    reader = _Reader(sub)
    reader.start()  # a bound subscriber sends its subscriptions only while it receives
    pub.wait_for_subscribers(1, timeout=10)
    marker = numbered(5, width=BIG).fields["id"][0, :4].numpy().tobytes()
    relay.cut_on(marker)
    for i in range(10):
        pub(numbered(i, width=BIG))
    wait_until(lambda: relay.cuts == 1 and relay.accepted == 2 and pub.statistics().subscribers == 1,
          "the cut and the reconnection")
    for i in range(10, 20):
        pub(numbered(i, width=BIG))
    pub.close(timeout=10)
    items = reader.result()
    got = _walk(items, 20, check_numbered)
    assert 5 not in got
    assert got[-10:] == list(range(10, 20))  # everything after the reconnection arrived
    assert isinstance(items[-1], RunEnd)
    assert sub.statistics().missing == 20 - len(got) > 0
    _accounted(pub.statistics())


def test_a_message_receivers_would_reject_is_refused_at_publish_and_numbers_nothing(
        make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str], numbered: Numbered,
        check_numbered: Check) -> None:
    """Bug: a batch whose field had a row too many (or a negative seq, an unknown hook, ...) was
    numbered and sent, and every receiver dropped it as malformed: the publisher's caller learnt
    nothing, and each subscriber's stream had a hole where a message had been counted sent.
    Now publish refuses it, before it takes a number: the stream carries on with no gap, every
    batch byte-exact, and the publisher counts only what it sent."""
    pub = make_pub(free_endpoint())
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    reader = _Reader(sub)
    reader.start()
    good = numbered(0)
    bad = [dataclasses.replace(good, fields={**good.fields, "x": torch.zeros(5, 3)}),  # 5 rows, 4 worlds
           dataclasses.replace(good, seq=-1),
           dataclasses.replace(good, hook="later")]  # type: ignore[arg-type]
    for i in range(6):
        pub(numbered(i))
        if i < len(bad):
            with pytest.raises(WireFormatError, match="receivers would reject this message") as info:
                pub(bad[i])
            assert info.value.reason == "encode"
    pub(RunEnd("run-a", 6, 6, 4, "cpu"))
    items = reader.result()
    pub.close(timeout=5)
    assert not any(isinstance(item, Gap) for item in items), items
    assert _walk(items, 6, check_numbered) == list(range(6))
    stats = pub.statistics()
    assert (stats.messages, stats.drops) == (7, 0)
    assert sub.statistics().missing == 0


@pytest.mark.parametrize("hello", [
    b"odd/" + b"9" * 4000,        # near the publisher's inbound limit (4096 bytes a subscription)
    b"odd/" + b"9" * 25,          # larger than any message
    b"odd/0", b"odd/-5", b"odd/1e9", b"odd", b"", b"\xff\xfe/", b"/" * 300,
])
def test_a_malformed_subscriber_hello_neither_stops_the_publisher_nor_costs_a_message(
        hello: bytes, make_pub: MakePub, make_sub: MakeSub, free_endpoint: Callable[[], str],
        numbered: Numbered, check_numbered: Check) -> None:
    """The publisher's sender thread parses every subscriber's hello: a peer (a raw SUB here)
    that announces itself wrongly is taken as a subscriber without a size limit, and a real
    subscriber beside it receives every batch, byte-exact. A parse that raised would stop the
    sender thread and lose everything after it; one that read a size from garbage would make
    the publisher drop every message as too large."""
    pub = make_pub(free_endpoint())
    ctx = zmq.Context()
    raw = ctx.socket(zmq.SUB)
    try:
        raw.connect(pub.endpoints[0])
        raw.setsockopt(zmq.SUBSCRIBE, SUBSCRIBER_HELLO + hello)
        raw.setsockopt(zmq.SUBSCRIBE, b"batch/")
        sub = make_sub(pub.endpoints[0])
        pub.wait_for_subscribers(2, timeout=10)
        reader = _Reader(sub)
        reader.start()
        for i in range(4):
            pub(numbered(i))
        pub(RunEnd("run-a", 4, 4, 4, "cpu"))
        items = reader.result()
        raw.setsockopt(zmq.UNSUBSCRIBE, SUBSCRIBER_HELLO + hello)  # leaves: close() awaits only `sub`
        pub.close(timeout=10)
    finally:
        raw.close(linger=0)
        ctx.term()
    assert _walk(items, 4, check_numbered) == [0, 1, 2, 3]
    stats = pub.statistics()
    assert (stats.messages, stats.drops, stats.failed, stats.oversized) == (5, 0, 0, 0)
