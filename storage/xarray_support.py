"""Reading a run store with xarray and dask: which episode each data row belongs to.

A term's arrays (``runs/<run>/data/<term>/``) open as one xarray dataset with dimension
``<term>_row``; the segment table says which rows make up each episode. :func:`episode_coordinate`
turns it into a coordinate of the data rows::

    ds = xr.open_zarr("runs.zarr", group=f"runs/{run}/data/obs", consolidated=False, chunks={})
    ds = ds.assign_coords(episode=("obs_row", episode_coordinate("runs.zarr", run, "obs")))

Nothing here imports xarray: the coordinate is a numpy array.
"""

from __future__ import annotations

import numpy as np
import zarr

from ._format import StoreLocation, node_name, open_store
from .errors import RunNotFoundError, StoreDamagedError
from .run_writer import read_meta

__all__ = ["episode_coordinate"]


def episode_coordinate(store: StoreLocation, run: str, term: str) -> np.ndarray:
    """The episode of each committed data row of ``term`` in ``run``: its row in
    ``runs/<run>/episodes`` (its position on that group's ``episode`` dimension), or ``-1``
    for a row no committed episode holds (part of an episode that never ended).

    The result has one value per committed row, so it fits a term's arrays once the run has
    ended or its daemon stopped (they are cut to their committed rows then). While a run is
    being written, each array has its own capacity past the committed rows (so xarray cannot
    open the term as one dataset yet): cut zarr's arrays at ``len(coordinate)``. An episode's
    rows are in the order they were recorded.

    Args:
        store: The run store (directory, URL or zarr store).
        run: The run id.
        term: The term (a topic ``batch/<term>`` of the run).

    Returns:
        An int64 array, one value per committed row of ``term``.

    Raises:
        StoreFormatError: ``store`` cannot be opened.
        RunNotFoundError: The store holds no committed run ``run``.
        ValueError: The run has no term ``term``.
        StoreDamagedError: The run's attributes or segment table cannot be read.
    """
    root = zarr.open_group(open_store(store, read_only=True), mode="r")
    group = root.get(f"runs/{node_name(run)}")
    meta = read_meta(group, run) if isinstance(group, zarr.Group) else None
    if not isinstance(group, zarr.Group) or meta is None:
        raise RunNotFoundError(f"run {run!r} not found in store {store!r}")
    topics: list[str] = meta["topics"]
    if term not in topics:
        raise ValueError(f"term: run {run!r} has no term {term!r}; its terms: {topics}")
    committed = meta["committed"]
    coordinate = np.full(int(committed["rows"].get(term, 0)), -1, np.int64)
    n = int(committed["segments"])
    if not n:
        return coordinate
    table: dict[str, np.ndarray] = {}
    for column in ("episode", "topic", "offset", "rows"):
        try:
            array = group[f"segments/{column}"]
            if not isinstance(array, zarr.Array):
                raise TypeError(f"segments/{column} is not an array")
            table[column] = np.asarray(array[:n], np.int64)
        except Exception as exc:  # missing or corrupt: name the run
            raise StoreDamagedError(f"run {run!r}: its segment table cannot be read: {exc!r}") from exc
    mine = table["topic"] == topics.index(term)
    offsets, counts, episodes = table["offset"][mine], table["rows"][mine], table["episode"][mine]
    # row j of the segments laid end to end is row offset + (j - rows of the segments before)
    shift = np.repeat(offsets - (np.cumsum(counts) - counts), counts)
    coordinate[shift + np.arange(int(counts.sum()))] = np.repeat(episodes, counts)
    return coordinate
