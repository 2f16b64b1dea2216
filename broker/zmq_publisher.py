"""The ZeroMQ publisher: a broker consumer that stages batches and sends them on a background thread."""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Literal

import zmq

from .errors import BrokerClosedError, SendTimeoutError, SubscriberTimeoutError, TransportError, translate_zmq_errors
from .messages import TOPIC_RUN_END, Message, RunEnd, RunStart
from .security import CurveServer, attach
from .staging import Layout, Slot, Staged, StagingRing
from .wire import SUBSCRIBER_ACK, SUBSCRIBER_HELLO, encode_header, message_tensors, tensor_spec

__all__ = ["DEFAULT_ENDPOINT", "Policy", "PublisherStatistics", "ZmqPublisher"]

_log = logging.getLogger("worldtap.broker.zmq")

DEFAULT_ENDPOINT: Final = "tcp://127.0.0.1:5555"
"""Loopback only: reaching other hosts is an explicit choice (and wants CURVE)."""
Policy = Literal["block", "drop"]
_IDLE_POLL: Final = 0.005


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """A snapshot of a publisher's counters.

    Attributes:
        published: Messages accepted by the publisher (each got a wire number).
        messages: Messages handed to ZeroMQ.
        bytes: Bytes of those messages (topic, header and frames).
        drops: Messages not delivered (``drop`` policy, or a ``block`` send timeout). Once the
            publisher is closed, ``published == messages + drops``.
        peak_queue: Most messages staged and waiting for the sender thread at once.
        queued: Messages waiting for the sender thread now.
        subscribers: :class:`broker.Subscriber` instances currently joined.
        send_timeouts: ``block``-policy sends that timed out.
        closed: Whether ``close()`` was called.
    """

    published: int
    messages: int
    bytes: int
    drops: int
    peak_queue: int
    queued: int
    subscribers: int
    send_timeouts: int
    closed: bool


class ZmqPublisher:
    """Forwards broker messages to ZeroMQ subscribers over an XPUB socket (``tcp://`` or ``ipc://``).

    Subscribe it to a :class:`broker.Broker` (``broker.subscribe("", pub)``). Each call copies
    the message's tensors once into a reusable staging slot (pinned host memory, a side stream
    and an event for CUDA tensors) and returns; a background thread sends the slot zero-copy.
    The caller may overwrite its tensors as soon as the call returns.

    Delivery: ``policy="block"`` (lossless) applies backpressure through XPUB_NODROP and the
    bounded ring; a message that cannot be handed on within ``send_timeout`` is lost and
    raises :class:`SendTimeoutError` (from the next call, or from ``close()``), never a hang.
    ``policy="drop"`` never makes the caller wait: a full ring or a full subscriber queue
    drops the message and counts it; subscribers see the gap. ``run/`` messages are never
    dropped. Messages are numbered per ``(publisher, run, topic)`` on the wire.

    Messages published before a subscriber has joined are lost to it (ZeroMQ's slow joiner):
    call :meth:`wait_for_subscribers` first. Call :meth:`close` at the end: it delivers everything
    already published, sends ``RunEnd`` for runs that did not send one, and closes the sockets;
    without it queued messages are lost.

    Args:
        endpoint: One endpoint or several, e.g. ``"tcp://127.0.0.1:5555"`` or ``"ipc:///tmp/w"``;
            ``tcp://127.0.0.1:*`` binds a free port (see :attr:`endpoints`).
        topics: Topic prefixes to forward (``run/`` messages always are).
        bind: Bind (default) or connect the endpoints.
        policy: ``"block"`` or ``"drop"``.
        send_timeout: Seconds a lossless send (or close) may wait before failing.
        slots: Staging slots in the ring (messages in flight at once).
        curve: CURVE server keys and client allow-list; ``None`` for plain text.
        hwm: ZeroMQ send high-water mark (messages queued per subscriber).
        name: Consumer name shown by the broker.
    """

    def __init__(
        self,
        endpoint: str | Sequence[str] = DEFAULT_ENDPOINT,
        *,
        topics: Sequence[str] = ("",),
        bind: bool = True,
        policy: Policy = "block",
        send_timeout: float = 30.0,
        slots: int = 8,
        curve: CurveServer | None = None,
        hwm: int = 64,
        name: str | None = None,
    ) -> None:
        if policy not in ("block", "drop"):
            raise ValueError(f"policy: expected 'block' or 'drop', got {policy!r}")
        if not send_timeout > 0:
            raise ValueError(f"send_timeout: expected a positive number of seconds, got {send_timeout!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if isinstance(topics, str) or not all(isinstance(t, str) for t in topics):
            raise TypeError(f"topics: expected a sequence of str prefixes, got {topics!r}")
        requested = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        self.id = uuid.uuid4().hex[:16]
        self.name = name or f"ZmqPublisher({', '.join(requested)})"
        self.policy: Policy = policy
        self.send_timeout = float(send_timeout)
        self.topics = tuple(topics)
        self._numbers: dict[str, dict[str, int]] = {}
        self._runs: dict[str, tuple[RunStart | None, int, int]] = {}
        self._queue: collections.deque[Staged] = collections.deque()
        self._cond = threading.Condition()
        self._ring = StagingRing(slots, self._cond)
        self._subscribers: set[bytes] = set()
        self._unacked: dict[str, set[bytes]] = {}  # run -> subscribers yet to confirm its RunEnd
        self._published = self._sent = self._bytes = self._ring_drops = self._send_drops = 0
        self._timeouts = self._peak = 0  # each counter is written by one thread only
        self._error: BaseException | None = None
        self._closed = self._closing = self._done = False
        self._close_deadline = 0.0
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._auth = curve.start_authenticator(self._ctx) if curve is not None else None
        self.endpoints: tuple[str, ...] = ()
        try:
            self._socket = self._open(requested, bind, curve, hwm)
        except BaseException:
            self._teardown(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"worldtap-zmq-pub-{self.id}", daemon=True)
        self._thread.start()

    def _open(self, endpoints: list[str], bind: bool, curve: CurveServer | None, hwm: int) -> zmq.Socket[Any]:
        with translate_zmq_errors("create XPUB socket"):
            sock: zmq.Socket[Any] = self._ctx.socket(zmq.XPUB)
        # NODROP in both policies: a full subscriber queue must be seen (EAGAIN) to be counted.
        # MAXMSGSIZE: the only inbound traffic is subscriptions.
        for option, value in ((zmq.LINGER, 0), (zmq.XPUB_NODROP, 1), (zmq.SNDHWM, hwm),
                              (zmq.MAXMSGSIZE, 4096), (zmq.SNDTIMEO, int(self.send_timeout * 1000))):
            sock.setsockopt(option, value)
        if curve is not None:
            curve.apply(sock)
        self.endpoints = attach(sock, endpoints, bind=bind, encrypted=curve is not None, owner=self.name)
        return sock

    # -- simulation thread -----------------------------------------------------------------

    def __call__(self, message: Message) -> None:
        """Stage ``message`` for sending (the broker consumer entry point).

        Raises:
            BrokerClosedError: The publisher was closed.
            SendTimeoutError: ``block`` policy: no staging slot freed up within ``send_timeout``,
                or an earlier message timed out on the socket (raised once).
            TransportError: The sender thread failed.
            WireFormatError: The message cannot be encoded.
        """
        if self._closed:
            raise BrokerClosedError(f"{self.name}: publish on topic {message.topic!r} after close()")
        self._raise_pending()
        topic = message.topic
        if not topic.startswith("run/") and not topic.startswith(self.topics):
            return
        self._forward(message)

    def _forward(self, message: Message) -> None:
        topic, run = message.topic, message.run
        own, fields = message_tensors(message)
        own_specs = [tensor_spec(topic, n, t) for n, t in own]
        field_specs = [tensor_spec(topic, n, t) for n, t in fields]
        counters = self._numbers.setdefault(run, {})
        number = counters.get(topic, 0)
        streams = ({t: c for t, c in counters.items() if t != TOPIC_RUN_END}
                   if isinstance(message, RunEnd) else None)
        header = encode_header(message, own_specs, field_specs, publisher=self.id, number=number,
                               streams=streams)
        counters[topic] = number + 1
        self._published += 1
        if isinstance(message, RunEnd):
            with self._cond:
                self._unacked[run] = set(self._subscribers)
            del self._numbers[run]
            self._runs.pop(run, None)
        else:
            start = message if isinstance(message, RunStart) else self._runs.get(run, (None, 0, 0))[0]
            self._runs[run] = (start, message.seq, message.step)
        control = topic.startswith("run/")
        tensors = own + fields
        slot: Slot | None = None
        layout: Layout = []
        event: Any = None
        if tensors:
            slot = self._acquire(control, topic)
            if slot is None:
                self._ring_drops += 1
                return
            try:
                layout, event = self._ring.stage(slot, [t for _, t in tensors])
            except BaseException:
                self._ring.release(slot, None)
                raise
        item = Staged(topic.encode(), header, slot, layout, event, control)
        with self._cond:
            self._queue.append(item)
            self._peak = max(self._peak, len(self._queue))
            self._cond.notify()

    def _acquire(self, control: bool, topic: str) -> Slot | None:
        """The next ring slot, or ``None`` (drop) when it is busy and dropping is allowed."""
        wait = self.policy == "block" or control
        slot = self._ring.acquire(wait, self.send_timeout)
        if slot is None and self._done:
            raise TransportError(f"{self.name}: the sender thread has stopped") from self._error
        if slot is None and wait:
            raise SendTimeoutError(
                f"{self.name}: no staging slot freed within send_timeout={self.send_timeout} s for "
                f"topic {topic!r}; a subscriber of {', '.join(self.endpoints)} is too slow or gone")
        return slot

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        if self._done and not self._closed:
            raise TransportError(f"{self.name}: the sender thread has stopped")

    # -- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._socket
        try:
            while True:
                item = None
                with self._cond:
                    if not self._queue and not self._closing:
                        self._cond.wait(_IDLE_POLL)
                    if self._queue:
                        item = self._queue.popleft()
                    elif self._closing:
                        break
                self._read_subscriptions(sock)
                if item is not None:
                    self._send(sock, item)
        except Exception as exc:
            _log.exception("%s: sender thread failed", self.name)
            self._error = TransportError(f"{self.name}: sender thread failed: {exc!r}")
            self._error.__cause__ = exc
        finally:
            linger = 0.0
            if self._closing:  # zero-copy messages are tracked: an undelivered one is an error
                if not self._released(self._close_deadline) and self._error is None:
                    self._error = SendTimeoutError(
                        f"{self.name}: close() could not deliver every message within its timeout; "
                        f"a subscriber of {', '.join(self.endpoints)} is too slow or gone")
                # Disconnecting drops what a subscriber has not read yet: wait until each one
                # confirms the RunEnd of every run (so it has received everything before it).
                while self._awaiting_acks() and time.monotonic() < self._close_deadline:
                    if sock.poll(20, zmq.POLLIN):
                        self._read_subscriptions(sock)
                if self._awaiting_acks() and self._error is None:
                    self._error = SendTimeoutError(
                        f"{self.name}: close(): a subscriber of {', '.join(self.endpoints)} did not confirm "
                        f"the end of run(s) {sorted(self._unacked)} within the timeout; it is too "
                        f"slow or gone")
                linger = max(self._close_deadline - time.monotonic(), 0.0)
            sock.close(linger=int(linger * 1000))
            self._done = True
            self._ring.close()

    def _read_subscriptions(self, sock: zmq.Socket[Any]) -> None:
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event: bytes = sock.recv(zmq.NOBLOCK)
            if event[1:].startswith(SUBSCRIBER_HELLO):
                with self._cond:
                    if event[:1] == b"\x01":
                        self._subscribers.add(event[1:])
                    else:
                        self._subscribers.discard(event[1:])
                        for waiting in self._unacked.values():
                            waiting.discard(event[1:])
                    self._cond.notify_all()
            elif event[:1] == b"\x01" and event[1:].startswith(SUBSCRIBER_ACK):
                pub, _, rest = event[1 + len(SUBSCRIBER_ACK):].decode(errors="replace").partition("/")
                run, _, sub = rest.rpartition("/")
                if pub == self.id:
                    with self._cond:
                        self._unacked.get(run, set()).discard(SUBSCRIBER_HELLO + sub.encode())
                        self._cond.notify_all()

    def _awaiting_acks(self) -> bool:
        """Whether a connected subscriber has not yet confirmed a RunEnd sent to it."""
        with self._cond:
            for run in [r for r, subs in self._unacked.items() if not subs & self._subscribers]:
                del self._unacked[run]
            return bool(self._unacked)

    def _send(self, sock: zmq.Socket[Any], item: Staged) -> None:
        frames: list[Any] = [item.topic, item.header]
        trackers: list[zmq.Frame] = []
        slot = item.slot
        if slot is not None:
            if item.event is not None:
                item.event.synchronize()
            # Frames at or above pyzmq's copy threshold go zero-copy out of the slot; ZeroMQ
            # releases the parts of a message in order, so tracking the last one covers all.
            threshold = sock.copy_threshold
            last = max((i for i, (_, nb) in enumerate(item.layout) if nb >= threshold), default=-1)
            for i, (off, nb) in enumerate(item.layout):
                frame: Any = slot.frame(off, nb)
                if i == last:
                    frame = zmq.Frame(frame, track=True)
                    trackers.append(frame)
                frames.append(frame)
        blocking = self.policy == "block" or item.control
        if self._closing and blocking:
            sock.setsockopt(zmq.SNDTIMEO, max(int((self._close_deadline - time.monotonic()) * 1000), 0))
        try:
            with translate_zmq_errors(f"send on {', '.join(self.endpoints)}"):
                sock.send_multipart(frames, 0 if blocking else zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._send_drops += 1
            if blocking:
                self._timeouts += 1
                limit = "the close() timeout" if self._closing else f"send_timeout={self.send_timeout} s"
                self._error = SendTimeoutError(
                    f"{self.name}: a message on topic {item.topic.decode()!r} could not be sent within "
                    f"{limit}; a subscriber of {', '.join(self.endpoints)} "
                    f"is too slow or gone (message lost)")
            trackers = []
        else:
            self._sent += 1
            self._bytes += item.nbytes
        if slot is not None:
            self._ring.release(slot, zmq.MessageTracker(*trackers) if trackers else None)

    # -- control ---------------------------------------------------------------------------

    def wait_for_subscribers(self, n: int = 1, timeout: float = 10.0) -> None:
        """Block until ``n`` :class:`broker.Subscriber` instances have joined (their topic
        subscriptions are in place), so nothing published afterwards is lost to the slow joiner.

        Raises:
            SubscriberTimeoutError: Fewer than ``n`` joined within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._subscribers) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._done:
                    raise SubscriberTimeoutError(
                        f"wait_for_subscribers: expected {n} subscriber(s) on "
                        f"{', '.join(self.endpoints)} within {timeout} s, {len(self._subscribers)} joined")
                self._cond.wait(min(remaining, 0.05))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every staged message has been handed to ZeroMQ and ZeroMQ is done with
        its staging slot (not that subscribers have processed it). Returns whether that
        happened within ``timeout`` seconds (``None``: ``send_timeout``)."""
        deadline = time.monotonic() + (self.send_timeout if timeout is None else timeout)
        with self._cond:
            while (self._queue or any(s.busy for s in self._ring.slots)) and not self._done:
                if not self._cond.wait(max(deadline - time.monotonic(), 0.0)):
                    return False
        return self._released(deadline)

    def _released(self, deadline: float) -> bool:
        for slot in self._ring.slots:
            if slot.tracker is not None:
                try:
                    slot.tracker.wait(max(deadline - time.monotonic(), 0.0))
                except zmq.NotDone:
                    return False
        return True

    def statistics(self) -> PublisherStatistics:
        """A frozen snapshot of the counters."""
        with self._cond:
            queued, subscribers = len(self._queue), len(self._subscribers)
        return PublisherStatistics(
            published=self._published, messages=self._sent, bytes=self._bytes,
            drops=self._ring_drops + self._send_drops, peak_queue=self._peak, queued=queued,
            subscribers=subscribers, send_timeouts=self._timeouts, closed=self._closed)

    def close(self, timeout: float | None = None) -> None:
        """Deliver everything already published, send ``RunEnd`` for every run that has not sent
        one, and close the sockets. Idempotent.

        Args:
            timeout: Seconds allowed for the flush (default ``send_timeout``).

        Raises:
            SendTimeoutError: ``block`` policy: some messages could not be delivered in time
                (the publisher is closed anyway).
        """
        if self._closed:
            return
        self._closed = True
        if not self._done:
            for run, (start, seq, step) in list(self._runs.items()):
                info = start or RunStart(run, 0, step, 0, "")
                try:
                    self._forward(RunEnd(run, seq + 1, step, info.num_worlds, info.device, info.schema,
                                         info.metadata))
                except SendTimeoutError as exc:
                    self._error = exc
        flush = self.send_timeout if timeout is None else timeout
        with self._cond:
            self._close_deadline = time.monotonic() + flush
            self._closing = True
            self._cond.notify_all()
        self._thread.join(flush + 5.0)
        self._teardown(linger=None if not self._thread.is_alive() else 0)
        error = self._error if self.policy == "block" else None
        self._error = None
        if error is not None:
            raise error

    def _teardown(self, linger: int | None) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.destroy(linger=0) if linger == 0 else self._ctx.term()

    def __enter__(self) -> ZmqPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
