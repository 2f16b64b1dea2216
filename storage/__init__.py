"""worldtap.storage: the storage daemon, the Zarr run-store writer and reader, and its CLI.

Layout of a run store: see ``storage/LAYOUT.md``.
"""

from .daemon import DaemonStatistics, StoreDaemon, failed_store_location
from .errors import (
    EpisodeNotFoundError,
    RunNotFoundError,
    StorageError,
    StoreFormatError,
    StoreLockedError,
)
from .lock import StoreLease, StoreLock
from .reader import RunStore, Table
from .run_state import ExportMode, RejectedMessage
from .zarr_store import EpisodeRows, RunStoreWriter, RunWriter

__all__ = [
    "DaemonStatistics",
    "EpisodeNotFoundError",
    "EpisodeRows",
    "ExportMode",
    "RejectedMessage",
    "RunNotFoundError",
    "RunStore",
    "RunStoreWriter",
    "RunWriter",
    "StorageError",
    "StoreDaemon",
    "StoreFormatError",
    "StoreLease",
    "StoreLock",
    "StoreLockedError",
    "Table",
    "failed_store_location",
]
