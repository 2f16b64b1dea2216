"""The ZeroMQ subscriber: decoded messages from one or more publishers, with gaps reported as values."""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import zmq

from .errors import BrokerClosedError, WireFormatError, translate_zmq_errors
from .messages import TOPIC_RUN_END, Message, RunEnd
from .security import CurveClient, attach
from .wire import (
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_MESSAGE_SIZE,
    SUBSCRIBER_ACK,
    SUBSCRIBER_HELLO,
    decode_envelope,
)
from .zmq_publisher import DEFAULT_ENDPOINT

__all__ = ["Gap", "Subscriber", "SubscriberStatistics"]

_log = logging.getLogger("worldtap.broker.zmq")
_SLICE = 0.05  # seconds between checks for close() while a receive blocks


@dataclass(frozen=True, slots=True)
class Gap:
    """Messages of one ``(publisher, run, topic)`` stream that never arrived.

    Attributes:
        run: The run the lost messages belong to.
        topic: Their topic.
        expected: The wire number the subscriber expected next.
        received: The wire number that arrived instead (at ``run/end``: the number of messages
            the publisher numbered on the topic).
        publisher: Id of the publisher that numbered them.
    """

    run: str
    topic: str
    expected: int
    received: int
    publisher: str = ""

    @property
    def missing(self) -> int:
        """How many messages were lost."""
        return self.received - self.expected


@dataclass(frozen=True, slots=True)
class SubscriberStatistics:
    """A snapshot of a subscriber's counters.

    Attributes:
        received: Messages decoded and returned.
        bytes: Bytes received, good and bad.
        bad_messages: Messages that failed to decode (skipped).
        bad_reasons: ``WireFormatError.reason`` -> count.
        gaps: Gaps reported.
        missing: Messages lost in those gaps, in total.
        publishers: Distinct publishers heard from.
        closed: Whether ``close()`` was called.
    """

    received: int
    bytes: int
    bad_messages: int
    bad_reasons: Mapping[str, int]
    gaps: int
    missing: int
    publishers: int
    closed: bool


class Subscriber:
    """Receives, validates and decodes messages from publishers (SUB socket).

    ``recv()`` returns broker messages whose tensors are CPU tensors over the received frames;
    they belong to the caller. A malformed message is counted by reason and skipped, never
    raised. Every ``(publisher, run, topic)`` stream is numbered by its publisher, so a lost
    message comes back as a :class:`Gap` before the next message of its stream (and losses at a
    stream's tail as gaps before ``run/end``), whatever prefixes were chosen. A new run or a
    restarted publisher starts new streams and is not a gap; joining a stream late is one.

    A *bound* subscriber sends its subscriptions to a publisher that connects to it only while
    it is inside ``recv`` (ZeroMQ processes socket commands in the owner's calls), so keep
    receiving while connecting publishers ``wait_for_subscribers``.

    Args:
        endpoints: One endpoint or several.
        topics: Topic prefixes to receive (``""``: all).
        bind: Connect (default) or bind the endpoints (a daemon that publishers connect to).
        curve: Client key pair and the publisher's public key; ``None`` for plain text.
        max_message_size: Largest accepted frame and message in bytes (ZeroMQ MAXMSGSIZE
            disconnects a peer that sends a larger frame).
        max_header_size: Largest accepted msgpack header in bytes.
        hwm: ZeroMQ receive high-water mark: at most this many messages wait in memory for
            ``recv`` (with a lossless publisher, a full queue slows the publisher down).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] = DEFAULT_ENDPOINT,
        *,
        topics: Sequence[str] = ("",),
        bind: bool = False,
        curve: CurveClient | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        hwm: int = 16,
    ) -> None:
        if isinstance(topics, str) or not all(isinstance(t, str) for t in topics):
            raise TypeError(f"topics: expected a sequence of str prefixes, got {topics!r}")
        for name, value in (("max_message_size", max_message_size), ("max_header_size", max_header_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        self.id = uuid.uuid4().hex[:16]
        self.topics = tuple(topics)
        self.max_message_size = max_message_size
        self.max_header_size = max_header_size
        self._prefixes = tuple(t.encode() for t in self.topics)
        self._lock = threading.RLock()
        self._pending: collections.deque[Message | Gap] = collections.deque()
        self._next: dict[tuple[str, str], dict[str, int]] = {}
        self._publishers: set[str] = set()
        self._reasons: dict[str, int] = {}
        self._received = self._bytes = self._gaps = self._missing = 0
        self._closed = False
        requested = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._socket = self._open(requested, bind, curve, hwm)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _open(self, endpoints: list[str], bind: bool, curve: CurveClient | None, hwm: int) -> zmq.Socket[Any]:
        with translate_zmq_errors("create SUB socket"):
            sock: zmq.Socket[Any] = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_size)
        if curve is not None:
            curve.apply(sock)
        # Topic subscriptions first, the hello last: when a publisher sees the hello, the
        # subscriptions before it are in place (wait_for_subscribers relies on it).
        for prefix in (*self._prefixes, TOPIC_RUN_END.encode(), SUBSCRIBER_HELLO + self.id.encode()):
            sock.setsockopt(zmq.SUBSCRIBE, prefix)
        self.endpoints = attach(sock, endpoints, bind=bind, encrypted=curve is not None, owner="Subscriber")
        return sock

    def recv(self, timeout: float | None = None) -> Message | Gap | None:
        """The next message or gap, or ``None`` when nothing arrived within ``timeout`` seconds
        (``None``: wait until something arrives or the subscriber is closed).

        Raises:
            BrokerClosedError: The subscriber was closed before this call.
            TransportError: The socket failed.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._closed:
                    raise BrokerClosedError("Subscriber.recv() after close()")
                if self._pending:
                    return self._pending.popleft()
                remaining = _SLICE if deadline is None else min(max(deadline - time.monotonic(), 0.0), _SLICE)
                with translate_zmq_errors(f"receive on {', '.join(self.endpoints)}"):
                    frames = self._recv(remaining)
                if frames is not None:
                    self._handle(frames)
                    if self._pending:
                        return self._pending.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _recv(self, timeout: float) -> list[Any] | None:
        try:  # the common case under load: a message is already queued
            return self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self._socket.poll(int(timeout * 1000)):
                return None
        return self._socket.recv_multipart(zmq.NOBLOCK, copy=False)

    def __iter__(self) -> Iterator[Message | Gap]:
        """Messages and gaps as they arrive, until the subscriber is closed (from any thread)."""
        while True:
            try:
                item = self.recv()
            except BrokerClosedError:
                return
            if item is not None:
                yield item

    def _handle(self, frames: list[Any]) -> None:
        self._bytes += sum(len(f) for f in frames)
        try:
            decoded = decode_envelope(frames, max_header_size=self.max_header_size,
                                      max_message_size=self.max_message_size)
        except WireFormatError as exc:
            count = self._reasons.get(exc.reason, 0)
            self._reasons[exc.reason] = count + 1
            (_log.warning if count == 0 else _log.debug)("Subscriber: skipped a bad message: %s", exc)
            return
        message, pub = decoded.message, decoded.publisher
        self._publishers.add(pub)
        wanted = message.topic.encode().startswith(self._prefixes)
        streams = self._next.setdefault((pub, message.run), {})
        if wanted:
            self._check(pub, message.run, message.topic, streams.get(message.topic, 0), decoded.number)
        streams[message.topic] = decoded.number + 1
        if isinstance(message, RunEnd):
            for topic, count in decoded.streams.items():
                if topic.encode().startswith(self._prefixes):
                    self._check(pub, message.run, topic, streams.get(topic, 0), count)
            del self._next[(pub, message.run)]
            ack = SUBSCRIBER_ACK + f"{pub}/{message.run}/{self.id}".encode()
            self._socket.setsockopt(zmq.SUBSCRIBE, ack)  # tells the publisher it may disconnect
            self._socket.setsockopt(zmq.UNSUBSCRIBE, ack)
        if wanted:
            self._received += 1
            self._pending.append(message)

    def _check(self, pub: str, run: str, topic: str, expected: int, received: int) -> None:
        if received > expected:
            gap = Gap(run, topic, expected, received, pub)
            self._gaps += 1
            self._missing += gap.missing
            _log.info("Subscriber: %d message(s) lost on %r of run %r", gap.missing, topic, run)
            self._pending.append(gap)

    def statistics(self) -> SubscriberStatistics:
        """A frozen snapshot of the counters."""
        reasons = dict(self._reasons)
        return SubscriberStatistics(
            received=self._received, bytes=self._bytes, bad_messages=sum(reasons.values()),
            bad_reasons=MappingProxyType(reasons), gaps=self._gaps, missing=self._missing,
            publishers=len(self._publishers), closed=self._closed)

    def close(self) -> None:
        """Close the socket; messages not yet received are discarded. Safe from any thread
        (a blocked ``recv`` or iteration ends within a fraction of a second). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._socket.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
