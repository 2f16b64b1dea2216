"""The ZeroMQ publisher: a broker consumer that stages batches and sends them on a background thread."""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, Literal

import zmq
from zmq.utils.monitor import recv_monitor_message

from .errors import (
    BrokerClosedError,
    BrokerError,
    SendTimeoutError,
    SubscriberTimeoutError,
    TransportError,
    WireFormatError,
    translate_zmq_errors,
)
from .messages import TOPIC_RUN_END, Message, RunEnd, RunStart
from .security import CurveClient, CurveServer, attach
from .wire import SUBSCRIBER_ACK, SUBSCRIBER_HELLO, HeaderCache, message_tensors

if TYPE_CHECKING:  # staging imports torch: only publishing needs it (subscribers import this module)
    from .staging import Slot, Staged

__all__ = ["DEFAULT_ENDPOINT", "HandshakeWatch", "Policy", "PublisherStatistics", "ZmqPublisher", "handshake_cause",
           "hello_subscription"]

_log = logging.getLogger("worldtap.broker.zmq")

DEFAULT_ENDPOINT: Final = "tcp://127.0.0.1:5555"
"""Loopback only: reaching other hosts is an explicit choice (and wants CURVE)."""
Policy = Literal["block", "drop"]
_IDLE_POLL: Final = 0.005
# Frames below this many bytes are copied by ZeroMQ in the sender thread (without the GIL);
# larger ones go zero-copy out of the staging slot. A zero-copy frame costs a round trip through
# pyzmq's garbage-collector thread, which takes the GIL from the simulation thread: dearer than
# copying a frame of up to a few hundred kilobytes (pyzmq's default threshold is 64 kB).
_COPY_THRESHOLD: Final = 1 << 18
_RESEND_INTERVAL: Final = 1.0  # seconds between re-sends of unconfirmed RunEnds while closing
_MAX_PENDING_ENDS: Final = 1024  # unconfirmed RunEnds kept for subscribers that may re-join
_TOPIC_RUN_END: Final = TOPIC_RUN_END.encode()
HANDSHAKE_FAILED: Final = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                           | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
"""The ZeroMQ monitor events of a failed handshake (CURVE keys that do not match)."""


def handshake_cause(event: int, value: int, *, server: bool, peer: str = "subscriber",
                    me: str = "publisher") -> str:
    """The likely cause of a failed ZeroMQ handshake, in words.

    Args:
        event: The monitor event (one of :data:`HANDSHAKE_FAILED`).
        value: The event's value (a ZAP status code or a ``zmq.PROTOCOL_ERROR_*`` code).
        server: Whether the socket that saw it is the binding, CURVE-server side (a publisher,
            a proxy; or such a side in plain text); ``False`` for a subscriber (CURVE client).
        peer, me: What the server side's peers are and what it is, in its messages
            (a proxy's frontend: ``peer="publisher", me="proxy"``).
    """
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (f"a {peer}'s key is not on the allow-list" if server else
                "the publisher refused this key: is its public key on the publisher's allow-list?")
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (f"a {peer} uses CURVE and this {me} does not, or the reverse" if server else
                "the publisher uses CURVE and this subscriber does not, or the reverse")
    if server and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return f"a {peer} has the wrong server public key"
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return ("a peer dropped the connection during the handshake" if server else
                "the publisher dropped the handshake: is the server public key the publisher's, this "
                "key on its allow-list, and CURVE used on both sides?")
    return f"the handshake failed (ZeroMQ event {event:#x}, code {value:#x})"


class HandshakeWatch:
    """Counts a socket's failed handshakes by likely cause (:func:`handshake_cause`), read from
    its ZeroMQ monitor on a thread of its own; the first failure of each cause is logged as a
    warning. Create it before the socket binds or connects, :meth:`stop` it before the socket's
    context is terminated.

    Args:
        sock: The socket to watch.
        server, peer, me: As :func:`handshake_cause`'s.
        owner: Names the socket in log lines.
    """

    def __init__(self, sock: zmq.Socket[Any], *, server: bool, owner: str, peer: str = "subscriber",
                 me: str = "publisher") -> None:
        self.server, self.owner, self._words = server, owner, {"peer": peer, "me": me}
        self._monitor: zmq.Socket[Any] = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
        self._lock = threading.Lock()
        self._causes: Counter[str] = Counter()
        self._running = threading.Event()
        self._running.set()
        self._thread = threading.Thread(target=self._run, name=f"worldtap-zmq-monitor-{owner}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        monitor = self._monitor
        try:
            while self._running.is_set():
                if not monitor.poll(50):
                    continue
                event: Any = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                cause = handshake_cause(event["event"], event["value"], server=self.server, **self._words)
                with self._lock:
                    self._causes[cause] += 1
                    first = self._causes[cause] == 1
                (_log.warning if first else _log.debug)(
                    "%s: a handshake on %s failed: %s", self.owner,
                    bytes(event["endpoint"]).decode(errors="replace"), cause)
        except zmq.ZMQError:  # the context is being destroyed
            return
        finally:
            monitor.close(linger=0)

    def causes(self) -> dict[str, int]:
        """Likely cause -> failed handshakes, so far."""
        with self._lock:
            return dict(self._causes)

    def describe(self) -> str:
        """``"; N CURVE handshake(s) failed (cause)"`` per cause, or ``""``: the tail of an
        error message that would otherwise only say who did not join."""
        return "".join(f"; {count} CURVE handshake(s) failed ({cause})"
                       for cause, count in sorted(self.causes().items()))

    def stop(self) -> None:
        """Stop watching and close the monitor socket. Idempotent."""
        self._running.clear()
        self._thread.join(5.0)


def hello_subscription(subscriber: str, max_message_size: int) -> bytes:
    """The subscription by which a :class:`broker.Subscriber` announces itself to publishers:
    ``SUBSCRIBER_HELLO + b"<id>/<max_message_size>"`` (its id keys its confirmations; the size
    is the largest message it accepts, which publishers then never exceed)."""
    return SUBSCRIBER_HELLO + f"{subscriber}/{max_message_size}".encode()


def _parse_hello(body: bytes) -> tuple[bytes, int | None]:
    """A hello's subscriber id and size limit (``None``: no limit, also for a size that is not
    a positive decimal int of at most 19 digits, which no message reaches)."""
    ident, _, size = body[len(SUBSCRIBER_HELLO):].partition(b"/")
    return ident, int(size) if size.isdigit() and len(size) <= 19 and int(size) > 0 else None


@dataclass(frozen=True, slots=True)
class PublisherStatistics:
    """A snapshot of a publisher's counters.

    Once the publisher is closed, ``published == messages + drops + failed``: every message
    that got a wire number was handed to ZeroMQ, dropped, or lost to an error, and each one
    that was not handed on leaves a hole in its stream's numbering that subscribers report as
    a :class:`broker.Gap`.

    Attributes:
        published: Messages accepted by the publisher (each got a wire number).
        messages: Messages handed to ZeroMQ.
        bytes: Bytes of those messages (topic, header and frames).
        drops: Messages not delivered: ``drop`` policy, a ``block`` send timeout, or larger
            than the message size limit (``oversized``).
        failed: Messages lost to an error (staging raised, the sender thread failed).
        oversized: Dropped messages larger than ``max_message_size`` or than the smallest
            ``max_message_size`` announced by a joined subscriber.
        peak_queue: Most messages staged and waiting for the sender thread at once.
        queued: Messages waiting for the sender thread now.
        subscribers: :class:`broker.Subscriber` instances joined and alive now.
        send_timeouts: ``block``-policy sends that timed out (no staging slot, or the socket).
        resent_run_ends: ``RunEnd`` messages sent again to subscribers that had not confirmed
            them (after they re-joined, or while ``close()`` waits). Not in ``messages``.
        closed: Whether ``close()`` was called.
        handshake_failures: Connections whose handshake failed (CURVE keys that do not match:
            such a peer never joins).
        handshake_causes: Their likely causes (:func:`handshake_cause`) -> count.
    """

    published: int
    messages: int
    bytes: int
    drops: int
    failed: int
    oversized: int
    peak_queue: int
    queued: int
    subscribers: int
    send_timeouts: int
    resent_run_ends: int
    closed: bool
    handshake_failures: int = 0
    handshake_causes: Mapping[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _PendingEnd:
    """A RunEnd the sender thread sent, and the subscribers that have not confirmed it yet."""

    header: bytes
    waiting: set[bytes] = field(default_factory=set)


class ZmqPublisher:
    """Forwards broker messages to ZeroMQ subscribers over an XPUB socket (``tcp://`` or ``ipc://``).

    Subscribe it to a :class:`broker.Broker` (``broker.subscribe("", pub)``). Each call copies
    the message's tensors once into a reusable staging slot (pinned host memory, a side stream
    and an event for CUDA tensors) and returns; a background thread sends the slot zero-copy.
    The caller may overwrite its tensors as soon as the call returns.

    Delivery: ``policy="block"`` (lossless) applies backpressure through XPUB_NODROP and the
    bounded ring; a message that cannot be handed on within ``send_timeout`` is lost and
    raises :class:`SendTimeoutError` (from the call that could not get a staging slot, or
    from the next call after the socket timed out), never a hang. ``policy="drop"`` never
    makes the caller wait: a full ring or a full subscriber queue drops the message and counts
    it. ``run/`` messages are never dropped by policy. Messages are numbered per
    ``(publisher, run, topic)`` on the wire before they are staged, so every message that is
    not handed to ZeroMQ leaves a hole that subscribers report as a :class:`broker.Gap`.
    In ``block`` policy a loss is never silent: it is counted in :meth:`statistics`, raised
    once from a call, and raised again by :meth:`close`.

    Message size: no message larger than ``max_message_size``, or than the smallest
    ``max_message_size`` a joined subscriber announced, is sent (ZeroMQ would drop the
    subscriber's connection, losing more than that message): it is counted as a drop
    (``oversized``), leaves a gap, and in ``block`` policy raises :class:`WireFormatError`
    (reason ``"too large"``) from the next call and from :meth:`close`.

    Subscribers: a :class:`broker.Subscriber` counts from its join (its topic subscriptions
    are in place) until it is gone: its connection closed, or silent for ``heartbeat``
    seconds (ZMTP heartbeats; a connecting publisher also drops the connection's queue then,
    ZeroMQ ``IMMEDIATE``, so a dead peer neither counts nor holds messages). Messages queued
    for a subscriber whose connection breaks are lost to it; it reports them as a gap if it
    comes back (same id) and sees later numbers of the stream.

    Through a ``worldtap-proxy`` (:class:`broker.proxy.Proxy`; connect to its frontend with
    ``bind=False``) the subscribers behind it join, count, announce their size limits and
    confirm run ends as if they were connected here, and backpressure reaches this publisher.
    While the proxy is down none of them counts; they re-join through the proxy that comes
    back, and what was in flight is lost to them (gaps).

    Run ends: a subscriber confirms each ``RunEnd`` it receives; :meth:`close` waits for the
    confirmations of every live subscriber (ZeroMQ discards what a peer has not read when the
    connection closes). A ``RunEnd`` that a subscriber has not confirmed is sent again when
    that subscriber re-joins, and every second while :meth:`close` waits, so a run's end (and
    the tail losses its per-topic counts reveal) survives a broken connection; subscribers
    skip the copies they already have.

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
        curve: CURVE server keys and the subscribers' allow-list; or, for a publisher that
            connects to a ``worldtap-proxy`` whose frontend is encrypted, client keys and the
            proxy's public key (:class:`broker.CurveClient`); ``None`` for plain text.
        hwm: ZeroMQ send high-water mark (messages queued per subscriber).
        name: Consumer name shown by the broker.
        max_message_size: Largest message (topic, header and frames, in bytes) this publisher
            sends; ``None``: only the subscribers' announced limits apply.
        heartbeat: Seconds without a sign of life (ZMTP heartbeats) after which a peer's
            connection is dropped and its subscribers stop counting; ``None``: only closed
            connections end a subscription. :class:`broker.Subscriber` pings at least every
            second, so only a stalled process or host trips it.
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
        curve: CurveServer | CurveClient | None = None,
        hwm: int = 64,
        name: str | None = None,
        max_message_size: int | None = None,
        heartbeat: float | None = 10.0,
    ) -> None:
        if policy not in ("block", "drop"):
            raise ValueError(f"policy: expected 'block' or 'drop', got {policy!r}")
        if not send_timeout > 0:
            raise ValueError(f"send_timeout: expected a positive number of seconds, got {send_timeout!r}")
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if isinstance(topics, str) or not all(isinstance(t, str) for t in topics):
            raise TypeError(f"topics: expected a sequence of str prefixes, got {topics!r}")
        if max_message_size is not None and (isinstance(max_message_size, bool) or not isinstance(
                max_message_size, int) or max_message_size <= 0):
            raise ValueError(f"max_message_size: expected a positive int or None, got {max_message_size!r}")
        if heartbeat is not None and not 0.1 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat: expected None or seconds in [0.1, 3600], got {heartbeat!r}")
        requested = [endpoint] if isinstance(endpoint, str) else list(endpoint)
        self.id = uuid.uuid4().hex[:16]
        self.name = name or f"ZmqPublisher({', '.join(requested)})"
        self.policy: Policy = policy
        self.send_timeout = float(send_timeout)
        self.topics = tuple(topics)
        self.max_message_size = max_message_size
        # run -> topic -> next wire number; kept after RunEnd, so a run id used again by this
        # publisher continues its streams (subscribers reject numbers they have seen).
        self._numbers: dict[str, dict[str, int]] = {}
        self._headers = HeaderCache()  # each message shape's header is encoded once
        self._runs: dict[str, tuple[RunStart | None, int, int]] = {}
        self._queue: collections.deque[Staged] = collections.deque()
        self._cond = threading.Condition()
        from .staging import StagingRing

        self._ring = StagingRing(slots, self._cond)
        # Guarded by _cond: live subscribers (id -> announced max_message_size), every id ever
        # joined, RunEnds awaiting confirmation, and errors waiting to be raised.
        self._subscribers: dict[bytes, int | None] = {}
        self._known: set[bytes] = set()
        self._ends: dict[str, _PendingEnd] = {}
        self._errors: list[BrokerError] = []
        self._limit = max_message_size  # the smallest limit in force (sender thread)
        self._resend: set[str] = set()  # runs whose RunEnd to send again (sender thread)
        # Each counter is written by one thread only: the simulation thread...
        self._published = self._ring_drops = self._ring_timeouts = self._failed_here = self._peak = 0
        # ... and the sender thread.
        self._sent = self._bytes = self._send_drops = self._timeouts = self._oversized = 0
        self._failed_sender = self._resent = 0
        self._closed = self._closing = self._done = False
        self._close_deadline = 0.0
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._auth: Any = None
        self.endpoints: tuple[str, ...] = ()
        self._handshakes: HandshakeWatch | None = None  # failed handshakes, by cause
        try:  # whatever fails below, the context and its threads are let go
            if isinstance(curve, CurveServer):
                self._auth = curve.start_authenticator(self._ctx)
            self._socket = self._open(requested, bind, curve, hwm, heartbeat)
        except BaseException:
            self._teardown(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name=f"worldtap-zmq-pub-{self.id}", daemon=True)
        self._thread.start()

    def _open(self, endpoints: list[str], bind: bool, curve: CurveServer | CurveClient | None, hwm: int,
              heartbeat: float | None) -> zmq.Socket[Any]:
        with translate_zmq_errors("create XPUB socket"):
            sock: zmq.Socket[Any] = self._ctx.socket(zmq.XPUB)
        # NODROP in both policies: a full subscriber queue must be seen (EAGAIN) to be counted.
        # MAXMSGSIZE: the only inbound traffic is subscriptions. IMMEDIATE: a connecting socket
        # otherwise keeps a broken connection's queue, and the subscriptions of whoever was at
        # the other end, across reconnects (a dead subscriber would count, and be waited for,
        # forever); with it, the queue is dropped and XPUB reports the unsubscriptions.
        options = [(zmq.LINGER, 0), (zmq.XPUB_NODROP, 1), (zmq.SNDHWM, hwm), (zmq.MAXMSGSIZE, 4096),
                   (zmq.SNDTIMEO, int(self.send_timeout * 1000)), (zmq.IMMEDIATE, 1)]
        if heartbeat is not None:
            options += [(zmq.HEARTBEAT_IVL, max(int(heartbeat * 100), 50)),
                        (zmq.HEARTBEAT_TIMEOUT, int(heartbeat * 1000))]
        for option, value in options:
            sock.setsockopt(option, value)
        sock.copy_threshold = _COPY_THRESHOLD
        if curve is not None:
            curve.apply(sock)
        self._handshakes = HandshakeWatch(sock, server=not isinstance(curve, CurveClient), owner=self.name)
        self.endpoints = attach(sock, endpoints, bind=bind, encrypted=curve is not None, owner=self.name)
        return sock

    # -- simulation thread -----------------------------------------------------------------

    def __call__(self, message: Message) -> None:
        """Stage ``message`` for sending (the broker consumer entry point).

        Errors about earlier messages (lost on the socket, too large, a failed sender thread)
        are raised once, from the next call, after that call's own message was staged: a
        caller that carries on (a non-strict broker) loses nothing more than what the error
        reports, and every message it lost is numbered, so subscribers see its gap.

        Raises:
            BrokerClosedError: The publisher was closed.
            SendTimeoutError: ``block`` policy: no staging slot freed up within ``send_timeout``
                (this message is lost), or earlier messages timed out on the socket (this one
                was staged; :meth:`close` raises again).
            TransportError: The sender thread failed.
            WireFormatError: The message cannot be encoded, or receivers would reject it (a
                field without one row per world, a negative seq, ...): it is not sent and
                takes no number, so subscribers see no gap for it; or
                (``block`` policy, reason ``"too large"``) an earlier message exceeded the
                message size limit.
        """
        topic = message.topic
        if self._closed:
            raise BrokerClosedError(f"{self.name}: publish on topic {topic!r} after close()")
        if topic.startswith("run/") or topic.startswith(self.topics):
            self._forward(message)
        self._raise_pending()

    def _forward(self, message: Message) -> None:
        topic, run = message.topic, message.run
        own, fields = message_tensors(message)
        counters = self._numbers.setdefault(run, {})
        number = counters.get(topic, 0)
        streams = ({t: c for t, c in counters.items() if t != TOPIC_RUN_END}
                   if isinstance(message, RunEnd) else None)
        header = self._headers.header(message, own, fields, publisher=self.id, number=number, streams=streams)
        # From here on the message has a wire number: it is sent, dropped or failed, and counted.
        counters[topic] = number + 1
        self._published += 1
        if isinstance(message, RunEnd):
            self._runs.pop(run, None)
        else:
            start = message if isinstance(message, RunStart) else self._runs.get(run, (None, 0, 0))[0]
            self._runs[run] = (start, message.seq, message.step)
        control = topic.startswith("run/")
        tensors = own + fields
        slot: Slot | None = None
        views: list[memoryview] = []
        event: Any = None
        if tensors:
            try:
                slot = self._acquire(control, topic)
            except SendTimeoutError:
                self._ring_drops += 1
                self._ring_timeouts += 1
                raise
            except BaseException:
                self._failed_here += 1
                raise
            if slot is None:
                self._ring_drops += 1
                return
            try:
                layout, event = self._ring.stage(slot, [t for _, t in tensors])
                views, packed = slot.frames(layout)
                if not packed:  # not laid out as one data frame: protocol 1
                    header = self._headers.header(message, own, fields, publisher=self.id, number=number,
                                                  version=1)
            except BaseException:
                try:
                    if event is not None:  # the slot's staging copies may still be in flight
                        event.synchronize()
                finally:
                    self._ring.release(slot, None)
                    self._failed_here += 1
                raise
        from .staging import Staged

        item = Staged(topic.encode(), run, header, slot, views, event, control)
        with self._cond:
            if self._done:  # the sender thread has stopped: nobody would send it
                self._failed_here += 1
                if slot is not None:
                    slot.busy = False
                raise TransportError(f"{self.name}: the sender thread has stopped; a message on topic "
                                     f"{topic!r} was not sent")
            self._queue.append(item)
            self._peak = max(self._peak, len(self._queue))
            self._cond.notify()

    def _acquire(self, control: bool, topic: str) -> Slot | None:
        """The next ring slot, or ``None`` (drop) when it is busy and dropping is allowed."""
        wait = self.policy == "block" or control
        slot = self._ring.acquire(wait, self.send_timeout)
        if slot is None and self._done:
            raise TransportError(f"{self.name}: the sender thread has stopped; a message on topic "
                                 f"{topic!r} was not sent")
        if slot is None and wait:
            raise SendTimeoutError(
                f"{self.name}: no staging slot freed within send_timeout={self.send_timeout} s for "
                f"topic {topic!r}; a subscriber of {', '.join(self.endpoints)} is too slow or gone "
                f"(message lost)")
        return slot

    def _fail(self, error: BrokerError) -> None:
        """Keep ``error`` to raise from the next call (or close()); earlier ones are kept too."""
        with self._cond:
            self._errors.append(error)

    def _take_errors(self) -> BrokerError | None:
        """The first pending error, noting the others on it (none is lost), or ``None``."""
        with self._cond:
            errors, self._errors = self._errors, []
        if not errors:
            return None
        first = errors[0]
        for other in errors[1:4]:
            first.add_note(f"also: {other}")
        if len(errors) > 4:
            first.add_note(f"... and {len(errors) - 4} more error(s)")
        return first

    def _raise_pending(self) -> None:
        error = self._take_errors()
        if error is not None:
            raise error
        if self._done and not self._closed:
            raise TransportError(f"{self.name}: the sender thread has stopped")

    # -- sender thread ---------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._socket
        item: Staged | None = None
        broken = False
        try:
            while True:
                with self._cond:
                    if not self._queue and not self._closing:
                        self._cond.wait(_IDLE_POLL)
                    item = self._queue.popleft() if self._queue else None
                    if item is None and self._closing:
                        break
                self._read_subscriptions(sock)
                if self._resend:
                    self._send_run_ends(sock, self._resend)
                if item is not None:
                    self._send(sock, item)
                    item = None
        except Exception as exc:
            broken = True
            _log.exception("%s: sender thread failed", self.name)
            if item is not None:  # its wire number is taken: a hole subscribers report
                self._failed_sender += 1
                if item.slot is not None:
                    self._ring.release(item.slot, None)
            error = TransportError(f"{self.name}: sender thread failed: {exc!r}")
            error.__cause__ = exc
            self._fail(error)
        finally:
            linger = 0.0
            if self._closing and not broken:
                try:
                    self._finish(sock)
                except zmq.ZMQError as exc:
                    error = TransportError(f"{self.name}: close() failed: {exc!r}")
                    error.__cause__ = exc
                    self._fail(error)
                linger = max(self._close_deadline - time.monotonic(), 0.0)
            sock.close(linger=int(linger * 1000))
            with self._cond:
                self._done = True
                for left in self._queue:  # never sent: their numbers are holes
                    self._failed_sender += 1
                    if left.slot is not None:
                        left.slot.busy = False
                self._queue.clear()
            self._ring.close()

    def _finish(self, sock: zmq.Socket[Any]) -> None:
        """close(): wait until ZeroMQ has sent every slot and each live subscriber has confirmed
        every RunEnd sent to it (disconnecting drops what a subscriber has not read yet)."""
        # Zero-copy messages are tracked: an undelivered one is an error.
        if not self._released(self._close_deadline):
            self._fail(SendTimeoutError(
                f"{self.name}: close() could not deliver every message within its timeout; "
                f"a subscriber of {', '.join(self.endpoints)} is too slow or gone"))
        resent = time.monotonic()
        while (awaited := self._awaited_runs()) and time.monotonic() < self._close_deadline:
            if sock.poll(20, zmq.POLLIN):
                self._read_subscriptions(sock)
            if time.monotonic() - resent >= _RESEND_INTERVAL:  # a copy may have been lost on the way
                self._resend.update(awaited)
                resent = time.monotonic()
            if self._resend:
                self._send_run_ends(sock, self._resend)
        if self._awaited_runs():
            self._fail(SendTimeoutError(
                f"{self.name}: close(): a subscriber of {', '.join(self.endpoints)} did not confirm "
                f"the end of run(s) {sorted(self._awaited_runs())} within the timeout; it is too "
                f"slow or gone"))

    def _read_subscriptions(self, sock: zmq.Socket[Any]) -> None:
        while int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event: bytes = sock.recv(zmq.NOBLOCK)
            subscribe, body = event[:1] == b"\x01", event[1:]
            if body.startswith(SUBSCRIBER_HELLO):
                ident, limit = _parse_hello(body)
                with self._cond:
                    if not subscribe:
                        self._subscribers.pop(ident, None)
                    else:
                        if ident in self._known and ident not in self._subscribers:  # it is back
                            self._resend.update(r for r, end in self._ends.items() if ident in end.waiting)
                        self._subscribers[ident] = limit
                        self._known.add(ident)
                    limits = [n for n in self._subscribers.values() if n is not None]
                    if self.max_message_size is not None:
                        limits.append(self.max_message_size)
                    self._limit = min(limits, default=None)
                    self._cond.notify_all()
            elif subscribe and body.startswith(SUBSCRIBER_ACK):
                pub, _, rest = body[len(SUBSCRIBER_ACK):].decode(errors="replace").partition("/")
                run, _, sub = rest.rpartition("/")
                if pub == self.id:
                    with self._cond:
                        end = self._ends.get(run)
                        if end is not None:
                            end.waiting.discard(sub.encode())
                            if not end.waiting:
                                del self._ends[run]
                        self._cond.notify_all()

    def _awaited_runs(self) -> set[str]:
        """Runs whose RunEnd a live subscriber has not confirmed yet."""
        with self._cond:
            live = self._subscribers.keys()
            return {run for run, end in self._ends.items() if not end.waiting.isdisjoint(live)}

    def _send_run_ends(self, sock: zmq.Socket[Any], runs: set[str]) -> None:
        """Send the RunEnd of ``runs`` again (never blocking: a full queue means the subscriber
        has not read the first copy yet); those not sent stay in ``runs``."""
        for run in sorted(runs):
            with self._cond:
                end = self._ends.get(run)
            if end is not None:
                try:
                    with translate_zmq_errors(f"send on {', '.join(self.endpoints)}"):
                        sock.send_multipart([_TOPIC_RUN_END, end.header], zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._resent += 1
            runs.discard(run)

    def _send(self, sock: zmq.Socket[Any], item: Staged) -> None:
        slot = item.slot
        if item.event is not None:  # the slot's staging copy is done (also before a drop: the
            item.event.synchronize()  # slot may next be written by the host)
        limit = self._limit
        if limit is not None and item.nbytes > limit:
            self._send_drops += 1
            self._oversized += 1
            if self.policy == "block":
                self._fail(WireFormatError(
                    "too large", f"{self.name}: a message of {item.nbytes} bytes on topic "
                                 f"{item.topic.decode()!r} exceeds max_message_size={limit} (this "
                                 f"publisher's or a subscriber's); not sent (message lost)"))
            if slot is not None:
                self._ring.release(slot, None)
            return
        frames: list[Any] = [item.topic, item.header]
        trackers: list[zmq.Frame] = []
        if slot is not None:
            # Frames at or above the copy threshold go zero-copy out of the slot; ZeroMQ
            # releases the parts of a message in order, so tracking the last one covers all.
            views = item.frames
            frames += views
            last = max((i for i, view in enumerate(views) if view.nbytes >= _COPY_THRESHOLD), default=-1)
            if last >= 0:
                frames[2 + last] = zmq.Frame(frames[2 + last], track=True)
                trackers.append(frames[2 + last])
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
                limit_text = "the close() timeout" if self._closing else f"send_timeout={self.send_timeout} s"
                self._fail(SendTimeoutError(
                    f"{self.name}: a message on topic {item.topic.decode()!r} could not be sent within "
                    f"{limit_text}; a subscriber of {', '.join(self.endpoints)} "
                    f"is too slow or gone (message lost)"))
            trackers = []
        else:
            self._sent += 1
            self._bytes += item.nbytes
        if item.topic == _TOPIC_RUN_END:  # sent, or to be sent again: subscribers confirm it
            with self._cond:
                self._ends[item.run] = _PendingEnd(item.header, set(self._known))
                while len(self._ends) > _MAX_PENDING_ENDS:
                    del self._ends[next(iter(self._ends))]
        if slot is not None:
            self._ring.release(slot, zmq.MessageTracker(*trackers) if trackers else None)

    # -- control ---------------------------------------------------------------------------

    def wait_for_subscribers(self, n: int = 1, timeout: float = 10.0) -> None:
        """Block until ``n`` live :class:`broker.Subscriber` instances have joined (their topic
        subscriptions are in place), so nothing published afterwards is lost to the slow joiner.
        Subscribers that have gone away do not count.

        Raises:
            SubscriberTimeoutError: Fewer than ``n`` were joined within ``timeout`` seconds; the
                message counts the handshakes that failed meanwhile, by likely cause (a
                subscriber whose key is not on the allow-list never joins).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._subscribers) < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._done:
                    failed = self._handshakes.describe() if self._handshakes is not None else ""
                    raise SubscriberTimeoutError(
                        f"wait_for_subscribers: expected {n} subscriber(s) on "
                        f"{', '.join(self.endpoints)} within {timeout} s, {len(self._subscribers)} "
                        f"joined{failed}")
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
            tracker = slot.tracker
            if tracker is not None:
                try:
                    tracker.wait(max(deadline - time.monotonic(), 0.0))
                except zmq.NotDone:
                    return False
        return True

    def statistics(self) -> PublisherStatistics:
        """A frozen snapshot of the counters."""
        with self._cond:
            queued, subscribers = len(self._queue), len(self._subscribers)
        handshakes = self._handshakes.causes() if self._handshakes is not None else {}
        return PublisherStatistics(
            published=self._published, messages=self._sent, bytes=self._bytes,
            drops=self._ring_drops + self._send_drops, failed=self._failed_here + self._failed_sender,
            oversized=self._oversized, peak_queue=self._peak, queued=queued, subscribers=subscribers,
            send_timeouts=self._ring_timeouts + self._timeouts, resent_run_ends=self._resent,
            closed=self._closed, handshake_failures=sum(handshakes.values()),
            handshake_causes=MappingProxyType(handshakes))

    def close(self, timeout: float | None = None) -> None:
        """Deliver everything already published, send ``RunEnd`` for every run that has not sent
        one, wait until every live subscriber has confirmed each ``RunEnd``, and close the
        sockets. Idempotent.

        Args:
            timeout: Seconds allowed for the flush (default ``send_timeout``).

        Raises:
            SendTimeoutError: ``block`` policy: messages were lost to send timeouts during the
                publisher's life (even if already raised once), or could not be delivered (or
                confirmed) in time now. The publisher is closed anyway.
            WireFormatError: ``block`` policy, reason ``"too large"``: messages over the message
                size limit were dropped, and nothing else was lost.
            TransportError: The sender thread failed (either policy).
        """
        if self._closed:
            return
        self._closed = True
        if not self._done:
            for run, (start, seq, step) in list(self._runs.items()):
                info = start or RunStart(run, 0, step, 0, "")
                try:
                    # The run's own RunEnd never came: it ends here, before its publisher meant it to.
                    self._forward(RunEnd(run, seq + 1, step, info.num_worlds, info.device, info.schema,
                                         info.metadata, variations=info.variations, seed=info.seed,
                                         wall_time=time.time(), interrupted=True))
                except BrokerError as exc:
                    self._fail(exc)
        flush = self.send_timeout if timeout is None else timeout
        with self._cond:
            self._close_deadline = time.monotonic() + flush
            self._closing = True
            self._cond.notify_all()
        self._thread.join(flush + 5.0)
        self._teardown(linger=None if not self._thread.is_alive() else 0)
        error = self._close_error()
        if error is not None:
            raise error

    def _close_error(self) -> BrokerError | None:
        """What close() raises: pending errors first; in ``block`` policy any loss at all."""
        error = self._take_errors()
        if self.policy == "drop":  # drops are expected there; a broken sender is not
            return error if isinstance(error, TransportError) else None
        stats = self.statistics()
        lost = stats.drops + stats.failed
        if not lost:
            return error
        summary = (f"{self.name}: {lost} of {stats.published} message(s) were lost ({stats.send_timeouts} "
                   f"send timeout(s), {stats.oversized} over the message size limit, {stats.failed} "
                   f"failed); subscribers report them as gaps")
        if error is not None:
            error.add_note(summary)
            return error
        if stats.send_timeouts:
            return SendTimeoutError(summary)
        if stats.oversized:
            return WireFormatError("too large", summary)
        return TransportError(summary)

    def _teardown(self, linger: int | None) -> None:
        if self._handshakes is not None:
            self._handshakes.stop()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.destroy(linger=0) if linger == 0 else self._ctx.term()

    def __enter__(self) -> ZmqPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
