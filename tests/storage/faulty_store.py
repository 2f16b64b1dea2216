"""A local zarr store that lets a test act on its Nth write: fail it (an injected disk error) or
kill the process there (the kill campaign). Writes are every ``set``, ``set_if_not_exists``,
``set_sync``, ``delete`` and ``delete_sync``, on any thread, counted in order."""

from __future__ import annotations

import errno
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from zarr.core.buffer import Buffer
from zarr.storage import LocalStore

Action = Callable[[int, str, bytes | None], None]
"""Called as ``action(n, key, value)`` before write number ``n`` (1-based) of ``key``; raising
makes that write fail, returning lets it happen."""


class FaultyStore(LocalStore):
    """A :class:`LocalStore` that calls ``before`` before every write (and ``after`` after it)."""

    def __init__(self, root: Path | str, *, before: Action | None = None,
                 after: Action | None = None, read_only: bool = False) -> None:
        super().__init__(root, read_only=read_only)
        self.before, self.after = before, after
        self.writes = 0
        self.keys: list[str] = []
        self._count = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return self is other

    __hash__ = object.__hash__

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
