"""One writer per store: an advisory ``flock`` on a file next to a local store.

The lock is held by the open file description, so the kernel releases it when the daemon
exits for any reason (including ``kill -9``); a stale lock file left behind never blocks a
resume. Stores that are not local directories (fsspec URLs) are not locked: running two
daemons on the same remote store is the operator's responsibility.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from .errors import StoreLockedError

__all__ = ["StoreLock", "lock_path"]


def lock_path(store: Path) -> Path:
    """Where the lock of the local store directory ``store`` lives (``<store>.lock``)."""
    return store.with_name(store.name + ".lock")


class StoreLock:
    """An exclusive, non-blocking lock on a local store directory.

    Args:
        store: The store directory (it need not exist yet).

    Raises:
        StoreLockedError: From ``acquire()``, when another process holds the lock.
    """

    def __init__(self, store: Path) -> None:
        self.store = Path(store)
        self.path = lock_path(self.store)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> StoreLock:
        """Take the lock and write our pid into the lock file. Idempotent."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            try:
                owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise StoreLockedError(
                f"store {str(self.store)!r} is locked by another storage daemon (pid {owner}, "
                f"lock file {str(self.path)!r}); stop it or choose another store"
            ) from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock. Idempotent. The lock file stays (removing it would race)."""
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
