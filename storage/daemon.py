"""The storage daemon's core: receives messages and gaps, routes them to per-run assemblies, and
keeps serving whatever one run or one message does.

:class:`StoreDaemon` is transport-agnostic (call :meth:`StoreDaemon.handle` with each message or
gap; it is also a broker consumer), so the in-process twin used by unit tests and the ZeroMQ
daemon of :mod:`storage.cli` share every line of the storage logic.

Durability: commits run on each run's writer thread, data first and index last (see
:class:`storage.RunWriter`); an episode is stored once the commit containing it has run, and
``statistics().episodes_stored`` counts only those. A run's end is confirmed (``on_run_end``)
only after its last commit is in the store. ``close()`` commits every complete episode and
waits for it: without ``close()`` (a crash) the episodes of the last commit interval are lost,
and the next daemon on the store resumes the run from its last commit.

Failure isolation: a message the store cannot accept is rejected (counted by reason, logged,
and the episodes it touched become incomplete); a run whose store writes fail is *failed*: it
stops at its last commit, its later messages are rejected, and every other run goes on.
Nothing a message holds fails a run: malformed envelopes, ``RunStart`` values (world count,
device, metadata JSON attributes cannot hold), ``RunEnd`` schemas, batches, episode ends and
variation samples are all rejections.

Sessions: a ``RunStart`` always starts a run: the late ``RunStart`` of a run joined a moment
before from later messages is adopted by it; any other is a new session of its run id, stored
as ``<run>#2``, ``<run>#3``, ... and never merged. A repeated ``RunEnd`` is confirmed again.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any

import numpy as np

from broker import Batch, EpisodeEnd, FieldSpec, Gap, Message, MessageOf, RunEnd, RunStart, VariationSample

from ._format import ALL_RUNS, Compression, Partition, StoreLocation, local_path, to_json
from .assembly import MAX_WORLDS, ExportMode, RejectedMessage, RunAssembly, run_fields
from .run_writer import RunStoreWriter, RunWriter
from .write_queue import RunWriteQueue

__all__ = ["DaemonStatistics", "StoreDaemon", "failed_store_location"]

_log = logging.getLogger("worldtap.storage")


@dataclass(frozen=True, slots=True)
class DaemonStatistics:
    """A snapshot of the daemon's counters.

    Attributes:
        messages: Messages handled (gaps excluded).
        episodes_stored: Episodes committed (both stores in ``split`` mode).
        episodes_filtered: Complete episodes the export mode left out.
        episodes_incomplete: Episodes dropped because part of them was missed or rejected.
        episodes_open_at_end: Episodes still in progress at ``RunEnd`` (never ended).
        bytes_written: Uncompressed field bytes appended to the store(s).
        gaps: Sequence gaps recorded.
        rejected: Messages that could not be stored, by reason.
        runs_active, runs_ended: Runs in progress and runs whose ``RunEnd`` was committed.
        runs_failed: Runs stopped by a failed store write (they keep their last commit).
        lag_steps: Highest step received minus the end step of the last committed episode.
        memory_bytes: Bytes held for episodes in progress and write pieces, all runs.
        uptime_s: Seconds since the daemon started.
        other_partition: Messages of runs of other partitions, dropped unread (and their
            ``RunEnd`` confirmed at once: their own daemon confirms its commit).
        stored_by_run: Episodes committed by this daemon, per stored run name (active runs and
            those it retired, ended or failed).
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
    runs_failed: int
    lag_steps: int
    memory_bytes: int
    uptime_s: float
    other_partition: int = 0
    stored_by_run: Mapping[str, int] = field(default_factory=dict)


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
        memory_budget: Bytes for buffered episode data across all runs together (default 1 GiB).
        commit_interval: Seconds between index commits while a run is busy (finite, >= 0), at
            least: a run whose commits take long (hundreds of columns, each commit rewriting
            every column's partial last chunk) commits no sooner than
            :data:`storage.assembly.COMMIT_PACE` times its last commit's duration after it, so
            the episodes a crash can lose span that much longer.
        max_runs: Runs held in memory at once; the least recently active one is retired (its
            complete episodes committed) to admit another, or the new run is rejected.
        idle_timeout: Seconds without a message after which a run is retired (it resumes if
            its messages come back).
        on_run_end: Called with a run id once that run's ``RunEnd`` is committed (the
            transport confirms the run's end to its publisher).
        partition: The runs this daemon stores (:class:`storage.Partition`, default
            all): messages and gaps of other runs are dropped before anything else, and the
            startup clean-up touches only this partition's runs.

    Raises:
        ValueError: An argument is out of range.
        StoreFormatError: The store is not a run store.
    """

    def __init__(self, store: StoreLocation, *, export: ExportMode = "all",
                 failed_store: StoreLocation | None = None, compression: Compression = "lz4",
                 chunk_bytes: int = 1 << 20, memory_budget: int = 1 << 30, fsync: bool = False,
                 commit_interval: float = 0.5, max_runs: int = 64, idle_timeout: float = 600.0,
                 on_run_end: Callable[[str], None] | None = None,
                 partition: Partition = ALL_RUNS) -> None:
        if not isinstance(partition, Partition):
            raise TypeError(f"partition: expected a storage Partition, got {partition!r}")
        if export not in ("all", "succeeded", "split", "none"):
            raise ValueError(f"export: expected 'all', 'succeeded', 'split' or 'none', got {export!r}")
        if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
            raise ValueError(f"memory_budget: expected a positive byte count, got {memory_budget!r}")
        if not (isinstance(commit_interval, int | float) and math.isfinite(commit_interval)
                and commit_interval >= 0):
            raise ValueError(f"commit_interval: expected a finite number of seconds >= 0, got "
                             f"{commit_interval!r}")
        if isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1:
            raise ValueError(f"max_runs: expected a positive int, got {max_runs!r}")
        if not (isinstance(idle_timeout, int | float) and idle_timeout > 0):
            raise ValueError(f"idle_timeout: expected a positive number of seconds, got {idle_timeout!r}")
        self.export: ExportMode = export
        self.memory_budget = memory_budget
        self.commit_interval = float(commit_interval)
        self.max_runs = max_runs
        self.idle_timeout = float(idle_timeout)
        self.on_run_end = on_run_end
        self.partition = partition
        self.writers: list[RunStoreWriter] = []
        if export != "none":
            opts: dict[str, Any] = {"compression": compression, "chunk_bytes": chunk_bytes,
                                    "fsync": fsync, "partition": partition}
            self.writers.append(RunStoreWriter(store, **opts))
            if export == "split":
                self.writers.append(RunStoreWriter(
                    failed_store if failed_store is not None else failed_store_location(store),
                    **opts))
        self.runs: dict[str, RunAssembly] = {}
        """Active runs by stored name."""
        self._session: dict[str, str] = {}  # published run id -> stored name of its session
        self._ended: set[str] = set()       # stored names whose RunEnd was committed here
        self._failed: dict[str, str] = {}   # stored name -> why it failed
        self._messages = 0
        self._other_partition = 0
        self._gaps = 0
        self._rejected: Counter[str] = Counter()
        self._retired = Counter[str]()
        self._stored_by_run = Counter[str]()  # retired runs' committed episodes, by name
        self._started = time.monotonic()
        self.closed = False
        for writer in self.writers:
            self._clean_dirty(writer)

    @staticmethod
    def _clean_dirty(writer: RunStoreWriter) -> None:
        """Finish what a stopped daemon left: cut runs whose arrays may be longer than their
        committed counts (killed in the middle of a run, a commit or a trim)."""
        for run in writer.dirty_runs():
            try:
                reclaimed = writer.clean(run)
            except Exception as exc:  # damage in one run never stops the store
                _log.error("run %r could not be cleaned up (it stays as it is): %r", run, exc)
            else:
                _log.info("run %r: cut to its last commit (%d uncommitted rows reclaimed)", run,
                          reclaimed)

    # -- input ---------------------------------------------------------------------------

    def __call__(self, message: Message) -> None:
        """Broker-consumer form of :meth:`handle`."""
        self.handle(message)

    def handle(self, item: MessageOf[Any] | Gap) -> None:
        """Store one message (its tensors torch tensors or numpy arrays: the stored bytes are the
        same), or record a transport gap. Never raises for what a message holds: messages the
        store cannot accept are counted and skipped (see :meth:`statistics`)."""
        run = getattr(item, "run", None)
        if isinstance(run, str) and not self.partition.owns(run):
            self._skip(item)
            return
        if isinstance(item, Gap):
            self._on_gap(item)
            return
        self._messages += 1
        name: str | None = None
        try:
            if not isinstance(item, Message):
                raise RejectedMessage("type", f"expected a broker message, got {type(item).__name__}")
            _check_envelope(item)
            asm = self._route(item)
            if asm is None:
                return
            name = asm.run
            if isinstance(item, RunStart):
                return
            asm.check_seq(item.seq, item.step, item)
            if isinstance(item, Batch):
                asm.on_batch(item)
            elif isinstance(item, EpisodeEnd):
                asm.on_end(item)
            elif isinstance(item, VariationSample):
                asm.on_variation(item)
            elif isinstance(item, RunEnd):
                self._end(asm, item)
                return
            if asm.due():
                asm.commit()
        except RejectedMessage as exc:
            self._reject(item, name, exc)
        except Exception as exc:  # the run's store failed (or a defect): that run stops, not us
            if name is None:
                self._reject(item, None, RejectedMessage("error", repr(exc)))
            else:
                self._fail(name, exc)
        finally:
            failure = self.runs[name].queue.failure if name is not None and name in self.runs else None
            if name is not None and failure is not None:
                self._fail(name, failure)

    def _skip(self, item: MessageOf[Any] | Gap) -> None:
        """Drop a message or gap of another partition's run; confirm its ``RunEnd`` at once
        (publishers wait for every daemon's confirmation; the owner confirms its commit)."""
        if isinstance(item, Gap):
            return
        self._other_partition += 1
        if isinstance(item, RunEnd) and self.on_run_end is not None:
            self.on_run_end(item.run)

    def tick(self) -> None:
        """Commit runs whose commit interval elapsed and retire idle ones (call when the input
        is idle, and now and then)."""
        now = time.monotonic()
        for name, asm in list(self.runs.items()):
            try:
                if asm.queue.failure is not None:
                    raise asm.queue.failure
                if now - asm.last_message > self.idle_timeout:
                    _log.info("run %r: idle for %.0f s; retired (it resumes if its messages come "
                              "back)", name, now - asm.last_message)
                    self._retire(name)
                elif asm.due():
                    asm.commit()
            except Exception as exc:
                self._fail(name, exc)

    # -- routing -------------------------------------------------------------------------

    def _route(self, msg: MessageOf[Any]) -> RunAssembly | None:
        """The assembly of ``msg``'s run: an active one, a resumed one, or a new one."""
        if self.export == "none":
            if isinstance(msg, RunEnd) and self.on_run_end is not None:
                self.on_run_end(msg.run)
            return None
        name = self._session.get(msg.run, msg.run)
        asm = self.runs.get(name)
        if isinstance(msg, RunStart):
            return self._start(msg, asm)
        if asm is not None:
            return asm
        if name in self._failed:
            raise RejectedMessage("run failed", f"run {name!r} failed earlier ({self._failed[name]}); "
                                                f"its messages are not stored", worlds=np.zeros(0, np.int64))
        if name not in self._ended and self.writers[0].status(name) in ("complete", "interrupted"):
            self._ended.add(name)  # ended before this daemon started: never reopened
        if name in self._ended:
            if isinstance(msg, RunEnd):  # a repeated end (the publisher asks again): confirm
                if self.on_run_end is not None:
                    self.on_run_end(msg.run)
                return None
            raise RejectedMessage("run ended", f"run {name!r}: a message after its RunEnd",
                                  worlds=np.zeros(0, np.int64))
        return self._open(name, msg)

    def _start(self, msg: RunStart, asm: RunAssembly | None) -> RunAssembly:
        """A ``RunStart``: a new run, the late start of a run joined a moment ago, or a new
        session of a run id already used (stored under a new name, never merged).

        Raises:
            RejectedMessage: The ``RunStart`` holds something that cannot be stored.
        """
        num_worlds, device, metadata, fields = _start_fields(msg)
        if asm is not None and asm.adoptable(int(msg.seq)):
            asm.adopt(num_worlds, device, metadata, fields)
            _log.info("run %r: its RunStart arrived after its first messages; adopted", asm.run)
            return asm
        previous = self._session.get(msg.run, msg.run)
        if previous in self.runs:
            _log.warning("run %r: a new session started before the previous one ended; the "
                         "previous one is retired as it stands", previous)
            self._retire(previous)
        name = self.writers[0].session_name(msg.run)
        for writer in self.writers[1:]:
            while writer.has_run(name):
                name = self.writers[0].session_name(name)
        if name != msg.run:
            _log.warning("run id %r is already in the store: this session is stored as %r", msg.run, name)
        self._session[msg.run] = name
        self._ended.discard(name)
        asm = self._admit(name, msg.run, num_worlds=num_worlds, device=device,
                          metadata=metadata, clean=True, start=msg)
        asm.set_run_fields(fields)
        return asm

    def _open(self, name: str, msg: MessageOf[Any]) -> RunAssembly:
        """A run joined without its ``RunStart``: resumed from the store, or new (its start
        counts as seen when the first message follows ``RunStart``'s sequence number 0)."""
        return self._admit(name, msg.run, num_worlds=None, device="unknown", metadata=None,
                           clean=msg.seq <= 1)

    def _admit(self, name: str, run_id: str, *, num_worlds: int | None, device: str,
               metadata: dict[str, Any] | None, clean: bool, start: RunStart | None = None) -> RunAssembly:
        if len(self.runs) >= self.max_runs:
            idle = min(self.runs, key=lambda r: self.runs[r].last_message)
            _log.warning("%d runs active (max_runs): retiring the least recently active, %r",
                         len(self.runs), idle)
            self._retire(idle)
        share = self.memory_budget // (len(self.runs) + 1)
        pieces = 2 if self.export == "split" else 1
        if num_worlds is not None and RunAssembly.base_bytes(num_worlds, pieces) > share:
            raise RejectedMessage("budget", f"run {name!r}: {num_worlds} worlds do not fit in its "
                                            f"share ({share} bytes) of --memory-budget="
                                            f"{self.memory_budget}")
        for other in self.runs.values():
            if other.min_budget() > share:
                raise RejectedMessage("budget", f"run {name!r}: {len(self.runs) + 1} runs do not "
                                                f"fit in --memory-budget={self.memory_budget} bytes "
                                                f"(run {other.run!r} needs {other.min_budget()}); "
                                                f"raise it, or lower max_runs")
        writers: list[RunWriter] = []
        try:
            for store in self.writers:
                writers.append(store.run(name, num_worlds=num_worlds or 1, device=device,
                                         metadata=metadata, session_of=run_id if name != run_id else None))
        except Exception:
            for store in self.writers:
                store.forget(name)
            raise
        primary = writers[0]
        resumed = primary.exists
        if resumed:
            with primary.lock:
                known = primary.meta.get("num_worlds_known", True)
                stored_worlds = int(primary.meta["num_worlds"])
            num_worlds = stored_worlds if known else None
            clean = False
        else:
            for writer in writers:
                with writer.lock:  # a joined run's worlds are discovered (and not trusted on resume)
                    writer.meta["num_worlds_known"] = num_worlds is not None
        queue = RunWriteQueue(name)
        try:
            asm = RunAssembly(name, primary, writers[1] if len(writers) > 1 else None, self.export,
                              queue, num_worlds=num_worlds, budget_bytes=share, clean=clean,
                              resumed=resumed, commit_interval=self.commit_interval,
                              joined=start is None and not resumed)
        except BaseException:
            queue.close()
            for store in self.writers:
                store.forget(name)
            raise
        for writer in writers:
            if writer.exists:
                queue.submit(_resume_job, writer)
            elif num_worlds is not None:
                queue.submit(writer.create)  # a started run shows in the store at once
        if start is not None:
            asm.started = True
            asm.check_seq(start.seq, start.step, start)
        self.runs[name] = asm
        for other in self.runs.values():
            if other is not asm:
                other.set_budget(share)
        _log.info("run %r: %s (%s worlds)", name,
                  "resumed" if resumed else "started" if start is not None else "joined",
                  num_worlds if num_worlds is not None else "unknown")
        return asm

    # -- run ends, failures, retirement --------------------------------------------------

    def _end(self, asm: RunAssembly, msg: RunEnd) -> None:
        schema = msg.schema
        if not isinstance(schema, Mapping) or not all(
                isinstance(t, str) and isinstance(fs, Mapping)
                and all(isinstance(f, str) and isinstance(spec, FieldSpec) for f, spec in fs.items())
                for t, fs in schema.items()):
            raise RejectedMessage("header", f"run {asm.run!r}: RunEnd schema is not a mapping of "
                                            f"topics to fields to FieldSpec: {schema!r:.120}",
                                  worlds=np.zeros(0, np.int64))
        asm.on_run_end(msg)
        if asm.queue.failure is not None:
            raise asm.queue.failure
        name = asm.run
        self._retire(name)
        self._ended.add(name)
        _log.info("run %r ended: %d episodes stored, %d filtered, %d incomplete, %d still open at "
                  "its end", name, sum(w.stored for w in asm._writers()), asm.filtered, asm.incomplete,
                  asm.open_at_end)
        if self.on_run_end is not None:
            self.on_run_end(msg.run)

    def _retire(self, name: str) -> None:
        asm = self.runs.pop(name)
        try:
            asm.close()
        finally:
            self._count(asm)
            for store in self.writers:
                store.forget(name)
        if asm.queue.failure is not None:
            self._failed[name] = repr(asm.queue.failure)

    def _fail(self, name: str, exc: BaseException) -> None:
        asm = self.runs.pop(name, None)
        if asm is None:
            return
        self._failed[name] = repr(exc)
        _log.error("run %r failed and stops at its last commit (the daemon serves the others): %r",
                   name, exc, exc_info=exc)
        asm.queue.close()
        self._count(asm)
        for store in self.writers:
            store.forget(name)
        self._rebalance()

    def _count(self, asm: RunAssembly) -> None:
        stored = sum(w.stored for w in asm._writers())
        self._retired["stored"] += stored
        self._stored_by_run[asm.run] += stored
        for key in ("filtered", "incomplete", "open_at_end"):
            self._retired[key] += getattr(asm, key)

    def _rebalance(self) -> None:
        """Give the remaining runs their larger share when it at least doubles."""
        if not self.runs:
            return
        share = self.memory_budget // len(self.runs)
        for name, asm in list(self.runs.items()):
            if share >= 2 * asm.budget_bytes:
                try:
                    asm.set_budget(share)
                except Exception as exc:
                    self._fail(name, exc)

    def _reject(self, item: Any, name: str | None, exc: RejectedMessage) -> None:
        self._rejected[exc.reason] += 1
        run = getattr(item, "run", None)
        (_log.warning if self._rejected[exc.reason] <= 10 else _log.debug)(
            "rejected a message of run %r: %s", run, exc)
        if name is None and isinstance(run, str):  # rejected before routing (its envelope)
            name = self._session.get(run, run)
        asm = self.runs.get(name) if name is not None else None
        if asm is not None:
            asm.rejected[exc.reason] += 1
            if exc.worlds is None or len(exc.worlds):
                asm.invalidate(exc.worlds)

    def _on_gap(self, gap: Gap) -> None:
        run, topic, expected, received = gap.run, gap.topic, gap.expected, gap.received
        if not (isinstance(run, str) and run and isinstance(topic, str)
                and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63
                        for v in (expected, received))):
            self._rejected["gap"] += 1
            _log.warning("a malformed gap was not recorded: %r", gap)
            return
        self._gaps += 1
        if self.export == "none":
            return
        name = self._session.get(run, run)
        asm = self.runs.get(name)
        try:
            if asm is None:
                if name in self._failed or name in self._ended:
                    return
                asm = self._admit(name, str(gap.run), num_worlds=None, device="unknown",
                                  metadata=None, clean=False)
            asm.on_gap(int(gap.expected), int(gap.received), str(gap.topic))
        except RejectedMessage as exc:
            self._rejected[exc.reason] += 1
            _log.warning("a gap of run %r could not be recorded: %s", gap.run, exc)
        except Exception as exc:
            self._fail(name, exc)

    # -- output --------------------------------------------------------------------------

    @property
    def runs_ended(self) -> int:
        """Runs whose ``RunEnd`` was committed (``statistics().runs_ended``, without building
        the whole snapshot: cheap enough to ask after every message)."""
        return len(self._ended)

    def statistics(self) -> DaemonStatistics:
        """A frozen snapshot of the counters."""
        live = list(self.runs.values())
        stored = self._retired["stored"] + sum(w.stored for a in live for w in a._writers())
        total = {k: self._retired[k] + sum(getattr(r, k) for r in live)
                 for k in ("filtered", "incomplete", "open_at_end")}
        lag = max((r.step_high - r.primary.committed_step for r in live), default=0)
        by_run = self._stored_by_run.copy()
        for r in live:
            by_run[r.run] += sum(w.stored for w in r._writers())
        return DaemonStatistics(
            messages=self._messages, episodes_stored=stored,
            episodes_filtered=total["filtered"], episodes_incomplete=total["incomplete"],
            episodes_open_at_end=total["open_at_end"],
            bytes_written=sum(w.bytes_written for w in self.writers), gaps=self._gaps,
            rejected=MappingProxyType(dict(self._rejected)), runs_active=len(live),
            runs_ended=len(self._ended), runs_failed=len(self._failed), lag_steps=max(0, lag),
            memory_bytes=sum(r.memory() for r in live), uptime_s=time.monotonic() - self._started,
            other_partition=self._other_partition, stored_by_run=MappingProxyType(dict(by_run)))

    def close(self) -> None:
        """Commit every complete episode of every run and cut the arrays. Idempotent.
        In-progress episodes are not stored (a later daemon resuming the run drops them as
        incomplete)."""
        if self.closed:
            return
        self.closed = True
        for name in list(self.runs):
            try:
                self._retire(name)
            except Exception as exc:
                self._fail(name, exc)
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


def _check_envelope(msg: MessageOf[Any]) -> None:
    run, seq, step = msg.run, msg.seq, msg.step
    if not isinstance(run, str) or not run:
        raise RejectedMessage("run", f"invalid run id {run!r:.80}")
    for what, value in (("seq", seq), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or not 0 <= value < 1 << 63:
            raise RejectedMessage("header", f"run {run!r}: invalid {what} {value!r:.80} (expected an "
                                            f"int in [0, 2**63))")


def _start_fields(msg: RunStart) -> tuple[int, str, dict[str, Any], dict[str, Any]]:
    """The world count, device, JSON-safe metadata and run fields (declarations, seed,
    ``started_at``: :func:`storage.assembly.run_fields`) of a ``RunStart``.

    Raises:
        RejectedMessage: (``"header"``) an invalid world count, device, seed or wall time;
            (``"metadata"``) metadata that is not a mapping of values JSON attributes can hold
            losslessly (bytes and non-finite floats can: see :func:`storage._format.to_json`);
            (``"variations"``) declarations that cannot be stored.
    """
    num_worlds, device, metadata = msg.num_worlds, msg.device, msg.metadata
    if isinstance(num_worlds, bool) or not isinstance(num_worlds, int | np.integer) or \
            not 1 <= num_worlds <= MAX_WORLDS:
        raise RejectedMessage("header", f"run {msg.run!r}: RunStart num_worlds must be an int in "
                                        f"[1, {MAX_WORLDS}], got {num_worlds!r:.80}")
    if not isinstance(device, str):
        raise RejectedMessage("header", f"run {msg.run!r}: RunStart device must be a str, got "
                                        f"{device!r:.80}")
    if not isinstance(metadata, Mapping):
        raise RejectedMessage("metadata", f"run {msg.run!r}: RunStart metadata must be a mapping, "
                                          f"got {type(metadata).__name__}")
    try:
        stored = to_json(dict(metadata))
        json.dumps(stored, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RejectedMessage("metadata", f"run {msg.run!r}: RunStart metadata cannot be stored "
                                          f"as JSON attributes: {exc}") from None
    return int(num_worlds), device, stored, run_fields(msg)


def _resume_job(writer: RunWriter) -> None:
    """First job of a reopened run: cut it back to its last commit, count the resume."""
    reclaimed = writer.recover()
    with writer.lock:
        resumed = int(writer.meta.get("resumed", 0)) + 1
        committed = writer.meta["committed"]["episodes"]
    writer.commit(status="open", extra={"resumed": resumed})
    _log.info("resumed run %r: %d committed episodes, %d uncommitted rows reclaimed",
              writer.run, committed, reclaimed)
