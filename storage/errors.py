"""The storage package's error vocabulary: one root, leaves that also inherit a built-in."""

from __future__ import annotations

__all__ = [
    "EpisodeNotFoundError",
    "LeaseExpiredError",
    "RunNotFoundError",
    "StorageError",
    "StoreDamagedError",
    "StoreFormatError",
    "StoreLockedError",
]


class StorageError(Exception):
    """Root of every error raised by the storage package."""


class StoreLockedError(StorageError, BlockingIOError):
    """Another storage daemon holds the lock of the store (one writer per store)."""


class StoreFormatError(StorageError, ValueError):
    """The store exists but is not a worldtap run store, or its layout version is unknown."""


class StoreDamagedError(StorageError, OSError):
    """Part of a run store is missing or corrupt (a chunk that fails its checksum, a missing
    chunk inside the committed rows, unreadable attributes). The message names the run and
    the array; other runs of the store stay readable."""


class LeaseExpiredError(StorageError, OSError):
    """A daemon's lease on its store was not renewed in time: it stops writing, since another
    daemon may hold the store by now (see :class:`storage.StoreLease`)."""


class RunNotFoundError(StorageError, KeyError):
    """The store holds no run with the requested id."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class EpisodeNotFoundError(StorageError, KeyError):
    """The run holds no committed episode with the requested (world, index)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
