"""The run-store reader: runs, the episode table, whole episodes, the variation (X, Y) table.

Only committed data is read: every array is cut at the counts of the run's ``committed``
attribute, so rows a writer appended but never committed (or a crash left behind) never
appear. Reading while a daemon writes is safe; a reader sees the commits made before
:meth:`RunStore.refresh`.

Damage is reported, never read as data: a chunk that fails its checksum, a chunk missing
inside the committed rows, or a run whose attributes cannot be read raise
:class:`storage.StoreDamagedError` naming the run and the array, and one damaged run never
hides the others (:meth:`RunStore.damaged` lists the runs that cannot be opened).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
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
from .errors import EpisodeNotFoundError, RunNotFoundError, StorageError, StoreDamagedError, StoreFormatError
from .run_writer import read_meta

__all__ = ["RunStore", "Table"]

_EPISODE_OUT = ("run", "world", "index", "length", "success", "terminated", "truncated",
                "end_step", "segments")


@dataclass(frozen=True, slots=True)
class Table:
    """Equal-length numpy columns. Filter with :meth:`where` or :meth:`filter`."""

    columns: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def where(self, mask: np.ndarray) -> Table:
        """The rows where the boolean ``mask`` is true."""
        return Table({k: v[mask] for k, v in self.columns.items()})

    def filter(self, **equal: Any) -> Table:
        """The rows whose columns equal the given values (``filter(success=True, world=3)``)."""
        mask = np.ones(len(self), bool)
        for column, value in equal.items():
            if column not in self.columns:
                raise KeyError(f"filter: no column {column!r}; columns are {sorted(self.columns)}")
            mask &= self.columns[column] == value
        return self.where(mask)

    def rows(self) -> list[dict[str, Any]]:
        """The rows as dicts of Python scalars."""
        return [{k: v[i].item() if hasattr(v[i], "item") else v[i] for k, v in self.columns.items()}
                for i in range(len(self))]

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` (pandas is imported lazily)."""
        import pandas as pd  # type: ignore[import-untyped]

        return pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in self.columns.items()})


class RunStore:
    """Read-only view of a run store.

    Args:
        location: Local directory, fsspec URL, or a zarr store.

    Raises:
        StoreFormatError: ``location`` is not a worldtap run store (of this layout version).
    """

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
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
        self._meta.clear()
        self._nodes.clear()
        self._damaged.clear()
        runs = self.root.get("runs")
        if not isinstance(runs, zarr.Group):
            return
        for node in child_nodes(runs):
            try:
                group = runs.get(node)
                if not isinstance(group, zarr.Group):
                    raise StoreDamagedError(f"runs/{node} is not a group")
                meta = read_meta(group, node)
            except Exception as exc:  # that run only: the others stay readable
                self._damaged[node] = str(exc) if isinstance(exc, StorageError) else repr(exc)
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

    def _column(self, run: str, group: zarr.Group | None, name: str, n: int, dtype: str) -> np.ndarray:
        if group is None or n == 0:
            return np.zeros(0, dtype)
        return self._read(run, group, name, 0, n)

    def episodes(self, run: str | None = None, **equal: Any) -> Table:
        """The committed episodes of ``run`` (all runs when ``None``), optionally filtered by
        column equality (``success=True``). Columns: run, world, index, length, success,
        terminated, truncated, end_step, segments, then the episode outcomes stored (float64,
        sorted by name; NaN where an episode lacks one)."""
        parts = []
        for r in [run] if run is not None else self.runs():
            n = int(self.info(r)["committed"]["episodes"])
            group = self._group(r, "episodes", n)
            cols: dict[str, np.ndarray] = {"run": np.full(n, r, dtype=object)}
            for c, dt in (("world", "int64"), ("index", "int64"), ("length", "int64"),
                          ("success", "bool"), ("terminated", "bool"), ("truncated", "bool"),
                          ("end_step", "int64"), ("segment_count", "int64")):
                cols["segments" if c == "segment_count" else c] = self._column(r, group, c, n, dt)
            cols.update(self._outcomes(r, group, n))
            parts.append(cols)
        names = sorted({c for p in parts for c in p} - set(_EPISODE_OUT))
        if not parts:
            return Table({c: np.zeros(0, object if c == "run" else "int64") for c in _EPISODE_OUT})
        table = Table({c: np.concatenate([p[c] if c in p else np.full(len(p["run"]), np.nan) for p in parts])
                       for c in (*_EPISODE_OUT, *names)})
        return table.filter(**equal) if equal else table

    def _outcomes(self, run: str, group: zarr.Group | None, n: int) -> dict[str, np.ndarray]:
        """The stored outcome columns of ``run``'s first ``n`` episodes, by name."""
        stored: dict[str, str] = self._meta[run].get("outcomes", {})
        return {name: self._column(run, group, node, n, "float64") for name, node in sorted(stored.items())}

    def episode(self, run: str, world: int, index: int) -> dict[str, np.ndarray]:
        """Every field of one committed episode, read back whole (fragments concatenated).

        Keys are ``"<term>/<field>"`` for the fields only, whatever their names (a field named
        ``_step`` is ``"<term>/_step"``); the step and lifecycle point of each row are
        :meth:`episode_rows`. bfloat16 fields read back as float32 (exactly: every bfloat16 is
        a float32).

        Raises:
            EpisodeNotFoundError: No committed episode ``(run, world, index)``.
            StoreDamagedError: Part of the episode is missing or corrupt in the store.
        """
        out: dict[str, np.ndarray] = {}
        for term, fields, read in self._episode_terms(run, world, index):
            for name, spec in fields.items():
                value = read(node_name(name))
                if spec.get("dtype") == "bfloat16":
                    value = (value.astype(np.uint32) << 16).view(np.float32)
                out[f"{term}/{name}"] = value
        return out

    def episode_rows(self, run: str, world: int, index: int) -> dict[str, dict[str, np.ndarray]]:
        """The row columns of one committed episode, read from the same rows as
        :meth:`episode`: ``{term: {"step": ..., "hook": ...}}``, ``step`` the global step of
        each row (int64), ``hook`` its lifecycle point by name (an object array of str, one
        of ``"pre_step"``, ``"post_step"``, ``"pre_reset"``, ``"post_reset"``; the store
        holds their uint8 codes). Row ``i`` of a term's columns is row ``i`` of its fields.

        Raises:
            EpisodeNotFoundError: No committed episode ``(run, world, index)``.
            StoreDamagedError: Part of the episode is missing or corrupt in the store.
        """
        out: dict[str, dict[str, np.ndarray]] = {}
        for term, _, read in self._episode_terms(run, world, index):
            codes = read(HOOK_NODE)
            if len(codes) and int(codes.max()) >= len(HOOKS):
                raise StoreDamagedError(f"run {run!r}: term {term!r} holds hook code "
                                        f"{int(codes.max())}, the store knows {len(HOOKS)} hooks")
            out[term] = {"step": read(STEP_NODE), "hook": np.asarray(HOOKS, dtype=object)[codes]}
        return out

    def _episode_terms(self, run: str, world: int, index: int) -> Iterator[
            tuple[str, dict[str, Any], Callable[[str], np.ndarray]]]:
        """For each term of the run with committed rows: its name, its stored field specs, and
        a reader of the episode's rows of a node of ``data/<term>/`` (its segments joined)."""
        meta = self.info(run)
        committed = meta["committed"]
        n = int(committed["episodes"])
        egroup = self._group(run, "episodes", n)
        worlds = self._column(run, egroup, "world", n, "int64")
        indices = self._column(run, egroup, "index", n, "int64")
        hits = np.flatnonzero((worlds == world) & (indices == index))
        if not len(hits):
            raise EpisodeNotFoundError(f"run {run!r} has no committed episode with world={world} "
                                       f"index={index} in store {self.location!r}")
        row = int(hits[-1])
        assert egroup is not None
        start = int(self._read(run, egroup, "segment_start", row, row + 1)[0])
        count = int(self._read(run, egroup, "segment_count", row, row + 1)[0])
        n_seg = int(committed["segments"])
        if start < 0 or count < 0 or start + count > n_seg:
            raise StoreDamagedError(f"run {run!r}: episode row {row} points at segments "
                                    f"{start}..{start + count}, {n_seg} are committed")
        sgroup = self._group(run, "segments", n_seg)
        segs = (np.stack([self._read(run, sgroup, c, start, start + count)
                          for c in ("topic", "offset", "rows")], axis=1)
                if count and sgroup is not None else np.zeros((0, 3), np.int64))
        for code, term in enumerate(meta["topics"]):
            mine = segs[segs[:, 0] == code].tolist()
            rows = int(committed["rows"].get(term, 0))
            tnode = meta.get("term_nodes", {}).get(term, node_name(term))
            tgroup = self._group(run, f"data/{tnode}", rows)
            if tgroup is None:
                continue
            for _, o, r in mine:
                if o < 0 or r < 0 or o + r > rows:
                    raise StoreDamagedError(f"run {run!r}: a segment of episode ({world}, {index}) "
                                            f"covers rows {o}..{o + r} of term {term!r}, {rows} are "
                                            f"committed")

            def read(node: str, tgroup: zarr.Group = tgroup, mine: list[list[int]] = mine) -> np.ndarray:
                pieces = [self._read(run, tgroup, node, int(o), int(o) + int(r)) for _, o, r in mine]
                if pieces:
                    return np.concatenate(pieces)
                arr = tgroup.get(node)
                shape = tuple(arr.shape[1:]) if isinstance(arr, zarr.Array) else ()
                dtype = arr.dtype if isinstance(arr, zarr.Array) else np.dtype("int64")
                return np.zeros((0, *shape), dtype)

            yield term, dict(meta["fields"][term]), read

    def gaps(self, run: str) -> Table:
        """Ranges ``[expected, received)`` the store never received: ``source`` 0 is a gap
        the transport reported in ``topic``'s wire numbering; the others are ranges of run
        sequence numbers (``topic`` ``""``): 1 what a resumed daemon never saw (and the
        episodes then in progress), 2 what was published before a daemon joined the run, 3
        numbers that never arrived."""
        meta = self.info(run)
        n = int(meta["committed"]["gaps"])
        group = self._group(run, "gaps", n)
        cols = {c: self._column(run, group, c, n, "int64") for c in ("expected", "received", "source")}
        names = np.asarray(meta.get("gap_topics", []) or [""], dtype=object)
        codes = self._column(run, group, "topic", n, "int64")
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
        group = self._group(run, f"variations/{meta['variations'][key]['node']}", n)
        cols = {c: self._column(run, group, c, n, "int64") for c in ("world", "episode", "step", "seq")}
        value = self._column(run, group, "value", n, "float64")
        if meta["variations"][key]["field"]["dtype"] == "bfloat16" and len(value):
            value = (value.astype(np.uint32) << 16).view(np.float32)
        cols["value"] = value
        return Table(cols)

    def variation_table(self, run: str | None = None) -> Any:
        """The (X = variation samples, Y = episode outcomes) table of the committed episodes
        of ``run`` (every run when ``None``), as a :class:`consumers.SampleTable` built by
        replaying the stored samples and episode ends in publication order; use its
        ``arrays()``, ``to_numpy()``, ``rows()`` or ``to_pandas()``."""
        import torch

        from broker import EpisodeEnd, RunStart, VariationSample
        from consumers.sample_table import SampleTable

        table = SampleTable()
        for r in [run] if run is not None else self.runs():
            info = self.info(r)
            table(RunStart(r, 0, 0, int(info["num_worlds"]), str(info["device"]),
                           variations=info["variations"], seed=info["seed"],
                           wall_time=float(info["started_at"] or 0.0)))
            meta = self._meta[r]
            events: list[tuple[int, int, Any]] = []
            for key, vmeta in meta["variations"].items():
                s = self.variation_samples(r, key)
                labels = from_json(vmeta["labels"])
                labels = tuple(labels) if labels is not None else None
                for seq in np.unique(s["seq"]).tolist():
                    m = s["seq"] == seq
                    events.append((seq, 0, VariationSample(
                        r, seq, int(s["step"][m][0]), key, vmeta["phase"],
                        torch.from_numpy(s["world"][m]), torch.from_numpy(s["episode"][m]),
                        torch.from_numpy(np.ascontiguousarray(s["value"][m])), labels)))
            n = int(meta["committed"]["episodes"])
            group = self._group(r, "episodes", n)
            cols = {c: self._column(r, group, c, n, "int64") for c in ("world", "index", "length",
                                                                       "end_step", "end_seq")}
            flags = {c: self._column(r, group, c, n, "bool") for c in ("success", "terminated",
                                                                       "truncated")}
            outcomes = self._outcomes(r, group, n)
            for seq in np.unique(cols["end_seq"]).tolist():
                m = cols["end_seq"] == seq
                t = {k: torch.from_numpy(v[m]) for k, v in {**cols, **flags}.items()}
                events.append((seq, 1, EpisodeEnd(r, seq, int(cols["end_step"][m][0]),
                                                  t["world"], t["index"], t["success"],
                                                  t["terminated"], t["truncated"], t["length"],
                                                  outcomes={k: torch.from_numpy(v[m]) for k, v in outcomes.items()})))
            for _, _, message in sorted(events, key=lambda e: (e[0], e[1])):
                table(message)
        return table


def _missing_chunks(arr: zarr.Array[Any], start: int, stop: int) -> list[int]:
    """Row-chunk indices of ``arr`` within rows ``[start, stop)`` whose chunk is not stored
    (zarr would read them as the fill value)."""
    from zarr.core.sync import sync

    rows = int(arr.chunks[0])
    first, last = start // rows, (stop - 1) // rows
    meta = arr.metadata
    store = arr.store_path.store
    prefix = f"{arr.store_path.path}/" if arr.store_path.path else ""
    rest = (0,) * (len(arr.shape) - 1)
    keys = [(i, prefix + meta.encode_chunk_key((i, *rest))) for i in range(first, last + 1)]

    async def check() -> list[bool]:
        import asyncio

        return list(await asyncio.gather(*(store.exists(k) for _, k in keys)))

    found = sync(check())
    return [i for (i, _), ok in zip(keys, found, strict=True) if not ok]
