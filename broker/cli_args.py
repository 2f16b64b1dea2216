"""argparse types shared by worldtap's command lines (``worldtap-store``, ``worldtap-proxy``):
each raises ``argparse.ArgumentTypeError`` with a message naming what was wrong, which argparse
turns into one usage line and exit code 2; and :func:`signals_set` and :func:`signals_interrupt`,
how those commands (and ``worldtap-sensitivity``'s live mode, ``worldtap-demo`` and
``worldtap-store export``) stop on SIGINT and SIGTERM."""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from types import FrameType
from typing import NoReturn

__all__ = ["OneLineParser", "add_malloc_argument", "check_endpoint", "parse_size", "positive_int", "seconds",
           "signals_interrupt", "signals_set"]

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30}


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (``PROG: error: ...``,
    pointing at ``--help``) and exit code 2; its subparsers are the same."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864. Accepts B, k/KB, KiB, M/MB, MiB, G/GB, GiB (case-insensitive)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 512MiB or 1GiB, got {text!r}")
    value = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return value


def seconds(*, zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, ``>= 0`` with ``zero`` else ``> 0``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"expected a finite number of seconds {'>= 0' if zero else '> 0'}, got {text!r}")
        return value
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def check_endpoint(text: str) -> str:
    """A ZeroMQ endpoint a worldtap command can bind or connect: ``tcp://HOST:PORT`` (port 1-65535, or ``*`` to
    bind any) or ``ipc://PATH`` whose folder exists."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT or ipc://PATH, got {text!r}")
    if scheme == "ipc":
        folder = os.path.dirname(rest) or "."
        if not rest or not os.path.isdir(folder):
            raise argparse.ArgumentTypeError(f"{text!r}: the folder {folder!r} of the ipc socket does "
                                             f"not exist")
        return text
    host, colon, port = rest.rpartition(":")
    if not colon or not host:
        raise argparse.ArgumentTypeError(f"expected tcp://HOST:PORT, got {text!r}")
    if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: the port must be 1-65535 or *, got {port!r}")
    return text


def add_malloc_argument(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--malloc {keep,system}`` (default ``keep``), for a command that receives large messages
    (see :mod:`broker.allocator`); apply it with :func:`broker.allocator.apply_malloc_choice`.
    ``help`` replaces the commands' help text (the benchmarks say where they apply it)."""
    p.add_argument("--malloc", choices=("keep", "system"), default="keep",
                   help=help or "keep (default): keep up to 64 MiB of freed memory per heap for the "
                                "next messages, where glibc's malloc would return it to the system at "
                                "nearly every message and fault it in again; system: glibc's own "
                                "defaults (and any MALLOC_* or GLIBC_TUNABLES setting always wins)")


@contextmanager
def signals_set(stop: threading.Event, *, interrupt_again: bool = False) -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM set ``stop`` (whatever the process inherited: a
    command a script starts in the background inherits SIGINT ignored), so the command's loop
    ends where it chooses; the previous handlers are restored afterwards. With
    ``interrupt_again``, a signal once ``stop`` is set raises ``KeyboardInterrupt`` where it
    lands. Outside the main thread (where no handler can be installed) it installs nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum: int, frame: FrameType | None) -> None:
        if interrupt_again and stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def signals_interrupt() -> AbstractContextManager[None]:
    """While the block runs, SIGINT and SIGTERM raise ``KeyboardInterrupt`` where they land
    (whatever the process inherited), so a one-shot command's cleanup runs on either: a
    ``kill`` removes what it was writing as Ctrl-C does. Outside the main thread it changes
    nothing (see :func:`signals_set`)."""
    stop = threading.Event()
    stop.set()
    return signals_set(stop, interrupt_again=True)
