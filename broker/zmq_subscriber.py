"""The ZeroMQ subscriber: decoded messages from one or more publishers, with gaps reported as values."""

from __future__ import annotations

import collections
import contextlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import BrokerClosedError, WireFormatError, translate_zmq_errors
from .messages import TOPIC_RUN_END, A, MessageOf, RunEnd
from .security import CurveClient, attach
from .wire import (
    DEFAULT_MAX_HEADER_SIZE,
    DEFAULT_MAX_MESSAGE_SIZE,
    SUBSCRIBER_ACK,
    Arrays,
    decode_envelope,
)
from .zmq_publisher import DEFAULT_ENDPOINT, HANDSHAKE_FAILED, handshake_cause, hello_subscription

if TYPE_CHECKING:
    from .wire import Decoded

__all__ = ["Gap", "Subscriber", "SubscriberStatistics"]

_log = logging.getLogger("worldtap.broker.zmq")
_SLICE: Final = 0.05  # seconds between checks for close() while a receive blocks
# Seconds between reads of the connection monitor while messages keep arriving (after a wait
# in which nothing came, it is read at once); reading it per message cost more than decoding
# a small one.
_WATCH_INTERVAL: Final = 0.02
_ENDED_RUNS: Final = 4096  # ended (publisher, run) streams remembered, to reject replays
_RETRY_GRACE: Final = 0.5  # seconds ZeroMQ has to start reconnecting a dropped connection itself
_ID: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_WATCHED: Final = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CONNECT_DELAYED
                   | zmq.EVENT_CONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)


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
        bad_messages: Messages that failed to decode, or were larger than ``max_message_size``
            (reason ``"too large"``); skipped.
        bad_reasons: ``WireFormatError.reason`` -> count.
        gaps: Gaps reported.
        missing: Messages lost in those gaps, in total.
        duplicates: Messages whose wire number was not new in their stream (a replay, a copy,
            or a message older than a reported gap); skipped, never returned.
        reconnects: Connections to publishers that ZeroMQ dropped for good (a frame over
            ``max_message_size``) and the subscriber connected again.
        publishers: Distinct publishers heard from.
        closed: Whether ``close()`` was called.
        handshake_failures: Connections whose handshake failed (CURVE keys that do not match:
            nothing is received over them).
        failing_endpoints: Endpoint -> likely cause (:func:`broker.zmq_publisher.handshake_cause`),
            for each endpoint whose latest handshake failed (one that succeeds later leaves it).
    """

    received: int
    bytes: int
    bad_messages: int
    bad_reasons: Mapping[str, int]
    gaps: int
    missing: int
    duplicates: int
    reconnects: int
    publishers: int
    closed: bool
    handshake_failures: int = 0
    failing_endpoints: Mapping[str, str] = field(default_factory=dict)


class Subscriber(Generic[A]):
    """Receives, validates and decodes messages from publishers (SUB socket).

    ``recv()`` returns broker messages whose tensors are CPU tensors over the received frames
    (``arrays="numpy"``: numpy arrays, a ``Subscriber[np.ndarray]``, see :func:`broker.decode`);
    they belong to the caller. A malformed message is counted by reason and skipped, never
    raised. Every ``(publisher, run, topic)`` stream is numbered by its publisher, so a lost
    message comes back as a :class:`Gap` before the next message of its stream (and losses at a
    stream's tail as gaps before ``run/end``), whatever prefixes were chosen. A new run or a
    restarted publisher starts new streams and is not a gap; joining a stream late is one. A
    message whose number is not new in its stream (a replayed or duplicated message, or one
    older than a gap already reported) is counted as a duplicate and skipped; the streams of
    the last few thousand ended runs are remembered for this.

    Run ends: each ``RunEnd`` received is confirmed to its publisher, whose ``close()`` waits
    for the confirmation; a publisher sends an unconfirmed ``RunEnd`` again, and the copies are
    skipped (and confirmed again). By default the confirmation goes out on receipt. A caller
    that must finish something first (a store that commits the run's tail) passes
    ``confirm_run_ends=False`` and calls :meth:`confirm_run_end` once the run is durable: until
    then the publisher keeps the ``RunEnd`` and, if this subscriber dies, sends it again to the
    subscriber that re-joins with the same ``id``, which receives it as a fresh ``RunEnd`` (with
    gaps for the streams it did not see). A ``RunEnd`` of a topic set this subscriber did not
    choose (``topics`` without ``run/``) is never returned and always confirmed on receipt.

    Size: a message larger than ``max_message_size`` (all its frames together) is received
    frame by frame, let go of frame by frame, counted (reason ``"too large"``) and its number
    becomes a gap. ZeroMQ itself drops the connection of a peer that sends a single frame
    larger than that (``MAXMSGSIZE``, the memory bound); worldtap publishers learn this
    subscriber's limit when it joins and never send such a message, and should another sender
    do it, a connecting subscriber connects again and the messages lost with the connection
    show up as gaps.

    Liveness: the subscriber pings its publishers (ZMTP heartbeats) and asks them to treat it
    as gone after ``heartbeat`` seconds of silence, so a publisher stops counting (and waiting
    for) a subscriber whose process or host died without closing its connections. Behind a
    ``worldtap-proxy`` (connect to its backend) it is the proxy that drops it, after the proxy's
    own ``heartbeat``; publishers then stop counting it.

    A *bound* subscriber sends its subscriptions to a publisher that connects to it only while
    it is inside ``recv`` (ZeroMQ processes socket commands in the owner's calls), so keep
    receiving while connecting publishers ``wait_for_subscribers``.

    Args:
        endpoints: One endpoint or several.
        topics: Topic prefixes to receive (``""``: all).
        bind: Connect (default) or bind the endpoints (a daemon that publishers connect to).
        curve: Client key pair and the publisher's public key; ``None`` for plain text.
        max_message_size: Largest accepted message (topic, header and frames) in bytes; also
            the socket's ``MAXMSGSIZE`` and the limit announced to publishers.
        max_header_size: Largest accepted msgpack header in bytes.
        hwm: ZeroMQ receive high-water mark: at most this many messages wait in memory for
            ``recv`` (with a lossless publisher, a full queue slows the publisher down).
        heartbeat: Seconds of silence after which publishers drop this subscriber's connection
            (ZMTP heartbeat TTL; it pings every ``heartbeat / 5`` seconds, at most 1 s apart).
        id: This subscriber's identity towards publishers (1 to 64 characters of
            ``[A-Za-z0-9_.-]``), which keys its ``RunEnd`` confirmations; ``None``: a random one.
            Give a stable id to a subscriber that is restarted (a storage daemon), so that
            publishers send it the ``RunEnd`` its previous incarnation did not confirm. Two
            live subscribers must never share an id.
        confirm_run_ends: Confirm each ``RunEnd`` on receipt (default), or only when the caller
            calls :meth:`confirm_run_end` (``False``: the publisher's ``close()`` waits, and a
            re-joining subscriber with the same ``id`` gets the ``RunEnd`` again).
        arrays: ``"torch"`` (default): messages hold torch tensors. ``"numpy"``: numpy arrays
            over the received frames (bfloat16 as :class:`broker.BFloat16Bits`), and torch is
            never imported; annotate the subscriber as ``Subscriber[np.ndarray]``.
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
        heartbeat: float = 10.0,
        id: str | None = None,
        confirm_run_ends: bool = True,
        arrays: Arrays = "torch",
    ) -> None:
        if isinstance(topics, str) or not all(isinstance(t, str) for t in topics):
            raise TypeError(f"topics: expected a sequence of str prefixes, got {topics!r}")
        for name, value in (("max_message_size", max_message_size), ("max_header_size", max_header_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if not 0.1 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat: expected seconds in [0.1, 3600], got {heartbeat!r}")
        if id is not None and (not isinstance(id, str) or _ID.fullmatch(id) is None):
            raise ValueError(f"id: expected None or 1 to 64 characters of [A-Za-z0-9_.-], got {id!r}")
        if arrays not in ("torch", "numpy"):
            raise ValueError(f"arrays: expected 'torch' or 'numpy', got {arrays!r}")
        self.arrays: Arrays = arrays
        self.id = uuid.uuid4().hex[:16] if id is None else id
        self.confirm_run_ends = bool(confirm_run_ends)
        self.topics = tuple(topics)
        self.max_message_size = max_message_size
        self.max_header_size = max_header_size
        self._prefixes = tuple(t.encode() for t in self.topics)
        self._lock = threading.RLock()
        self._pending: collections.deque[MessageOf[A] | Gap] = collections.deque()
        # (publisher, run) -> topic -> next expected wire number; ended runs move to _ended.
        self._next: dict[tuple[str, str], dict[str, int]] = {}
        self._ended: collections.OrderedDict[tuple[str, str], dict[str, int]] = collections.OrderedDict()
        self._publishers: set[str] = set()
        # run -> publishers whose RunEnd of it was returned and awaits confirm_run_end().
        self._unconfirmed: dict[str, set[str]] = {}
        self._reasons: dict[str, int] = {}
        self._received = self._bytes = self._gaps = self._missing = self._duplicates = self._reconnects = 0
        self._closed = False
        requested = [endpoints] if isinstance(endpoints, str) else list(endpoints)
        self._connected = [] if bind else requested  # endpoints to connect again if ZeroMQ gives up
        self._dropped: dict[str, float] = {}  # monitor endpoint -> when to reconnect it ourselves
        self._seen: set[str] = set()  # endpoint names the monitor reported
        self._handshakes = 0
        self._failing: dict[str, str] = {}  # endpoint -> cause of its latest failed handshake
        self._monitor: zmq.Socket[Any] | None = None
        self._watch_due = 0.0  # monotonic time of the next monitor read while busy
        self._ctx: zmq.Context[Any] = zmq.Context()
        try:
            self._socket = self._open(requested, bind, curve, hwm, heartbeat)
        except BaseException:
            self._ctx.destroy(linger=0)
            raise

    def _open(self, endpoints: list[str], bind: bool, curve: CurveClient | None, hwm: int,
              heartbeat: float) -> zmq.Socket[Any]:
        with translate_zmq_errors("create SUB socket"):
            sock: zmq.Socket[Any] = self._ctx.socket(zmq.SUB)
        # Heartbeats prove this process alive to publishers (its I/O thread pings even while
        # recv is not called); it never times publishers out itself (HEARTBEAT_TIMEOUT 0): while
        # its queue is full it reads nothing, not even their answers.
        for option, value in ((zmq.LINGER, 0), (zmq.RCVHWM, hwm), (zmq.MAXMSGSIZE, self.max_message_size),
                              (zmq.HEARTBEAT_IVL, max(50, min(1000, int(heartbeat * 200)))),
                              (zmq.HEARTBEAT_TTL, int(heartbeat * 1000)), (zmq.HEARTBEAT_TIMEOUT, 0)):
            sock.setsockopt(option, value)
        if curve is not None:
            curve.apply(sock)
        # Topic subscriptions first, the hello last: when a publisher sees the hello, the
        # subscriptions before it are in place (wait_for_subscribers relies on it).
        for prefix in (*self._prefixes, TOPIC_RUN_END.encode(), hello_subscription(self.id, self.max_message_size)):
            sock.setsockopt(zmq.SUBSCRIBE, prefix)
        # ZeroMQ does not reconnect after a protocol error (an oversized frame); failed
        # handshakes are counted (bound or connected).
        self._monitor = sock.get_monitor_socket(_WATCHED)
        try:
            self.endpoints = attach(sock, endpoints, bind=bind, encrypted=curve is not None, owner="Subscriber")
        except BaseException:
            if self._monitor is not None:
                self._monitor.close(linger=0)
            raise
        return sock

    def recv(self, timeout: float | None = None) -> MessageOf[A] | Gap | None:
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
                    if self._monitor is not None and (now := time.monotonic()) >= self._watch_due:
                        self._watch(self._monitor)
                        self._watch_due = now + _WATCH_INTERVAL
                    frames = self._recv(remaining)
                    if frames is None:  # nothing came within the slice: read the monitor next
                        self._watch_due = 0.0
                if frames:
                    self._handle(frames)
                    if self._pending:
                        return self._pending.popleft()
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def _recv(self, timeout: float) -> list[Any] | None:
        """The frames of the next message (``[]`` if it was too large), or ``None``."""
        sock = self._socket
        try:  # the common case under load: a message is already queued
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not sock.poll(int(timeout * 1000)):
                return None
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        frames = [frame]
        size, limit = len(frame), self.max_message_size
        while frame.more:  # the parts of a message arrive together
            frame = sock.recv(zmq.NOBLOCK, copy=False)
            size += len(frame)
            if size <= limit:
                frames.append(frame)
            elif frames:  # never hold more than the limit: let go of the parts as they come
                frames = []
        self._bytes += size
        if size > limit:
            self._bad(WireFormatError("too large", f"message of at least {size} bytes exceeds "
                                                   f"max_message_size={limit}"))
        return frames

    def _watch(self, monitor: zmq.Socket[Any]) -> None:
        """Record handshakes that fail or succeed; connect again to an endpoint whose connection
        ZeroMQ dropped and does not retry."""
        while int(monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event: Any = recv_monitor_message(monitor, zmq.NOBLOCK)
            where = bytes(event["endpoint"]).decode(errors="replace")
            kind = event["event"]
            if kind & HANDSHAKE_FAILED:
                cause = handshake_cause(kind, event["value"], server=False)
                self._handshakes += 1
                known = self._failing.get(where)
                if known is not None and kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                    cause = known  # a retry that failed without detail: keep what is known
                (_log.debug if known == cause else _log.warning)(
                    "Subscriber: the handshake with %r failed: %s", where, cause)
                self._failing[where] = cause
                continue
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._failing.pop(where, None)
                continue
            if not self._connected:  # bound: nothing to connect again
                continue
            self._seen.add(where)
            if kind == zmq.EVENT_DISCONNECTED:
                self._dropped[where] = time.monotonic() + _RETRY_GRACE
            else:  # ZeroMQ is connecting again itself
                self._dropped.pop(where, None)
        if not self._dropped:
            return
        now = time.monotonic()
        for where, due in list(self._dropped.items()):
            if now < due:
                continue
            del self._dropped[where]
            # The monitor names an endpoint as ZeroMQ resolved it ("localhost" -> 127.0.0.1).
            targets = [ep for ep in self._connected if ep == where] or [
                ep for ep in self._connected if ep not in self._seen]
            for ep in targets:
                if where in self._failing:  # refused at the handshake: try again, quietly
                    _log.debug("Subscriber: connecting again to %r after a failed handshake", ep)
                else:
                    _log.warning("Subscriber: the connection to %r was dropped (a frame over "
                                 "max_message_size=%d?); connecting again", ep, self.max_message_size)
                with contextlib.suppress(zmq.ZMQError):  # ZeroMQ may have forgotten it already
                    self._socket.disconnect(ep)
                self._socket.connect(ep)
                self._reconnects += 1

    def __iter__(self) -> Iterator[MessageOf[A] | Gap]:
        """Messages and gaps as they arrive, until the subscriber is closed (from any thread)."""
        while True:
            try:
                item = self.recv()
            except BrokerClosedError:
                return
            if item is not None:
                yield item

    def _handle(self, frames: list[Any]) -> None:
        try:
            decoded = cast("Decoded[A]", decode_envelope(  # A is what self.arrays makes
                frames, max_header_size=self.max_header_size, max_message_size=self.max_message_size,
                arrays=self.arrays))
        except WireFormatError as exc:
            self._bad(exc)
            return
        message, pub, number = decoded.message, decoded.publisher, decoded.number
        run, topic = message.run, message.topic
        self._publishers.add(pub)
        key = (pub, run)
        streams = self._next.get(key)
        if streams is None:  # a new stream, or an ended one (only numbers beyond its end reopen it)
            streams = self._ended.get(key, {})
        expected = streams.get(topic, 0)
        if number < expected:  # seen, or older than a gap already reported: never delivered twice
            self._duplicates += 1
            _log.debug("Subscriber: skipped a duplicate: number %d on %r of run %r (expected %d)",
                       number, topic, run, expected)
            if isinstance(message, RunEnd) and pub not in self._unconfirmed.get(run, ()):
                self._confirm(pub, run)  # the publisher missed the first confirmation
            return
        if key not in self._next:
            self._next[key] = streams
            self._ended.pop(key, None)
        wanted = topic.encode().startswith(self._prefixes)
        if wanted:
            self._check(pub, run, topic, expected, number)
        streams[topic] = number + 1
        if isinstance(message, RunEnd):
            for name, count in decoded.streams.items():
                if name.encode().startswith(self._prefixes):
                    self._check(pub, run, name, streams.get(name, 0), count)
                streams[name] = max(streams.get(name, 0), count)
            self._ended[key] = self._next.pop(key)
            while len(self._ended) > _ENDED_RUNS:
                self._ended.popitem(last=False)
            if self.confirm_run_ends or not wanted:
                self._confirm(pub, run)
            else:
                self._unconfirmed.setdefault(run, set()).add(pub)
        if wanted:
            self._received += 1
            self._pending.append(message)

    def _bad(self, exc: WireFormatError) -> None:
        count = self._reasons.get(exc.reason, 0)
        self._reasons[exc.reason] = count + 1
        (_log.warning if count == 0 else _log.debug)("Subscriber: skipped a bad message: %s", exc)

    def confirm_run_end(self, run: str) -> None:
        """Confirm the ``RunEnd`` of ``run`` to every publisher it came from (with
        ``confirm_run_ends=False``; call it once what the run needs is done, e.g. committed).
        A run whose ``RunEnd`` was not returned, or was confirmed already, is ignored. Call it
        from the thread that calls :meth:`recv`.

        Raises:
            BrokerClosedError: The subscriber was closed.
            TransportError: The socket failed.
        """
        with self._lock:
            if self._closed:
                raise BrokerClosedError(f"Subscriber.confirm_run_end({run!r}) after close()")
            with translate_zmq_errors(f"confirm on {', '.join(self.endpoints)}"):
                for pub in sorted(self._unconfirmed.pop(run, ())):
                    self._confirm(pub, run)

    def _confirm(self, pub: str, run: str) -> None:
        """Tell publisher ``pub`` that its RunEnd of ``run`` arrived (it may disconnect)."""
        ack = SUBSCRIBER_ACK + f"{pub}/{run}/{self.id}".encode()
        self._socket.setsockopt(zmq.SUBSCRIBE, ack)
        self._socket.setsockopt(zmq.UNSUBSCRIBE, ack)

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
            duplicates=self._duplicates, reconnects=self._reconnects,
            publishers=len(self._publishers), closed=self._closed,
            handshake_failures=self._handshakes,
            failing_endpoints=MappingProxyType(dict(self._failing)))

    def close(self) -> None:
        """Close the socket; messages not yet received are discarded. Safe from any thread
        (a blocked ``recv`` or iteration ends within a fraction of a second). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._monitor is not None:
                self._socket.disable_monitor()
                self._monitor.close(linger=0)
            self._socket.close(linger=0)
            self._ctx.term()

    def __enter__(self) -> Subscriber[A]:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
