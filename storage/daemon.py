"""The storage daemon's core: routes received messages into per-run assemblers and commits.

:class:`StoreDaemon` is transport-agnostic (call :meth:`StoreDaemon.handle` with each
message or gap; it is also a broker consumer), so the in-process twin used by unit tests and
the ZeroMQ daemon of :mod:`storage.cli` share every line of the storage logic.

Durability: commits run on each run's writer thread, data first and index last (see
:class:`storage.RunWriter`); an episode is stored once the commit containing it has run, and
``statistics().episodes_stored`` counts only those. ``close()`` commits every complete
episode and waits for it: without ``close()`` (a crash) the episodes of the last commit
interval are lost. Episodes still in progress are never stored by this session; a later
session resuming the run drops them as incomplete.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

from broker import Batch, EpisodeEnd, Gap, Message, RunEnd, RunStart, VariationSample

from ._zarr_io import Compression, StoreLocation, local_path
from .run_state import ExportMode, RejectedMessage, RunAssembler
from .zarr_store import RunStoreWriter

__all__ = ["DaemonStatistics", "StoreDaemon", "failed_store_location"]

_log = logging.getLogger("worldtap.storage")


@dataclass(frozen=True, slots=True)
class DaemonStatistics:
    """A snapshot of the daemon's counters.

    Attributes:
        messages: Messages handled (gaps excluded).
        episodes_stored: Episodes committed (both stores in ``split`` mode).
        episodes_filtered: Complete episodes the export mode left out.
        episodes_incomplete: Episodes dropped because their start or part of them was missed.
        episodes_open_at_end: Episodes still in progress at ``RunEnd`` (never ended).
        bytes_written: Uncompressed field bytes appended to the store(s).
        gaps: Sequence gaps recorded.
        rejected: Messages that decoded but could not be stored, by reason.
        runs_active, runs_ended: Runs in progress and runs whose ``RunEnd`` was handled.
        lag_steps: Highest step received minus the end step of the last committed episode.
        uptime_s: Seconds since the daemon started.
    """

    messages: int
    episodes_stored: int
    episodes_filtered: int
    episodes_incomplete: int
    episodes_open_at_end: int
    bytes_written: int
    gaps: int
    rejected: Mapping[str, int]
    runs_active: int
    runs_ended: int
    lag_steps: int
    uptime_s: float


def failed_store_location(location: StoreLocation) -> StoreLocation:
    """Where ``split`` mode puts failed episodes: ``runs.zarr`` -> ``runs_failed.zarr``."""
    path = local_path(location)
    text = str(path) if path is not None else os.fspath(location)  # type: ignore[arg-type]
    stem, dot, suffix = text.rstrip("/").rpartition(".")
    if not dot or "/" in suffix:
        return text.rstrip("/") + "_failed"
    return f"{stem}_failed.{suffix}"


class StoreDaemon:
    """Writes the runs it is fed into a run store.

    Args:
        store: Where kept (or succeeded) episodes go; ignored with ``export="none"``.
        export: ``all``, ``succeeded``, ``split`` (failed ones into ``failed_store``) or ``none``.
        failed_store: Store for failed episodes in ``split`` mode (default: see
            :func:`failed_store_location`).
        compression, chunk_bytes, fsync: Passed to :class:`storage.RunStoreWriter`.
        memory_budget: Bytes for buffered episode data across all runs (default 1 GiB).
        commit_interval: Seconds between index commits while a run is busy.
    """

    def __init__(self, store: StoreLocation, *, export: ExportMode = "all",
                 failed_store: StoreLocation | None = None, compression: Compression = "lz4",
                 chunk_bytes: int = 1 << 20, memory_budget: int = 1 << 30, fsync: bool = False,
                 commit_interval: float = 0.5) -> None:
        if export not in ("all", "succeeded", "split", "none"):
            raise ValueError(f"export: expected 'all', 'succeeded', 'split' or 'none', got {export!r}")
        if memory_budget <= 0:
            raise ValueError(f"memory_budget: expected a positive byte count, got {memory_budget!r}")
        self.export: ExportMode = export
        self.memory_budget = memory_budget
        self.commit_interval = commit_interval
        self.writers: list[RunStoreWriter] = []
        if export != "none":
            opts: dict[str, Any] = {"compression": compression, "chunk_bytes": chunk_bytes,
                                    "fsync": fsync}
            self.writers.append(RunStoreWriter(store, **opts))
            if export == "split":
                self.writers.append(RunStoreWriter(
                    failed_store if failed_store is not None else failed_store_location(store),
                    **opts))
        self.runs: dict[str, RunAssembler] = {}
        self._ended: set[str] = set()
        self._messages = 0
        self._gaps = 0
        self._rejected: Counter[str] = Counter()
        self._retired = Counter[str]()
        self._started = time.monotonic()
        self.closed = False

    # -- input ---------------------------------------------------------------------------

    def __call__(self, message: Message) -> None:
        """Broker-consumer form of :meth:`handle`."""
        self.handle(message)

    def handle(self, item: Message | Gap) -> None:
        """Store one message, or record a transport gap (anything with ``run``, ``expected``
        and ``received``). Messages the store cannot accept are counted and skipped."""
        if not isinstance(item, Message):  # a transport Gap
            self._gaps += 1
            run = self._run(str(item.run), None)
            if run is not None:
                run.on_gap(int(item.expected), int(item.received), str(item.topic))
            return
        self._messages += 1
        try:
            run = self._run(item.run, item)
            if run is None:
                return
            run.note_seq(item.seq, item.step)
            if isinstance(item, Batch):
                run.on_batch(item)
            elif isinstance(item, EpisodeEnd):
                run.on_end(item)
            elif isinstance(item, VariationSample):
                run.on_variation(item)
            elif isinstance(item, RunEnd):
                run.on_run_end(item)
                self._retire(item.run)
                return
            if run.due():
                run.commit()
        except RejectedMessage as exc:
            reason = str(exc)
            self._rejected[reason.split(":")[0]] += 1
            _log.warning("rejected a message of run %r: %s", item.run, reason)

    def tick(self) -> None:
        """Commit runs whose commit interval elapsed (call when the input is idle)."""
        for run in list(self.runs.values()):
            if run.due():
                run.commit()

    def _run(self, run_id: str, msg: Message | None) -> RunAssembler | None:
        run = self.runs.get(run_id)
        if run is not None:
            return run
        if self.export == "none" or (run_id in self._ended and not isinstance(msg, RunStart)):
            return None
        start = msg if isinstance(msg, RunStart) else None
        num_worlds = start.num_worlds if start is not None else 1
        writers = [w.run(run_id, num_worlds=num_worlds,
                         device=start.device if start is not None else "unknown",
                         metadata=dict(start.metadata) if start is not None else None)
                   for w in self.writers]
        num_worlds = max(num_worlds, int(writers[0].meta["num_worlds"]))
        share = self.memory_budget // (1 + len(self.runs))
        run = RunAssembler(run_id, writers[0], writers[1] if len(writers) > 1 else None,
                           self.export, num_worlds=num_worlds, budget_bytes=share,
                           clean=start is not None, commit_interval=self.commit_interval)
        self.runs[run_id] = run
        self._ended.discard(run_id)
        _log.info("run %r: %s (%d worlds)", run_id, "started" if start else "joined", num_worlds)
        return run

    def _retire(self, run_id: str) -> None:
        run = self.runs.pop(run_id)
        run.close()
        self._ended.add(run_id)
        for key in ("stored", "filtered", "incomplete", "open_at_end"):
            self._retired[key] += getattr(run, key)
        _log.info("run %r ended: %d episodes stored, %d filtered, %d incomplete",
                  run_id, run.stored, run.filtered, run.incomplete)

    # -- output --------------------------------------------------------------------------

    def statistics(self) -> DaemonStatistics:
        """A frozen snapshot of the counters."""
        live = list(self.runs.values())
        total = {k: self._retired[k] + sum(getattr(r, k) for r in live)
                 for k in ("stored", "filtered", "incomplete", "open_at_end")}
        lag = max((r.step_high - r.committed_step for r in live), default=0)
        return DaemonStatistics(
            messages=self._messages, episodes_stored=total["stored"],
            episodes_filtered=total["filtered"], episodes_incomplete=total["incomplete"],
            episodes_open_at_end=total["open_at_end"],
            bytes_written=sum(w.bytes_written for w in self.writers), gaps=self._gaps,
            rejected=MappingProxyType(dict(self._rejected)), runs_active=len(live),
            runs_ended=len(self._ended), lag_steps=max(0, lag),
            uptime_s=time.monotonic() - self._started)

    def close(self) -> None:
        """Commit every complete episode of every run. Idempotent. In-progress episodes are
        not stored (a later daemon resuming the run drops them as incomplete)."""
        if self.closed:
            return
        self.closed = True
        for run in self.runs.values():
            run.commit(wait=True)
            run.close()
        for writer in self.writers:
            writer.close()

    def __enter__(self) -> StoreDaemon:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def store_paths(self) -> list[Path]:
        """Local directories written to (what the lock must cover)."""
        return [p for w in self.writers if (p := local_path(w.location)) is not None]
