"""Zarr stores that let a test act on their Nth write: fail it (an injected disk error) or kill
the process there (the kill campaign). Writes are every ``set``, ``set_if_not_exists``,
``set_sync``, ``delete`` and ``delete_sync`` (and, through :func:`faulty`, ``delete_dir``), on
any thread, counted in order.

:class:`FaultyStore` is a local directory, written as a daemon writes one; :func:`faulty`
wraps any store (a memory store, an fsspec URL's store) and keeps the synchronous write path
of stores that have one."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr.abc.store import Store, SupportsDeleteSync, SupportsSetSync
from zarr.core.buffer import Buffer
from zarr.storage import WrapperStore

from storage._format import RunLocalStore

Action = Callable[[int, str, bytes | None], None]
"""Called as ``action(n, key, value)`` before write number ``n`` (1-based) of ``key``; raising
makes that write fail, returning lets it happen."""


class _Counted:
    """Counts writes in order and calls ``before`` / ``after`` around each."""

    def _count_writes(self, before: Action | None, after: Action | None) -> None:
        self.before, self.after = before, after
        self.writes = 0
        self.keys: list[str] = []
        self._count = threading.Lock()

    def _hook(self, key: str, value: Buffer | None) -> int:
        with self._count:
            self.writes += 1
            self.keys.append(key)
            n = self.writes
        if self.before is not None:
            self.before(n, key, None if value is None else value.to_bytes())
        return n

    def _done(self, n: int, key: str, value: Buffer | None) -> None:
        if self.after is not None:
            self.after(n, key, None if value is None else value.to_bytes())


class FaultyStore(_Counted, RunLocalStore):
    """A local directory written as a daemon writes one (:class:`RunLocalStore`: each write to
    a temporary file renamed into place) that calls ``before`` before every write (and
    ``after`` after it)."""

    def __init__(self, root: Path | str, *, before: Action | None = None,
                 after: Action | None = None, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self._count_writes(before, after)

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    async def set(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        await super().set(key, value)
        self._done(n, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        await super().set_if_not_exists(key, value)
        self._done(n, key, value)

    def set_sync(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        super().set_sync(key, value)
        self._done(n, key, value)

    async def delete(self, key: str) -> None:
        n = self._hook(key, None)
        await super().delete(key)
        self._done(n, key, None)

    def delete_sync(self, key: str) -> None:
        n = self._hook(key, None)
        super().delete_sync(key)
        self._done(n, key, None)


class FaultyWrapper(_Counted, WrapperStore[Store]):
    """Any zarr store, calling ``before`` before every write (and ``after`` after it). Build it
    with :func:`faulty`."""

    def __init__(self, store: Store, *, before: Action | None = None, after: Action | None = None) -> None:
        super().__init__(store)
        self._count_writes(before, after)

    def _with_store(self, store: Store) -> FaultyWrapper:
        return type(self)(store, before=self.before, after=self.after)

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

    async def set(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        await self._store.set(key, value)
        self._done(n, key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        await self._store.set_if_not_exists(key, value)
        self._done(n, key, value)

    async def delete(self, key: str) -> None:
        n = self._hook(key, None)
        await self._store.delete(key)
        self._done(n, key, None)

    async def delete_dir(self, prefix: str) -> None:
        n = self._hook(prefix, None)
        await self._store.delete_dir(prefix)
        self._done(n, prefix, None)


class _SyncFaultyWrapper(FaultyWrapper):
    """A :class:`FaultyWrapper` of a store with zarr's synchronous writes (local, memory)."""

    def set_sync(self, key: str, value: Buffer) -> None:
        n = self._hook(key, value)
        self._store.set_sync(key, value)  # type: ignore[attr-defined]
        self._done(n, key, value)

    def delete_sync(self, key: str) -> None:
        n = self._hook(key, None)
        self._store.delete_sync(key)  # type: ignore[attr-defined]
        self._done(n, key, None)


def faulty(store: Store, *, before: Action | None = None, after: Action | None = None) -> FaultyWrapper:
    """``store`` wrapped to call ``before``/``after`` around each write; the wrapper has
    ``set_sync``/``delete_sync`` exactly when ``store`` has them, so the daemon writes through
    it on the same path as through ``store``."""
    sync = isinstance(store, SupportsSetSync) and isinstance(store, SupportsDeleteSync)
    return (_SyncFaultyWrapper if sync else FaultyWrapper)(store, before=before, after=after)


def fail_at(n: int, *, persistent: bool = False) -> Action:
    """An action failing write ``n`` with ENOSPC (and, if ``persistent``, every later one: a
    full disk)."""

    def action(k: int, key: str, value: bytes | None) -> None:
        if k == n or (persistent and k > n):
            raise OSError(errno.ENOSPC, f"injected: no space left on device (write {k}, {key})")

    return action


def kill_when(predicate: Callable[[int, str, bytes | None], bool]) -> Action:
    """An action that kills this process (SIGKILL: no cleanup, no flush) at the first write
    ``predicate`` accepts."""

    def action(k: int, key: str, value: bytes | None) -> None:
        if predicate(k, key, value):
            os.kill(os.getpid(), signal.SIGKILL)

    return action


def run_attrs_write(run: str) -> Callable[[str], bool]:
    """Whether a key is the run group's metadata (its attributes are the commit point)."""
    return lambda key: key == f"runs/{run}/zarr.json"


def describe(value: Any) -> str:
    return "None" if value is None else f"{len(value)} bytes"
