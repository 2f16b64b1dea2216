"""One writer per store.

- Local directories: :class:`StoreLock`, an advisory ``flock`` on a file next to the store.
  The lock is held by the open file description, so the kernel releases it when the daemon
  exits for any reason (including ``kill -9``); a stale lock file never blocks a resume.
- Other stores (fsspec URLs): :class:`StoreLease`, a lease object next to the store
  (``<url>.lock``: owner, host, pid and an expiry time), renewed by a background thread. A
  daemon that crashed holds its lease until it expires (``ttl``, 30 s by default), so a resume
  right after a crash waits that long or is told to. Object stores have no atomic
  create-if-absent here, so two daemons starting within the same moment could both read "no
  lease"; each re-reads its lease after writing it and the later writer wins, and a daemon
  that finds another's lease while renewing stops writing (see :attr:`StoreLease.lost`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from .errors import StoreLockedError

__all__ = ["StoreLease", "StoreLock", "lock_path"]

_log = logging.getLogger("worldtap.storage")



class _Held:
    """``with lock:`` takes it (``acquire``) and gives it back (``release``)."""

    def acquire(self) -> Self:
        raise NotImplementedError

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def lock_path(store: Path) -> Path:
    """Where the lock of the local store directory ``store`` lives (``<store>.lock``)."""
    return store.with_name(store.name + ".lock")


class StoreLock(_Held):
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


class StoreLease(_Held):
    """An exclusive lease on a store given by an fsspec URL (see the module notes).

    Args:
        url: The store's URL (``s3://bucket/runs.zarr``); the lease is ``<url>.lock``.
        ttl: Seconds a lease lasts without renewal; it is renewed every ``ttl / 3``.

    Raises:
        StoreLockedError: From ``acquire()``, when another daemon's lease has not expired.
    """

    def __init__(self, url: str, *, ttl: float = 30.0) -> None:
        import fsspec

        if ttl <= 0:
            raise ValueError(f"ttl: expected a positive number of seconds, got {ttl!r}")
        self.name, self.ttl = url, ttl
        self.url = url.rstrip("/") + ".lock"
        self.fs, self.path = fsspec.core.url_to_fs(self.url)
        self.token = uuid.uuid4().hex
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None and not self.lost.is_set()

    def _read(self) -> dict[str, Any] | None:
        try:
            lease = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except ValueError:
            return None  # a torn or foreign write: no valid lease
        return lease if isinstance(lease, dict) else None

    def _write(self) -> None:
        lease = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                 "expires": time.time() + self.ttl}
        self.fs.pipe_file(self.path, json.dumps(lease).encode())

    def _check(self, lease: dict[str, Any] | None, now: float) -> None:
        if lease is None or lease.get("token") == self.token:
            return
        expires = float(lease.get("expires", 0))
        if expires > now:
            raise StoreLockedError(
                f"store {self.name!r} is leased by another storage daemon (host "
                f"{lease.get('host')!r}, pid {lease.get('pid')}) for {expires - now:.0f} s more "
                f"(lease {self.url!r}); stop it, or if it crashed wait for the lease to expire")

    def acquire(self) -> StoreLease:
        """Take the lease (or raise) and start renewing it. Idempotent."""
        if self._thread is not None:
            return self
        self._check(self._read(), time.time())
        self._write()
        self._check(self._read(), time.time())  # a daemon that wrote after us won
        self._thread = threading.Thread(target=self._renew, name="worldtap-lease", daemon=True)
        self._thread.start()
        return self

    def _renew(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                lease = self._read()
                if lease is not None and lease.get("token") != self.token:
                    _log.error("store %r: another daemon (host %r, pid %s) took the lease; "
                               "stop writing", self.name, lease.get("host"), lease.get("pid"))
                    self.lost.set()
                    return
                self._write()
            except Exception as exc:  # a failed renewal is retried; expiry is what protects
                _log.warning("store %r: renewing the lease failed: %s", self.name, exc)

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if not self.lost.is_set():
            lease = self._read()
            if lease is not None and lease.get("token") == self.token:
                self.fs.rm_file(self.path)
