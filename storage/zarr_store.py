"""The run-store writer: appends episode data, then commits the index (see ``LAYOUT.md``).

Durability: data arrays are written first, then the episode and segment tables, and last the
run group's ``committed`` attribute, one atomic metadata write that is the commit point. Rows
beyond the committed counts are invisible to readers; :meth:`RunWriter.recover` (called when a
writer reopens a run) truncates them and zeroes unreferenced fragment rows. Without
``fsync`` a commit survives any crash of the writing process (zarr's local store writes each
file atomically) but relies on the OS for power loss; with ``fsync`` every file is synced
before the commit returns.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zarr

from broker import FieldSpec

from ._columns import Column, write_columns
from ._zarr_io import (
    APPEND_CONFIG,
    CHUNK_KEYS,
    EPISODE_COLUMNS,
    FORMAT,
    FORMAT_VERSION,
    GAP_COLUMNS,
    HOOKS,
    SEGMENT_COLUMNS,
    TABLE_CHUNK,
    VAR_COLUMNS,
    Compression,
    StoreLocation,
    as_array,
    compressors,
    encode_name,
    open_store,
    remove_partial_files,
    resize_tail,
    zero_rows,
)
from .errors import StoreFormatError

__all__ = ["EPISODE_COLUMNS", "SEGMENT_COLUMNS", "EpisodeRows", "RunStoreWriter", "RunWriter"]

_log = logging.getLogger("worldtap.storage")



@dataclass(slots=True)
class EpisodeRows:
    """Episodes to commit: one entry per column of the episode table, plus their segments.

    ``segments`` holds ``(topic code, offset, rows)`` per segment, episode after episode, and
    ``segment_count`` says how many belong to each episode (``segment_start`` is assigned by
    the writer).
    """

    columns: dict[str, np.ndarray]
    segments: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))

    def __len__(self) -> int:
        return len(self.columns["world"])


class RunWriter:
    """Writes one run into its group ``runs/<run>``. Obtain it from :meth:`RunStoreWriter.run`.

    One writer per store (see :class:`storage.StoreLock`). Appends and commits must come
    from one thread at a time; :meth:`ensure_term` may run beside them (``lock`` guards the
    run's metadata).
    """

    def __init__(self, owner: RunStoreWriter, group: zarr.Group, meta: dict[str, Any]) -> None:
        self._owner = owner
        self.group = group
        self.meta = meta
        self.lock = threading.RLock()
        self._data: dict[str, dict[str, Column]] = {}
        self._tables: dict[str, dict[str, Column]] = {}
        self._variations: dict[str, dict[str, Column]] = {}

    @property
    def run(self) -> str:
        return str(self.meta["run"])

    @property
    def committed(self) -> dict[str, Any]:
        return dict(self.meta["committed"])

    def topic_code(self, term: str) -> int:
        topics: list[str] = self.meta["topics"]
        return topics.index(term)

    # -- data (written first, invisible until committed) --------------------------------

    def ensure_term(self, term: str, specs: Mapping[str, FieldSpec]) -> None:
        """Create the data arrays of ``term`` (or check them against ``specs`` on resume).

        Raises:
            StoreFormatError: The stored schema of ``term`` differs from ``specs``.
        """
        with self.lock:
            self._ensure_term(term, specs)

    def _ensure_term(self, term: str, specs: Mapping[str, FieldSpec]) -> None:
        if term in self._data:
            known = self.meta["fields"][term]
            got = {name: spec.to_dict() for name, spec in specs.items()}
            if got != known:
                raise StoreFormatError(
                    f"run {self.run!r} term {term!r}: expected fields {known!r}, got {got!r}"
                )
            return
        if term in self.meta["fields"]:
            self._open_term(term)
            self._ensure_term(term, specs)
            return
        owner = self._owner
        tgroup = self.group.require_group(f"data/{term}")
        arrays: dict[str, Column] = {}
        for name, spec in {**specs, "_step": FieldSpec("int64", ()),
                           "_hook": FieldSpec("uint8", ())}.items():
            dtype = np.dtype(spec.dtype)
            row_bytes = max(1, dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
            chunk_rows = max(1, owner.chunk_bytes // row_bytes)
            dims = (f"{term}_row", *(f"{name}_dim{i}" for i in range(len(spec.shape))))
            arrays[name] = Column(tgroup.create_array(
                name, shape=(0, *spec.shape), dtype=dtype, chunks=(chunk_rows, *spec.shape),
                compressors=owner.compressors, fill_value=False if dtype == np.bool_ else 0,
                chunk_key_encoding=CHUNK_KEYS, dimension_names=dims,
                attributes={"worldtap_field": spec.to_dict()},
                overwrite=True,  # an array not in the committed meta is debris of a crash
            ).with_config(APPEND_CONFIG), 0)
        self._data[term] = arrays
        self.meta["fields"][term] = {name: spec.to_dict() for name, spec in specs.items()}
        self.meta["topics"].append(term)
        self.meta["committed"]["rows"].setdefault(term, 0)

    def _term_arrays(self, term: str) -> dict[str, zarr.Array[Any]]:
        tgroup = self.group[f"data/{term}"]
        assert isinstance(tgroup, zarr.Group)
        names = [*self.meta["fields"][term], "_step", "_hook"]
        return {name: as_array(tgroup[name]).with_config(APPEND_CONFIG) for name in names}

    def _open_term(self, term: str, arrays: Mapping[str, zarr.Array[Any]] | None = None) -> None:
        rows = int(self.meta["committed"]["rows"].get(term, 0))
        arrays = self._term_arrays(term) if arrays is None else arrays
        self._data[term] = {name: Column(arr, rows) for name, arr in arrays.items()}

    def rows(self, term: str) -> int:
        """Rows written so far to ``term`` (committed or not)."""
        return self._data[term]["_step"].rows

    def data_array(self, term: str, name: str) -> zarr.Array[Any]:
        """The zarr array of field ``name`` (or ``_step``/``_hook``) of ``term``; rows past
        :meth:`rows` are capacity, not data."""
        return self._data[term][name].array

    def append(self, term: str, fields: Mapping[str, np.ndarray], steps: np.ndarray,
               hooks: np.ndarray) -> int:
        """Append rows to ``term``'s arrays (data only: nothing is committed). Returns the
        offset of the first row."""
        columns = self._data[term]
        offset = self.rows(term)
        write_columns([(columns[name], values) for name, values in fields.items()]
                      + [(columns["_step"], steps), (columns["_hook"], hooks)])
        self._owner.bytes_written += sum(int(v.nbytes) for v in fields.values())
        return offset

    # -- index (written last) ------------------------------------------------------------

    def _table(self, name: str, columns: Mapping[str, str], dim: str) -> dict[str, Column]:
        if name not in self._tables:
            tgroup = self.group.require_group(name)
            rows = int(self.meta["committed"][name])
            self._tables[name] = {
                col: Column(as_array(tgroup[col]) if col in tgroup else tgroup.create_array(
                    col, shape=(0,), dtype=dtype, chunks=(TABLE_CHUNK,),
                    compressors=self._owner.compressors, dimension_names=(dim,)), rows)
                for col, dtype in columns.items()
            }
        return self._tables[name]

    def commit(self, episodes: EpisodeRows | None = None, *,
               gaps: Sequence[tuple[int, int, int, str]] = (),
               seq_high: int | None = None, step_high: int | None = None,
               variations: Mapping[str, int] | None = None, status: str | None = None,
               extra: Mapping[str, Any] | None = None) -> None:
        """Append episode/segment/gap rows, then publish the new committed counts.

        ``gaps`` holds ``(expected, received, source, topic)`` per gap: wire numbers of the
        topic's stream (source 0, from the transport) or run sequence numbers (source 1,
        topic ``""``: the range a resumed daemon never saw).

        ``variations`` maps a variation key to its new committed sample count (its rows were
        written with :meth:`variation_group` arrays first). When this returns, the commit is
        visible to readers (and on disk, with ``fsync``).
        """
        with self.lock:
            self._commit(episodes, gaps, seq_high, step_high, variations, status, extra)

    def _commit(self, episodes: EpisodeRows | None, gaps: Sequence[tuple[int, int, int, str]],
                seq_high: int | None, step_high: int | None,
                variations: Mapping[str, int] | None, status: str | None,
                extra: Mapping[str, Any] | None) -> None:
        committed = self.meta["committed"]
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
            seg = np.ascontiguousarray(episodes.segments, dtype=np.int64)
            write_columns([(c, np.asarray(cols[col], dtype=c.array.dtype)) for col, c in etab.items()]
                          + [(stab["episode"], np.repeat(np.arange(n_ep, n_ep + len(counts)), counts)),
                             (stab["topic"], seg[:, 0]), (stab["offset"], seg[:, 1]),
                             (stab["rows"], seg[:, 2])])
            committed["episodes"] = n_ep + len(counts)
            committed["segments"] = n_seg + len(seg)
        if gaps:
            gtab = self._table("gaps", GAP_COLUMNS, "gap")
            for column in gtab.values():
                column.rewind(committed["gaps"])
            topics: list[str] = self.meta.setdefault("gap_topics", [])
            for topic in {g[3] for g in gaps} - set(topics):
                topics.append(topic)
            rows = np.asarray([(e, r, s, topics.index(t)) for e, r, s, t in gaps], np.int64)
            write_columns([(c, rows[:, i]) for i, c in enumerate(gtab.values())])
            committed["gaps"] += len(gaps)
        for term in self._data:
            committed["rows"][term] = self.rows(term)
        if variations:
            committed["variations"].update(variations)
        if seq_high is not None:
            committed["seq_high"] = max(committed["seq_high"], seq_high)
        if step_high is not None:
            committed["step_high"] = max(committed["step_high"], step_high)
        if status is not None:
            self.meta["status"] = status
        if extra:
            self.meta.update(extra)
        self.group.update_attributes({"worldtap_run": self.meta})  # the commit point

    def append_variation(self, key: str, phase: str, labels: list[Any] | None, worlds: np.ndarray,
                         episodes: np.ndarray, steps: np.ndarray, seqs: np.ndarray,
                         value: np.ndarray) -> int:
        """Append samples of variation ``key`` (data only). Returns the new sample count, to
        pass to :meth:`commit` as ``variations={key: count}``."""
        vmeta = self.meta["variations"]
        name = encode_name(key)
        if key not in vmeta:
            vgroup = self.group.require_group(f"variations/{name}")
            dims = ("sample", *(f"value_dim{i}" for i in range(value.ndim - 1)))
            vgroup.create_array("value", shape=(0, *value.shape[1:]), dtype=value.dtype,
                                chunks=(TABLE_CHUNK, *value.shape[1:]), dimension_names=dims,
                                compressors=self._owner.compressors, overwrite=True)
            for col in VAR_COLUMNS:
                vgroup.create_array(col, shape=(0,), dtype="int64", chunks=(TABLE_CHUNK,),
                                    dimension_names=("sample",),
                                    compressors=self._owner.compressors, overwrite=True)
            vmeta[key] = {"node": name, "phase": phase, "labels": labels,
                          "field": FieldSpec(str(value.dtype), tuple(value.shape[1:])).to_dict()}
            self.meta["committed"]["variations"].setdefault(key, 0)
        n = int(self.meta["committed"]["variations"][key])
        if key not in self._variations:
            vnode = self.group[f"variations/{name}"]
            assert isinstance(vnode, zarr.Group)
            self._variations[key] = {col: Column(as_array(vnode[col]), n)
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
        """Make the arrays match the committed counts: truncate uncommitted tails and zero
        rows no committed segment references. Returns the number of rows reclaimed."""
        committed = self.meta["committed"]
        reclaimed = 0
        for term in list(self.meta["fields"]):
            n = int(committed["rows"].get(term, 0))
            arrays = self._term_arrays(term)
            reclaimed += max(0, arrays["_step"].shape[0] - n)
            resize_tail(arrays, n)
            self._open_term(term, arrays)
        for name, cols in (("episodes", EPISODE_COLUMNS), ("segments", SEGMENT_COLUMNS),
                           ("gaps", GAP_COLUMNS)):
            if name in self.group:
                tgroup = self.group[name]
                assert isinstance(tgroup, zarr.Group)
                resize_tail({c: as_array(tgroup[c]) for c in cols if c in tgroup}, committed[name])
        for key, vmeta in self.meta["variations"].items():
            vgroup = self.group[f"variations/{vmeta['node']}"]
            assert isinstance(vgroup, zarr.Group)
            n = int(committed["variations"].get(key, 0))
            resize_tail({c: as_array(vgroup[c]) for c in ("value", *VAR_COLUMNS)}, n)
        reclaimed += self._zero_holes()
        return reclaimed

    def _zero_holes(self, *, piece: int = 1 << 20) -> int:
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
            columns = self._data[term]
            sizes = sorted({c.chunk for c in columns.values()})
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
            for column in columns.values():
                dead = np.flatnonzero(np.cumsum(marks[column.chunk][:-1]) == 0)
                if not len(dead):
                    continue
                rows = column.chunk
                breaks = np.flatnonzero(np.diff(dead) != 1)
                for lo, hi in zip(np.r_[dead[0], dead[breaks + 1]], np.r_[dead[breaks], dead[-1]],
                                  strict=True):
                    start, stop = int(lo) * rows, min(end, (int(hi) + 1) * rows)
                    zero_rows(column.array, start, stop)
                    reclaimed += (stop - start) if column is columns["_step"] else 0
        return reclaimed

    def trim(self) -> None:
        """Cut every array to the rows written, so plain zarr readers see exact lengths
        (call once everything written is committed: at the run's end, or at shutdown).
        Writing afterwards grows the capacity again."""
        with self.lock:
            for columns in [*self._data.values(), *self._tables.values(), *self._variations.values()]:
                for column in columns.values():
                    column.trim()


class RunStoreWriter:
    """Opens (or creates) a run store for writing.

    Args:
        location: Local directory (default kind), fsspec URL, or a zarr store (e.g.
            ``zarr.storage.MemoryStore()`` as an in-memory twin).
        compression: ``"lz4"`` (fast default), ``"zstd"`` or ``"none"``.
        chunk_bytes: Target uncompressed bytes per data chunk.
        fsync: Sync every write to disk before a commit is reported (local stores).

    Raises:
        StoreFormatError: ``location`` holds something that is not a worldtap run store.
    """

    def __init__(self, location: StoreLocation, *, compression: Compression = "lz4",
                 chunk_bytes: int = 1 << 20, fsync: bool = False) -> None:
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes: expected a positive int, got {chunk_bytes!r}")
        self.location = location
        self.compressors = compressors(compression)
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.bytes_written = 0
        self.store = open_store(location, fsync=fsync)
        self.debris_removed = remove_partial_files(location)
        try:
            self.root = zarr.open_group(self.store, mode="a")
        except Exception as exc:
            raise StoreFormatError(f"cannot open {location!r} as a zarr v3 group: {exc}") from exc
        info = self.root.attrs.get("worldtap")
        if info is None:
            if any(True for _ in self.root.members()):
                raise StoreFormatError(f"{location!r} is a zarr group but not a worldtap run store")
            self.root.update_attributes({"worldtap": {"format": FORMAT, "version": FORMAT_VERSION,
                                                      "hooks": list(HOOKS)}})
        elif not isinstance(info, dict) or info.get("format") != FORMAT or \
                info.get("version") != FORMAT_VERSION:
            raise StoreFormatError(
                f"{location!r}: expected a {FORMAT} version {FORMAT_VERSION} store, got {info!r}")
        self.runs_group = self.root.require_group("runs")
        self._runs: dict[str, RunWriter] = {}

    def run(self, run: str, *, num_worlds: int, device: str = "cpu",
            metadata: Mapping[str, Any] | None = None) -> RunWriter:
        """The writer of ``run``: created, or reopened and recovered when the store has it."""
        if run in self._runs:
            return self._runs[run]
        name = encode_name(run)
        if name in self.runs_group:
            node = self.runs_group[name]
            if not isinstance(node, zarr.Group):
                raise StoreFormatError(f"runs/{name} in {self.location!r} is not a group")
            meta: dict[str, Any] = dict(node.attrs["worldtap_run"])  # type: ignore[arg-type]
            group = node
            writer = RunWriter(self, group, meta)
            reclaimed = writer.recover()
            writer.commit(status="open", extra={"resumed": int(meta.get("resumed", 0)) + 1})
            committed: dict[str, Any] = meta["committed"]
            _log.info("resumed run %r: %d committed episodes, %d uncommitted rows reclaimed",
                      run, committed["episodes"], reclaimed)
        else:
            group = self.runs_group.require_group(name)
            meta = {"run": run, "num_worlds": num_worlds, "device": device,
                    "metadata": dict(metadata or {}), "status": "open", "topics": [],
                    "fields": {}, "variations": {}, "resumed": 0,
                    "committed": {"episodes": 0, "segments": 0, "gaps": 0, "rows": {},
                                  "variations": {}, "seq_high": -1, "step_high": -1}}
            writer = RunWriter(self, group, meta)
            writer.commit()
        self._runs[run] = writer
        return writer

    def close(self) -> None:
        """Forget the open runs. Everything committed is already in the store."""
        self._runs.clear()
