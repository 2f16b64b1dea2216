"""xarray and dask read a run store lazily, as README's "Reading a store" shows: a term's
arrays are one dataset of dask arrays, equal to the committed rows, and
:func:`storage.episode_coordinate` puts each row's episode on it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr
from storage_sim import Sim

from broker import Broker
from storage import RunNotFoundError, RunStore, StoreDaemon, episode_coordinate

pytestmark = pytest.mark.timeout(60)
xr = pytest.importorskip("xarray")
dask_array = pytest.importorskip("dask.array")

DAEMON = {"chunk_bytes": 128, "memory_budget": 6 << 10, "commit_interval": 3600.0}
"""Several chunks per array, and long episodes flushed as fragments (several segments)."""


def _write(store: Path, *, close: bool = True) -> tuple[Sim, StoreDaemon]:
    broker = Broker(strict=True)
    daemon = StoreDaemon(store, **DAEMON)  # type: ignore[arg-type]
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.25)
    sim.step(20)
    if close:
        sim.close()
        daemon.close()
    return sim, daemon


def _open(store: Path, term: str) -> object:
    return xr.open_zarr(store, group=f"runs/run-a/data/{term}", consolidated=False, chunks={})


def test_a_term_opens_lazily_and_equals_the_committed_rows(tmp_path: Path) -> None:
    """Every field and row column of every term is a dask array (nothing read until asked),
    as long as the term's committed rows (the run ended: its arrays were cut), and equal to
    them value for value. Bug caught: arrays left longer than the committed rows (xarray
    would show capacity as data), or a dtype or fill value xarray decodes differently."""
    store = tmp_path / "runs.zarr"
    _write(store)
    committed = RunStore(store).info("run-a")["committed"]["rows"]
    root = zarr.open_group(store, mode="r")
    assert set(committed) == {"obs", "final", "init"}
    for term, rows in committed.items():
        ds = _open(store, term)
        assert ds.sizes[f"{term}_row"] == rows > 0
        arrays = dict(root[f"runs/run-a/data/{term}"].arrays())
        assert set(ds.data_vars) == set(arrays)
        for name, variable in ds.data_vars.items():
            assert isinstance(variable.data, dask_array.Array), name
            assert variable.dims[0] == f"{term}_row"
            want = arrays[name][:rows]
            got = variable.values
            assert got.dtype == want.dtype, name
            np.testing.assert_array_equal(got, want)
            assert got.tobytes() == want.tobytes(), name


def test_the_episode_coordinate_puts_each_row_in_its_episode(tmp_path: Path) -> None:
    """``ds.assign_coords(episode=("obs_row", episode_coordinate(store, run, "obs")))``: the
    rows of episode ``i`` (row ``i`` of ``runs/<run>/episodes``), in order, are exactly the
    rows the simulation published for it, fragments included. Bug caught: a coordinate that
    misplaces the rows of episodes stored in several segments."""
    store = tmp_path / "runs.zarr"
    sim, _ = _write(store)
    assert RunStore(store).episodes("run-a")["segments"].max() > 3  # several segments each
    episodes = xr.open_zarr(store, group="runs/run-a/episodes", consolidated=False)
    keys = [(int(w), int(i)) for w, i in zip(episodes["world"].values, episodes["index"].values, strict=True)]
    assert sorted(keys) == sorted(sim.outcome)
    for term in ("obs", "init"):
        coordinate = episode_coordinate(store, "run-a", term)
        ds = _open(store, term).assign_coords(episode=(f"{term}_row", coordinate))
        assert not (coordinate == -1).any()  # the run ended: every row is an episode's
        for name, variable in ds.data_vars.items():
            field = variable.attrs["worldtap_field"]["name"]  # (node names are escaped)
            if name in ("_step", "_hook"):
                continue
            values = variable.values
            for i, key in enumerate(keys):
                got = values[ds["episode"].values == i]
                want = sim.arrays(key).get(f"{term}/{field}")
                if want is None:  # no row of this term in this episode
                    assert len(got) == 0
                else:
                    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="term: run 'run-a' has no term 'nope'"):
        episode_coordinate(store, "run-a", "nope")
    with pytest.raises(RunNotFoundError, match="run 'missing' not found"):
        episode_coordinate(store, "missing", "obs")


def test_an_open_runs_coordinate_covers_its_committed_rows(tmp_path: Path) -> None:
    """While a run is open its arrays hold more rows than are committed (each its own
    capacity, so xarray cannot open the term as one dataset yet); the coordinate has one value
    per committed row, and with zarr's arrays cut at its length it finds each committed
    episode's rows. Bug caught: a coordinate sized to the arrays (uncommitted rows shown as
    episodes) or built from uncommitted segments."""
    store = tmp_path / "runs.zarr"
    sim, daemon = _write(store, close=False)
    try:
        daemon.runs["run-a"].commit(wait=True)
        sim.step(6)  # written, not committed
        daemon.runs["run-a"].queue.wait()
        coordinate = episode_coordinate(store, "run-a", "obs")
        reader = RunStore(store)
        assert len(coordinate) == reader.info("run-a")["committed"]["rows"]["obs"]
        state = zarr.open_array(store / "runs/run-a/data/obs/state", mode="r")
        assert state.shape[0] > len(coordinate)
        rows = state[:len(coordinate)]
        root = zarr.open_group(store / "runs/run-a/episodes", mode="r")
        n = reader.info("run-a")["committed"]["episodes"]
        assert n > 0
        for i, (world, index) in enumerate(zip(root["world"][:n], root["index"][:n], strict=True)):
            np.testing.assert_array_equal(rows[coordinate == i], sim.arrays((int(world), int(index)))["obs/state"])
    finally:
        daemon.close()
