"""The run-store reader: runs, the episode table, whole episodes, the variation (X, Y) table,
queries, and bulk reads of many episodes at once.

Only committed data is read: every array is cut at the counts of the run's ``committed``
attribute, so rows a writer appended but never committed (or a crash left behind) never
appear. Reading while a daemon writes is safe; a reader sees the commits made before
:meth:`RunStore.refresh`.

Damage is reported, never read as data: a chunk that fails its checksum, a chunk missing
inside the committed rows, or a run whose attributes cannot be read raise
:class:`storage.StoreDamagedError` naming the run and the array, and one damaged run never
hides the others (:meth:`RunStore.damaged` lists the runs that cannot be opened).

Bulk reads (:meth:`RunStore.read_batch`, :meth:`RunStore.read_episodes`) gather the segments of
many episodes and read every chunk they touch once (:meth:`RunStore.episode` and
:meth:`RunStore.episode_rows` are the same path for one episode): the stored chunk bytes are fetched and
decoded with the array's own codecs (checksum included) on plain threads where the store and
codecs allow it (local directories, memory stores), through zarr's asynchronous store and codec
pipeline otherwise (fsspec URLs), and each chunk's rows are copied straight to where they
belong in the output. A chunk missing inside the committed rows raises
:class:`storage.StoreDamagedError` there too. Decoded chunks are kept in a small cache (least
recently used out, ``cache_bytes``), so reading episodes one by one in storage order decodes
each chunk once; the cache is emptied by :meth:`RunStore.refresh`. A run's episode table is
read once per refresh too.

On an object store, what can be read at once is: the runs' attributes when the reader opens,
the columns of a table, the arrays a first read opens and the arrays a read fetches (up to
:data:`storage._reading._ARRAYS_AT_ONCE` at a time), so a read costs a few round trips
whatever the number of fields.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ._format import (
    FORMAT,
    FORMAT_VERSION,
    HOOK_NODE,
    HOOKS,
    STEP_NODE,
    StoreLocation,
    child_nodes,
    from_json,
    node_name,
    open_store,
)
from ._reading import (
    _at_once,
    _before,
    _ChunkCache,
    _fetch,
    _find,
    _float32,
    _keys,
    _local,
    _locate,
    _missing_chunks,
    _ranges,
    _span,
    _sync_codecs,
)
from ._tables import EpisodeBatch, Table
from .errors import EpisodeNotFoundError, RunNotFoundError, StorageError, StoreDamagedError, StoreFormatError
from .run_writer import read_meta

__all__ = ["EpisodeBatch", "RunStore", "Table"]

_EPISODE_COLUMNS: dict[str, str] = {
    **dict.fromkeys(("world", "index", "length", "end_step", "end_seq", "segment_start", "segment_count"), "int64"),
    **dict.fromkeys(("success", "terminated", "truncated"), "bool")}
"""The episode table's columns (``runs/<run>/episodes/``) besides the outcomes, and their dtypes."""
_EPISODE_OUT = ("run", "world", "index", "length", "success", "terminated", "truncated",
                "end_step", "segments")


@dataclass(frozen=True, slots=True, eq=False)
class _Index:
    """A run's committed episode and segment tables, as bulk reads use them. ``keys`` are the
    episodes' ``(world, index)`` sorted; ``order[i]`` is the episode row of ``keys[i]``."""

    world: np.ndarray
    index: np.ndarray
    keys: np.ndarray
    order: np.ndarray
    segment_start: np.ndarray
    segment_count: np.ndarray
    topic: np.ndarray
    offset: np.ndarray
    rows: np.ndarray


_RUNS_AT_ONCE = 8
"""Batches of small runs :meth:`RunStore.read_episodes` reads at once from an object store."""


class RunStore:
    """Read-only view of a run store.

    A ``RunStore`` is meant for one thread at a time; a process that forks (DataLoader
    workers) should open its own.

    Args:
        location: Local directory, fsspec URL, or a zarr store.
        cache_bytes: Decoded chunks kept for the reads of episodes (least recently used
            dropped first; 0 keeps none).

    Raises:
        StoreFormatError: ``location`` is not a worldtap run store (of this layout version).
        ValueError: ``cache_bytes`` is negative.
    """

    def __init__(self, location: StoreLocation, *, cache_bytes: int = 64 << 20) -> None:
        if not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValueError(f"cache_bytes: expected an integer >= 0, got {cache_bytes!r}")
        self.location = location
        self._cache = _ChunkCache(cache_bytes)
        self._indexes: dict[str, _Index] = {}
        self._arrays: dict[tuple[str, str, str], zarr.Array[Any]] = {}  # (run, term, node)
        self._episode_tables: dict[str, dict[str, np.ndarray]] = {}  # run -> its episode table's columns
        self._variation_arrays: dict[str | None, Any] = {}  # run (None: all) -> its (X, Y) SampleArrays
        try:
            self.root = zarr.open_group(open_store(location, read_only=True), mode="r")
            info = self.root.attrs.get("worldtap")
        except StoreFormatError:
            raise
        except Exception as exc:
            raise StoreFormatError(f"no run store at {location!r}: {exc}") from exc
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise StoreFormatError(f"{location!r} is not a worldtap run store (attributes {info!r})")
        if info.get("version") != FORMAT_VERSION:
            raise StoreFormatError(f"{location!r}: layout version {info.get('version')!r}, this reader "
                                   f"reads version {FORMAT_VERSION}")
        self._meta: dict[str, dict[str, Any]] = {}
        self._nodes: dict[str, str] = {}
        self._damaged: dict[str, str] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-read the committed state of every run (to see commits made since opening)."""
        self._cache.clear()
        self._indexes.clear()
        self._arrays.clear()
        self._episode_tables.clear()
        self._variation_arrays.clear()
        self._meta.clear()
        self._nodes.clear()
        self._damaged.clear()
        runs = self.root.get("runs")
        if not isinstance(runs, zarr.Group):
            return

        def open_run(node: str) -> tuple[Exception | None, dict[str, Any] | None]:
            try:
                group = runs.get(node)
                if not isinstance(group, zarr.Group):
                    raise StoreDamagedError(f"runs/{node} is not a group")
                return None, read_meta(group, node)
            except Exception as exc:  # that run only: the others stay readable
                return exc, None

        nodes = child_nodes(runs)  # each run's attributes at once on an object store
        opened = _at_once([(open_run, (node,)) for node in nodes], not _local(self.root.store))
        for node, (failure, meta) in zip(nodes, opened, strict=True):
            if failure is not None:
                self._damaged[node] = str(failure) if isinstance(failure, StorageError) else repr(failure)
                continue
            if meta is None:  # a run being created: nothing committed
                continue
            run = str(meta["run"])
            self._meta[run] = meta
            self._nodes[run] = node

    def runs(self) -> list[str]:
        """Run ids in the store, sorted (damaged runs excluded: see :meth:`damaged`)."""
        return sorted(self._meta)

    def damaged(self) -> dict[str, str]:
        """Run group nodes whose attributes cannot be read, with what is wrong."""
        return dict(self._damaged)

    def node(self, run: str) -> str:
        """The group node of ``run`` under ``runs/`` (its escaped name, see ``LAYOUT.md``).

        Raises:
            RunNotFoundError, StoreDamagedError: As :meth:`info`.
        """
        self.info(run)
        return self._nodes[run]

    def info(self, run: str) -> dict[str, Any]:
        """The run's attributes: num_worlds, device, metadata, status, fields, committed, and:

        - ``variations``: variation key -> declaration (``kind``, ``phase``, ``shape``,
          ``seed``, bounds or labels...) as the run's ``RunStart`` and ``RunEnd`` declared them;
        - ``variation_samples``: variation key -> how its samples are stored (``node``,
          ``phase``, ``labels``, ``field``), for every key with stored samples;
        - ``seed``: the run seed (or ``None``); ``started_at``, ``ended_at``: unix seconds (or
          ``None``: a run joined without its ``RunStart``, a run not ended);
        - ``outcomes``: the episode outcome names stored (sorted).

        Raises:
            RunNotFoundError: No run ``run``.
            StoreDamagedError: The run's attributes cannot be read.
        """
        meta = self._meta.get(run)
        if meta is None:
            node = node_name(run) if isinstance(run, str) and run else ""
            if node in self._damaged:
                raise StoreDamagedError(f"run {run!r} in store {self.location!r} is damaged: "
                                        f"{self._damaged[node]}")
            raise RunNotFoundError(f"run {run!r} not found in store {self.location!r}; "
                                   f"runs: {self.runs()}")
        out = dict(meta)
        out["metadata"] = from_json(meta.get("metadata", {}))
        out["variation_samples"] = dict(meta.get("variations", {}))
        out["variations"] = from_json(meta.get("declarations", {}))
        out["outcomes"] = sorted(meta.get("outcomes", {}))
        for key in ("seed", "started_at", "ended_at"):
            out.setdefault(key, None)
        out.pop("declarations", None)
        return out

    def _group(self, run: str, path: str, rows: int) -> zarr.Group | None:
        """``runs/<run>/<path>``; ``None`` when it holds nothing committed (``rows == 0``).

        Raises:
            StoreDamagedError: The group is missing although ``rows`` rows are committed.
        """
        self.info(run)
        where = f"runs/{self._nodes[run]}/{path}"
        try:
            node = self.root.get(where)
        except Exception as exc:
            raise StoreDamagedError(f"run {run!r}: {where} cannot be read: {exc!r}") from exc
        if not isinstance(node, zarr.Group):
            if rows:
                raise StoreDamagedError(f"run {run!r}: {where} is missing but {rows} rows are "
                                        f"committed (store {self.location!r})")
            return None
        return node

    def _read(self, run: str, group: zarr.Group, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of array ``name``: every chunk they lie in must exist and
        pass its checksum.

        Raises:
            StoreDamagedError: The array or one of those chunks is missing or corrupt.
        """
        where = f"{group.path}/{name}"
        try:
            arr = group.get(name)
            if not isinstance(arr, zarr.Array):
                raise StoreDamagedError(f"run {run!r}: array {where!r} is missing")
            if stop > arr.shape[0]:
                raise StoreDamagedError(f"run {run!r}: array {where!r} has {arr.shape[0]} rows, "
                                        f"{stop} are committed")
            if stop > start and not _local(arr.store_path.store) and arr.shards is None \
                    and tuple(arr.chunks[1:]) == tuple(arr.shape[1:]):  # chunks of whole rows
                return self._fetch_rows(run, arr, start, stop)
            if stop > start:
                missing = _missing_chunks(arr, start, stop)
                if missing:
                    raise StoreDamagedError(f"run {run!r}: array {where!r} lacks chunk(s) {missing[:5]} "
                                            f"of its committed rows {start}..{stop}")
            return np.asarray(arr[start:stop])
        except StoreDamagedError:
            raise
        except Exception as exc:  # a chunk that fails its checksum or cannot be decoded
            raise StoreDamagedError(f"run {run!r}: array {where!r} rows {start}..{stop} cannot be "
                                    f"read: {exc!r}") from exc

    @staticmethod
    def _fetch_rows(run: str, arr: zarr.Array[Any], start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of ``arr`` from an object store: each chunk fetched once (a
        missing one is a ``None`` answer, not a question asked first: one round trip, not two).

        Raises:
            StoreDamagedError: A chunk is missing or cannot be decoded.
        """
        size = int(arr.chunks[0])
        ids = list(range(start // size, (stop - 1) // size + 1))
        out = np.empty((stop - start, *arr.shape[1:]), arr.dtype)

        def place(i: int, chunk: np.ndarray) -> None:
            first = ids[i] * size
            lo, hi = max(start, first), min(stop, first + size)
            out[lo - start:hi - start] = chunk[lo - first:hi - first]

        _fetch(run, arr, ids, place)
        return out

    def _columns(self, run: str, path: str, n: int, dtypes: Mapping[str, str]) -> dict[str, np.ndarray]:
        """The first ``n`` rows of the columns ``dtypes`` (name -> dtype when empty) of table
        ``runs/<run>/<path>`` (see :meth:`_tables`)."""
        return self._tables([(run, path, n, dtypes)])[0]

    def _tables(self, wanted: Sequence[tuple[str, str, int, Mapping[str, str]]]) -> list[dict[str, np.ndarray]]:
        """For each ``(run, path, n, dtypes)``, the first ``n`` rows of the columns ``dtypes``
        (name -> dtype when empty) of table ``runs/<run>/<path>``. On an object store the
        tables' groups are opened at once, then all their columns read at once (one thread
        each, up to :data:`storage._reading._ARRAYS_AT_ONCE`): any number of tables costs a
        few round trips, not a few per column.

        Raises:
            StoreDamagedError: As :meth:`_group` and :meth:`_read`, for the first damaged
                table, then the first damaged column, in ``wanted`` order (after every read
                has ended).
        """
        remote = not _local(self.root.store)
        groups = _at_once([(self._group, (run, path, n)) for run, path, n, _ in wanted], remote)
        jobs = [(i, name) for i, ((_, _, n, dtypes), group) in enumerate(zip(wanted, groups, strict=True))
                if group is not None and n for name in dtypes]
        values = _at_once([(self._read, (wanted[i][0], groups[i], name, 0, wanted[i][2])) for i, name in jobs],
                          remote)
        out = [{name: np.zeros(0, dtype) for name, dtype in dtypes.items()} for _, _, _, dtypes in wanted]
        for (i, name), value in zip(jobs, values, strict=True):
            out[i][name] = value
        return out

    def _episode_table(self, run: str) -> dict[str, np.ndarray]:
        """Every committed column of ``run``'s episode table, by its node name (outcomes too),
        read once per :meth:`refresh`: the episode list, the index of :meth:`episode` and
        the bulk reads, and :meth:`variation_table` share it. Never mutate the result."""
        table = self._episode_tables.get(run)
        if table is None:
            self._read_episode_tables([run])
            table = self._episode_tables[run]
        return table

    def _read_episode_tables(self, runs: Sequence[str], also: Sequence[tuple[str, str, int, Mapping[str, str]]] = (),
                             ) -> list[dict[str, np.ndarray]]:
        """Read the episode tables of ``runs`` not read yet (at once, on an object store),
        and the tables ``also`` (as :meth:`_tables` takes them) with them; returns those."""
        todo = [r for r in dict.fromkeys(runs) if r not in self._episode_tables]
        wanted = [(r, "episodes", int(self.info(r)["committed"]["episodes"]),
                   {**_EPISODE_COLUMNS, **dict.fromkeys(self._meta[r].get("outcomes", {}).values(), "float64")})
                  for r in todo]
        if not wanted and not also:
            return []
        tables = self._tables([*wanted, *also])
        for r, table in zip(todo, tables, strict=False):
            for column in table.values():
                column.flags.writeable = False
            self._episode_tables[r] = table
        return tables[len(wanted):]

    def episodes(self, run: str | None = None, **equal: Any) -> Table:
        """The committed episodes of ``run`` (all runs when ``None``), optionally filtered by
        column equality (``success=True``). Columns: run, world, index, length, success,
        terminated, truncated, end_step, segments, then the episode outcomes stored (float64,
        sorted by name; NaN where an episode lacks one)."""
        parts = []
        runs = [run] if run is not None else self.runs()
        self._read_episode_tables(runs)
        for r in runs:
            stored = self._episode_table(r)
            cols: dict[str, np.ndarray] = {"run": np.full(len(stored["world"]), r, dtype=object)}
            for c in ("world", "index", "length", "success", "terminated", "truncated", "end_step",
                      "segment_count"):
                cols["segments" if c == "segment_count" else c] = stored[c]
            cols.update(self._outcomes(r))
            parts.append(cols)
        names = sorted({c for p in parts for c in p} - set(_EPISODE_OUT))
        if not parts:
            return Table({c: np.zeros(0, object if c == "run" else "int64") for c in _EPISODE_OUT})
        table = Table({c: np.concatenate([p[c] if c in p else np.full(len(p["run"]), np.nan) for p in parts])
                       for c in (*_EPISODE_OUT, *names)})
        return table.filter(**equal) if equal else table

    def _outcomes(self, run: str) -> dict[str, np.ndarray]:
        """The stored outcome columns of ``run``'s committed episodes, by name."""
        stored: dict[str, str] = self._meta[run].get("outcomes", {})
        table = self._episode_table(run)
        return {name: table[node] for name, node in sorted(stored.items())}

    def episode(self, run: str, world: int, index: int) -> dict[str, np.ndarray]:
        """Every field of one committed episode, read back whole (fragments concatenated).

        Keys are ``"<term>/<field>"`` for the fields only, whatever their names (a field named
        ``_step`` is ``"<term>/_step"``); the step and lifecycle point of each row are
        :meth:`episode_rows`. bfloat16 fields read back as float32 (exactly: every bfloat16 is
        a float32).

        Raises:
            EpisodeNotFoundError: No committed episode ``(run, world, index)``.
            StoreDamagedError: Part of the episode is missing or corrupt in the store.
            TypeError: ``world`` or ``index`` is not an int.
        """
        # the bulk path for one episode: each array's chunks fetched at once (concurrently
        # from an object store), the run's episode index read once per refresh
        rows = self._locate(run, *self._key(run, world, index))
        data, offsets = self._gather(run, rows, self._fields(run, None), None, None)
        return {name: values[offsets[name][0]:offsets[name][1]] for name, values in data.items()}

    def episode_rows(self, run: str, world: int, index: int) -> dict[str, dict[str, np.ndarray]]:
        """The row columns of one committed episode, read from the same rows as
        :meth:`episode`: ``{term: {"step": ..., "hook": ...}}``, ``step`` the global step of
        each row (int64), ``hook`` its lifecycle point by name (an object array of str, one
        of ``"pre_step"``, ``"post_step"``, ``"pre_reset"``, ``"post_reset"``,
        ``"post_physics_decimation_step"``; the store holds their uint8 codes). Row ``i`` of a
        term's columns is row ``i`` of its fields.

        Raises:
            EpisodeNotFoundError: No committed episode ``(run, world, index)``.
            StoreDamagedError: Part of the episode is missing or corrupt in the store.
            TypeError: ``world`` or ``index`` is not an int.
        """
        rows = self._locate(run, *self._key(run, world, index))
        topics = self._meta[run]["topics"]
        data, _ = self._gather(run, rows, {t: [STEP_NODE, HOOK_NODE] for t in topics}, None, None,
                               row_columns=True)
        out: dict[str, dict[str, np.ndarray]] = {}
        for term in topics:
            if f"{term}/{STEP_NODE}" not in data:  # the term has no committed rows (no group)
                continue
            codes = data[f"{term}/{HOOK_NODE}"]
            if len(codes) and int(codes.max()) >= len(HOOKS):
                raise StoreDamagedError(f"run {run!r}: term {term!r} holds hook code "
                                        f"{int(codes.max())}, the store knows {len(HOOKS)} hooks")
            out[term] = {"step": data[f"{term}/{STEP_NODE}"], "hook": np.asarray(HOOKS, dtype=object)[codes]}
        return out

    # -- queries and bulk reads ------------------------------------------------------------

    def query(self, where: str | None = None, run: str | None = None) -> Table:
        """The episode table of ``run`` (every run when ``None``) with each episode's variation
        values joined as columns, the rows where ``where`` holds.

        Columns: those of :meth:`episodes`, then the factor columns of :meth:`variation_table`
        (a scalar variation ``key``, one ``key[i]`` per component of a vector one, the code
        ``key`` and the label ``key.label`` of a categorical one; NaN and ``None`` where an
        episode has no value; a name an episode column already has is prefixed
        ``variation.``).

        ``where`` is an expression over the columns (see :func:`storage.query.evaluate`):
        ``"not success and mass > 0.3"``, ``"world in [0, 3] and 10 <= index < 20"``,
        ``"`pole[0]` > 1 or color.label == 'red'"``.

        Raises:
            QueryError: ``where`` cannot be parsed, names an unknown column, or is not a
                condition on each episode.
            RunNotFoundError: No run ``run``.
            StoreDamagedError: Part of the tables is missing or corrupt.
        """
        from .query import evaluate

        table = self._with_variations(self.episodes(run), run)
        return table if where is None else table.where(evaluate(where, table.columns, len(table)))

    def _with_variations(self, table: Table, run: str | None) -> Table:
        """``table`` (episode rows) with the factor columns of :meth:`variation_table` joined."""
        runs = [run] if run is not None else self.runs()
        if not any(self._meta[r].get("variations") for r in runs):
            return table
        arrays = self._variation_arrays.get(run)
        if arrays is None:  # the replay of every sample, once per refresh (never handed out: joined as copies)
            arrays = self._variation_arrays[run] = self.variation_table(run).arrays()
        names = np.unique(np.concatenate([table["run"].astype(str), arrays.run.astype(str)]))
        found = _locate(
            (np.searchsorted(names, arrays.run.astype(str)), arrays.world, arrays.episode),
            (np.searchsorted(names, table["run"].astype(str)), table["world"], table["index"]))
        hit = found >= 0
        columns = dict(table.columns)

        def join(name: str, values: np.ndarray, fill: Any) -> None:
            column = np.full(len(table), fill, dtype=values.dtype)
            column[hit] = values[found[hit]]
            columns[f"variation.{name}" if name in columns else name] = column

        for j, name in enumerate(arrays.x_columns):
            join(name, arrays.x[:, j], np.nan)
        for key, labels in arrays.labels.items():
            join(f"{key}.label", labels, None)
        return Table(columns)

    def read_batch(self, run: str | None = None, episodes: Table | str | None = None,
                   fields: Sequence[str] | None = None, *, start: Any = None,
                   stop: Any = None) -> EpisodeBatch:
        """Many episodes of one run at once, each chunk of each array read once.

        Args:
            run: The run (may be ``None`` when the selection or the store names one run).
            episodes: Which episodes, in which order: ``None`` (all of the run's, in the
                episode table's order), a where-expression (:meth:`query`), or a
                :class:`Table` with columns ``world`` and ``index`` (and ``run``), such as
                :meth:`episodes` or :meth:`query` return.
            fields: ``"<term>/<field>"`` names or term names (all of the term's fields);
                ``None`` reads every field.
            start, stop: Read only rows ``[start, stop)`` of each episode, in every term (an
                int for all episodes, or one per episode; clipped to the episode's rows).

        Returns:
            The episodes' rows, concatenated per field, with their offsets; the batch's
            ``table`` is the selection (with its columns) in its order.

        Raises:
            ValueError: The selection spans several runs, or names no run while the store has
                several; ``start``/``stop`` are negative or of the wrong length; a field or
                term the run lacks (the message names it).
            TypeError: ``episodes`` or ``fields`` of the wrong type.
            EpisodeNotFoundError: A selected episode is not committed.
            RunNotFoundError: No run ``run``.
            StoreDamagedError: Part of an episode is missing or corrupt in the store.
        """
        if episodes is None and run in self._meta:  # the run's episode and segment tables at once
            self._read_indexes([run])
        table = self._select(run, episodes)
        runs = list(dict.fromkeys(table["run"].tolist()))
        if len(runs) > 1:
            raise ValueError(f"episodes: read_batch reads one run, the selection holds runs {runs}; "
                             f"pass run= or use read_episodes")
        name = runs[0] if runs else run
        if name is None:
            return EpisodeBatch(None, table, {}, {})
        rows = self._locate(name, table["world"], table["index"])
        first, last = _span(start, stop, len(rows))
        data, offsets = self._gather(name, rows, self._fields(name, fields), first, last)
        return EpisodeBatch(name, table, data, offsets)

    def read_episodes(self, run: str | None = None, episodes: Table | str | None = None,
                      fields: Sequence[str] | None = None, *,
                      batch_bytes: int = 256 << 20) -> Iterator[dict[str, np.ndarray]]:
        """Every selected episode, as :meth:`episode` returns it (``"<term>/<field>"`` ->
        array), in the order of the selection, read in batches of about ``batch_bytes`` (each
        batch as :meth:`read_batch` reads it).

        Args:
            run: The run; ``None`` for every run of the selection (all runs' episodes in
                :meth:`episodes` order when ``episodes`` is ``None`` too).
            episodes, fields: As :meth:`read_batch` takes them; a Table may mix runs.
            batch_bytes: Rows read at once, in bytes (at least one episode per batch).

        Raises:
            As :meth:`read_batch`, at the call for a bad selection or field, and while
            iterating for damage.
        """
        if not isinstance(batch_bytes, int) or batch_bytes < 1:
            raise ValueError(f"batch_bytes: expected a positive integer, got {batch_bytes!r}")
        if episodes is None and (run is None or run in self._meta):  # every table at once
            self._read_indexes(self.runs() if run is None else [run])
        table = self._select(run, episodes)
        names = table["run"]
        self._read_indexes([str(r) for r in dict.fromkeys(names.tolist())])
        cuts = np.flatnonzero(names[1:] != names[:-1]) + 1 if len(names) else np.zeros(0, np.int64)
        plans = []
        for a, b in zip(np.r_[0, cuts].tolist(), np.r_[cuts, len(names)].tolist(), strict=True):
            if b > a:
                r = str(names[a])
                rows = self._locate(r, table["world"][a:b], table["index"][a:b])
                plans.append((r, rows, self._fields(r, fields)))
        remote = not _local(self.root.store)
        # every run's arrays opened at once (an object store; damage raises where it is read)
        self._open_all([(r, term, name, None) for r, _, terms in plans for term, names in terms.items()
                        for name in names], quiet=True)

        def pieces() -> Iterator[tuple[str, np.ndarray, Mapping[str, Sequence[str]], int] | Exception]:
            """Each batch's run, rows, fields and bytes, in order; a run whose arrays cannot be
            sized ends them with its error (raised where its episodes are due)."""
            for r, rows, terms in plans:
                try:
                    sizes = self._episode_bytes(r, rows, terms)
                except StorageError as exc:
                    yield exc
                    return
                ends = np.cumsum(sizes)
                i = 0
                while i < len(rows):
                    j = max(i + 1, int(np.searchsorted(ends, ends[i] - sizes[i] + batch_bytes, "right")))
                    yield r, rows[i:j], terms, int(ends[j - 1] - ends[i] + sizes[i])
                    i = j

        def waves() -> Iterator[list[tuple[str, np.ndarray, Mapping[str, Sequence[str]], int] | Exception]]:
            """Consecutive batches of at most ``batch_bytes`` in all (at least one): on an object
            store they are read at once (small runs: one round trip for several)."""
            wave: list[Any] = []
            total = 0
            for piece in pieces():
                if wave and (isinstance(piece, Exception) or total + piece[3] > batch_bytes or not remote):
                    yield wave
                    wave, total = [], 0
                wave.append(piece)
                total += 0 if isinstance(piece, Exception) else piece[3]
            if wave:
                yield wave

        def batches() -> Iterator[dict[str, np.ndarray]]:
            with ThreadPoolExecutor(_RUNS_AT_ONCE, thread_name_prefix="worldtap-read-runs") as pool:
                for wave in waves():
                    # each batch's read: started on the pool when the wave has several
                    started = [pool.submit(self._gather, p[0], p[1], p[2], None, None)
                               if len(wave) > 1 and not isinstance(p, Exception) else None for p in wave]
                    for piece, future in zip(wave, started, strict=True):
                        if isinstance(piece, Exception):
                            raise piece
                        data, offsets = future.result() if future is not None else \
                            self._gather(piece[0], piece[1], piece[2], None, None)
                        for k in range(len(piece[1])):
                            yield {n: v[offsets[n][k]:offsets[n][k + 1]] for n, v in data.items()}

        return batches()

    def _select(self, run: str | None, episodes: Table | str | None) -> Table:
        """The selection of :meth:`read_batch`, with a ``run`` column.

        Raises:
            TypeError, ValueError: See :meth:`read_batch`.
        """
        if episodes is None:
            return self.episodes(run)
        if isinstance(episodes, str):
            return self.query(episodes, run)
        if not isinstance(episodes, Table):
            raise TypeError(f"episodes: expected a Table, a where-expression or None, got "
                            f"{type(episodes).__name__}")
        missing = {"world", "index"} - set(episodes.columns)
        if missing:
            raise ValueError(f"episodes: the table lacks column(s) {sorted(missing)}; pass "
                             f"rows of RunStore.episodes() or RunStore.query()")
        if "run" in episodes.columns:
            other = sorted({str(r) for r in episodes["run"].tolist()} - {run}) if run is not None else []
            if other:
                raise ValueError(f"episodes: run={run!r} was asked but the table holds rows of "
                                 f"run(s) {other}")
            return episodes
        if run is None:
            if len(self.runs()) != 1:
                raise ValueError(f"episodes: the table has no run column and the store holds "
                                 f"runs {self.runs()}; pass run=")
            run = self.runs()[0]
        self.info(run)
        return Table({"run": np.full(len(episodes), run, dtype=object), **episodes.columns})

    def _index(self, run: str) -> _Index:
        """The run's committed episode and segment tables (read once per :meth:`refresh`)."""
        index = self._indexes.get(run)
        if index is None:
            self._read_indexes([run])
            index = self._indexes[run]
        return index

    def _read_indexes(self, runs: Sequence[str]) -> None:
        """Build the indexes of ``runs`` not built yet, their tables read at once (on an object
        store)."""
        todo = [r for r in dict.fromkeys(runs) if r not in self._indexes]
        if not todo:
            return
        segments = self._read_episode_tables(todo, [(r, "segments", int(self.info(r)["committed"]["segments"]),
                                                     dict.fromkeys(("topic", "offset", "rows"), "int64"))
                                                    for r in todo])  # both tables at once
        for r, seg in zip(todo, segments, strict=True):
            ep = self._episode_table(r)
            keys = _keys(ep["world"], ep["index"])
            order = np.argsort(keys, kind="stable")
            self._indexes[r] = _Index(ep["world"], ep["index"], keys[order], order, ep["segment_start"],
                                      ep["segment_count"], seg["topic"], seg["offset"], seg["rows"])

    def _key(self, run: str, world: Any, index: Any) -> tuple[np.ndarray, np.ndarray]:
        """``(world, index)`` of one episode as the int64 arrays :meth:`_locate` takes.

        Raises:
            TypeError: ``world`` or ``index`` is not an int (a float or a str is not taken as one).
            EpisodeNotFoundError: One of them lies outside int64 (no episode has it).
        """
        try:
            key = operator.index(world), operator.index(index)
        except TypeError:
            raise TypeError(f"world and index: expected ints, got {world!r} and {index!r}") from None
        if not all(-(1 << 63) <= v < 1 << 63 for v in key):
            raise self._missing(run, *key)
        return np.array([key[0]], np.int64), np.array([key[1]], np.int64)

    def _missing(self, run: str, world: int, index: int) -> EpisodeNotFoundError:
        return EpisodeNotFoundError(f"run {run!r} has no committed episode with world={world} "
                                    f"index={index} in store {self.location!r}")

    def _locate(self, run: str, world: np.ndarray, index: np.ndarray) -> np.ndarray:
        """Episode-table rows of the committed episodes ``(world[i], index[i])`` (the last
        one, as :meth:`episode`, should a key repeat).

        Raises:
            EpisodeNotFoundError: One of them is not a committed episode of ``run``.
        """
        idx = self._index(run)
        world, index = np.asarray(world, np.int64), np.asarray(index, np.int64)
        rows = _find(idx.keys, idx.order, _keys(world, index))
        if len(rows) and int(rows.min()) < 0:
            i = int(np.argmin(rows))
            raise self._missing(run, int(world[i]), int(index[i]))
        return rows

    def _fields(self, run: str, fields: Sequence[str] | None) -> dict[str, list[str]]:
        """Term -> names of its fields to read, in the run's order.

        Raises:
            TypeError: ``fields`` is a str or not a sequence.
            ValueError: A name is neither a term nor a ``"<term>/<field>"`` of the run.
        """
        stored: dict[str, list[str]] = {t: list(self.info(run)["fields"].get(t, {}))
                                        for t in self._meta[run]["topics"]}
        if fields is None:
            return stored
        if isinstance(fields, str) or not isinstance(fields, Sequence):
            raise TypeError(f"fields: expected a list of names, got {fields!r}")
        wanted: set[tuple[str, str]] = set()
        for name in fields:
            if name in stored:
                wanted.update((name, f) for f in stored[name])
                continue
            hits = [(t, name[len(t) + 1:]) for t in stored
                    if name.startswith(f"{t}/") and name[len(t) + 1:] in stored[t]]
            if not hits:
                known = [f"{t}/{f}" for t, fs in stored.items() for f in fs]
                raise ValueError(f"fields: run {run!r} has no field or term {name!r}; terms "
                                 f"{sorted(stored)}, fields {known}")
            wanted.update(hits)
        return {t: [f for f in fs if (t, f) in wanted] for t, fs in stored.items()
                if any((t, f) in wanted for f in fs)}

    def _segments(self, run: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The segments of episode rows ``rows``, in episode then segment order, and the
        position in ``rows`` of the episode each belongs to.

        Raises:
            StoreDamagedError: An episode points past the committed segments.
        """
        idx = self._index(run)
        first, count = idx.segment_start[rows], idx.segment_count[rows]
        bad = (first < 0) | (count < 0) | (first + count > len(idx.topic))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise StoreDamagedError(f"run {run!r}: episode row {int(rows[i])} points at segments "
                                    f"{int(first[i])}..{int(first[i] + count[i])}, {len(idx.topic)} "
                                    f"are committed")
        return _ranges(first, count), np.repeat(np.arange(len(rows)), count)

    def _term_rows(self, run: str, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Term -> how many rows each episode of ``rows`` holds in it."""
        idx = self._index(run)
        seg, owner = self._segments(run, rows)
        topic, counts = idx.topic[seg], idx.rows[seg]
        return {term: np.bincount(owner[topic == code], counts[topic == code],
                                  minlength=len(rows)).astype(np.int64)
                for code, term in enumerate(self._meta[run]["topics"])}

    def _episode_bytes(self, run: str, rows: np.ndarray, terms: Mapping[str, Sequence[str]]) -> np.ndarray:
        """Bytes of the fields ``terms`` of each episode of ``rows``."""
        counts = self._term_rows(run, rows)
        out = np.zeros(len(rows), np.int64)
        for term, names in terms.items():
            for name in names:
                arr = self._array(run, term, name)
                if arr is not None:
                    out += counts[term] * arr.dtype.itemsize * int(np.prod(arr.shape[1:], dtype=np.int64))
        return out

    def _array(self, run: str, term: str, name: str, *, node: str | None = None) -> zarr.Array[Any] | None:
        """The array of field ``name`` of ``term`` (or of its node ``node``: a row column);
        ``None`` when the term holds no committed rows and has no group.

        Raises:
            StoreDamagedError: The array or its group is missing though rows are committed, or
                it is shorter than the committed rows.
        """
        node = node_name(name) if node is None else node
        arr = self._arrays.get((run, term, node))
        if arr is None:
            meta = self._meta[run]
            tnode = meta.get("term_nodes", {}).get(term, node_name(term))
            where = f"runs/{self._nodes[run]}/data/{tnode}/{node}"
            rows = int(meta["committed"]["rows"].get(term, 0))
            group = self._group(run, f"data/{tnode}", rows)
            if group is None:
                return None
            try:
                found = group.get(node)
            except Exception as exc:
                raise StoreDamagedError(f"run {run!r}: array {where!r} cannot be opened: {exc!r}") from exc
            if not isinstance(found, zarr.Array):
                raise StoreDamagedError(f"run {run!r}: array {where!r} is missing")
            if rows > found.shape[0]:
                raise StoreDamagedError(f"run {run!r}: array {where!r} has {found.shape[0]} rows, "
                                        f"{rows} are committed")
            if tuple(found.chunks[1:]) != tuple(found.shape[1:]) or found.shards is not None:
                raise StoreFormatError(f"run {run!r}: array {where!r} is chunked {found.chunks} "
                                       f"(shape {found.shape}); a run store chunks rows only")
            arr = self._arrays[run, term, node] = found
        return arr

    def _open_arrays(self, run: str, wanted: Sequence[tuple[str, str, str | None]]) -> None:
        """Open the arrays ``(term, name, node)`` of :meth:`_array` not yet open, at once on an
        object store (one thread each, up to :data:`storage._reading._ARRAYS_AT_ONCE`), so
        that a first read opens them in about one round trip, not one per array.

        Raises:
            StoreDamagedError: As :meth:`_array`, for the first of ``wanted`` that fails
                (after every array's opening has ended).
        """
        self._open_all([(run, *w) for w in wanted])

    def _open_all(self, wanted: Sequence[tuple[str, str, str, str | None]], *, quiet: bool = False) -> None:
        """:meth:`_open_arrays` of arrays ``(run, term, name, node)`` of any runs; with
        ``quiet``, an array that cannot be opened is left to raise where it is read."""
        if _local(self.root.store):  # elsewhere opened one by one where they are read
            return
        todo = [w for w in wanted if (w[0], w[1], node_name(w[2]) if w[3] is None else w[3]) not in self._arrays]

        def one(run: str, term: str, name: str, node: str | None) -> None:
            try:
                self._array(run, term, name, node=node)
            except StoreDamagedError:
                if not quiet:
                    raise

        _at_once([(one, w) for w in todo], True)

    def _gather(self, run: str, rows: np.ndarray, terms: Mapping[str, Sequence[str]],
                start: np.ndarray | None, stop: np.ndarray | None, *,
                row_columns: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The fields ``terms`` of episode rows ``rows`` (only rows ``[start[i], stop[i])`` of
        episode ``i`` when given), concatenated, and their offsets; with ``row_columns``,
        ``terms`` names row column nodes (:data:`STEP_NODE`, :data:`HOOK_NODE`) instead, read
        as stored.

        Raises:
            StoreDamagedError: Part of an episode is missing or corrupt.
        """
        idx = self._index(run)
        meta = self._meta[run]
        self._open_arrays(run, [(term, name, name if row_columns else None) for term in meta["topics"]
                                if term in terms for name in terms[term]])
        seg, owner = self._segments(run, rows)
        data: dict[str, np.ndarray] = {}
        offsets: dict[str, np.ndarray] = {}
        jobs: list[tuple[str, zarr.Array[Any], np.ndarray, np.ndarray, bool]] = []
        for code, term in enumerate(meta["topics"]):
            if term not in terms:
                continue
            mine = idx.topic[seg] == code
            at, count, who = idx.offset[seg][mine], idx.rows[seg][mine], owner[mine]
            committed = int(meta["committed"]["rows"].get(term, 0))
            bad = (at < 0) | (count < 0) | (at + count > committed)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                e = int(rows[who[i]])
                raise StoreDamagedError(f"run {run!r}: a segment of episode ({int(idx.world[e])}, "
                                        f"{int(idx.index[e])}) covers rows {int(at[i])}..{int(at[i] + count[i])} "
                                        f"of term {term!r}, {committed} are committed")
            if start is not None and stop is not None:
                before = _before(count, who)
                lo = np.maximum(before, start[who])
                hi = np.minimum(before + count, stop[who])
                keep = hi > lo
                at, count, who = (at + lo - before)[keep], (hi - lo)[keep], who[keep]
            offs = np.zeros(len(rows) + 1, np.int64)
            np.cumsum(np.bincount(who, count, minlength=len(rows)).astype(np.int64), out=offs[1:])
            src = _ranges(at, count)
            for name in terms[term]:
                arr = self._array(run, term, name, node=name if row_columns else None)
                if arr is None:
                    continue
                bf16 = not row_columns and meta["fields"][term][name].get("dtype") == "bfloat16"
                jobs.append((f"{term}/{name}", arr, src, offs, bf16))
        values = self._take_all(run, [(arr, src) for _, arr, src, _, _ in jobs])
        for (key, _, _, offs, bf16), value in zip(jobs, values, strict=True):
            data[key] = _float32(value) if bf16 else value
            offsets[key] = offs
        return data, offsets

    def _take_all(self, run: str, jobs: Sequence[tuple[zarr.Array[Any], np.ndarray]]) -> list[np.ndarray]:
        """:meth:`_take` of each ``(array, rows)``. When two or more of them are read through
        zarr's asynchronous path (object stores), the arrays are read concurrently, one thread
        each (up to :data:`storage._reading._ARRAYS_AT_ONCE`), so that a read costs about one
        round trip rather than one per array; arrays of a local store (whose chunks are fetched
        and decoded on threads already) one after the other.

        Raises:
            StoreDamagedError: As :meth:`_take`, for the first damaged array in ``jobs`` order
                (after every array's read has ended).
        """
        remote = sum(_sync_codecs(arr.async_array) is None for arr, _ in jobs)
        return _at_once([(self._take, (run, arr, src)) for arr, src in jobs], remote >= 2)

    def _take(self, run: str, arr: zarr.Array[Any], src: np.ndarray) -> np.ndarray:
        """Rows ``src`` of ``arr`` (in that order), each chunk they lie in read once.

        Raises:
            StoreDamagedError: One of those chunks is missing or fails to decode.
        """
        out = np.empty((len(src), *arr.shape[1:]), arr.dtype)
        if not len(src):
            return out
        rows = int(arr.chunks[0])
        cid = src // rows
        order = None if bool(np.all(cid[1:] >= cid[:-1])) else np.argsort(cid, kind="stable")
        grouped = cid if order is None else cid[order]
        lo = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])  # where each chunk's rows begin
        ids = grouped[lo]
        hi = np.r_[lo[1:], len(src)]

        def place(k: int, chunk: np.ndarray) -> None:
            a, b = int(lo[k]), int(hi[k])
            if order is None:
                local = src[a:b] - int(ids[k]) * rows
                first = int(local[0])
                if int(local[-1]) - first == b - a - 1 and (b - a < 3 or bool(np.all(np.diff(local) == 1))):
                    out[a:b] = chunk[first:first + b - a]  # one contiguous run of the chunk's rows
                else:
                    out[a:b] = chunk[local]
            else:
                pos = order[a:b]
                out[pos] = chunk[src[pos] - int(ids[k]) * rows]

        where = arr.path
        todo: list[int] = []
        for k, chunk_id in enumerate(ids.tolist()):
            cached = self._cache.get((where, chunk_id))
            if cached is None:
                todo.append(k)
            else:
                place(k, cached)
        wanted = [int(ids[k]) for k in todo]
        fetched = _fetch(run, arr, wanted, lambda i, chunk: place(todo[i], chunk)) if todo else []
        for chunk_id, chunk in zip(wanted, fetched, strict=True):
            self._cache.put((where, chunk_id), chunk)
        return out

    def check_chunks(self, run: str, arr: zarr.Array[Any], chunk_ids: Sequence[int],
                     place: Callable[[int, np.ndarray], None] | None = None, *,
                     batch: int = 64) -> dict[int, str]:
        """Fetch and decode row chunks ``chunk_ids`` of ``arr`` (a run's array, as the bulk
        reads do: checksums included), without stopping at the first bad one.

        Args:
            run: The run the array belongs to (for the messages).
            arr: The array.
            chunk_ids: Row-chunk indices to read.
            place: Called as ``place(chunk_id, chunk)`` for every chunk that decodes (on the
                fetching threads: each call must touch only its own part of any output).
            batch: Chunks fetched at once (memory: ``batch`` decoded chunks).

        Returns:
            Chunk index -> what is wrong with it (``"missing"``, or why it cannot be read),
            for every chunk that is missing or fails to decode; empty when all are sound.
        """
        bad: dict[int, str] = {}
        ids = [int(i) for i in chunk_ids]

        def read(part: list[int]) -> None:
            def put(i: int, chunk: np.ndarray) -> None:
                if place is not None:
                    place(part[i], chunk)

            _fetch(run, arr, part, put)

        for a in range(0, len(ids), batch):
            part = ids[a:a + batch]
            try:
                read(part)
                continue
            except StoreDamagedError:
                pass
            for chunk_id in part:  # one by one, to name each bad chunk
                try:
                    read([chunk_id])
                except StoreDamagedError as exc:
                    cause = exc.__cause__
                    bad[chunk_id] = "missing" if cause is None else f"cannot be read: {cause!r}"
        return bad

    def gaps(self, run: str) -> Table:
        """Ranges ``[expected, received)`` the store never received: ``source`` 0 is a gap
        the transport reported in ``topic``'s wire numbering; the others are ranges of run
        sequence numbers (``topic`` ``""``): 1 what a resumed daemon never saw (and the
        episodes then in progress), 2 what was published before a daemon joined the run, 3
        numbers that never arrived."""
        meta = self.info(run)
        n = int(meta["committed"]["gaps"])
        cols = self._columns(run, "gaps", n, dict.fromkeys(("expected", "received", "source", "topic"), "int64"))
        names = np.asarray(meta.get("gap_topics", []) or [""], dtype=object)
        codes = cols.pop("topic")
        if len(codes) and (codes.min() < 0 or codes.max() >= len(names)):
            raise StoreDamagedError(f"run {run!r}: gap topic codes out of range")
        cols["topic"] = names[codes]
        return Table(cols)

    def variation_samples(self, run: str, key: str) -> Table:
        """Raw committed samples of one variation: world, episode, step, seq, value."""
        self.info(run)
        meta = self._meta[run]
        if key not in meta["variations"]:
            raise KeyError(f"run {run!r} has no variation {key!r}; "
                           f"variations: {sorted(meta['variations'])}")
        n = int(meta["committed"]["variations"].get(key, 0))
        cols = self._columns(run, f"variations/{meta['variations'][key]['node']}", n,
                             {**dict.fromkeys(("world", "episode", "step", "seq"), "int64"), "value": "float64"})
        value = cols.pop("value")
        if meta["variations"][key]["field"]["dtype"] == "bfloat16" and len(value):
            value = _float32(value)
        cols["value"] = value
        return Table(cols)

    def variation_table(self, run: str | None = None) -> Any:
        """The (X = variation samples, Y = episode outcomes) table of the committed episodes
        of ``run`` (every run when ``None``), as a :class:`consumers.SampleTable` holding what
        replaying the stored samples and episode ends in publication order gives, joined a
        run at once (:meth:`consumers.SampleTable.add_run`); use its ``arrays()``,
        ``to_numpy()``, ``rows()`` or ``to_pandas()``."""
        from broker import RunStart
        from consumers.sample_table import SampleTable

        table = SampleTable()
        runs = [run] if run is not None else self.runs()
        self._read_episode_tables(runs)
        for r in runs:
            info = self.info(r)
            table(RunStart(r, 0, 0, int(info["num_worlds"]), str(info["device"]),
                           variations=info["variations"], seed=info["seed"],
                           wall_time=float(info["started_at"] or 0.0)))
            samples = {}
            for key, vmeta in self._meta[r]["variations"].items():
                s = self.variation_samples(r, key)
                labels = from_json(vmeta["labels"])
                samples[key] = {"seq": s["seq"], "world": s["world"], "episode": s["episode"], "value": s["value"],
                                "phase": vmeta["phase"], "labels": tuple(labels) if labels is not None else None}
            stored = self._episode_table(r)
            ends: dict[str, Any] = {c: stored[c] for c in ("world", "length", "success", "terminated", "truncated")}
            table.add_run(r, samples, {**ends, "episode": stored["index"], "seq": stored["end_seq"],
                                       "outcomes": self._outcomes(r)})
        return table

