"""worldtap.storage: the storage daemon, the Zarr run-store writer and reader, and its CLI.

The path of a message, in module order: receive (:mod:`storage.daemon`, :mod:`storage.cli`,
:mod:`storage.status`) -> assemble (:mod:`storage.assembly`, :mod:`storage.episode_buffers`) ->
write (:mod:`storage.write_queue`, :mod:`storage.run_writer`) -> read (:mod:`storage.reader`).
Operating a store: :mod:`storage.info`, :mod:`storage.verify` (verify and repair) and
:mod:`storage.status_cli` (a running daemon's status, read over its ``--status`` socket).
Layout of a run store: see ``storage/LAYOUT.md``.
"""

from ._format import Partition
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
from .status import daemon_status
from .verify import Problem, RunReport, VerifyReport, repair_store, verify_store
from .xarray_support import episode_coordinate

__all__ = [
    "DaemonStatistics",
    "EpisodeBatch",
    "EpisodeNotFoundError",
    "EpisodeRows",
    "ExportMode",
    "FencedStore",
    "LeaseExpiredError",
    "Partition",
    "Problem",
    "QueryError",
    "RejectedMessage",
    "RunNotFoundError",
    "RunReport",
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
    "VerifyReport",
    "daemon_status",
    "episode_coordinate",
    "failed_store_location",
    "repair_store",
    "verify_store",
]
