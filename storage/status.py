"""Live status of the daemon: a rich progress display on a terminal, log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from .daemon import DaemonStatistics

__all__ = ["StatusLine", "StatusReporter", "format_status"]

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
        self._last_bytes = 0
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
        rate = (s.bytes_written - self._last_bytes) / max(now - self._last_t, 1e-9) / 1e6
        self._last_t, self._last_bytes = now, s.bytes_written
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
