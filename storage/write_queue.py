"""One run's writer thread: data writes and index commits, in order, stopping at the first failure.

The daemon's main thread assembles episodes and hands the store work to this queue: pieces
of episode rows (data) and then the commit that references them (index). One thread runs the
jobs in submission order, so data is always written before the index that points at it. The
first job that raises *poisons* the queue: no later job runs, so a commit never follows a
failed data write and nothing is committed twice; :attr:`RunWriteQueue.failure` keeps the error
until the daemon retires the run. The store then holds the run's last good commit, which a
restarted daemon resumes from.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

__all__ = ["RunWriteQueue"]

_log = logging.getLogger("worldtap.storage")


class RunWriteQueue:
    """Runs one run's store jobs on a thread of its own, in order, until one fails.

    Args:
        run: Run id (thread name and log messages).
    """

    def __init__(self, run: str) -> None:
        self.run = run
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"worldtap-store-{run[:32]}")
        self._lock = threading.Lock()
        self._failure: BaseException | None = None
        self._last: Future[None] | None = None
        self.closed = False

    @property
    def failure(self) -> BaseException | None:
        """The error of the first job that failed, or ``None``."""
        return self._failure

    def submit(self, job: Callable[..., Any], *args: Any) -> Future[None]:
        """Queue ``job(*args)``; it is skipped if an earlier job failed. The future never raises
        (see :attr:`failure`); it is done when the job has run or been skipped."""
        if self.closed:
            raise RuntimeError(f"run {self.run!r}: the write queue is closed")
        self._last = self._executor.submit(self._run, job, args)
        return self._last

    def _run(self, job: Callable[..., Any], args: tuple[Any, ...]) -> None:
        if self._failure is not None:
            return
        try:
            job(*args)
        except BaseException as exc:  # a write failed: nothing after it may run
            with self._lock:
                if self._failure is None:
                    self._failure = exc
            _log.error("run %r: a store write failed; the run stops at its last commit: %r",
                       self.run, exc)

    def wait(self) -> None:
        """Wait until every job submitted so far has run or been skipped."""
        last = self._last
        if last is not None:
            last.result()

    def close(self) -> None:
        """Run (or skip) what is queued and stop the thread. Idempotent."""
        if not self.closed:
            self.closed = True
            self._executor.shutdown(wait=True)
