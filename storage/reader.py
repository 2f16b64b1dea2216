"""The run-store reader: runs, the episode table, whole episodes, the variation (X, Y) table.

Only committed data is read: every array is cut at the counts of the run's ``committed``
attribute, so rows a writer appended but never committed (or a crash left behind) never
appear. Reading while a daemon writes is safe; a reader sees the commits made before
:meth:`RunStore.refresh`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ._zarr_io import FORMAT, HOOKS, StoreLocation, decode_name, encode_name, open_store
from .errors import EpisodeNotFoundError, RunNotFoundError, StoreFormatError

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
        StoreFormatError: ``location`` is not a worldtap run store.
    """

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        try:
            self.root = zarr.open_group(open_store(location, read_only=True), mode="r")
        except StoreFormatError:
            raise
        except Exception as exc:
            raise StoreFormatError(f"no run store at {location!r}: {exc}") from exc
        info = self.root.attrs.get("worldtap")
        if not isinstance(info, dict) or info.get("format") != FORMAT:
            raise StoreFormatError(f"{location!r} is not a worldtap run store (attributes {info!r})")
        self._meta: dict[str, dict[str, Any]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Re-read the committed state of every run (to see commits made since opening)."""
        self._meta.clear()
        if "runs" not in self.root:
            return
        runs = self.root["runs"]
        assert isinstance(runs, zarr.Group)
        for name, group in runs.groups():
            meta = group.attrs.get("worldtap_run")
            if isinstance(meta, dict):
                self._meta[decode_name(name)] = meta

    def runs(self) -> list[str]:
        """Run ids in the store, sorted."""
        return sorted(self._meta)

    def info(self, run: str) -> dict[str, Any]:
        """The run's attributes: num_worlds, device, metadata, status, fields, committed."""
        try:
            return dict(self._meta[run])
        except KeyError:
            raise RunNotFoundError(f"run {run!r} not found in store {self.location!r}; "
                                   f"runs: {self.runs()}") from None

    def _group(self, run: str, path: str) -> zarr.Group | None:
        self.info(run)
        node = self.root.get(f"runs/{encode_name(run)}/{path}")
        return node if isinstance(node, zarr.Group) else None

    def _column(self, group: zarr.Group | None, name: str, n: int, dtype: str) -> np.ndarray:
        if group is None or n == 0:
            return np.zeros(0, dtype)
        arr = group[name]
        assert isinstance(arr, zarr.Array)
        return np.asarray(arr[:n])

    def episodes(self, run: str | None = None, **equal: Any) -> Table:
        """The committed episodes of ``run`` (all runs when ``None``), optionally filtered by
        column equality (``success=True``). Columns: run, world, index, length, success,
        terminated, truncated, end_step, segments."""
        parts = []
        for r in [run] if run is not None else self.runs():
            n = int(self.info(r)["committed"]["episodes"])
            group = self._group(r, "episodes")
            cols: dict[str, np.ndarray] = {"run": np.full(n, r, dtype=object)}
            for c, dt in (("world", "int64"), ("index", "int64"), ("length", "int64"),
                          ("success", "bool"), ("terminated", "bool"), ("truncated", "bool"),
                          ("end_step", "int64"), ("segment_count", "int64")):
                cols["segments" if c == "segment_count" else c] = self._column(group, c, n, dt)
            parts.append(cols)
        if not parts:
            return Table({c: np.zeros(0, object if c == "run" else "int64") for c in _EPISODE_OUT})
        table = Table({c: np.concatenate([p[c] for p in parts]) for c in _EPISODE_OUT})
        return table.filter(**equal) if equal else table

    def episode(self, run: str, world: int, index: int) -> dict[str, np.ndarray]:
        """Every field of one committed episode, read back whole (fragments concatenated).

        Keys are ``"<term>/<field>"``, plus ``"<term>/_step"`` (global step of each row) and
        ``"<term>/_hook"`` (lifecycle point of each row, as a str array).

        Raises:
            EpisodeNotFoundError: No committed episode ``(run, world, index)``.
        """
        meta = self.info(run)
        committed = meta["committed"]
        n = int(committed["episodes"])
        egroup = self._group(run, "episodes")
        worlds = self._column(egroup, "world", n, "int64")
        indices = self._column(egroup, "index", n, "int64")
        hits = np.flatnonzero((worlds == world) & (indices == index))
        if not len(hits):
            raise EpisodeNotFoundError(f"run {run!r} has no committed episode with world={world} "
                                       f"index={index} in store {self.location!r}")
        row = int(hits[-1])
        assert egroup is not None
        start = int(egroup["segment_start"][row])  # type: ignore[index,arg-type]
        count = int(egroup["segment_count"][row])  # type: ignore[index,arg-type]
        sgroup = self._group(run, "segments")
        assert sgroup is not None
        segs = np.stack([np.asarray(sgroup[c][start:start + count])  # type: ignore[index]
                         for c in ("topic", "offset", "rows")], axis=1) if count else np.zeros((0, 3))
        out: dict[str, np.ndarray] = {}
        for code, term in enumerate(meta["topics"]):
            mine = segs[segs[:, 0] == code]
            tgroup = self._group(run, f"data/{term}")
            if tgroup is None:
                continue
            for name in [*meta["fields"][term], "_step", "_hook"]:
                arr = tgroup[name]
                assert isinstance(arr, zarr.Array)
                pieces = [np.asarray(arr[int(o):int(o) + int(r)]) for _, o, r in mine.tolist()]
                value = (np.concatenate(pieces) if pieces
                         else np.zeros((0, *arr.shape[1:]), arr.dtype))
                out[f"{term}/{name}"] = (np.asarray(HOOKS, dtype=object)[value]
                                         if name == "_hook" else value)
        return out

    def gaps(self, run: str) -> Table:
        """Ranges ``[expected, received)`` the store never received: ``source`` 0 is a gap
        the transport reported in ``topic``'s wire numbering; ``source`` 1 a range of run
        sequence numbers a resumed daemon never saw (``topic`` ``""``)."""
        meta = self.info(run)
        n = int(meta["committed"]["gaps"])
        group = self._group(run, "gaps")
        cols = {c: self._column(group, c, n, "int64") for c in ("expected", "received", "source")}
        names = np.asarray(meta.get("gap_topics", []) or [""], dtype=object)
        cols["topic"] = names[self._column(group, "topic", n, "int64")]
        return Table(cols)

    def variation_samples(self, run: str, key: str) -> Table:
        """Raw committed samples of one variation: world, episode, step, seq, value."""
        meta = self.info(run)
        if key not in meta["variations"]:
            raise KeyError(f"run {run!r} has no variation {key!r}; "
                           f"variations: {sorted(meta['variations'])}")
        n = int(meta["committed"]["variations"].get(key, 0))
        group = self._group(run, f"variations/{meta['variations'][key]['node']}")
        cols = {c: self._column(group, c, n, "int64") for c in ("world", "episode", "step", "seq")}
        assert group is not None
        value = group["value"]
        assert isinstance(value, zarr.Array)
        cols["value"] = np.asarray(value[:n])
        return Table(cols)

    def variation_table(self, run: str | None = None) -> Any:
        """The (X = variation samples, Y = episode outcomes) table of the committed episodes
        of ``run`` (every run when ``None``), as a :class:`consumers.SampleTable` built by
        replaying the stored samples and episode ends in publication order; use its
        ``arrays()``, ``to_numpy()``, ``rows()`` or ``to_pandas()``."""
        import torch

        from broker import EpisodeEnd, VariationSample
        from consumers.sample_table import SampleTable

        table = SampleTable()
        for r in [run] if run is not None else self.runs():
            meta = self.info(r)
            events: list[tuple[int, int, Any]] = []
            for key, vmeta in meta["variations"].items():
                s = self.variation_samples(r, key)
                labels = tuple(vmeta["labels"]) if vmeta["labels"] is not None else None
                for seq in np.unique(s["seq"]).tolist():
                    m = s["seq"] == seq
                    events.append((seq, 0, VariationSample(
                        r, seq, int(s["step"][m][0]), key, vmeta["phase"],
                        torch.from_numpy(s["world"][m]), torch.from_numpy(s["episode"][m]),
                        torch.from_numpy(np.ascontiguousarray(s["value"][m])), labels)))
            n = int(meta["committed"]["episodes"])
            group = self._group(r, "episodes")
            cols = {c: self._column(group, c, n, "int64") for c in ("world", "index", "length",
                                                                    "end_step", "end_seq")}
            flags = {c: self._column(group, c, n, "bool") for c in ("success", "terminated",
                                                                    "truncated")}
            for seq in np.unique(cols["end_seq"]).tolist():
                m = cols["end_seq"] == seq
                t = {k: torch.from_numpy(v[m]) for k, v in {**cols, **flags}.items()}
                events.append((seq, 1, EpisodeEnd(r, seq, int(cols["end_step"][m][0]),
                                                  t["world"], t["index"], t["success"],
                                                  t["terminated"], t["truncated"], t["length"])))
            for _, _, message in sorted(events, key=lambda e: (e[0], e[1])):
                table(message)
        return table
