"""Waiting in tests: poll a condition until a deadline, never sleep a fixed time and hope."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str, timeout: float = 10.0, poll: float = 0.005) -> None:
    """Return as soon as ``condition()`` is true; fail naming ``what`` once ``timeout`` seconds
    have passed without it."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)
