"""``worldtap-store verify`` and ``worldtap-store repair``: check a run store against its index,
and cut damaged runs back to what verifies.

:func:`verify_store` reads every chunk of every array inside each run's committed rows once
(through the bulk readers' chunk path: checksums included) and checks the index: the run's
attributes parse, every table (episodes, segments, gaps, variation samples) has its committed
length, every episode's segments are contiguous, belong to it and lie within its terms'
committed rows, and every row of an episode was recorded between its start and end steps.
A data chunk that no committed segment references may be absent (a resumed run's reclaimed
debris); one that is present must still decode. Per run it reports each problem and the
*longest verified prefix*: the number of leading episodes, in commit order, whose table rows,
segments and data all verified.

:func:`repair_store` cuts each damaged run to that prefix through the commit protocol (see
``LAYOUT.md``): the removed range is appended to ``gaps/`` (source 4), then one commit point
publishes the smaller counts and the ``repaired`` attribute, then the run's arrays are cut to
them as a resumed daemon cuts a dirty run. A kill at any moment leaves the old commit or the
new one. A run whose attributes cannot be read has no index to cut by and is left as it is.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._format import (
    EPISODE_COLUMNS,
    GAP_COLUMNS,
    HOOK_NODE,
    SEGMENT_COLUMNS,
    STEP_NODE,
    VAR_COLUMNS,
    StoreLocation,
    child_nodes,
    node_name,
)

__all__ = ["REPAIR_SOURCE", "Problem", "RunReport", "VerifyReport", "repair_store", "verify_store"]

HELP = "check every chunk and index of a store (exit 7 when something is damaged)"

DAMAGED = 7
"""Exit code of ``verify`` (and ``repair --dry-run``) when a store holds damage, and of
``repair`` when a run could not be repaired."""
REPAIR_SOURCE = 4
"""``gaps/`` source code of the episodes a repair removed (a range of run sequence numbers)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong in a run.

    Attributes:
        run: The run id (the group node when the attributes cannot be read).
        array: The array or group, relative to the run's group (``""``: the attributes).
        rows: The rows ``[start, stop)`` concerned, or ``None``.
        chunk: The row-chunk index, or ``None``.
        what: What is wrong.
    """

    run: str
    array: str
    rows: tuple[int, int] | None
    chunk: int | None
    what: str

    def __str__(self) -> str:
        where = self.array or "attributes"
        if self.chunk is not None:
            where += f" chunk {self.chunk}"
        if self.rows is not None:
            where += f" rows {self.rows[0]}..{self.rows[1]}"
        return f"run {self.run!r}: {where}: {self.what}"

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "array": self.array, "rows": list(self.rows) if self.rows else None,
                "chunk": self.chunk, "what": self.what}


@dataclass(slots=True)
class RunReport:
    """What :func:`verify_store` found in one run.

    Attributes:
        run: The run id (the group node when the attributes cannot be read).
        node: The run's group node under ``runs/``.
        episodes: Committed episodes (``None`` when the attributes cannot be read).
        verified: The longest verified prefix: leading episodes (commit order) whose data all
            verified (``None`` when the attributes cannot be read).
        problems: Everything wrong, in the order found.
        keep: The committed counts a repair would publish (``None``: nothing to cut, or the
            run cannot be repaired).
        removed: ``[expected, received)`` run sequence numbers the removed episodes span.
    """

    run: str
    node: str
    episodes: int | None
    verified: int | None
    problems: list[Problem] = field(default_factory=list)
    keep: dict[str, Any] | None = None
    removed: tuple[int, int] | None = None

    @property
    def sound(self) -> bool:
        return not self.problems

    @property
    def repairable(self) -> bool:
        """Whether :func:`repair_store` can cut it (its attributes, the index, are readable)."""
        return self.episodes is not None

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "node": self.node, "sound": self.sound, "episodes": self.episodes,
                "verified": self.verified, "repairable": self.repairable,
                "problems": [p.to_dict() for p in self.problems]}


@dataclass(slots=True)
class VerifyReport:
    """What :func:`verify_store` found: one :class:`RunReport` per run checked."""

    location: str
    runs: list[RunReport]

    @property
    def sound(self) -> bool:
        return all(r.sound for r in self.runs)

    @property
    def problems(self) -> list[Problem]:
        return [p for r in self.runs for p in r.problems]

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.location, "sound": self.sound, "runs": [r.to_dict() for r in self.runs]}


class _Column:
    """Committed rows of one array, with the rows that could not be read."""

    def __init__(self, values: np.ndarray, bad: np.ndarray) -> None:
        self.values = values
        self.bad = bad


_BATCH = 64
"""Chunks of an array read (and held decoded) at once."""

_RUNS_AT_ONCE = 8
"""Runs of an object store checked at once."""


class _Checker:
    """Checks one run (see :func:`verify_store`)."""

    def __init__(self, reader: Any, run: str, node: str, tick: Callable[[int], None]) -> None:
        self.reader, self.run, self.node, self.tick = reader, run, node, tick
        self.problems: list[Problem] = []
        # path -> what :meth:`prefetch` read: the array (or why it cannot be opened), its bad
        # chunks and the values kept (None where it was not read)
        self.fetched: dict[str, tuple[Any, dict[int, str] | None, np.ndarray | None]] = {}

    def prefetch(self, wanted: Sequence[tuple[str, int, str | None]]) -> None:
        """Open the arrays ``wanted`` (path, committed rows, the dtype of the values to keep or
        ``None``) and read their chunks, all at once on the reader's array threads (an object
        store, where each request waits a round trip); :meth:`array`, :meth:`chunks` and
        :meth:`column` then take what was read, and record its problems where they are
        called, in the order a check one array after the other records them."""
        import zarr

        from ._reading import _ARRAYS_AT_ONCE, _at_once

        def one(path: str, n: int, dtype: str | None) -> tuple[Any, dict[int, str] | None, np.ndarray | None]:
            try:
                arr = self._open(path)
            except Exception as exc:
                return exc, None, None
            if not isinstance(arr, zarr.Array) or arr.shape[0] < n:
                return arr, None, None
            values = np.zeros(n, dtype) if dtype is not None else None
            # as many decoded chunks held at once, in all, as one array read alone holds
            return arr, self._read(arr, n, values, _BATCH // _ARRAYS_AT_ONCE), values

        for (path, _, _), got in zip(wanted, _at_once([(one, w) for w in wanted], True), strict=True):
            self.fetched[path] = got

    def _open(self, path: str) -> Any:
        """The node ``path`` of the run (an array, a group or ``None``)."""
        return self.reader.root.get(f"runs/{self.node}/{path}")

    def problem(self, array: str, what: str, rows: tuple[int, int] | None = None,
                chunk: int | None = None) -> None:
        self.problems.append(Problem(self.run, array, rows, chunk, what))

    def array(self, path: str, n: int) -> Any:
        """The array ``path`` of the run, ``None`` (and a problem) when it cannot be opened
        or is shorter than its ``n`` committed rows."""
        import zarr

        try:
            arr = self.fetched[path][0] if path in self.fetched else self._open(path)
            if isinstance(arr, Exception):
                raise arr
        except Exception as exc:
            self.problem(path, f"cannot be opened: {exc!r}", (0, n))
            return None
        if not isinstance(arr, zarr.Array):
            if n:
                self.problem(path, f"is missing but {n} rows are committed", (0, n))
            return None
        if arr.shape[0] < n:
            self.problem(path, f"has {arr.shape[0]} rows, {n} are committed", (arr.shape[0], n))
            return None
        return arr

    def chunks(self, path: str, arr: Any, n: int, out: np.ndarray | None = None) -> dict[int, str]:
        """Read every chunk of ``arr`` holding its first ``n`` rows (into ``out`` when given);
        returns the bad chunks."""
        _, bad, values = self.fetched.get(path, (None, None, None))
        if bad is not None:  # read by prefetch
            if out is not None:
                assert values is not None
                out[:] = values
            return bad
        return self._read(arr, n, out)

    def _read(self, arr: Any, n: int, out: np.ndarray | None, batch: int = _BATCH) -> dict[int, str]:
        rows = int(arr.chunks[0])
        ids = range(-(-n // rows))

        def place(i: int, chunk: np.ndarray) -> None:
            if out is not None:
                stop = min(n, (i + 1) * rows)
                out[i * rows:stop] = chunk[:stop - i * rows]

        bad: dict[int, str] = self.reader.check_chunks(self.run, arr, ids,
                                                       place if out is not None else None, batch=batch)
        self.tick(len(ids))
        return bad

    def column(self, path: str, n: int, dtype: str) -> _Column:
        """The first ``n`` rows of a table column; a problem for each bad chunk."""
        values = np.zeros(n, dtype)
        bad = np.zeros(n, bool)
        arr = self.array(path, n)
        if arr is None:
            bad[:] = bool(n)
            return _Column(values, bad)
        rows = int(arr.chunks[0])
        for chunk, why in sorted(self.chunks(path, arr, n, values).items()):
            span = (chunk * rows, min(n, (chunk + 1) * rows))
            bad[span[0]:span[1]] = True
            self.problem(path, why, span, chunk)
        return _Column(values, bad)

    def table(self, path: str, names: Iterable[str], n: int, dtype: str = "int64") -> dict[str, _Column]:
        return {c: self.column(f"{path}/{c}", n, EPISODE_COLUMNS.get(c, dtype) if path == "episodes"
                               else dtype) for c in names}


def _counts(meta: dict[str, Any]) -> str | None:
    """What is wrong with a run's attributes (``None``: they hold what a reader needs)."""
    committed = meta["committed"]
    for key in ("episodes", "segments", "gaps"):
        if not isinstance(committed.get(key), int) or committed[key] < 0:
            return f"committed {key} is {committed.get(key)!r}, not a count"
    topics, fields = meta.get("topics"), meta.get("fields")
    if not isinstance(topics, list) or not isinstance(fields, dict) or \
            any(not isinstance(t, str) or not isinstance(fields.get(t), dict) for t in topics):
        return "topics and fields do not match"
    rows, variations = committed.get("rows"), committed.get("variations", {})
    if not isinstance(rows, dict) or any(not isinstance(v, int) or v < 0 for v in rows.values()):
        return f"committed rows are {rows!r:.200}, not counts per term"
    if not isinstance(variations, dict) or not isinstance(meta.get("variations", {}), dict) or \
            any(not isinstance(v, int) or v < 0 for v in variations.values()):
        return f"committed variations are {variations!r:.200}, not counts per key"
    if any(not isinstance(v, dict) or not isinstance(v.get("node"), str)
           for v in meta.get("variations", {}).values()):
        return "variation sample groups are not named"
    return None


def _arrays(meta: dict[str, Any], n: int, n_seg: int, n_gap: int) -> list[tuple[str, int, str | None]]:
    """Every array :func:`_check_run` reads: its path, committed rows and the dtype of the
    values the check keeps (``None``: only whether its chunks are sound)."""
    committed = meta["committed"]
    wanted: list[tuple[str, int, str | None]] = [(f"episodes/{c}", n, dtype) for c, dtype in EPISODE_COLUMNS.items()]
    wanted += [(f"episodes/{col}", n, "float64") for _, col in sorted(meta.get("outcomes", {}).items())]
    wanted += [(f"segments/{c}", n_seg, "int64") for c in SEGMENT_COLUMNS]
    wanted += [(f"gaps/{c}", n_gap, "int64") for c in GAP_COLUMNS]
    for term in meta["topics"]:
        rows = int(committed["rows"].get(term, 0))
        if rows:
            tnode = meta.get("term_nodes", {}).get(term, node_name(term))
            wanted += [(f"data/{tnode}/{node_name(f)}", rows, None) for f in meta["fields"][term]]
            wanted += [(f"data/{tnode}/{STEP_NODE}", rows, "int64"), (f"data/{tnode}/{HOOK_NODE}", rows, None)]
    for key, vmeta in meta.get("variations", {}).items():
        k = int(committed.get("variations", {}).get(key, 0))
        wanted += [(f"variations/{vmeta['node']}/{c}", k, "int64") for c in VAR_COLUMNS]
        wanted.append((f"variations/{vmeta['node']}/value", k, None))
    return wanted


def _check_run(reader: Any, run: str, tick: Callable[[int], None], remote: bool = False) -> RunReport:
    from .reader import RunStore

    assert isinstance(reader, RunStore)
    meta = reader._meta[run]
    node = reader._nodes[run]
    check = _Checker(reader, run, node, tick)
    wrong = _counts(meta)
    if wrong is not None:
        check.problem("", wrong)
        return RunReport(run, node, None, None, check.problems)
    committed = meta["committed"]
    n, n_seg, n_gap = (int(committed[k]) for k in ("episodes", "segments", "gaps"))
    topics: list[str] = meta["topics"]
    if remote:  # every array this check reads, at once
        check.prefetch(_arrays(meta, n, n_seg, n_gap))
    ep = check.table("episodes", EPISODE_COLUMNS, n)
    outcomes = {name: check.column(f"episodes/{col}", n, "float64")
                for name, col in sorted(meta.get("outcomes", {}).items())}
    seg = check.table("segments", SEGMENT_COLUMNS, n_seg)
    gaps = check.table("gaps", GAP_COLUMNS, n_gap)
    ep_bad = np.zeros(n, bool)
    for c in [*ep.values(), *outcomes.values()]:
        ep_bad |= c.bad
    seg_bad = np.zeros(n_seg, bool)
    for c in seg.values():
        seg_bad |= c.bad

    # the episode -> segment index
    start, count = ep["segment_start"].values, ep["segment_count"].values
    expect = np.r_[0, np.cumsum(count)[:-1]] if n else np.zeros(0, np.int64)
    wrong_range = ~ep_bad & ((count < 0) | (start != expect) | (start + count > n_seg))
    _report_rows(check, "episodes/segment_start", wrong_range,
                 f"segments are not contiguous in commit order or lie past the {n_seg} committed")
    ep_bad |= wrong_range
    # after the first episode whose segment range is unknown, segment ownership is unknown too
    known = int(np.argmax(ep_bad)) if ep_bad.any() else n
    owner = np.full(n_seg, -1, np.int64)
    last = int(start[known - 1] + count[known - 1]) if known else 0
    owner[:last] = np.repeat(np.arange(known), count[:known])
    seg_ok = ~seg_bad & (owner >= 0)
    topic, offset, rows = seg["topic"].values, seg["offset"].values, seg["rows"].values
    term_rows = np.array([int(committed["rows"].get(t, 0)) for t in topics] + [0], np.int64)
    safe_topic = np.where((topic >= 0) & (topic < len(topics)), topic, len(topics))
    invalid = seg_ok & ((seg["episode"].values != owner) | (safe_topic == len(topics)) | (offset < 0)
                        | (rows < 0) | (offset + rows > term_rows[safe_topic]))
    _report_rows(check, "segments/offset", invalid,
                 "segments name another episode, an unknown term, or rows past the term's committed rows")
    seg_bad |= invalid

    # data: every chunk inside the committed rows; the segments say which ones must be there
    end_step, length = ep["end_step"].values, ep["length"].values
    for code, term in enumerate(topics):
        n_rows = int(term_rows[code])
        if not n_rows:
            continue
        mine = np.flatnonzero(seg_ok & ~seg_bad & (topic == code) & (rows > 0))
        tnode = meta.get("term_nodes", {}).get(term, node_name(term))
        nodes = [node_name(f) for f in meta["fields"][term]] + [STEP_NODE, HOOK_NODE]
        for name in nodes:
            path = f"data/{tnode}/{name}"
            arr = check.array(path, n_rows)
            if arr is None:
                seg_bad[mine] = True
                continue
            size = int(arr.chunks[0])
            used = np.zeros(-(-n_rows // size) + 1, np.int64)
            np.add.at(used, offset[mine] // size, 1)
            np.add.at(used, (offset[mine] + rows[mine] - 1) // size + 1, -1)
            referenced = np.cumsum(used)[:-1] > 0
            steps = np.zeros(n_rows, np.int64) if name == STEP_NODE else None
            broken = np.zeros(len(referenced), bool)
            for chunk, why in sorted(check.chunks(path, arr, n_rows, steps).items()):
                span = (chunk * size, min(n_rows, (chunk + 1) * size))
                if why == "missing" and not referenced[chunk]:
                    continue  # reclaimed debris: no committed episode reads it
                broken[chunk] = True
                check.problem(path, why if referenced[chunk] else
                              f"{why} (no committed episode reads it; a repair deletes it)", span, chunk)
            hit = np.cumsum(np.r_[0, broken])
            bad_here = hit[(offset[mine] + rows[mine] - 1) // size + 1] - hit[offset[mine] // size] > 0
            seg_bad[mine[bad_here]] = True
            if steps is not None:  # every row was recorded during its episode
                ok = mine[~bad_here]
                e = owner[ok]
                lo = np.minimum.reduceat(steps[_span_rows(offset[ok], rows[ok])], _firsts(rows[ok])) \
                    if len(ok) else np.zeros(0, np.int64)
                hi = np.maximum.reduceat(steps[_span_rows(offset[ok], rows[ok])], _firsts(rows[ok])) \
                    if len(ok) else np.zeros(0, np.int64)
                outside = (lo < end_step[e] - length[e]) | (hi > end_step[e])
                if outside.any():
                    first = int(ok[np.flatnonzero(outside)[0]])
                    check.problem(path, f"{int(outside.sum())} segment(s) hold rows recorded outside "
                                  f"their episode's steps (end_step - length .. end_step), the first "
                                  f"segment {first}", (int(offset[first]), int(offset[first] + rows[first])))
                    seg_bad[ok[outside]] = True
    # an episode verifies when its table row, its segment range and all its segments do
    for s in np.flatnonzero(seg_bad[:last]):
        ep_bad[owner[s]] = True
    ep_bad[known:] = True
    verified = int(np.argmax(ep_bad)) if ep_bad.any() else n

    # tables without episodes: gaps and variation samples are cut at their first bad row
    keep_gaps = _first(gaps)
    keep_vars: dict[str, int] = {}
    for key, vmeta in meta.get("variations", {}).items():
        k = int(committed.get("variations", {}).get(key, 0))
        cols = {c: check.column(f"variations/{vmeta['node']}/{c}", k, "int64") for c in VAR_COLUMNS}
        value = check.array(f"variations/{vmeta['node']}/value", k)
        value_bad = np.zeros(k, bool) if value is not None else np.ones(k, bool)
        if value is not None:
            size = int(value.chunks[0])
            for chunk, why in sorted(check.chunks(f"variations/{vmeta['node']}/value", value, k).items()):
                value_bad[chunk * size:(chunk + 1) * size] = True
                check.problem(f"variations/{vmeta['node']}/value", why,
                              (chunk * size, min(k, (chunk + 1) * size)), chunk)
        good = _first({**cols, "value": _Column(np.zeros(k), value_bad)})
        if good < k and good:  # drop the last message read: its other samples may be lost
            seqs = cols["seq"].values
            good = int(np.searchsorted(seqs[:good], seqs[good - 1], "left"))
        keep_vars[key] = good
    report = RunReport(run, node, n, verified, check.problems)
    if report.sound:
        return report
    kept_segments = int(start[verified - 1] + count[verified - 1]) if verified else 0
    kept = slice(0, kept_segments)
    report.keep = {
        "episodes": verified, "segments": kept_segments, "gaps": keep_gaps,
        "rows": {t: int(np.max(offset[kept][topic[kept] == code] + rows[kept][topic[kept] == code],
                               initial=0)) for code, t in enumerate(topics)},
        "variations": keep_vars,
    }
    if verified < n:
        report.removed = _removed_range(ep, ep_bad, verified, int(meta["num_worlds"]),
                                        int(committed.get("seq_high", -1)))
    return report


def _span_rows(offset: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The rows of every segment, concatenated."""
    from ._reading import _ranges

    return _ranges(offset, rows)


def _firsts(rows: np.ndarray) -> np.ndarray:
    """Where each segment's rows begin in :func:`_span_rows`."""
    out: np.ndarray = np.r_[0, np.cumsum(rows)[:-1]].astype(np.int64)
    return out


def _first(table: dict[str, _Column]) -> int:
    """The number of leading rows of a table that every column could read."""
    bad = np.zeros(len(next(iter(table.values())).bad), bool) if table else np.zeros(0, bool)
    for c in table.values():
        bad |= c.bad
    return int(np.argmax(bad)) if bad.any() else len(bad)


def _report_rows(check: _Checker, path: str, mask: np.ndarray, what: str) -> None:
    if mask.any():
        first = int(np.flatnonzero(mask)[0])
        check.problem(path, f"{int(mask.sum())} row(s), the first {first}: {what}", (first, first + 1))


def _removed_range(ep: dict[str, _Column], bad: np.ndarray, verified: int, num_worlds: int,
                   seq_high: int) -> tuple[int, int]:
    """``[expected, received)``: the run sequence numbers of the episodes after the first
    ``verified``, from the boundary that started each (its world's previous ``EpisodeEnd``, 0
    at the run's start) to its ``EpisodeEnd``. Episodes whose rows cannot be read may be of
    any world: then every world's messages after its last kept episode, up to ``seq_high``."""
    world, end_seq = ep["world"].values, ep["end_seq"].values
    readable = np.logical_not(np.any(np.asarray([c.bad for c in ep.values()]), axis=0))
    boundary: dict[int, int] = {}
    lowest: int | None = None  # the lowest boundary of any world, while no boundary moved
    starts, ends = [], []
    for i in range(len(world)):
        w = int(world[i]) if readable[i] else None
        if i >= verified:
            if w is None:  # unreadable rows come a chunk at a time: worked out once per run of them
                if lowest is None:
                    lowest = min([boundary.get(x, 0) for x in range(num_worlds)], default=0)
                starts.append(lowest)
                ends.append(seq_high + 1)
            else:
                starts.append(boundary.get(w, 0))
                ends.append(int(end_seq[i]) + 1)
        if w is not None:
            boundary[w] = int(end_seq[i])
            lowest = None
    return min(starts), max(max(ends), min(starts))


def _progress() -> Iterator[Callable[[int], None]]:
    """A callback counting chunks read on stderr (rich, when installed and stderr is a
    terminal), or one doing nothing."""
    try:
        if not sys.stderr.isatty():
            raise ImportError
        from rich.console import Console
        from rich.progress import Progress
    except ImportError:
        yield lambda k: None
        return
    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("verifying chunks", total=None)
        yield lambda k: bar.advance(task, k)


def verify_store(location: StoreLocation, runs: Sequence[str] | None = None, *,
                 progress: Callable[[int], None] | None = None) -> VerifyReport:
    """Check every committed episode of ``runs`` (all of the store's when ``None``) against
    the index (see the module's documentation). Read-only; safe beside a running daemon
    (it checks the commits made before it opened the store).

    Args:
        location: Local directory, fsspec URL, or zarr store.
        runs: Run ids to check; ``None`` for every run, those whose attributes cannot be read
            included.
        progress: Called with the number of chunks read, as they are read.

    Returns:
        The report: per run, its problems and longest verified prefix.

    Raises:
        StoreFormatError: ``location`` is not a run store.
        RunNotFoundError: A run of ``runs`` is not in the store.
    """
    from ._reading import _local
    from .errors import RunNotFoundError
    from .reader import RunStore

    reader = RunStore(location, cache_bytes=0)
    remote = not _local(reader.root.store)  # an object store: each run's arrays read at once
    lock = threading.Lock()

    def tick(k: int) -> None:  # called from the reading threads
        if progress is not None:
            with lock:
                progress(k)

    damaged = reader.damaged()
    if runs is not None:
        names = list(dict.fromkeys(runs))
        unknown = [r for r in names if r not in reader.runs() and node_name(r) not in damaged]
        if unknown:
            raise RunNotFoundError(f"runs: {unknown} not in store {location!r}; runs: {reader.runs()}")
    else:
        names = [*reader.runs(), *damaged]

    def check(name: str) -> RunReport:
        node = name if runs is None and name in damaged else node_name(name)
        if node in damaged:
            return RunReport(name, node, None, None, [Problem(name, "", None, None, damaged[node])])
        return _check_run(reader, name, tick, remote)

    if not remote or len(names) < 2:
        return VerifyReport(str(location), [check(name) for name in names])
    # an object store: runs checked at once too (their reads share the reader's array threads,
    # which bound the chunks held in all)
    with ThreadPoolExecutor(min(len(names), _RUNS_AT_ONCE), thread_name_prefix="worldtap-verify") as pool:
        return VerifyReport(str(location), list(pool.map(check, names)))


@dataclass(frozen=True, slots=True)
class Repair:
    """What :func:`repair_store` did (or, dry, would do) to one run."""

    run: str
    removed_episodes: int
    kept_episodes: int
    gap: tuple[int, int] | None
    reason: str
    done: bool

    def __str__(self) -> str:
        gap = f", gap {self.gap[0]}..{self.gap[1]} recorded" if self.gap else ""
        return (f"run {self.run!r}: {'kept' if self.done else 'would keep'} {self.kept_episodes} "
                f"episode(s), {'removed' if self.done else 'would remove'} "
                f"{self.removed_episodes}{gap} ({self.reason})")


def repair_store(location: StoreLocation, runs: Sequence[str] | None = None, *,
                 dry_run: bool = False, lease_ttl: float = 30.0) -> tuple[VerifyReport, list[Repair]]:
    """Cut every damaged run of ``runs`` (all when ``None``) back to its longest verified
    prefix (see the module's documentation). Idempotent: a sound run is not written.

    Args:
        location: Local directory or fsspec URL (a repair takes the daemon's lock or lease).
        runs: Run ids; ``None`` for every run.
        dry_run: Verify and say what would be cut, writing nothing.
        lease_ttl: The lease's ttl on stores given by URL.

    Returns:
        The report of the verification before the repair, and what was done per run cut.
        Runs whose attributes cannot be read are in the report, not repaired.

    Raises:
        StoreLockedError: A daemon holds the store.
        StoreFormatError: ``location`` is not a run store.
        RunNotFoundError: A run of ``runs`` is not in the store.
    """
    from contextlib import ExitStack

    from ._format import local_path
    from .lock import StoreLease, StoreLock

    with ExitStack() as stack:
        if not dry_run:  # the whole store's lock, as a daemon of the whole store takes it
            path = local_path(location)
            stack.enter_context(StoreLock(path) if path is not None else
                                StoreLease(str(location), ttl=lease_ttl))
        report = verify_store(location, runs)
        todo = [r for r in report.runs if not r.sound and r.repairable]
        repairs = [_plan(r, dry_run) for r in todo]
        if todo and not dry_run:
            from .run_writer import RunStoreWriter

            writer = RunStoreWriter(location)
            for r in todo:
                _cut(writer, r, repairs[todo.index(r)])
    return report, repairs


def _plan(report: RunReport, dry_run: bool) -> Repair:
    assert report.episodes is not None
    assert report.verified is not None
    reason = "; ".join(str(p) for p in report.problems[:3])
    if len(report.problems) > 3:
        reason += f"; and {len(report.problems) - 3} more"
    return Repair(report.run, report.episodes - report.verified, report.verified, report.removed,
                  reason, not dry_run)


def _cut(store: Any, report: RunReport, repair: Repair) -> None:
    """Publish ``report.keep`` as the run's commit (the removed range appended to its gaps
    first), then cut its arrays to it, as a resumed daemon cuts a dirty run."""
    import zarr

    keep = report.keep
    assert keep is not None
    writer = store.run(report.run, num_worlds=1)
    meta = writer.meta
    assert writer.group is not None
    group: zarr.Group = writer.group
    # Arrays whose metadata cannot be read hold no kept row: remove them (they are recreated
    # empty), with the variations they held.
    for path in _unreadable(group):
        del group[path]
        for key, vmeta in list(meta.get("variations", {}).items()):
            if path.startswith(f"variations/{vmeta['node']}"):
                if f"variations/{vmeta['node']}" in group:
                    del group[f"variations/{vmeta['node']}"]
                del meta["variations"][key]
                meta["committed"]["variations"].pop(key, None)
                keep["variations"].pop(key, None)
        for name, node in list(meta.get("outcomes", {}).items()):
            if path == f"episodes/{node}":
                del meta["outcomes"][name]
    committed = meta["committed"]
    before = {"episodes": committed["episodes"], "gaps": committed["gaps"],
              "variations": dict(committed.get("variations", {}))}
    committed.update({k: keep[k] for k in ("episodes", "segments", "gaps")})
    committed["rows"] = {**committed["rows"], **keep["rows"]}
    committed["variations"] = {**committed.get("variations", {}), **keep["variations"]}
    repaired = {"at": time.time(), "removed_episodes": repair.removed_episodes,
                "removed_gaps": before["gaps"] - keep["gaps"],
                "removed_samples": {k: before["variations"].get(k, 0) - v
                                    for k, v in keep["variations"].items()
                                    if before["variations"].get(k, 0) != v},
                "reason": repair.reason}
    gaps = [(repair.gap[0], repair.gap[1], REPAIR_SOURCE, "")] if repair.gap else []
    writer.commit(gaps=gaps, extra={"repaired": repaired})  # the commit point
    store.clean(report.run)  # cut every array to it (the run is dirty until then)


def _unreadable(group: Any) -> list[str]:
    """Paths of arrays under a run's ``group`` whose metadata cannot be read."""
    import zarr

    out: list[str] = []

    def walk(node: Any, prefix: str) -> None:
        for name in child_nodes(node):
            path = f"{prefix}{name}"
            try:
                child = node.get(name)
            except Exception:
                out.append(path)
                continue
            if isinstance(child, zarr.Group):
                walk(child, f"{path}/")

    walk(group, "")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worldtap-store verify``."""
    parser.add_argument("store", help="local directory or zarr/fsspec URL of a run store")
    parser.add_argument("--run", action="append", default=None, metavar="RUN",
                        help="a run to check (repeatable; default: every run)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def fail(command: str, code: int, message: object) -> int:
    print(f"worldtap-store {command}: {message}", file=sys.stderr)
    return code


def run(args: argparse.Namespace) -> int:
    """``worldtap-store verify``: 0 sound, 7 damaged, 2 an unknown run, 3 no run store."""
    from .errors import RunNotFoundError, StorageError

    try:
        for tick in _progress():
            report = verify_store(args.store, args.run, progress=tick)
    except RunNotFoundError as exc:
        return fail("verify", 2, exc)
    except StorageError as exc:
        return fail("verify", 3, exc)
    if args.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for r in report.runs:
            state = "ok" if r.sound else "DAMAGED"
            prefix = "unknown" if r.verified is None else f"{r.verified}/{r.episodes}"
            print(f"{r.run}: {state}, verified episodes {prefix}")
            for p in r.problems:
                print(f"  {p}")
    return 0 if report.sound else DAMAGED
