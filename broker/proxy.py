"""``worldtap-proxy``: many publishers and many subscribers meet at one ZeroMQ forwarder.

Publishers connect to the proxy's *frontend* (an XSUB socket), storage daemons and tools to its
*backend* (an XPUB socket); libzmq's steerable proxy (:func:`zmq.proxy_steerable`) forwards
messages downstream and subscriptions upstream, on a thread of its own. Everything the
publishers rely on travels through it unchanged:

- every subscription and unsubscription of every subscriber (``XPUB_VERBOSER``): a
  subscriber's join (its topics, then its hello with its id and ``max_message_size``), its
  ``RunEnd`` confirmations and its leave reach every publisher, so ``wait_for_subscribers``
  counts the live subscribers behind the proxy, ``close()`` waits for their confirmations, and
  publishers never send a message larger than the smallest limit announced behind it; a
  publisher that connects later is sent the subscriptions in place (XSUB);
- backpressure (``XPUB_NODROP``): the proxy waits for a subscriber whose queue is full and
  stops reading from the publishers, whose lossless sends then wait in turn; nothing is dropped
  on the way;
- liveness: a subscriber from which nothing (not even a ZMTP heartbeat) came for ``heartbeat``
  seconds is dropped, and stops counting at every publisher; the proxy pings publishers and
  subscribers, even while backpressure keeps it from reading, so they keep counting it.

What a proxy restart costs: the messages inside it (up to ``hwm`` per publisher and per
subscriber, and what the sockets' buffers held) and those published while it is down are lost;
subscribers report them as gaps. Publishers and subscribers reconnect by themselves, runs go
on, and every subscriber re-joins (a ``RunEnd`` it had not confirmed is sent to it again).

Usage::

    worldtap-proxy [--frontend ENDPOINT]... [--backend ENDPOINT]... [--curve-keys FILE]
                   [--curve-publishers DIR] [--curve-subscribers DIR] [--hwm N]
                   [--heartbeat SECONDS] [--status-interval SECONDS]

prints ``worldtap-proxy ready: frontend=... backend=...`` on stderr once both sides are bound,
then a status line every ``--status-interval`` seconds; SIGINT and SIGTERM stop it. A peer
whose CURVE handshake fails (its key is not on the side's allow-list, CURVE on one end only, the
wrong server key) is logged with its likely cause the first time, and counted per side in the
status lines (``backend_handshakes_failed=N``) and :attr:`ProxyStatistics.handshake_failures`;
the proxy serves the others.

Exit codes (every error is one line on stderr): 0 stopped by SIGINT/SIGTERM; 1 an unexpected
error (the forwarding thread failed); 2 usage error (a bad option, a missing ipc folder, a
missing or malformed key file); 5 transport: an endpoint cannot be bound (address in use, ...)
or libzmq is older than 4.3.5.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final

import zmq

from .allocator import apply_malloc_choice
from .errors import (
    BrokerClosedError,
    BrokerError,
    SecurityError,
    SendTimeoutError,
    TransportError,
    translate_zmq_errors,
)
from .security import CurveServer, attach, load_keypair, load_public_keys
from .zmq_publisher import HandshakeWatch

__all__ = ["DEFAULT_BACKEND", "DEFAULT_FRONTEND", "Proxy", "ProxyStatistics", "main"]

_log = logging.getLogger("worldtap.broker.proxy")

DEFAULT_FRONTEND: Final = "tcp://127.0.0.1:5550"
"""Where publishers connect (loopback only: reaching other hosts is an explicit choice)."""
DEFAULT_BACKEND: Final = "tcp://127.0.0.1:5551"
"""Where subscribers connect."""
_LIBZMQ: Final = (4, 3, 5)  # STATISTICS, and a reply to every control command
# libzmq 4.3.5 swaps the meaning of the PAUSE and RESUME control commands.
_PAUSE, _RESUME = (b"RESUME", b"PAUSE") if zmq.zmq_version_info() == (4, 3, 5) else (b"PAUSE", b"RESUME")


@dataclass(frozen=True, slots=True)
class ProxyStatistics:
    """A snapshot of a proxy's counters (libzmq counts message frames, not messages).

    Attributes:
        frames_in: Frames received from publishers.
        bytes_in: Bytes of those frames.
        frames_out: Frames handed to the subscribers' socket (once, whatever their number).
        bytes_out: Bytes of those frames.
        subscriptions_in: Subscriptions and unsubscriptions received from subscribers.
        subscriptions_out: Subscriptions and unsubscriptions forwarded to publishers.
        paused: Whether forwarding is paused.
        handshake_failures: Peers whose handshake failed, by side (``frontend``: publishers,
            ``backend``: subscribers) and likely cause (a key not on the side's allow-list, CURVE
            on one end only, the wrong server key); such a peer is never connected.
    """

    frames_in: int
    bytes_in: int
    frames_out: int
    bytes_out: int
    subscriptions_in: int
    subscriptions_out: int
    paused: bool
    handshake_failures: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def _heartbeat_options(heartbeat: float | None, *, timeout: bool) -> list[tuple[int, int]]:
    """Ping every ``heartbeat / 5`` s (at most 1 s apart); with ``timeout``, drop a peer from
    which nothing came for ``heartbeat`` s."""
    if heartbeat is None:
        return []
    ms = int(heartbeat * 1000)
    return [(zmq.HEARTBEAT_IVL, max(50, min(1000, ms // 5))), (zmq.HEARTBEAT_TIMEOUT, ms if timeout else 0)]


class Proxy:
    """An XSUB/XPUB forwarder between publishers (frontend) and subscribers (backend).

    Publishers connect with ``ZmqPublisher(frontend, bind=False)``, subscribers with
    ``Subscriber(backend)``; see the module documentation for what travels through. Forwarding
    runs on a background thread from :meth:`start` until :meth:`close`; :meth:`pause` holds
    messages and subscriptions in the proxy's queues (publishers then wait, lossless) until
    :meth:`resume`.

    CURVE: ``frontend_curve`` makes the frontend a CURVE server whose allow-list holds the
    publishers' public keys (publishers pass ``curve=CurveClient(keys, server_public=<the
    proxy's public key>)``); ``backend_curve`` does the same for the subscribers. Either side
    may be encrypted alone.

    Args:
        frontend: Endpoint(s) to bind for publishers; ``tcp://127.0.0.1:*`` binds a free port
            (see :attr:`frontend_endpoints`).
        backend: Endpoint(s) to bind for subscribers (see :attr:`backend_endpoints`).
        frontend_curve: CURVE server keys and the publishers' allow-list; ``None``: plain text.
        backend_curve: CURVE server keys and the subscribers' allow-list; ``None``: plain text.
        hwm: Messages queued per publisher (inbound) and per subscriber (outbound) before
            backpressure applies; the memory the proxy holds is about ``hwm`` x message size
            per peer.
        heartbeat: Seconds of silence after which a subscriber's connection is dropped (its
            subscriptions with it); ``None``: only closed connections count. Subscribers must
            send something more often: a :class:`broker.Subscriber` pings every fifth of its
            own ``heartbeat``, at most 1 s apart, so keep this above 2 s for them.
        name: Shown in logs and errors.

    Raises:
        ValueError: A bad ``hwm`` or ``heartbeat``.
        TypeError: An endpoint that is not a string.
        TransportError: libzmq is older than 4.3.5.
    """

    def __init__(
        self,
        frontend: str | Sequence[str] = DEFAULT_FRONTEND,
        backend: str | Sequence[str] = DEFAULT_BACKEND,
        *,
        frontend_curve: CurveServer | None = None,
        backend_curve: CurveServer | None = None,
        hwm: int = 16,
        heartbeat: float | None = 10.0,
        name: str | None = None,
    ) -> None:
        sides = {"frontend": frontend, "backend": backend}
        self._requested = {k: [v] if isinstance(v, str) else list(v) for k, v in sides.items()}
        for side, endpoints in self._requested.items():
            if not endpoints or not all(isinstance(e, str) for e in endpoints):
                raise TypeError(f"{side}: expected an endpoint or a sequence of endpoints, got {sides[side]!r}")
        if isinstance(hwm, bool) or not isinstance(hwm, int) or hwm < 1:
            raise ValueError(f"hwm: expected a positive int, got {hwm!r}")
        if heartbeat is not None and not 0.1 <= heartbeat <= 3600:
            raise ValueError(f"heartbeat: expected None or seconds in [0.1, 3600], got {heartbeat!r}")
        if zmq.zmq_version_info() < _LIBZMQ:
            raise TransportError(f"Proxy needs libzmq >= 4.3.5 (its proxy's control commands); this "
                                 f"pyzmq uses libzmq {zmq.zmq_version()}")
        self.name = name or "Proxy"
        self.hwm = hwm
        self.heartbeat = heartbeat
        self._curve = {"frontend": frontend_curve, "backend": backend_curve}
        self.frontend_endpoints: tuple[str, ...] = ()
        self.backend_endpoints: tuple[str, ...] = ()
        self._lock = threading.Lock()  # the control socket, and the state below
        self._started = self._closed = self._paused = False
        self._error: TransportError | None = None
        self._contexts: list[zmq.Context[Any]] = []
        self._auths: list[Any] = []
        self._handshakes: dict[str, HandshakeWatch] = {}  # side -> its failed handshakes
        self._control: zmq.Socket[Any] | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------------

    def start(self) -> Proxy:
        """Bind both sides and start forwarding on a background thread.

        Returns:
            This proxy.

        Raises:
            BrokerClosedError: It was closed, or started already.
            TransportError: An endpoint could not be bound (the proxy is closed again).
        """
        with self._lock:
            if self._started or self._closed:
                raise BrokerClosedError(f"{self.name}: start() twice or after close()")
            self._started = True
        try:
            sockets = self._open()
        except BaseException:
            self._teardown()
            with self._lock:
                self._closed = True
            raise
        self._thread = threading.Thread(target=self._forward, args=sockets,
                                        name=f"worldtap-proxy-{id(self):x}", daemon=True)
        self._thread.start()
        return self

    def _open(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any], zmq.Socket[Any]]:
        # One context per side: each CURVE side has its own authenticator and allow-list.
        front_ctx, back_ctx = zmq.Context(), zmq.Context()
        self._contexts = [front_ctx, back_ctx]
        made: list[zmq.Socket[Any]] = []
        try:
            # Publishers are pinged but never timed out: under backpressure the proxy reads
            # nothing from them, not even their pings (they time out a proxy that is gone).
            made.append(self._side(front_ctx, "frontend", zmq.XSUB, [
                (zmq.RCVHWM, self.hwm), *_heartbeat_options(self.heartbeat, timeout=False)]))
            # VERBOSER: every (un)subscription of every subscriber goes upstream (XSUB counts
            # them per topic, so a topic is unsubscribed upstream when its last subscriber
            # leaves). NODROP: a full subscriber queue holds the proxy back, never a drop.
            # MAXMSGSIZE: the only inbound traffic is subscriptions.
            made.append(self._side(back_ctx, "backend", zmq.XPUB,
                                   [(zmq.SNDHWM, self.hwm), (zmq.XPUB_VERBOSER, 1), (zmq.XPUB_NODROP, 1),
                                    (zmq.MAXMSGSIZE, 4096), *_heartbeat_options(self.heartbeat, timeout=True)]))
            where = f"inproc://worldtap-proxy-{uuid.uuid4().hex}"
            with translate_zmq_errors(f"{self.name}: control socket"):
                made.append(back_ctx.socket(zmq.REP))
                made[-1].bind(where)
                client: zmq.Socket[Any] = back_ctx.socket(zmq.REQ)
                self._control = client
                # RELAXED + CORRELATE: a request whose reply timed out does not block the next
                # one, and its late reply is discarded.
                for option, value in ((zmq.LINGER, 0), (zmq.REQ_RELAXED, 1), (zmq.REQ_CORRELATE, 1)):
                    client.setsockopt(option, value)
                client.connect(where)
        except BaseException:
            for sock in made:
                sock.close(linger=0)
            raise
        return made[0], made[1], made[2]

    def _side(self, ctx: zmq.Context[Any], side: str, kind: int, options: list[tuple[int, int]]) -> zmq.Socket[Any]:
        curve = self._curve[side]
        if curve is not None:
            self._auths.append(curve.start_authenticator(ctx))
        with translate_zmq_errors(f"{self.name}: create the {side} socket"):
            sock: zmq.Socket[Any] = ctx.socket(kind)
        try:
            for option, value in [(zmq.LINGER, 0), *options]:
                sock.setsockopt(option, value)
            if curve is not None:
                curve.apply(sock)
        except BaseException:
            sock.close(linger=0)
            raise
        self._handshakes[side] = HandshakeWatch(
            sock, server=True, owner=f"{self.name} {side}", me="proxy",
            peer="publisher" if side == "frontend" else "subscriber")
        try:
            bound = attach(sock, self._requested[side], bind=True, encrypted=curve is not None,
                           owner=f"{self.name} {side}")
        except TransportError as exc:
            raise TransportError(f"{side}: {exc}") from exc.__cause__
        if side == "frontend":
            self.frontend_endpoints = bound
        else:
            self.backend_endpoints = bound
        return sock

    def _forward(self, front: zmq.Socket[Any], back: zmq.Socket[Any], control: zmq.Socket[Any]) -> None:
        try:
            zmq.proxy_steerable(front, back, None, control)
        except zmq.ContextTerminated:  # close() stopped a proxy that backpressure held
            pass
        except zmq.ZMQError as exc:
            _log.error("%s: forwarding failed: %s", self.name, exc)
            self._error = TransportError(f"{self.name}: forwarding failed: {exc} (errno {exc.errno})")
            self._error.__cause__ = exc
        finally:
            for sock in (front, back, control):
                sock.close(linger=0)

    @property
    def running(self) -> bool:
        """Whether the forwarding thread runs (started, not closed, not failed)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def error(self) -> TransportError | None:
        """Why forwarding stopped on its own, or ``None``."""
        return self._error

    def close(self, timeout: float = 5.0) -> None:
        """Stop forwarding and close the sockets. Messages inside the proxy are lost (subscribers
        report them as gaps). Idempotent.

        A proxy held back by a subscriber that does not read (backpressure) takes commands only
        once that subscriber reads or is dropped (``heartbeat``); after ``timeout`` seconds its
        sockets are closed under it, and the message it was forwarding is lost too.

        Args:
            timeout: Seconds to wait for the forwarding thread to stop, before and after its
                sockets are closed under it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._thread is not None:
            with contextlib.suppress(BrokerError):  # held back (see above), or stopped already
                self._command(b"TERMINATE", timeout, closing=True)
            self._thread.join(timeout)
        self._teardown(timeout)

    def _teardown(self, timeout: float = 0.0) -> None:
        if self._control is not None:
            self._control.close(linger=0)
            self._control = None
        for auth in self._auths:
            auth.stop()
        self._auths = []
        for watch in self._handshakes.values():
            watch.stop()
        held = self._thread is not None and self._thread.is_alive()
        if held:
            _log.warning("%s: forwarding is held back by a subscriber that does not read; closing "
                         "its sockets under it (the message in flight is lost)", self.name)
        for ctx in self._contexts:
            if held:  # the blocked send fails with ETERM; term() returns once the peer is gone
                threading.Thread(target=ctx.term, name="worldtap-proxy-term", daemon=True).start()
            else:
                ctx.term()
        self._contexts = []
        if held and self._thread is not None:
            self._thread.join(timeout)

    # -- control ---------------------------------------------------------------------------

    def _command(self, command: bytes, timeout: float, *, closing: bool = False) -> list[bytes]:
        """Send a control command and return its reply (libzmq >= 4.3.5 answers every one).

        Raises:
            BrokerClosedError: Not started, closed, or forwarding stopped.
            SendTimeoutError: No reply within ``timeout``: the proxy is held back by a subscriber
                that does not read (backpressure).
        """
        with self._lock:
            control = self._control
            if control is None or (self._closed and not closing) or not self.running:
                why = f": {self._error}" if self._error is not None else ""
                raise BrokerClosedError(f"{self.name}: not forwarding (not started, or closed){why}")
            with translate_zmq_errors(f"{self.name}: control"):
                control.send(command)
                if not control.poll(int(timeout * 1000)):
                    raise SendTimeoutError(
                        f"{self.name}: no answer to {command.decode()} within {timeout} s: forwarding is "
                        f"held back by a subscriber that does not read (backpressure)")
                return control.recv_multipart()

    def statistics(self, timeout: float = 5.0) -> ProxyStatistics:
        """A snapshot of the counters.

        Raises:
            BrokerClosedError: The proxy is not forwarding.
            SendTimeoutError: It did not answer within ``timeout`` s (backpressure holds it).
        """
        reply = self._command(b"STATISTICS", timeout)
        if len(reply) != 8:
            raise TransportError(f"{self.name}: STATISTICS: expected 8 counters, got {len(reply)} frame(s)")
        f_in, fb_in, f_out, _, s_in, _, b_out, bb_out = (int.from_bytes(f, "little") for f in reply)
        failed = {side: causes for side, watch in self._handshakes.items() if (causes := watch.causes())}
        return ProxyStatistics(frames_in=f_in, bytes_in=fb_in, frames_out=b_out, bytes_out=bb_out,
                               subscriptions_in=s_in, subscriptions_out=f_out, paused=self._paused,
                               handshake_failures=failed)

    def pause(self, timeout: float = 5.0) -> None:
        """Hold messages and subscriptions in the proxy's queues until :meth:`resume` (publishers
        then wait, losslessly, and new subscribers are not seen by publishers).

        Raises:
            BrokerClosedError: The proxy is not forwarding.
            SendTimeoutError: It did not answer within ``timeout`` s (backpressure holds it).
        """
        self._command(_PAUSE, timeout)
        self._paused = True

    def resume(self, timeout: float = 5.0) -> None:
        """Forward again after :meth:`pause`.

        Raises:
            BrokerClosedError: The proxy is not forwarding.
            SendTimeoutError: It did not answer within ``timeout`` s.
        """
        self._command(_RESUME, timeout)
        self._paused = False

    def __enter__(self) -> Proxy:
        if not self._started:
            self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# -- command line -----------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    """The parser of ``worldtap-proxy``."""
    # Options are validated as worldtap-store validates its own.
    from .cli_args import OneLineParser, add_malloc_argument, check_endpoint, positive_int, seconds

    p = OneLineParser(
        prog="worldtap-proxy",
        description="Forward worldtap messages from many publishers (which connect to the "
                    "frontend) to many subscribers (which connect to the backend), subscriptions "
                    "and backpressure included.")
    p.add_argument("--frontend", action="append", type=check_endpoint, metavar="ENDPOINT",
                   help=f"endpoint to bind for publishers (repeatable; default {DEFAULT_FRONTEND})")
    p.add_argument("--backend", action="append", type=check_endpoint, metavar="ENDPOINT",
                   help=f"endpoint to bind for subscribers (repeatable; default {DEFAULT_BACKEND})")
    p.add_argument("--curve-keys", default=None, metavar="FILE",
                   help="CURVE: this proxy's key pair (a .key_secret file from worldtap-keys)")
    p.add_argument("--curve-publishers", default=None, metavar="DIR",
                   help="CURVE on the frontend: the folder of the publishers' public .key files "
                        "(the allow-list); needs --curve-keys")
    p.add_argument("--curve-subscribers", default=None, metavar="DIR",
                   help="CURVE on the backend: the folder of the subscribers' public .key files "
                        "(the allow-list); needs --curve-keys")
    p.add_argument("--hwm", type=positive_int, default=16, metavar="N",
                   help="messages queued per publisher and per subscriber before backpressure "
                        "(default 16; memory: about N x message size per peer)")
    p.add_argument("--heartbeat", type=seconds(zero=False), default=10.0, metavar="SECONDS",
                   help="drop a subscriber silent for this long (default 10; worldtap subscribers "
                        "ping every second)")
    p.add_argument("--status-interval", type=seconds(zero=False), default=10.0, metavar="SECONDS",
                   help="seconds between status lines (default 10)")
    add_malloc_argument(p)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def _curves(args: argparse.Namespace) -> tuple[CurveServer | None, CurveServer | None]:
    """The frontend's and backend's CURVE settings.

    Raises:
        SecurityError: A key file or allow-list folder is missing, malformed or empty.
    """
    if args.curve_keys is None:
        return None, None
    keys = load_keypair(args.curve_keys)
    curves: list[CurveServer | None] = []
    for folder in (args.curve_publishers, args.curve_subscribers):
        if folder is None:
            curves.append(None)
            continue
        allowed = load_public_keys(folder)
        if not allowed:
            raise SecurityError(f"{folder!r}: no .key files (public keys) to allow")
        curves.append(CurveServer(keys, allowed))
    return curves[0], curves[1]


def _status(stats: ProxyStatistics, rate: float | None = None) -> str:
    """One status line's fields; ``rate``: MB/s in since the last line."""
    speed = "" if rate is None else f" MB/s={rate:.1f}"
    return (f"frames_in={stats.frames_in} MB_in={stats.bytes_in / 1e6:.1f} frames_out={stats.frames_out} "
            f"MB_out={stats.bytes_out / 1e6:.1f}{speed} subscriptions_in={stats.subscriptions_in} "
            f"subscriptions_out={stats.subscriptions_out} paused={'yes' if stats.paused else 'no'}"
            + "".join(f" {side}_handshakes_failed={sum(causes.values())}"
                      for side, causes in sorted(stats.handshake_failures.items())))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``worldtap-proxy``: forward until SIGINT/SIGTERM; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.curve_keys is None) != (args.curve_publishers is None and args.curve_subscribers is None):
        parser.error("--curve-keys goes with --curve-publishers and/or --curve-subscribers")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s worldtap-proxy %(levelname)s %(message)s")
    malloc = apply_malloc_choice(args.malloc)  # said in the ready line; stderr stays one line on errors
    try:
        front_curve, back_curve = _curves(args)
    except SecurityError as exc:
        print(f"worldtap-proxy: {exc}", file=sys.stderr)
        return 2
    try:
        proxy = Proxy(args.frontend or [DEFAULT_FRONTEND], args.backend or [DEFAULT_BACKEND],
                      frontend_curve=front_curve, backend_curve=back_curve, hwm=args.hwm,
                      heartbeat=args.heartbeat, name="worldtap-proxy").start()
    except ValueError as exc:  # --heartbeat out of range
        parser.error(str(exc))
    except TransportError as exc:
        print(f"worldtap-proxy: {exc}", file=sys.stderr)
        return 5
    from .cli_args import signals_set

    stop = threading.Event()
    with signals_set(stop):  # the proxy is closed before the previous handlers are back
        try:
            return _serve(proxy, stop, args.status_interval, malloc)
        finally:
            proxy.close()


def _serve(proxy: Proxy, stop: threading.Event, interval: float, malloc: str) -> int:
    print(f"worldtap-proxy ready: frontend={','.join(proxy.frontend_endpoints)} "
          f"backend={','.join(proxy.backend_endpoints)} malloc={malloc}", file=sys.stderr, flush=True)
    last: ProxyStatistics | None = None
    since = time.monotonic()
    while not stop.wait(interval):
        if not proxy.running:
            print(f"worldtap-proxy: {proxy.error}", file=sys.stderr, flush=True)
            return 1
        try:
            stats = proxy.statistics(timeout=1.0)
        except SendTimeoutError:
            print("worldtap-proxy status: held back by a subscriber that does not read "
                  "(backpressure)", file=sys.stderr, flush=True)
            continue
        now = time.monotonic()
        rate = (stats.bytes_in - (last.bytes_in if last else 0)) / 1e6 / max(now - since, 1e-9)
        print(f"worldtap-proxy status: {_status(stats, rate)}", file=sys.stderr, flush=True)
        last, since = stats, now
    try:
        final = f"done: {_status(proxy.statistics(timeout=1.0))}"
    except (SendTimeoutError, BrokerClosedError):
        final = "done (forwarding was held back by a subscriber that does not read)"
    proxy.close()
    print(f"worldtap-proxy {final}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
