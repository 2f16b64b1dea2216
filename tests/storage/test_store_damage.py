"""A damaged store (item 29) and a directory that is not one (item 22).

Damage in one run never hides another; a missing or corrupt chunk inside the committed range
is an error naming the run and the array (never zeros); the reader raises only
``StorageError``s; a daemon resuming a damaged run fails that run, not itself; a directory
that is not (yet) a run store is never touched.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from procs import ENV
from storage_sim import Sim, assert_episode_equal

from broker import Broker
from storage import (
    RunStore,
    RunStoreWriter,
    StorageError,
    StoreDaemon,
    StoreDamagedError,
    StoreFormatError,
)

pytestmark = pytest.mark.timeout(120)


def _store(path: Path, runs: tuple[str, ...] = ("run-a", "run-b")) -> dict[str, Sim]:
    daemon = StoreDaemon(path, commit_interval=0.0, chunk_bytes=256)  # many small chunks
    sims = {}
    for i, run in enumerate(runs):
        broker = Broker()
        broker.subscribe("", daemon)
        sim = Sim(broker, 4, run=run, seed=i, reset_p=0.2)
        sim.step(30)
        sim.close()
        sims[run] = sim
    daemon.close()
    return sims


def _read_all(reader: RunStore, run: str) -> None:
    for row in reader.episodes(run).rows():
        reader.episode(run, int(row["world"]), int(row["index"]))


def _check_run(reader: RunStore, run: str, sim: Sim) -> None:
    rows = reader.episodes(run).rows()
    assert len(rows) == len(sim.outcome)
    for row in rows:
        key = (int(row["world"]), int(row["index"]))
        assert_episode_equal(reader.episode(run, *key), sim.arrays(key))


def test_an_unreadable_run_never_hides_the_others(tmp_path: Path) -> None:
    """Before: one run's unreadable ``zarr.json`` made ``info`` and ``RunStore`` fail for every
    run of the store (bare JSONDecodeError)."""
    path = tmp_path / "runs.zarr"
    sims = _store(path)
    (path / "runs/run-a/zarr.json").write_text('{"zarr_format": 3, "node_type": "gr')  # torn
    reader = RunStore(path)
    assert reader.runs() == ["run-b"]
    assert "run-a" in next(iter(reader.damaged()))
    with pytest.raises(StoreDamagedError, match="run-a"):
        reader.info("run-a")
    _check_run(reader, "run-b", sims["run-b"])
    info = subprocess.run([sys.executable, "-m", "storage", "info", str(path)], env=ENV,
                          capture_output=True, text=True, timeout=60, check=False)
    assert info.returncode == 3, info.stderr
    assert "run-b" in info.stdout
    assert "run-a" in info.stdout + info.stderr
    assert "Traceback" not in info.stderr
    # a daemon on that store still serves: the damaged run is left as it is
    daemon = StoreDaemon(path, commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", daemon)
    sim = Sim(broker, 4, run="run-c", seed=5)
    sim.step(20)
    sim.close()
    daemon.close()
    _check_run(RunStore(path), "run-c", sim)


@pytest.mark.parametrize("array", ["data/obs/state", "episodes/world", "segments/offset"])
def test_a_missing_chunk_inside_the_committed_rows_is_an_error_not_zeros(tmp_path: Path, array: str) -> None:
    """Before: a deleted data or episode-table chunk read back as zeros, silently."""
    path = tmp_path / "runs.zarr"
    sims = _store(path)
    chunks = sorted(p for p in (path / "runs/run-a" / array).rglob("*")
                    if p.is_file() and p.name != "zarr.json")
    assert chunks
    chunks[0].unlink()
    reader = RunStore(path)
    with pytest.raises(StoreDamagedError, match=rf"run 'run-a'.*{array.split('/')[-1]}"):
        _read_all(reader, "run-a")
    _check_run(reader, "run-b", sims["run-b"])  # the other run is whole


def test_a_corrupt_chunk_fails_its_checksum(tmp_path: Path) -> None:
    """Chunks carry crc32c checksums: a flipped byte is an error naming the run and array."""
    path = tmp_path / "runs.zarr"
    _store(path, ("run-a",))
    chunk = sorted((path / "runs/run-a/data/obs/state").glob("c*"))[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    reader = RunStore(path)
    with pytest.raises(StoreDamagedError, match=r"run 'run-a'.*state"):
        _read_all(reader, "run-a")


def test_only_storage_errors_escape_the_reader_on_random_damage(tmp_path: Path) -> None:
    """Truncate, empty or garble files of one run at random: every read either succeeds with
    the published bytes or raises a StorageError (before: JSONDecodeError, KeyError,
    IndexError)."""
    base = tmp_path / "base.zarr"
    sims = _store(base)
    files = sorted(p for p in (base / "runs/run-a").rglob("*") if p.is_file())
    rng = np.random.default_rng(3)
    import shutil

    for trial in range(8):
        path = tmp_path / f"t{trial}.zarr"
        shutil.copytree(base, path)
        victim = path / files[int(rng.integers(len(files)))].relative_to(base)
        raw = victim.read_bytes()
        how = int(rng.integers(3))
        victim.write_bytes(raw[: len(raw) // 2] if how == 0 else b"" if how == 1 else
                           bytes(rng.integers(0, 256, len(raw), dtype=np.uint8)))
        reader = RunStore(path)
        try:
            for row in reader.episodes("run-a").rows():
                key = (int(row["world"]), int(row["index"]))
                got = reader.episode("run-a", *key)
                assert_episode_equal(got, sims["run-a"].arrays(key))  # read: then it is right
            reader.variation_table("run-a")
            reader.gaps("run-a")
        except StorageError:
            pass
    _check_run(RunStore(path), "run-b", sims["run-b"])  # the damage stays in its run


def test_a_daemon_resuming_a_run_with_a_truncated_chunk_keeps_serving(tmp_path: Path) -> None:
    """Before: a truncated chunk crashed a resuming daemon."""
    path = tmp_path / "runs.zarr"
    daemon = StoreDaemon(path, commit_interval=0.0, chunk_bytes=256)
    broker = Broker()
    broker.subscribe("", daemon)
    sim = Sim(broker, 4, seed=0, reset_p=0.2)
    sim.step(30)
    daemon.close()  # the run stays open (no RunEnd): a later daemon resumes it
    for chunk in (path / "runs/run-a/data/obs/state").glob("c*"):
        chunk.write_bytes(chunk.read_bytes()[:5])
    again = StoreDaemon(path, commit_interval=0.0)
    broker2 = Broker()
    broker2.subscribe("", again)
    sim.broker = broker2
    sim.rec.broker = broker2  # the run's later messages reach the new daemon
    sim.step(10)
    sim.close()
    other = Broker()
    other.subscribe("", again)
    sim_b = Sim(other, 4, run="run-b", seed=1)
    sim_b.step(10)
    sim_b.close()
    again.close()
    _check_run(RunStore(path), "run-b", sim_b)


def test_a_foreign_directory_is_refused_and_untouched(tmp_path: Path) -> None:
    """Before: the daemon deleted every ``*.partial`` file under the directory it was given
    before checking it was a run store, and adopted a non-empty directory silently."""
    home = tmp_path / "home"
    (home / "docs").mkdir(parents=True)
    files = {home / "thesis.tex.partial": b"chapter 1", home / "docs/a.partial": b"x",
             home / "notes.txt": b"keep"}
    for p, data in files.items():
        p.write_bytes(data)
    with pytest.raises(StoreFormatError, match="non-empty directory but not a zarr store"):
        RunStoreWriter(home)
    with pytest.raises(StoreFormatError):
        StoreDaemon(home)
    for p, data in files.items():
        assert p.read_bytes() == data
    assert sorted(p.name for p in home.rglob("*")) == ["a.partial", "docs", "notes.txt", "thesis.tex.partial"]
    # a run store's own debris is removed, and only its kind of file
    store = tmp_path / "runs.zarr"
    _store(store, ("run-a",))
    debris = store / "runs/run-a/zarr.json.0123456789abcdef0123456789abcdef.partial"
    debris.write_bytes(b"torn")
    mine = store / "mine.partial"
    mine.write_bytes(b"not ours")
    RunStoreWriter(store)
    assert not debris.exists()
    assert mine.read_bytes() == b"not ours"
