"""Live status of the daemon: a rich progress display on a terminal, log lines otherwise, and
the status socket (:class:`StatusServer`) that answers :func:`daemon_status` and
``worldtap-store status`` with one JSON document per request.

The status socket is plain text and unauthenticated (it carries counters, store and endpoint
names, never data): bind it to loopback, an ``ipc://`` path, or a trusted network only."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from .daemon import DaemonStatistics
from .errors import StorageError

__all__ = ["Rates", "StatusLine", "StatusReporter", "StatusServer", "StatusTimeoutError", "daemon_status",
           "format_status", "status_document"]

STATUS_FORMAT: Final = 1
"""Version of the status document's layout (its ``format`` key)."""
_MAX_REQUEST: Final = 4096  # bytes: a status request is a short word
_ANSWERS_PER_POLL: Final = 16  # requests answered per poll(): ingestion never waits on askers

_log = logging.getLogger("worldtap.storage")


@dataclass(frozen=True, slots=True)
class StatusLine:
    """What one status update shows."""

    episodes: int
    mb_per_s: float
    lag_steps: int
    gaps: int
    bad_messages: int
    rejected: int
    incomplete: int
    runs: int


def format_status(s: StatusLine) -> str:
    return (f"episodes={s.episodes} rate={s.mb_per_s:.1f}MB/s lag={s.lag_steps}steps "
            f"gaps={s.gaps} bad={s.bad_messages} rejected={s.rejected} "
            f"incomplete={s.incomplete} runs={s.runs}")


@dataclass(frozen=True, slots=True)
class Rates:
    """Write rates over the last status interval.

    Attributes:
        mb_per_s: Uncompressed megabytes (1e6 bytes) written per second.
        episodes_per_s: Episodes committed per second.
        interval_s: Seconds the rates were measured over.
    """

    mb_per_s: float = 0.0
    episodes_per_s: float = 0.0
    interval_s: float = 0.0


class StatusReporter:
    """Shows the daemon's status every ``interval`` seconds.

    Args:
        stats: Returns the daemon's statistics.
        transport: Returns the subscriber's statistics mapping (``bad_messages``, ``gaps``), or
            ``None`` when there is no transport.
        interval: Seconds between updates.
        tty: Use a rich live display (default: when stderr is a terminal and rich imports).
    """

    def __init__(self, stats: Callable[[], DaemonStatistics],
                 transport: Callable[[], Mapping[str, Any]] | None = None, *,
                 interval: float = 5.0, tty: bool | None = None) -> None:
        self._stats = stats
        self._transport = transport
        self.interval = interval
        self._last_t = time.monotonic()
        self._last_bytes = self._last_episodes = 0
        self.rates = Rates()
        """The rates of the last completed interval (updated by :meth:`snapshot`)."""
        self._next = self._last_t + interval
        self._live: Any = None
        if tty is None:
            tty = sys.stderr.isatty()
        if tty:
            try:
                from rich.console import Console
                from rich.live import Live
            except ImportError:  # rich is optional: fall back to log lines
                tty = False
            else:
                self._live = Live(console=Console(stderr=True), refresh_per_second=2,
                                  transient=False)
        self.tty = tty

    def snapshot(self) -> StatusLine:
        s = self._stats()
        now = time.monotonic()
        span = max(now - self._last_t, 1e-9)
        rate = (s.bytes_written - self._last_bytes) / span / 1e6
        self.rates = Rates(rate, (s.episodes_stored - self._last_episodes) / span, span)
        self._last_t, self._last_bytes = now, s.bytes_written
        self._last_episodes = s.episodes_stored
        t = dict(self._transport()) if self._transport is not None else {}
        return StatusLine(
            episodes=s.episodes_stored, mb_per_s=rate, lag_steps=s.lag_steps,
            gaps=max(s.gaps, int(t.get("gaps", 0))), bad_messages=int(t.get("bad_messages", 0)),
            rejected=sum(s.rejected.values()), incomplete=s.episodes_incomplete,
            runs=s.runs_active)

    def poll(self) -> None:
        """Update the display if the interval elapsed (cheap to call often)."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + self.interval
        line = self.snapshot()
        if self._live is not None:
            self._live.update(_render(line))
        else:
            _log.info("status %s", format_status(line))

    def __enter__(self) -> StatusReporter:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.stop()


def _render(line: StatusLine) -> Any:
    from rich.table import Table

    table = Table(title="worldtap-store", show_header=True)
    for name in ("episodes", "MB/s", "lag (steps)", "gaps", "bad", "rejected", "incomplete",
                 "runs"):
        table.add_column(name, justify="right")
    table.add_row(str(line.episodes), f"{line.mb_per_s:.1f}", str(line.lag_steps), str(line.gaps),
                  str(line.bad_messages), str(line.rejected), str(line.incomplete), str(line.runs))
    return table


def status_document(stats: DaemonStatistics, transport: Mapping[str, Any], rates: Rates, *,
                    memory_budget: int, about: Mapping[str, Any]) -> dict[str, Any]:
    """The status document the status socket answers (JSON-serializable).

    Args:
        stats: The daemon's counters.
        transport: The subscriber's counters (:class:`broker.SubscriberStatistics` fields:
            ``gaps``, ``bad_messages``, ``bad_reasons``, ``publishers``, ``received``,
            ``handshake_failures``, ``failing_endpoints``); missing keys count as 0.
        rates: The write rates of the last status interval.
        memory_budget: The daemon's ``--memory-budget`` in bytes.
        about: Fixed facts shown as they are: ``store``, ``export``, ``endpoints``, ``bind``...

    Returns:
        ``{"format", "version", "uptime_s", "runs", "episodes", "lag_steps", "rate",
        "bytes_written", "messages", "gaps", "bad_messages", "rejected", "memory",
        "subscriber", **about}``.
    """
    from importlib import metadata

    try:
        version = metadata.version("worldtap")
    except metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "format": STATUS_FORMAT, "version": version, **about,
        "uptime_s": round(stats.uptime_s, 3),
        "runs": {"active": stats.runs_active, "ended": stats.runs_ended,
                 "failed": stats.runs_failed, "episodes": dict(stats.stored_by_run)},
        "episodes": {"stored": stats.episodes_stored, "filtered": stats.episodes_filtered,
                     "incomplete": stats.episodes_incomplete,
                     "open_at_end": stats.episodes_open_at_end},
        "lag_steps": stats.lag_steps,
        "rate": {"mb_per_s": round(rates.mb_per_s, 3),
                 "episodes_per_s": round(rates.episodes_per_s, 3),
                 "interval_s": round(rates.interval_s, 3)},
        "bytes_written": stats.bytes_written, "messages": stats.messages,
        "gaps": max(stats.gaps, int(transport.get("gaps", 0))),
        "bad_messages": int(transport.get("bad_messages", 0)),
        "bad_reasons": dict(transport.get("bad_reasons", {})),
        "rejected": dict(stats.rejected),
        "memory": {"held_bytes": stats.memory_bytes, "budget_bytes": memory_budget},
        "subscriber": {"publishers": int(transport.get("publishers", 0)),
                       "received": int(transport.get("received", 0)),
                       "handshake_failures": int(transport.get("handshake_failures", 0)),
                       "failing_endpoints": dict(transport.get("failing_endpoints", {}))},
    }


class StatusServer:
    """Answers status requests on a bound ZeroMQ ROUTER socket: each request (any short
    message from a REQ socket, e.g. :func:`daemon_status`) gets one JSON document. Nothing
    blocks: :meth:`poll` answers what is waiting and returns.

    The socket is plain text (see the module's note): bind it to loopback, ``ipc://`` or a
    trusted network.

    Args:
        endpoint: Where to bind, e.g. ``tcp://127.0.0.1:5557`` or ``ipc:///run/worldtap/status``.
        document: Returns the current status document.

    Raises:
        TransportError: ``endpoint`` cannot be bound (the port is in use, the ipc folder is
            missing).
    """

    def __init__(self, endpoint: str, document: Callable[[], Mapping[str, Any]]) -> None:
        import zmq

        from broker.errors import translate_zmq_errors
        from broker.security import attach

        self._document = document
        self._ctx: Any = zmq.Context()
        try:
            with translate_zmq_errors("create the status socket"):
                sock = self._ctx.socket(zmq.ROUTER)
                for option, value in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, _MAX_REQUEST),
                                      (zmq.SNDHWM, 64), (zmq.RCVHWM, 64)):
                    sock.setsockopt(option, value)
            self.endpoint = attach(sock, [endpoint], bind=True, encrypted=False,
                                   owner="status socket")[0]
        except BaseException:
            self._ctx.destroy(linger=0)
            raise
        self._socket = sock
        self.answered = 0

    def poll(self) -> int:
        """Answer the requests waiting now (at most a few); returns how many were answered."""
        import zmq

        answered = 0
        while answered < _ANSWERS_PER_POLL:
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 2:  # not from a REQ/DEALER peer: nowhere to answer
                continue
            body = json.dumps(self._document(), allow_nan=False).encode()
            try:  # a peer that is gone (or not reading) is not waited for
                self._socket.send_multipart([*frames[:-1], body], zmq.NOBLOCK)
            except zmq.Again:
                continue
            answered += 1
        self.answered += answered
        return answered

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._ctx.destroy(linger=0)

    def __enter__(self) -> StatusServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class StatusTimeoutError(StorageError, TimeoutError):
    """No storage daemon answered a status request in time."""


def daemon_status(endpoint: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """Ask the storage daemon whose status socket (``worldtap-store serve --status``) is at
    ``endpoint`` for its status.

    Args:
        endpoint: The daemon's status endpoint, e.g. ``tcp://127.0.0.1:5557``.
        timeout: Seconds to wait for the answer.

    Returns:
        The status document (see :func:`status_document`): uptime, runs active/ended/failed
        and the episodes stored per run, lag, write rates, bytes written, gaps, bad messages,
        rejections by reason, memory held and budget, store and endpoints, version.

    Raises:
        ValueError: ``timeout`` is not a positive number of seconds.
        StatusTimeoutError: Nothing answered within ``timeout`` seconds.
        StorageError: The answer is not a status document.
        TransportError: ``endpoint`` is not a valid ZeroMQ endpoint.
    """
    import zmq

    from broker.errors import translate_zmq_errors

    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    ctx: Any = zmq.Context()
    try:
        with translate_zmq_errors(f"connect {endpoint!r}"):
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(b"status")
            if not sock.poll(int(timeout * 1000)):
                raise StatusTimeoutError(f"no status from {endpoint!r} within {timeout:g} s: is a "
                                         f"worldtap-store daemon serving --status there?")
            reply = sock.recv()
    finally:
        ctx.destroy(linger=0)
    try:
        doc = json.loads(reply)
    except ValueError as exc:
        raise StorageError(f"{endpoint!r} answered something that is not a status document: "
                           f"{exc}") from None
    if not isinstance(doc, dict) or "format" not in doc:
        raise StorageError(f"{endpoint!r} answered something that is not a status document")
    return doc
