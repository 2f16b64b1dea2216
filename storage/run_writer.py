"""The run-store writer: appends episode data, then commits the index (see ``LAYOUT.md``).

Durability: data arrays are written first, then the episode and segment tables, and last the
run group's ``worldtap_run`` attribute, one atomic metadata write that is the commit point. Rows
beyond the committed counts are invisible to readers; :meth:`RunWriter.recover` (run when a
writer reopens a run) truncates them and deletes unreferenced fragment chunks. Without
``fsync`` a commit survives any crash of the writing process (zarr's local store writes each
file atomically) but relies on the OS for power loss; with ``fsync`` every file is on disk
before the commit returns.

A run's group is created with its attributes in one write, so a crash never leaves a run
without them; a writer for a run that is not in the store yet creates it at its first job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import numpy as np
import zarr

from broker import FieldSpec

from ._columns import Column, flush_columns, write_columns
from ._format import (
    ALL_RUNS,
    APPEND_CONFIG,
    CHUNK_KEYS,
    EPISODE_COLUMNS,
    FORMAT,
    FORMAT_VERSION,
    GAP_COLUMNS,
    HOOK_NODE,
    HOOKS,
    ROW_DTYPES,
    SEGMENT_COLUMNS,
    STEP_NODE,
    TABLE_CHUNK,
    VAR_COLUMNS,
    Compression,
    Partition,
    StoreLocation,
    child_nodes,
    codecs,
    create_groups,
    is_partial_file,
    local_path,
    node_name,
    numpy_dtype,
    open_store,
    remove_partial_files,
    resize_tail,
    to_json,
    zero_rows,
)
from .errors import StoreDamagedError, StoreFormatError

__all__ = ["EpisodeRows", "RunStoreWriter", "RunWriter", "TermColumns", "new_meta", "read_meta"]

_log = logging.getLogger("worldtap.storage")

_TermArrays: TypeAlias = "tuple[dict[str, zarr.Array[Any]], zarr.Array[Any], zarr.Array[Any]]"
"""A term's stored arrays: its fields by name, then its step and hook row columns."""


@dataclass(slots=True)
class TermColumns:
    """The arrays of one term: its fields by name and, never among them, its row columns
    (``step``: the global step of each row, ``hook``: its lifecycle code), so a field may
    bear any name."""

    fields: dict[str, Column]
    step: Column
    hook: Column

    def all(self) -> list[Column]:
        """Every column: the fields, then step and hook."""
        return [*self.fields.values(), self.step, self.hook]


@dataclass(slots=True)
class EpisodeRows:
    """Episodes to commit: one entry per column of the episode table, plus their segments.

    ``segments`` holds ``(topic code, offset, rows)`` per segment, episode after episode, and
    ``segment_count`` says how many belong to each episode (``segment_start`` is assigned by
    the writer). ``outcomes`` maps outcome names to float64 values per episode (NaN where an
    episode lacks one); an outcome the run stored before and these episodes lack is NaN too.
    """

    columns: dict[str, np.ndarray]
    segments: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    outcomes: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.columns["world"])


def _as_array(node: object, where: str) -> zarr.Array[Any]:
    if not isinstance(node, zarr.Array):
        raise StoreDamagedError(f"{where}: expected a zarr array, got {type(node).__name__}")
    return node


def _as_group(node: object, where: str) -> zarr.Group:
    if not isinstance(node, zarr.Group):
        raise StoreDamagedError(f"{where}: expected a zarr group, got {type(node).__name__}")
    return node


def new_meta(run: str, *, num_worlds: int, device: str, metadata: Mapping[str, Any] | None,
             session_of: str | None = None) -> dict[str, Any]:
    """The attributes of a new run (JSON-safe)."""
    return {"run": run, "session_of": session_of, "num_worlds": int(num_worlds),
            "device": device, "metadata": to_json(dict(metadata or {})), "status": "open",
            "started_at": None, "ended_at": None, "declarations": {}, "seed": None, "outcomes": {},
            "dirty": True, "topics": [], "term_nodes": {}, "fields": {}, "variations": {}, "resumed": 0,
            "committed": {"episodes": 0, "segments": 0, "gaps": 0, "rows": {}, "variations": {},
                          "seq_high": -1, "step_high": -1}}


class RunWriter:
    """Writes one run into its group ``runs/<node>``. Obtain it from :meth:`RunStoreWriter.run`.

    One writer per store (see :class:`storage.StoreLock`). Appends, commits and array creation
    run on the run's writer thread (one at a time); :meth:`declare_term` and the accessors may
    run beside them on the daemon's thread (``lock`` guards the run's attributes).
    """

    def __init__(self, owner: RunStoreWriter, group: zarr.Group | None, meta: dict[str, Any]) -> None:
        self._owner = owner
        self.group = group
        self._debris = group is not None
        """Whether the run's group may hold arrays no commit names (left by a crash): only if
        it was in the store before this writer. A group this writer creates holds nothing
        else, so its arrays are made without looking for (or deleting) anything first: on an
        object store, each look costs requests."""
        self.meta = meta
        self.lock = threading.RLock()
        self._data: dict[str, TermColumns] = {}
        self._tables: dict[str, dict[str, Column]] = {}
        self._variations: dict[str, dict[str, Column]] = {}
        self._outcomes: dict[str, Column] = {}
        self.stored = 0
        """Episodes committed by this writer (this session)."""
        self.committed_step = int(meta["committed"]["step_high"])
        """End step of the last episode committed (for the daemon's lag)."""

    @property
    def run(self) -> str:
        return str(self.meta["run"])

    @property
    def exists(self) -> bool:
        """Whether the run's group is in the store yet."""
        return self.group is not None

    @property
    def committed(self) -> dict[str, Any]:
        with self.lock:
            return dict(self.meta["committed"])

    def topic_code(self, term: str) -> int:
        with self.lock:
            topics: list[str] = self.meta["topics"]
            return topics.index(term)

    def specs(self, term: str) -> dict[str, FieldSpec] | None:
        """The stored fields of ``term``, or ``None`` if the run has no such term."""
        with self.lock:
            fields = self.meta["fields"].get(term)
            return None if fields is None else {n: FieldSpec.from_dict(s) for n, s in fields.items()}

    def variation_spec(self, key: str) -> FieldSpec | None:
        """The stored per-world value spec of variation ``key``, or ``None``."""
        with self.lock:
            vmeta = self.meta["variations"].get(key)
            return None if vmeta is None else FieldSpec.from_dict(vmeta["field"])

    # -- creation (writer thread) --------------------------------------------------------

    def create(self) -> None:
        """Create the run's group with its attributes in one write, if it is not there yet."""
        if self.group is not None:
            return
        with self.lock:
            self.group = self._owner.runs_group.create_group(
                node_name(self.run), attributes={"worldtap_run": self.meta})

    def write_meta(self) -> None:
        """Write the run's attributes as they are now (writer thread; nothing if the run is not
        in the store yet: its creation writes them). The committed counts in them are the
        writer thread's own, so this moves no commit point."""
        if self.group is None:
            return
        with self.lock:
            meta = dict(self.meta)
        self.group.update_attributes({"worldtap_run": meta})

    # -- data (written first, invisible until committed) --------------------------------

    def declare_term(self, term: str, specs: Mapping[str, FieldSpec]) -> bool:
        """Register ``term`` with ``specs``, or check them against the stored ones (by name).
        Returns whether the term is new (its arrays must then be made with
        :meth:`create_term`, on the writer thread, before its first append).

        Raises:
            StoreFormatError: The stored schema of ``term`` differs from ``specs``.
        """
        got = {name: spec.to_dict() for name, spec in specs.items()}
        with self.lock:
            known = self.meta["fields"].get(term)
            if known is not None:
                if got != known:
                    raise StoreFormatError(
                        f"run {self.run!r} term {term!r}: expected fields {known!r}, got {got!r}")
                return False
            self.meta["fields"][term] = got
            self.meta["term_nodes"][term] = node_name(term)
            self.meta["topics"].append(term)
            self.meta["committed"]["rows"].setdefault(term, 0)
            return True

    def create_term(self, term: str) -> None:
        """Create the data arrays of a term :meth:`declare_term` registered (writer thread)."""
        self.create()
        assert self.group is not None
        owner = self._owner
        with self.lock:
            specs = {n: FieldSpec.from_dict(s) for n, s in self.meta["fields"][term].items()}
            tgroup = self.group.require_group(f"data/{self.meta['term_nodes'][term]}")

        def make(node: str, name: str, spec: FieldSpec) -> Column:
            dtype = numpy_dtype(spec.dtype)
            row_bytes = max(1, dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
            chunk_rows = max(1, owner.chunk_bytes // row_bytes)
            dims = (f"{term}_row", *(f"{name}_dim{i}" for i in range(len(spec.shape))))
            return Column(tgroup.create_array(
                node, shape=(0, *spec.shape), dtype=dtype, chunks=(chunk_rows, *spec.shape),
                compressors=owner.codecs, fill_value=False if dtype == np.bool_ else 0,
                chunk_key_encoding=CHUNK_KEYS, dimension_names=dims,  # type: ignore[arg-type]
                attributes={"worldtap_field": {"name": name, **spec.to_dict()}},
                config=APPEND_CONFIG,
                overwrite=self._debris,  # an array not in the committed meta is debris of a crash
            ), 0)

        fields = {name: make(node_name(name), name, spec) for name, spec in specs.items()}
        step, hook = (make(node, node, FieldSpec(ROW_DTYPES[node], ())) for node in (STEP_NODE, HOOK_NODE))
        self._data[term] = TermColumns(fields, step, hook)

    def _term_arrays(self, term: str) -> _TermArrays:
        """The stored arrays of ``term``: its fields by name, then its step and hook columns."""
        assert self.group is not None
        where = f"run {self.run!r} term {term!r}"
        tnode = self.meta["term_nodes"][term]
        tgroup = _as_group(self.group.get(f"data/{tnode}"), where)

        def get(node: str) -> zarr.Array[Any]:
            return _as_array(tgroup.get(node), f"{where} array {node!r}").with_config(APPEND_CONFIG)

        return {name: get(node_name(name)) for name in self.meta["fields"][term]}, get(STEP_NODE), \
            get(HOOK_NODE)

    def _open_term(self, term: str, arrays: _TermArrays | None = None) -> None:
        rows = int(self.meta["committed"]["rows"].get(term, 0))
        fields, step, hook = self._term_arrays(term) if arrays is None else arrays
        self._data[term] = TermColumns({name: Column(arr, rows) for name, arr in fields.items()},
                                       Column(step, rows), Column(hook, rows))

    def rows(self, term: str) -> int:
        """Rows written so far to ``term`` (committed or not)."""
        if term not in self._data:
            self._open_term(term)
        return self._data[term].step.rows

    def _stored(self, term: str) -> TermColumns:
        """The columns of ``term`` with every row appended in the store (partial last chunks
        written: writer thread)."""
        if term not in self._data:
            self._open_term(term)
        columns = self._data[term]
        flush_columns(columns.all())
        return columns

    def data_array(self, term: str, name: str) -> zarr.Array[Any]:
        """The zarr array of field ``name`` of ``term`` (any name: the row columns are
        :meth:`row_arrays`), holding every row appended (writer thread: the partial last
        chunks are written first); rows past :meth:`rows` are capacity, not data."""
        return self._stored(term).fields[name].array

    def row_arrays(self, term: str) -> tuple[zarr.Array[Any], zarr.Array[Any]]:
        """The zarr arrays of ``term``'s row columns: step (int64) and hook (uint8 code into
        :data:`HOOKS`), holding every row appended (writer thread, as :meth:`data_array`);
        rows past :meth:`rows` are capacity, not data."""
        columns = self._stored(term)
        return columns.step.array, columns.hook.array

    def append(self, term: str, fields: Mapping[str, np.ndarray], steps: np.ndarray,
               hooks: np.ndarray) -> int:
        """Append rows to ``term``'s arrays (data only: nothing is committed). Returns the
        offset of the first row. Fields are matched by name (any name, ``_step`` too); the
        rows' steps and hook codes go to the row columns. Only whole chunks are written here:
        the rows of each partial last chunk wait in memory for the commit that needs them."""
        if term not in self._data:
            self._open_term(term)
        columns = self._data[term]
        offset = self.rows(term)
        write_columns([(columns.fields[name], values) for name, values in fields.items()]
                      + [(columns.step, steps), (columns.hook, hooks)], flush=False)
        self._owner.bytes_written += sum(int(v.nbytes) for v in fields.values())
        return offset

    # -- index (written last) ------------------------------------------------------------

    def _table(self, name: str, columns: Mapping[str, str], dim: str) -> dict[str, Column]:
        if name not in self._tables:
            assert self.group is not None
            tgroup = self.group.require_group(name)
            rows = int(self.meta["committed"][name])
            made = {}
            for col, dtype in columns.items():
                if self._debris and col in tgroup:
                    arr = _as_array(tgroup[col], f"run {self.run!r} {name}/{col}")
                else:
                    arr = tgroup.create_array(col, shape=(0,), dtype=dtype, chunks=(TABLE_CHUNK,),
                                              compressors=self._owner.codecs, dimension_names=(dim,),
                                              config=APPEND_CONFIG)
                made[col] = Column(arr.with_config(APPEND_CONFIG), rows)
            self._tables[name] = made
        return self._tables[name]

    def _outcome_rows(self, outcomes: Mapping[str, np.ndarray], n_ep: int,
                      n: int) -> list[tuple[Column, np.ndarray]]:
        """The writes of the outcome columns for ``n`` episodes after the ``n_ep`` committed:
        every stored outcome (NaN where these episodes lack it), and a new outcome's column made
        here with its first ``n_ep`` rows NaN (registered in the attributes at the commit)."""
        assert self.group is not None
        with self.lock:
            known: dict[str, str] = dict(self.meta.get("outcomes", {}))
        writes = []
        for name in sorted(set(known) | set(outcomes)):
            values = np.asarray(outcomes[name], np.float64) if name in outcomes else np.full(n, np.nan)
            column = self._outcomes.get(name)
            if column is None:
                egroup = self.group.require_group("episodes")
                if name in known:  # stored by an earlier session: reopen it at the committed rows
                    arr = _as_array(egroup.get(known[name]), f"run {self.run!r} episodes/{known[name]}")
                    column = Column(arr.with_config(APPEND_CONFIG), n_ep)
                else:  # new: rows of the episodes committed before it are NaN
                    node = node_name(name)
                    column = Column(egroup.create_array(
                        node, shape=(0,), dtype="float64", chunks=(TABLE_CHUNK,), fill_value=np.nan,
                        compressors=self._owner.codecs, dimension_names=("episode",),
                        attributes={"worldtap_outcome": name}, config=APPEND_CONFIG,
                        overwrite=self._debris), 0)  # a column not in the committed meta is crash debris
                    values = np.concatenate([np.full(n_ep, np.nan), values])
                    with self.lock:
                        self.meta.setdefault("outcomes", {})[name] = node
                self._outcomes[name] = column
            else:
                column.rewind(n_ep)  # rows an interrupted commit wrote are overwritten
            writes.append((column, values))
        return writes

    def commit(self, episodes: EpisodeRows | None = None, *,
               gaps: Sequence[tuple[int, int, int, str]] = (),
               seq_high: int | None = None, step_high: int | None = None,
               variations: Mapping[str, int] | None = None, status: str | None = None,
               extra: Mapping[str, Any] | None = None) -> None:
        """Append episode/segment/gap rows, then publish the new committed counts (writer thread).

        ``gaps`` holds ``(expected, received, source, topic)`` per gap: wire numbers of the
        topic's stream (source 0, from the transport) or run sequence numbers (source 1,
        topic ``""``: the range a resumed daemon never saw).

        ``variations`` maps a variation key to its new committed sample count (its rows were
        written with :meth:`append_variation` first). When this returns, the commit is
        visible to readers (and on disk, with ``fsync``).
        """
        self.create()
        assert self.group is not None
        committed = self.meta["committed"]
        self._store_segments(episodes.segments if episodes is not None else None)
        if episodes is not None and len(episodes):
            etab = self._table("episodes", EPISODE_COLUMNS, "episode")
            stab = self._table("segments", SEGMENT_COLUMNS, "segment")
            n_ep, n_seg = committed["episodes"], committed["segments"]
            counts = episodes.columns["segment_count"].astype(np.int64)
            starts = n_seg + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            cols = {**episodes.columns, "segment_start": starts}
            for table, n in ((etab, n_ep), (stab, n_seg)):  # an interrupted commit's rows
                for column in table.values():
                    column.rewind(n)
            seg = np.ascontiguousarray(episodes.segments, dtype=np.int64).reshape(-1, 3)
            outcomes = self._outcome_rows(episodes.outcomes, n_ep, len(counts))
            write_columns([(c, np.asarray(cols[col], dtype=c.array.dtype)) for col, c in etab.items()]
                          + outcomes
                          + [(stab["episode"], np.repeat(np.arange(n_ep, n_ep + len(counts)), counts)),
                             (stab["topic"], seg[:, 0]), (stab["offset"], seg[:, 1]),
                             (stab["rows"], seg[:, 2])])
            new_episodes, new_segments = n_ep + len(counts), n_seg + len(seg)
        else:
            new_episodes, new_segments = committed["episodes"], committed["segments"]
        new_gaps = committed["gaps"]
        if gaps:
            gtab = self._table("gaps", GAP_COLUMNS, "gap")
            for column in gtab.values():
                column.rewind(committed["gaps"])
            with self.lock:
                topics: list[str] = self.meta.setdefault("gap_topics", [])
                for topic in sorted({g[3] for g in gaps} - set(topics)):
                    topics.append(topic)
                rows = np.asarray([(e, r, s, topics.index(t)) for e, r, s, t in gaps], np.int64)
            write_columns([(c, rows[:, i]) for i, c in enumerate(gtab.values())])
            new_gaps += len(gaps)
        with self.lock:
            committed["episodes"], committed["segments"], committed["gaps"] = \
                new_episodes, new_segments, new_gaps
            for term, columns in self._data.items():
                committed["rows"][term] = min(c.stored for c in columns.all())
            if variations:
                committed["variations"].update(variations)
            if seq_high is not None:
                committed["seq_high"] = max(committed["seq_high"], seq_high)
            if step_high is not None:
                committed["step_high"] = max(committed["step_high"], step_high)
            if status is not None:
                self.meta["status"] = status
            if extra:
                self.meta.update(to_json(dict(extra)))
            self.meta["dirty"] = True
            meta = dict(self.meta)
        self.group.update_attributes({"worldtap_run": meta})  # the commit point

    def _store_segments(self, segments: np.ndarray | None) -> None:
        """Write the partial last chunks that hold rows of ``segments`` (``(topic code,
        offset, rows)`` rows) and are not in the store yet, so the commit may count them."""
        need: dict[int, int] = {}
        if segments is not None:
            seg = np.asarray(segments, np.int64).reshape(-1, 3)
            for code, end in zip(seg[:, 0].tolist(), (seg[:, 1] + seg[:, 2]).tolist(), strict=True):
                need[code] = max(need.get(code, 0), end)
        with self.lock:
            topics: list[str] = list(self.meta["topics"])
        flush_columns([c for code, term in enumerate(topics) if term in self._data and code in need
                       for c in self._data[term].all() if c.stored < need[code]])

    def mark_clean(self, **extra: Any) -> None:
        """Record that every array is cut to the committed counts (after :meth:`trim`)."""
        assert self.group is not None
        with self.lock:
            self.meta.update(to_json(extra))
            self.meta["dirty"] = False
            meta = dict(self.meta)
        self.group.update_attributes({"worldtap_run": meta})

    def append_variation(self, key: str, phase: str, labels: list[Any] | None, worlds: np.ndarray,
                         episodes: np.ndarray, steps: np.ndarray, seqs: np.ndarray,
                         value: np.ndarray, spec: FieldSpec) -> int:
        """Append samples of variation ``key`` (data only; writer thread). Returns the new
        sample count, to pass to :meth:`commit` as ``variations={key: count}``.

        Raises:
            StoreFormatError: ``spec`` differs from the variation's stored value spec.
        """
        self.create()
        assert self.group is not None
        with self.lock:
            vmeta = self.meta["variations"]
            if key not in vmeta:
                node = node_name(key)
                vgroup = self.group.require_group(f"variations/{node}")
                dims = ("sample", *(f"value_dim{i}" for i in range(len(spec.shape))))
                dtype = numpy_dtype(spec.dtype)
                # rows of a chunk as the data arrays size theirs: a value of many numbers per
                # world would otherwise make a chunk of TABLE_CHUNK rows over 2 GiB, which the
                # codecs refuse (the run would fail at its next commit)
                value_bytes = max(1, dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
                rows = max(1, min(TABLE_CHUNK, self._owner.chunk_bytes // value_bytes))
                vgroup.create_array("value", shape=(0, *spec.shape), dtype=dtype,
                                    chunks=(rows, *spec.shape), dimension_names=dims,
                                    compressors=self._owner.codecs, overwrite=self._debris,
                                    config=APPEND_CONFIG)
                for col in VAR_COLUMNS:
                    vgroup.create_array(col, shape=(0,), dtype="int64", chunks=(TABLE_CHUNK,),
                                        dimension_names=("sample",), compressors=self._owner.codecs,
                                        overwrite=self._debris, config=APPEND_CONFIG)
                vmeta[key] = {"node": node, "phase": phase, "labels": to_json(labels),
                              "field": spec.to_dict()}
                self.meta["committed"]["variations"].setdefault(key, 0)
            elif vmeta[key]["field"] != spec.to_dict():
                raise StoreFormatError(f"run {self.run!r} variation {key!r}: expected values "
                                       f"{vmeta[key]['field']!r}, got {spec.to_dict()!r}")
            n = int(self.meta["committed"]["variations"][key])
            node = vmeta[key]["node"]
        if key not in self._variations:
            vnode = _as_group(self.group.get(f"variations/{node}"), f"run {self.run!r} variation {key!r}")
            self._variations[key] = {
                col: Column(_as_array(vnode.get(col), f"run {self.run!r} variation {key!r} {col}")
                            .with_config(APPEND_CONFIG), n)
                for col in ("value", *VAR_COLUMNS)}
        columns = self._variations[key]
        for column in columns.values():
            column.rewind(n)  # rows an interrupted commit wrote are overwritten
        write_columns([(c, np.asarray(values, dtype=c.array.dtype)) for c, values in (
            (columns["value"], value), (columns["world"], worlds), (columns["episode"], episodes),
            (columns["step"], steps), (columns["seq"], seqs))])
        return n + len(worlds)

    # -- recovery ------------------------------------------------------------------------

    def recover(self) -> int:
        """Make the arrays match the committed counts: truncate uncommitted tails and delete
        chunks no committed segment references. Returns the number of rows reclaimed.

        Raises:
            StoreDamagedError: An array the committed state needs is missing or unreadable.
        """
        assert self.group is not None
        committed = self.meta["committed"]
        reclaimed = 0
        for term in list(self.meta["fields"]):
            n = int(committed["rows"].get(term, 0))
            try:
                arrays = self._term_arrays(term)
            except StoreDamagedError:
                if n:
                    raise
                # Declared (the run's metadata names it) but its arrays were never all made:
                # killed in between. Nothing of it is committed: make them afresh.
                self.create_term(term)
                continue
            fields, step, hook = arrays
            reclaimed += max(0, step.shape[0] - n)
            resize_tail([*fields.values(), step, hook], n)
            self._open_term(term, arrays)
        outcome_nodes = list(self.meta.get("outcomes", {}).values())
        for name, cols in (("episodes", [*EPISODE_COLUMNS, *outcome_nodes]), ("segments", SEGMENT_COLUMNS),
                           ("gaps", GAP_COLUMNS)):
            self._cut_group(name, f"table {name!r}", "rows", cols, int(committed[name]))
        self._remove_debris_outcomes(outcome_nodes)
        for key, vmeta in self.meta["variations"].items():
            self._cut_group(f"variations/{vmeta['node']}", f"variation {key!r}", "samples",
                            ("value", *VAR_COLUMNS), int(committed["variations"].get(key, 0)))
        reclaimed += self.zero_holes()
        return reclaimed

    def _remove_debris_outcomes(self, known: Sequence[str]) -> None:
        """Delete outcome columns a crash left between their creation and the commit that
        would have registered them (arrays of ``episodes/`` the attributes do not name)."""
        assert self.group is not None
        node = self.group.get("episodes")
        if not isinstance(node, zarr.Group):
            return
        for name in child_nodes(node):
            if name not in EPISODE_COLUMNS and name not in known:
                arr = node.get(name)
                if isinstance(arr, zarr.Array) and "worldtap_outcome" in arr.attrs:
                    del node[name]

    def _cut_group(self, path: str, what: str, unit: str, cols: Iterable[str], n: int) -> None:
        """Cut the columns of the table group at ``path`` to its ``n`` committed rows.

        Raises:
            StoreDamagedError: The group is missing although ``n`` rows of it are committed.
        """
        assert self.group is not None
        node = self.group.get(path)
        if node is None:
            if n:
                raise StoreDamagedError(f"run {self.run!r}: {what} is missing but {n} {unit} are "
                                        f"committed")
            return
        group = _as_group(node, f"run {self.run!r} {what}")
        resize_tail([_as_array(group[c], f"run {self.run!r} {what} column {c!r}")
                     for c in cols if c in group], n)

    def zero_holes(self, *, piece: int = 1 << 20) -> int:
        """Delete data chunks that no committed segment references (fragments of episodes
        that never ended). Unreferenced rows sharing a chunk with committed ones stay: they
        are invisible, and bounded by one chunk per hole. Returns the rows reclaimed.

        Memory is bounded by the number of chunks, whatever the run's length: the segment
        table is read ``piece`` rows at a time."""
        n_seg = int(self.meta["committed"]["segments"])
        stab = self._table("segments", SEGMENT_COLUMNS, "segment") if n_seg else {}
        reclaimed = 0
        for code, term in enumerate(self.meta["topics"]):
            end = int(self.meta["committed"]["rows"].get(term, 0))
            if term not in self._data:
                if not end:
                    continue
                self._open_term(term)
            columns = self._data[term]
            sizes = sorted({c.chunk for c in columns.all()})
            # per chunk size: +1 where a segment's first chunk is, -1 after its last
            marks = {rows: np.zeros(-(-end // rows) + 1, np.int64) for rows in sizes}
            for a in range(0, n_seg, piece):
                b = min(n_seg, a + piece)
                topic, offset, count = (np.asarray(stab[c].array[a:b], np.int64)
                                        for c in ("topic", "offset", "rows"))
                mine = (topic == code) & (count > 0)
                first, last = offset[mine], offset[mine] + count[mine] - 1
                for rows, mark in marks.items():
                    np.add.at(mark, first // rows, 1)
                    np.add.at(mark, last // rows + 1, -1)
            for column in columns.all():
                dead = np.flatnonzero(np.cumsum(marks[column.chunk][:-1]) == 0)
                if not len(dead):
                    continue
                rows = column.chunk
                breaks = np.flatnonzero(np.diff(dead) != 1)
                for lo, hi in zip(np.r_[dead[0], dead[breaks + 1]], np.r_[dead[breaks], dead[-1]],
                                  strict=True):
                    start, stop = int(lo) * rows, min(end, (int(hi) + 1) * rows)
                    zero_rows(column.array, start, stop)
                    reclaimed += (stop - start) if column is columns.step else 0
        return reclaimed

    def trim(self) -> None:
        """Cut every array to its committed rows, so plain zarr readers see exact lengths
        (call after the last commit: at the run's end, or at shutdown). Data rows appended
        after that commit (fragments of episodes still open) are forgotten. Writing
        afterwards grows the capacity again."""
        with self.lock:
            for term, data in self._data.items():
                for column in data.all():
                    column.trim(int(self.meta["committed"]["rows"][term]))
            for columns in [*self._tables.values(), *self._variations.values(), self._outcomes]:
                for column in columns.values():
                    column.trim(column.rows)


class RunStoreWriter:
    """Opens (or creates) a run store for writing.

    Args:
        location: Local directory (default kind), fsspec URL, or a zarr store (e.g.
            ``zarr.storage.MemoryStore()`` as an in-memory twin).
        compression: ``"lz4"`` (fast default), ``"zstd"`` or ``"none"``; every chunk also
            carries a crc32c checksum.
        chunk_bytes: Target uncompressed bytes per data chunk.
        fsync: Make every write durable before a commit is reported (local stores).
        partition: The runs this writer owns (:class:`storage.Partition`; default all):
            crash debris is removed, and dirty runs are listed, only among them.

    Raises:
        StoreFormatError: ``location`` holds something that is not a worldtap run store (a
            non-empty directory that is not a zarr store is never written to), or a run store
            whose hook list neither is a beginning of :data:`HOOKS` (an older store, whose list
            is extended) nor begins with it.
    """

    def __init__(self, location: StoreLocation, *, compression: Compression = "lz4",
                 chunk_bytes: int = 1 << 20, fsync: bool = False,
                 partition: Partition = ALL_RUNS) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
        self.location = location
        self.codecs = codecs(compression)
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.partition = partition
        self.bytes_written = 0
        path = local_path(location)
        if path is not None and path.exists():
            if not path.is_dir():
                raise StoreFormatError(f"{str(path)!r} is not a directory, so not a run store")
            # Listed first: another daemon may be creating the store (its temporary files are
            # no content, and it writes zarr.json before anything else).
            content = [entry for entry in path.iterdir() if not is_partial_file(entry.name)]
            if content and not (path / "zarr.json").is_file():
                raise StoreFormatError(
                    f"{str(path)!r} is a non-empty directory but not a zarr store; refusing to "
                    f"write into it (choose an empty or new directory, or an existing run store)")
        self.store = open_store(location, fsync=fsync)
        try:
            # Several daemons (partitions) may start at once on an empty store: each writes
            # the same root and runs/ metadata only where absent, never an empty root first.
            create_groups(self.store, {"": {"worldtap": {"format": FORMAT, "version": FORMAT_VERSION,
                                                         "hooks": list(HOOKS)}}})
            self.root = zarr.open_group(self.store, mode="r+")
            info = self.root.attrs.get("worldtap")
        except OSError:  # disk full, read-only, permissions: the caller says so as it is
            raise
        except Exception as exc:
            raise StoreFormatError(f"cannot open {location!r} as a zarr v3 group: {exc}") from exc
        if info is None:
            if any(True for _ in self.root.members()) or dict(self.root.attrs):
                raise StoreFormatError(f"{location!r} is a zarr group but not a worldtap run store")
            self.root.update_attributes({"worldtap": {"format": FORMAT, "version": FORMAT_VERSION,
                                                      "hooks": list(HOOKS)}})
        elif not isinstance(info, dict) or info.get("format") != FORMAT or \
                info.get("version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{location!r}: expected a {FORMAT} store of layout version {FORMAT_VERSION}, got "
                f"{info!r}")
        else:
            self._extend_hooks(location, info)
        create_groups(self.store, {"runs": {}})
        self.runs_group = _as_group(self.root["runs"], "runs")
        self._runs: dict[str, RunWriter] = {}
        # Only now is it known to be a run store: its debris is ours to remove; with several
        # partitions only inside our own runs (the other daemons' writes are in flight), and
        # beside the shared metadata of the root and runs/ (the temporary files of a daemon
        # killed while it created them; a live daemon whose temporary file is removed there
        # writes it again, see RunLocalStore).
        if path is None:
            self.debris_removed = 0
        elif partition.whole:
            self.debris_removed = remove_partial_files(path)
        else:
            self.debris_removed = sum(remove_partial_files(path / "runs" / node)
                                      for node, _ in self._own_runs())
            self.debris_removed += remove_partial_files(path, recursive=False) + \
                remove_partial_files(path / "runs", recursive=False)

    def _extend_hooks(self, location: StoreLocation, info: dict[str, Any]) -> None:
        """Bring the root's hook list up to :data:`HOOKS` (codes are append-only, so a store
        written before a lifecycle point existed only lacks the newer names)."""
        stored = info.get("hooks")
        known = list(HOOKS)
        if not isinstance(stored, list) or (stored != known[:len(stored)] and known != stored[:len(known)]):
            raise StoreFormatError(f"{location!r}: its hooks {stored!r:.200} do not extend or begin "
                                   f"with this writer's {known!r}, so its hook codes mean something else")
        if len(stored) < len(known):
            self.root.update_attributes({"worldtap": {**info, "hooks": known}})

    def has_run(self, run: str) -> bool:
        """Whether the store holds a group for run id ``run``."""
        return node_name(run) in child_nodes(self.runs_group)

    def status(self, run: str) -> str | None:
        """The committed status of ``run`` (``"open"``, ``"complete"``, ``"interrupted"``), ``None`` if the store
        has no such run or nothing of it is committed.

        Raises:
            StoreDamagedError: The run's group or attributes cannot be read.
        """
        if run in self._runs:
            writer = self._runs[run]
            with writer.lock:
                return str(writer.meta.get("status")) if writer.exists else None
        group = self._group(node_name(run), run)
        meta = None if group is None else read_meta(group, run)
        return None if meta is None else str(meta.get("status"))

    def _group(self, node: str, run: str) -> zarr.Group | None:
        if node not in child_nodes(self.runs_group):
            return None
        try:
            existing = self.runs_group.get(node)
        except Exception as exc:  # unreadable zarr.json of that run only
            raise StoreDamagedError(f"run {run!r}: its group metadata cannot be read: {exc!r}") from exc
        return None if existing is None else _as_group(existing, f"run {run!r}")

    def session_name(self, run: str) -> str:
        """The stored name for a new session of run id ``run``: ``run`` itself when free, else
        ``run#2``, ``run#3``, ... (never merged into the earlier session's run)."""
        if not self.has_run(run) and run not in self._runs:
            return run
        k = 2
        while self.has_run(f"{run}#{k}") or f"{run}#{k}" in self._runs:
            k += 1
        return f"{run}#{k}"

    def run(self, run: str, *, num_worlds: int, device: str = "cpu",
            metadata: Mapping[str, Any] | None = None, session_of: str | None = None) -> RunWriter:
        """The writer of ``run``: an existing run is reopened (its recovery is the caller's
        first job: :meth:`RunWriter.recover`), a new one exists in memory until its first job
        creates it in the store.

        Raises:
            StoreDamagedError: The run's group or attributes cannot be read.
        """
        if run in self._runs:
            return self._runs[run]
        node = node_name(run)
        group = self._group(node, run)
        if group is not None:
            meta = read_meta(group, run)
            if meta is None:  # created by an older writer without its attributes: nothing committed
                _log.warning("run %r: its group has no run attributes (creation was interrupted); "
                             "recreating it", run)
                del self.runs_group[node]
                writer = RunWriter(self, None, new_meta(run, num_worlds=num_worlds, device=device,
                                                        metadata=metadata, session_of=session_of))
            else:
                writer = RunWriter(self, group, meta)
        else:
            writer = RunWriter(self, None, new_meta(run, num_worlds=num_worlds, device=device,
                                                    metadata=metadata, session_of=session_of))
        self._runs[run] = writer
        return writer

    def forget(self, run: str) -> None:
        """Drop the writer of ``run`` (retired or failed); a later :meth:`run` reopens it."""
        self._runs.pop(run, None)

    def _own_runs(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """``(node, attributes)`` of the stored runs of this writer's partition (runs whose
        attributes cannot be read are logged and skipped)."""
        for node in child_nodes(self.runs_group):
            try:
                group = self._group(node, node)
                meta = None if group is None else read_meta(group, node)
            except StoreDamagedError as exc:
                _log.error("store %r: %s", self.location, exc)
                continue
            if meta is not None and self.partition.owns_meta(meta):
                yield node, meta

    def dirty_runs(self) -> list[str]:
        """Runs of this writer's partition whose arrays may hold rows past their committed
        counts (a daemon stopped before trimming them): resume them, or :meth:`clean` them."""
        return sorted(str(meta["run"]) for _, meta in self._own_runs() if meta.get("dirty", False))

    def clean(self, run: str) -> int:
        """Recover and trim ``run`` (no writer may be open on it); returns rows reclaimed.

        Raises:
            StoreDamagedError: The run cannot be read.
        """
        writer = self.run(run, num_worlds=1)
        try:
            reclaimed = writer.recover()
            writer.trim()
            writer.mark_clean()
        finally:
            self.forget(run)
        return reclaimed

    def close(self) -> None:
        """Forget the open runs. Everything committed is already in the store."""
        self._runs.clear()


def read_meta(group: zarr.Group, run: str) -> dict[str, Any] | None:
    """The committed attributes of a run group, ``None`` if it has none yet.

    Raises:
        StoreDamagedError: The attributes exist but are not a run's.
    """
    try:
        meta = group.attrs.get("worldtap_run")
    except Exception as exc:  # unreadable zarr.json
        raise StoreDamagedError(f"run {run!r}: its attributes cannot be read: {exc!r}") from exc
    if meta is None:
        return None
    if not isinstance(meta, dict) or not isinstance(meta.get("committed"), dict) or \
            not isinstance(meta.get("run"), str):
        raise StoreDamagedError(f"run {run!r}: its attributes are not a worldtap run's: {meta!r:.200}")
    return dict(meta)

