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
  The holder is also *fenced*: once its last successful renewal is older than the ttl minus
  a margin (cut off from the store, a stalled process), :meth:`StoreLease.check` raises and
  :class:`FencedStore` refuses every write, before any other daemon could take the lease over.
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

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, Store
from zarr.storage import WrapperStore

from ._format import url_options
from .errors import LeaseExpiredError, StoreLockedError

__all__ = ["FencedStore", "StoreLease", "StoreLock", "lock_path"]

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

    Fencing: the holder counts as holding the lease only while its last successful renewal
    (by its own monotonic clock, measured from before the write) is younger than
    ``ttl - margin``; after that :meth:`check` raises :class:`LeaseExpiredError` and
    :attr:`lost` is set, so a daemon cut off from the store stops writing before the lease
    another daemon would wait for has expired. One failed renewal in a row is tolerated
    (renewals come every ``ttl / 3``); two are not.

    Args:
        url: The store's URL (``s3://bucket/runs.zarr``); the lease is ``<url>.lock``.
        ttl: Seconds a lease lasts without renewal; it is renewed every ``ttl / 3``.
        margin: Seconds before the lease's expiry at which the holder stops writing (clock
            drift between hosts and the latency of one write); default ``ttl / 4``.

    Raises:
        StoreLockedError: From ``acquire()``, when another daemon's lease has not expired.
        StoreFormatError: The filesystem of ``url`` is not installed (the message names the
            ``pip install`` that adds it).
        ValueError: ``ttl`` or ``margin`` is out of range.
    """

    def __init__(self, url: str, *, ttl: float = 30.0, margin: float | None = None) -> None:
        import fsspec

        if not ttl > 0:
            raise ValueError(f"ttl: expected a positive number of seconds, got {ttl!r}")
        margin = ttl / 4 if margin is None else margin
        if not 0 <= margin < ttl * 2 / 3:
            raise ValueError(f"margin: expected seconds in [0, 2/3 of ttl), got {margin!r}")
        self.name, self.ttl, self.margin = url, ttl, margin
        self._renewed = -float("inf")  # monotonic time before the last successful write
        options = url_options(url)  # (first: a missing filesystem is named for the store)
        self.url = url.rstrip("/") + ".lock"
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **options)
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
        started = time.monotonic()  # the lease runs from before the write, never after it
        lease = {"token": self.token, "host": socket.gethostname(), "pid": os.getpid(),
                 "expires": time.time() + self.ttl}
        self.fs.pipe_file(self.path, json.dumps(lease).encode())
        self._renewed = started

    @property
    def age(self) -> float:
        """Seconds since the last successful renewal began."""
        return time.monotonic() - self._renewed

    def check(self) -> None:
        """Raise unless the lease is held and was renewed less than ``ttl - margin`` ago.

        Raises:
            LeaseExpiredError: Not held, lost to another daemon, or not renewed in time.
        """
        if self._thread is None:
            raise LeaseExpiredError(f"store {self.name!r}: the lease is not held")
        if self.lost.is_set():
            raise LeaseExpiredError(f"store {self.name!r}: another daemon took the lease; "
                                    f"this daemon stopped writing")
        age = self.age
        if age >= self.ttl - self.margin:
            self.lost.set()
            raise LeaseExpiredError(
                f"store {self.name!r}: the lease was last renewed {age:.1f} s ago (ttl {self.ttl:g} s, "
                f"margin {self.margin:g} s); this daemon stopped writing, since another may hold "
                f"the store by now")

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
            if self.age >= self.ttl - self.margin:
                _log.error("store %r: the lease could not be renewed for %.1f s; stop writing",
                           self.name, self.age)
                self.lost.set()
                return
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


class FencedStore(WrapperStore[Store]):
    """A zarr store that refuses every write unless ``lease`` is valid (:meth:`StoreLease.check`).

    Wrap the daemon's store in it so that a daemon whose lease lapsed (cut off from the store,
    stalled) writes nothing more, not even a commit already queued on a writer thread.
    """

    def __init__(self, store: Store, lease: StoreLease) -> None:
        super().__init__(store)
        self.lease = lease

    def _with_store(self, store: Store) -> FencedStore:
        return type(self)(store, self.lease)

    async def set(self, key: str, value: Buffer) -> None:
        self.lease.check()
        await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        self.lease.check()
        await self._store.set_if_not_exists(key, value)

    async def delete(self, key: str) -> None:
        self.lease.check()
        await self._store.delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self.lease.check()
        await self._store.delete_dir(prefix)

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        return await self._store.get(key, prototype, byte_range)
