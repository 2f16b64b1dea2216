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

Partitions (:class:`storage.Partition`, ``K/N`` with ``N > 1``): each partition has its own
lock, ``<store>.partition-K-of-N.lock`` (file or lease object), so N daemons hold one store and
two daemons of one partition exclude each other as above. A daemon of the whole store and
partitioned daemons exclude each other (locally: the partitioned ones hold a shared ``flock``
on ``<store>.lock``, the whole-store daemon an exclusive one), and so do partitioned daemons
of different counts ``N`` (their partitions overlap): a daemon that finds such a lock held, or
such a lease unexpired, refuses to start.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from zarr.abc.buffer import Buffer, BufferPrototype
from zarr.abc.store import ByteRequest, Store
from zarr.storage import WrapperStore

from ._format import ALL_RUNS, Partition, url_options
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


_PARTITION_LOCK = re.compile(r"\.partition-(\d+)-of-(\d+)\.lock")


def lock_path(store: Path, partition: Partition = ALL_RUNS) -> Path:
    """Where the lock of the local store directory ``store`` lives: ``<store>.lock``, or
    ``<store>.partition-K-of-N.lock`` for partition ``K/N`` of several."""
    return store.with_name(store.name + _lock_suffix(partition))


def _lock_suffix(partition: Partition) -> str:
    return ".lock" if partition.whole else f".partition-{partition.index}-of-{partition.count}.lock"


def _partition_of(name: str, store_name: str) -> Partition | None:
    """The partition whose lock (file or lease) is named ``name``, for store ``store_name``."""
    match = _PARTITION_LOCK.fullmatch(name[len(store_name):]) if name.startswith(store_name) else None
    if match is None:
        return None
    try:
        return Partition(int(match[1]), int(match[2]))
    except ValueError:
        return None


def _owner(fd: int) -> str:
    return os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"


def _held_partitions(store: Path, conflicts: Callable[[Partition], bool]) -> list[str]:
    """``"K/N (pid P)"`` of each partition lock of ``store`` held by a live process whose
    partition ``conflicts``. Probing a lock takes it shared for an instant."""
    held = []
    for path in sorted(store.parent.glob(store.name + ".partition-*-of-*.lock")):
        partition = _partition_of(path.name, store.name)
        if partition is None or not conflicts(partition):
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            held.append(f"{partition} (pid {_owner(fd)})")
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    return held


class StoreLock(_Held):
    """An exclusive, non-blocking lock on a local store directory, or on one partition of it.

    Args:
        store: The store directory (it need not exist yet).
        partition: The runs the holder writes (default: all of them).

    Raises:
        StoreLockedError: From ``acquire()``, when another process holds the lock, or holds a
            lock that overlaps it (the whole store, or a partition of another count).
    """

    def __init__(self, store: Path, partition: Partition = ALL_RUNS) -> None:
        self.store = Path(store)
        self.partition = partition
        self.path = lock_path(self.store, partition)
        self._fd: int | None = None
        self._shared: int | None = None  # partitions: <store>.lock, shared with the others

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> StoreLock:
        """Take the lock and write our pid into the lock file. Idempotent."""
        if self._fd is not None:
            return self
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if not self.partition.whole:
                self._shared = self._take(lock_path(self.store), fcntl.LOCK_SH)
            self._fd = self._take(self.path, fcntl.LOCK_EX)
            mine = self.partition
            # After taking ours: of two daemons starting at once, one sees the other's lock.
            held = _held_partitions(self.store, lambda p: mine.whole or p.count != mine.count)
            if held:
                raise StoreLockedError(
                    f"store {str(self.store)!r} is locked by storage daemons of partition "
                    f"{', '.join(held)}; every daemon on a store must use the same partition count "
                    f"(stop them all to change it)")
        except BaseException:
            self.release()
            raise
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        return self

    def _take(self, path: Path, how: int) -> int:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            try:
                owner = _owner(fd)
            finally:
                os.close(fd)
            if how == fcntl.LOCK_SH:
                raise StoreLockedError(
                    f"store {str(self.store)!r} is locked by a storage daemon of all its runs "
                    f"(pid {owner}, lock file {str(path)!r}); stop it to start partition "
                    f"{self.partition}") from exc
            held = _held_partitions(self.store, lambda p: True) if self.partition.whole else []
            if held:
                raise StoreLockedError(
                    f"store {str(self.store)!r} is locked by storage daemons of partition "
                    f"{', '.join(held)}; stop them to start a daemon of all its runs") from exc
            what = "store" if self.partition.whole else f"partition {self.partition} of store"
            raise StoreLockedError(
                f"{what} {str(self.store)!r} is locked by another storage daemon (pid {owner}, "
                f"lock file {str(path)!r}); stop it or choose another store") from exc
        return fd

    def release(self) -> None:
        """Release the lock. Idempotent. The lock file stays (removing it would race)."""
        for fd in (self._fd, self._shared):
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self._fd = self._shared = None


class StoreLease(_Held):
    """An exclusive lease on a store given by an fsspec URL (see the module notes).

    Fencing: the holder counts as holding the lease only while its last successful renewal
    (by its own monotonic clock, measured from before the write) is younger than
    ``ttl - margin``; after that :meth:`check` raises :class:`LeaseExpiredError` and
    :attr:`lost` is set, so a daemon cut off from the store stops writing before the lease
    another daemon would wait for has expired. One failed renewal in a row is tolerated
    (renewals come every ``ttl / 3``); two are not.

    Args:
        url: The store's URL (``s3://bucket/runs.zarr``); the lease is ``<url>.lock``
            (``<url>.partition-K-of-N.lock`` for a partition of several).
        ttl: Seconds a lease lasts without renewal; it is renewed every ``ttl / 3``.
        margin: Seconds before the lease's expiry at which the holder stops writing (clock
            drift between hosts and the latency of one write); default ``ttl / 4``.
        partition: The runs the holder writes (default: all of them).

    Raises:
        StoreLockedError: From ``acquire()``, when another daemon's lease on the same runs, or
            an overlapping one (the whole store, a partition of another count), has not expired.
        StoreFormatError: The filesystem of ``url`` is not installed (the message names the
            ``pip install`` that adds it).
        ValueError: ``ttl`` or ``margin`` is out of range.
    """

    def __init__(self, url: str, *, ttl: float = 30.0, margin: float | None = None,
                 partition: Partition = ALL_RUNS) -> None:
        import fsspec

        if not ttl > 0:
            raise ValueError(f"ttl: expected a positive number of seconds, got {ttl!r}")
        margin = ttl / 4 if margin is None else margin
        if not 0 <= margin < ttl * 2 / 3:
            raise ValueError(f"margin: expected seconds in [0, 2/3 of ttl), got {margin!r}")
        self.name, self.ttl, self.margin, self.partition = url, ttl, margin, partition
        self._renewed = -float("inf")  # monotonic time before the last successful write
        options = url_options(url)  # (first: a missing filesystem is named for the store)
        self.url = url.rstrip("/") + _lock_suffix(partition)
        self.fs, self.path = fsspec.core.url_to_fs(self.url, **options)
        self._base = self.path.removesuffix(_lock_suffix(partition))  # the store's path
        self.token = uuid.uuid4().hex
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None and not self.lost.is_set()

    def _read(self, path: str | None = None) -> dict[str, Any] | None:
        try:
            lease = json.loads(self.fs.cat_file(self.path if path is None else path))
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
        try:
            self._check_overlaps()
        except StoreLockedError:
            self.fs.rm_file(self.path)  # ours: no daemon of this partition holds it
            raise
        self._thread = threading.Thread(target=self._renew, name="worldtap-lease", daemon=True)
        self._thread.start()
        return self

    def _check_overlaps(self) -> None:
        """Raise if an unexpired lease of another daemon covers runs of ours (after writing
        ours: of two daemons starting at once, one sees the other's lease)."""
        name = self._base.rsplit("/", 1)[-1]
        paths = [] if self.partition.whole else [self._base + ".lock"]
        paths += sorted(self.fs.glob(self._base + ".partition-*-of-*.lock"))
        now = time.time()
        for path in paths:
            other = Partition() if path == self._base + ".lock" else \
                _partition_of(path.rsplit("/", 1)[-1], name)
            if path == self.path or other is None or not (
                    self.partition.whole or other.whole or other.count != self.partition.count):
                continue
            lease = self._read(path)
            if lease is None or lease.get("token") == self.token:
                continue
            expires = float(lease.get("expires", 0))
            if expires > now:
                whose = "all its runs" if other.whole else f"partition {other}"
                raise StoreLockedError(
                    f"store {self.name!r} is leased by a storage daemon of {whose} (host "
                    f"{lease.get('host')!r}, pid {lease.get('pid')}) for {expires - now:.0f} s "
                    f"more; every daemon on a store must use the same partition count (stop them "
                    f"all to change it)")

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

    async def _set_many(self, values: Iterable[tuple[str, Buffer]]) -> None:
        # zarr writes several nodes at once through it (the wrapped store's own would not pass
        # through this wrapper's set)
        self.lease.check()
        await self._store._set_many(values)

    async def clear(self) -> None:
        self.lease.check()
        await self._store.clear()

    async def get(self, key: str, prototype: BufferPrototype,
                  byte_range: ByteRequest | None = None) -> Buffer | None:
        return await self._store.get(key, prototype, byte_range)
