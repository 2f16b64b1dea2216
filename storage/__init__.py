"""worldtap.storage: the storage daemon, the Zarr run-store writer and reader, and its CLI.

The path of a message, in module order: receive (:mod:`storage.daemon`, :mod:`storage.cli`,
:mod:`storage.status`) -> assemble (:mod:`storage.assembly`, :mod:`storage.episode_buffers`) ->
write (:mod:`storage.write_queue`, :mod:`storage.run_writer`) -> read (:mod:`storage.reader`).
Layout of a run store: see ``storage/LAYOUT.md``.
"""

from .assembly import ExportMode, RejectedMessage
from .daemon import DaemonStatistics, StoreDaemon, failed_store_location
from .errors import (
    EpisodeNotFoundError,
    LeaseExpiredError,
    RunNotFoundError,
    StorageError,
    StoreDamagedError,
    StoreFormatError,
    StoreLockedError,
)
from .lock import FencedStore, StoreLease, StoreLock
from .query import QueryError
from .reader import EpisodeBatch, RunStore, Table
from .run_writer import EpisodeRows, RunStoreWriter, RunWriter
from .xarray_support import episode_coordinate

__all__ = [
    "DaemonStatistics",
    "EpisodeBatch",
    "EpisodeNotFoundError",
    "EpisodeRows",
    "ExportMode",
    "FencedStore",
    "LeaseExpiredError",
    "QueryError",
    "RejectedMessage",
    "RunNotFoundError",
    "RunStore",
    "RunStoreWriter",
    "RunWriter",
    "StorageError",
    "StoreDaemon",
    "StoreDamagedError",
    "StoreFormatError",
    "StoreLease",
    "StoreLock",
    "StoreLockedError",
    "Table",
    "episode_coordinate",
    "failed_store_location",
]
