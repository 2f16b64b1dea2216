"""The writer, reader and daemon core, in process, on in-memory twins and real disk stores."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from storage_sim import Sim, assert_episode_equal

import storage
from broker import Batch, Broker, EpisodeEnd, Gap
from consumers.sample_table import SampleTable
from storage import (
    EpisodeNotFoundError,
    RunNotFoundError,
    RunStore,
    RunStoreWriter,
    StoreDaemon,
    StoreFormatError,
)

pytestmark = pytest.mark.timeout(60)


def run_sim(broker: Broker, store: Any, *, steps: int = 120, worlds: int = 6, close: bool = True,
            **daemon_kw: Any) -> tuple[Sim, StoreDaemon]:
    daemon = StoreDaemon(store, commit_interval=0.5, **daemon_kw)
    broker.subscribe("", daemon)
    sim = Sim(broker, worlds)
    sim.step(steps)
    if close:
        sim.close()
        daemon.close()
    return sim, daemon


def check_all(reader: RunStore, sim: Sim, run: str = "run-a", *, expect: str = "all") -> int:
    table = reader.episodes(run)
    done = {k for k in sim.outcome if expect == "all" or sim.outcome[k] == (expect == "succeeded")}
    got = {(r["world"], r["index"]) for r in table.rows()}
    assert got == done
    for row in table.rows():
        key = (row["world"], row["index"])
        assert row["success"] == sim.outcome[key]
        assert_episode_equal(reader.episode(run, *key), sim.arrays(key))
    return len(table)


def test_exported_surface() -> None:
    assert storage.__all__ == sorted(storage.__all__)
    assert {n for n in dir(storage) if not n.startswith("_")} >= set(storage.__all__)


def test_round_trip_memory_store(broker: Broker) -> None:
    store = zarr.storage.MemoryStore()
    sim, daemon = run_sim(broker, store)
    reader = RunStore(store)
    assert reader.runs() == ["run-a"]
    n = check_all(reader, sim)
    assert n > 20
    assert daemon.statistics().episodes_stored == n
    assert reader.info("run-a")["status"] == "complete"
    rows = reader.episode_rows("run-a", *next(iter(sim.outcome)))
    assert set(rows["obs"]["hook"].tolist()) == {"post_step"}
    assert np.all(np.diff(rows["obs"]["step"]) == 1)


def test_round_trip_disk_and_plain_zarr_and_xarray(broker: Broker, tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    sim, _ = run_sim(broker, tmp_path / "runs.zarr")
    reader = RunStore(tmp_path / "runs.zarr")
    check_all(reader, sim)
    root = zarr.open_group(tmp_path / "runs.zarr", mode="r")
    meta = root["runs/run-a"].attrs["worldtap_run"]
    n = meta["committed"]["episodes"]
    assert np.array_equal(root["runs/run-a/episodes/world"][:n], reader.episodes("run-a")["world"])
    ds = xr.open_zarr(tmp_path / "runs.zarr", group="runs/run-a/episodes", consolidated=False)
    assert ds.sizes["episode"] == n
    assert ds["success"].dtype == bool
    data = xr.open_zarr(tmp_path / "runs.zarr", group="runs/run-a/data/obs", consolidated=False)
    assert data["state"].dims == ("obs_row", "state_dim0")


def test_filters_and_errors(broker: Broker) -> None:
    store = zarr.storage.MemoryStore()
    sim, _ = run_sim(broker, store)
    reader = RunStore(store)
    table = reader.episodes()
    ok = table.filter(success=True)
    assert len(ok) == sum(sim.outcome.values())
    assert ok["success"].all()
    assert len(table.where(table["world"] == 2)) == sum(1 for w, _ in sim.outcome if w == 2)
    with pytest.raises(KeyError, match="no column 'nope'"):
        table.filter(nope=1)
    with pytest.raises(RunNotFoundError, match="run 'missing' not found in store"):
        reader.episodes("missing")
    with pytest.raises(EpisodeNotFoundError, match="no committed episode with world=0 index=999"):
        reader.episode("run-a", 0, 999)
    # Before: a world of 2**70 raised numpy's OverflowError, and "0" or 0.9 read world 0's episode.
    for read in (reader.episode, reader.episode_rows):
        with pytest.raises(EpisodeNotFoundError, match=r"no committed episode with world=1180591620717411303424 "):
            read("run-a", 2**70, 0)
        with pytest.raises(EpisodeNotFoundError, match="no committed episode with world=0 index=-1"):
            read("run-a", 0, -1)
        for world in ("0", 0.9, None):
            with pytest.raises(TypeError, match=r"world and index: expected ints, got"):
                read("run-a", world, 0)  # type: ignore[arg-type]
    assert reader.episode("run-a", np.int64(0), True).keys() == reader.episode("run-a", 0, 1).keys()


def test_not_a_run_store(tmp_path: Path) -> None:
    zarr.open_group(tmp_path / "other.zarr", mode="w").create_group("x")
    with pytest.raises(StoreFormatError, match="is a zarr group but not a worldtap run store"):
        RunStoreWriter(tmp_path / "other.zarr")
    with pytest.raises(StoreFormatError, match="is not a worldtap run store"):
        RunStore(tmp_path / "other.zarr")
    with pytest.raises(StoreFormatError, match="the directory does not exist"):
        RunStore(tmp_path / "absent.zarr")


def test_variation_table_matches_live_sample_table(broker: Broker) -> None:
    live = SampleTable()
    live.attach(broker)
    store = zarr.storage.MemoryStore()
    run_sim(broker, store)
    stored = RunStore(store).variation_table("run-a")
    assert stored.columns == live.columns
    assert stored.columns[3:5] == ("friction", "mass")
    assert len(stored) == len(live) > 20
    a, b = stored.arrays(), live.arrays()
    order_a = np.lexsort((a.episode, a.world))
    order_b = np.lexsort((b.episode, b.world))
    np.testing.assert_array_equal(a.world[order_a], b.world[order_b])
    np.testing.assert_array_equal(a.episode[order_a], b.episode[order_b])
    np.testing.assert_array_equal(a.x[order_a], b.x[order_b])  # NaN (no runtime draw) == NaN
    np.testing.assert_array_equal(a.y[order_a], b.y[order_b])
    assert np.isnan(a.x[:, 0]).sum() < len(a.world)


def test_queries_replay_the_variation_samples_once_per_refresh(broker: Broker, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``query()`` joins the (X, Y) table built by replaying every stored sample; the replay
    is done once until ``refresh`` (it took 300-370 ms per query on the demo's 2,001 episodes,
    2.1 s on 20,001), and what a caller does to a returned table never reaches the next."""
    path = tmp_path / "runs.zarr"
    run_sim(broker, path)
    reader = RunStore(path)
    replays = []
    original = RunStore.variation_table
    monkeypatch.setattr(RunStore, "variation_table", lambda self, run=None: replays.append(run) or original(self, run))
    first = reader.query("success", "run-a")
    assert "mass" in first.columns
    mass = first["mass"].copy()
    first["mass"][:] = -1.0
    again = reader.query("success", "run-a")
    np.testing.assert_array_equal(again["mass"], mass)
    assert len(reader.query(None, "run-a")) == len(reader.episodes("run-a"))
    assert replays == ["run-a"]
    reader.refresh()
    np.testing.assert_array_equal(reader.query("success", "run-a")["mass"], mass)
    assert replays == ["run-a", "run-a"]


def test_long_episode_far_beyond_budget(broker: Broker) -> None:
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, memory_budget=64 << 10, commit_interval=0.0)
    broker.subscribe("", daemon)
    sim = Sim(broker, 2, reset_p=0.0, width=64)   # ~260 bytes per world-step
    sim.step(1500, force_reset=None)  # 1500 steps * 2 worlds * 270 B ~ 800 KB >> 64 KiB
    sim.step(1, force_reset=[0, 1])
    sim.close()
    daemon.close()
    reader = RunStore(store)
    table = reader.episodes("run-a")
    assert len(table) == 2
    assert table["segments"].min() > 10  # flushed as fragments, read back whole
    for row in table.rows():
        key = (row["world"], row["index"])
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


@pytest.mark.parametrize("mode", ["all", "succeeded", "split", "none"])
def test_export_modes(broker: Broker, mode: str) -> None:
    store, failed = zarr.storage.MemoryStore(), zarr.storage.MemoryStore()
    sim, daemon = run_sim(broker, store, export=mode, failed_store=failed,
                          memory_budget=32 << 10)  # small: failed episodes have fragments
    stats = daemon.statistics()
    if mode == "none":
        assert stats.episodes_stored == 0
        assert not daemon.writers
        return
    n = check_all(RunStore(store), sim, expect="all" if mode == "all" else "succeeded")
    if mode == "split":
        n += check_all(RunStore(failed), sim, expect="failed")
    assert stats.episodes_stored == n
    if mode == "succeeded":
        assert stats.episodes_filtered == len(sim.outcome) - n


def test_gap_drops_episodes_in_progress_and_is_recorded(broker: Broker) -> None:
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    sim = Sim(broker, 4, reset_p=0.0)
    sim.step(5)
    gap = Gap("run-a", "batch/obs", 40, 45)
    daemon.handle(gap)
    sim.step(1, force_reset=[0, 1])  # these episodes lost their middle: not stored
    sim.step(4)
    sim.step(1, force_reset=[0])  # this one started after the gap: stored
    sim.close()
    daemon.close()
    reader = RunStore(store)
    assert [(r["world"], r["index"]) for r in reader.episodes("run-a").rows()] == [(0, 1)]
    assert reader.gaps("run-a").rows() == [
        {"expected": 40, "received": 45, "source": 0, "topic": "batch/obs"}]
    assert daemon.statistics().episodes_incomplete == 2


def test_rejected_messages_are_counted_and_their_episodes_never_stored(broker: Broker) -> None:
    """A rejected batch mid-episode makes that episode incomplete (it was stored as complete,
    with missing rows, before); later episodes of the same worlds are stored byte-exact."""
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.0)
    sim.step(3)
    w = torch.arange(3)
    seq = sim.rec.next_seq
    bad = [
        Batch("run-a", seq(), 3, "batch/obs", w, torch.zeros(3, dtype=torch.int64),
              {"state": torch.zeros(3, 5)}),  # schema change
        Batch("run-a", seq(), 3, "batch/x", w, torch.zeros(2, dtype=torch.int64),
              {"a": torch.zeros(3)}),  # episodes of the wrong length
        EpisodeEnd("run-a", seq(), 3, torch.tensor([0, 0]), torch.zeros(2, dtype=torch.int64),
                   *(torch.zeros(2, dtype=torch.bool),) * 3, torch.zeros(2, dtype=torch.int64)),
    ]
    for message in bad:
        daemon.handle(message)
    sim.step(1, force_reset=[0, 1, 2])  # ends the episodes the rejected batches touched
    sim.step(2)
    sim.step(1, force_reset=[0, 1, 2])  # whole episodes after them
    sim.close()
    daemon.close()
    stats = daemon.statistics()
    assert dict(stats.rejected) == {"schema": 1, "worlds": 2}
    assert stats.episodes_incomplete == 3
    reader = RunStore(store)
    stored = {(r["world"], r["index"]) for r in reader.episodes("run-a").rows()}
    assert stored == {(w, 1) for w in range(3)}
    for key in stored:
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


def test_resume_truncates_uncommitted_rows(tmp_path: Path) -> None:
    writer = RunStoreWriter(tmp_path / "s.zarr")
    from broker import FieldSpec

    run = writer.run("r", num_worlds=2)
    run.declare_term("t", {"v": FieldSpec("float32", (2,))})
    run.create_term("t")
    ones = np.ones((4, 2), np.float32)
    off = run.append("t", {"v": ones}, np.arange(4), np.ones(4, np.uint8))
    from storage.run_writer import EpisodeRows

    cols = {"world": np.array([0]), "index": np.array([0]), "length": np.array([4]),
            "success": np.array([True]), "terminated": np.array([False]),
            "truncated": np.array([False]), "end_step": np.array([4]), "end_seq": np.array([9]),
            "segment_count": np.array([1])}
    run.commit(EpisodeRows(cols, np.array([[0, off, 4]])))
    spec = FieldSpec("float64", (3,))
    count = run.append_variation("k", "runtime", None, np.array([0]), np.array([0]),
                                 np.array([1]), np.array([2]), np.ones((1, 3)), spec)
    run.commit(variations={"k": count})
    run.append_variation("k", "runtime", None, np.array([1]), np.array([0]), np.array([5]),
                         np.array([6]), np.ones((1, 3)), spec)  # never committed
    run.append("t", {"v": 2 * ones}, np.arange(4), np.ones(4, np.uint8))  # never committed
    run.group["episodes/world"].append(np.array([1]))  # an interrupted commit's debris
    reader = RunStore(tmp_path / "s.zarr")
    assert len(reader.episodes("r")) == 1
    assert reader.episode("r", 0, 0)["t/v"].tobytes() == ones.tobytes()
    from storage.daemon import _resume_job

    again = RunStoreWriter(tmp_path / "s.zarr").run("r", num_worlds=2)
    _resume_job(again)  # what a daemon does first with a run it reopens
    assert again.rows("t") == 4
    assert again.group["episodes/world"].shape == (1,)
    assert again.meta["resumed"] == 1
    assert again.group["variations/k/value"].shape == (1, 3)
    assert RunStore(tmp_path / "s.zarr").variation_samples("r", "k")["world"].tolist() == [0]


def test_unreferenced_chunks_are_deleted_and_referenced_ones_kept(tmp_path: Path) -> None:
    from broker import FieldSpec
    from storage.run_writer import EpisodeRows

    writer = RunStoreWriter(tmp_path / "s.zarr", chunk_bytes=8 * 4)  # 4 rows of v per chunk
    run = writer.run("r", num_worlds=1)
    run.declare_term("t", {"v": FieldSpec("float32", (2,))})
    run.create_term("t")
    rows = np.arange(40, dtype=np.float32).reshape(20, 2) + 1
    run.append("t", {"v": rows}, np.arange(20), np.ones(20, np.uint8))
    # two committed episodes: rows 0-2 and 13-14; rows 3-12 and 15-19 are orphaned fragments
    cols = {"world": np.array([0, 0]), "index": np.array([0, 1]), "length": np.array([3, 2]),
            "success": np.array([True, True]), "terminated": np.array([False, False]),
            "truncated": np.array([False, False]), "end_step": np.array([3, 15]),
            "end_seq": np.array([3, 15]), "segment_count": np.array([1, 1])}
    run.commit(EpisodeRows(cols, np.array([[0, 0, 3], [0, 13, 2]])))
    reclaimed = run.zero_holes(piece=1)  # the segment table read one row at a time
    chunks = sorted(p.name for p in (tmp_path / "s.zarr/runs/r/data/t/v").glob("c.*"))
    assert chunks == ["c.0.0", "c.3.0"]  # rows 0-3 and 12-15 hold committed rows; 4-11, 16-19 are gone
    assert reclaimed == 12
    reader = RunStore(tmp_path / "s.zarr")
    np.testing.assert_array_equal(reader.episode("r", 0, 0)["t/v"], rows[0:3])
    np.testing.assert_array_equal(reader.episode("r", 0, 1)["t/v"], rows[13:15])


def test_terms_that_require_grad_are_stored_in_process(broker: Broker) -> None:
    """In-process delivery hands the daemon the term's own tensors, autograd and all."""
    from capture.recorder import Recorder
    from capture.terms import FunctionTerm

    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    rec = Recorder(4, broker=broker, run="grad")
    weight = torch.ones(3, requires_grad=True)
    published: list[torch.Tensor] = []

    def policy() -> dict[str, torch.Tensor]:
        action = torch.randn(4, 3) * weight  # a policy output: part of a graph
        published.append(action.detach().clone())
        return {"action": action}

    rec.add_term("policy", FunctionTerm(post_step=policy))
    rec.start()
    for _ in range(3):
        rec.record_post_step()
    rec.record_pre_reset(torch.arange(4), success=torch.ones(4, dtype=torch.bool),
                         truncated=torch.zeros(4, dtype=torch.bool))
    rec.close()
    daemon.close()
    reader = RunStore(store)
    assert len(reader.episodes("grad")) == 4
    for w in range(4):
        got = reader.episode("grad", w, 0)["policy/action"]
        np.testing.assert_array_equal(got, torch.stack([p[w] for p in published]).numpy())


def test_zarrs_asynchronous_path_writes_the_same_store(tmp_path: Path) -> None:
    """The fallback for stores without zarr's synchronous protocols (fsspec URLs, or a zarr
    that moves them) writes the same chunk bytes as the synchronous path, read back exactly."""
    from storage import _columns, _zarr_io

    stores = {}
    for enabled in (True, False):
        _columns.sync_path(enabled)
        try:
            broker = Broker()
            path = tmp_path / f"sync-{enabled}.zarr"
            sim, _ = run_sim(broker, path, steps=60)
            arr = zarr.open_array(path / "runs/run-a/data/obs/state", mode="r+")
            assert (_zarr_io.ChunkEncoder.of(arr) is not None) == (enabled and _columns.SYNC_PATH)
        finally:
            _columns.sync_path(True)
        check_all(RunStore(path), sim)
        stores[enabled] = {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("c*"))
                           if p.is_file() and "/data/" in p.as_posix()}
    assert stores[True].keys() == stores[False].keys()
    assert stores[True] == stores[False]


def test_a_term_schema_is_checked_by_topic_schema_naming_the_field(broker: Broker,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Issue 11 item 18: the daemon checks a term's later batches through ``broker.TopicSchema``
    (the recorder's and retention's check) against the batch's own tensors, so a rejection names
    the field, what was expected and what came, and a bfloat16 field (stored as its 16 bits) is
    compared as bfloat16. Bug caught: the daemon compared dicts of specs itself and said only
    "expected fields {...}, got {...}" for the whole term."""
    from broker import RunEnd, RunStart

    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    half = torch.tensor([[1.5], [-2.0]], dtype=torch.bfloat16)
    seq = iter(range(100))
    broker.publish(RunStart("run-a", next(seq), 0, 2, "cpu"))
    good = {"state": torch.ones(2, 3), "h": half}
    broker.publish(Batch("run-a", next(seq), 1, "batch/obs", w, e, good))
    broker.publish(Batch("run-a", next(seq), 2, "batch/obs", w, e, {"h": half, "state": 2 * torch.ones(2, 3)}))
    bad = [
        ({"state": torch.ones(2, 5), "h": half},
         r"topic 'batch/obs' field 'state': expected float32 per-world shape \(3,\), got float32 per-world shape \(5,\)"),
        ({"state": torch.ones(2, 3), "h": half.to(torch.float16)},
         r"topic 'batch/obs' field 'h': expected bfloat16 per-world shape \(1,\), got float16"),
        ({"state": torch.ones(2, 3)}, r"missing \['h'\], extra \[\]"),
    ]
    with caplog.at_level("WARNING", logger="worldtap.storage"):
        for fields, _ in bad:
            broker.publish(Batch("run-a", next(seq), 3, "batch/obs", w, e, fields))
    assert dict(daemon.statistics().rejected) == {"schema": 3}
    text = caplog.text
    for _, match in bad:
        assert re.search(match, text), (match, text)
    # the worlds' episodes were invalidated; the next ones are stored byte for byte, any field order
    broker.publish(EpisodeEnd("run-a", next(seq), 4, w, e, *(torch.ones(2, dtype=torch.bool),) * 3,
                              torch.full((2,), 2)))
    broker.publish(Batch("run-a", next(seq), 5, "batch/obs", w, e + 1, {"h": half, "state": 3 * torch.ones(2, 3)}))
    broker.publish(EpisodeEnd("run-a", next(seq), 6, w, e + 1, *(torch.ones(2, dtype=torch.bool),) * 3,
                              torch.ones(2, dtype=torch.int64)))
    broker.publish(RunEnd("run-a", next(seq), 7, 2, "cpu"))
    daemon.close()
    reader = RunStore(store)
    assert sorted(reader.episodes("run-a")["index"].tolist()) == [1, 1]
    ep = reader.episode("run-a", 0, 1)
    assert ep["obs/state"].tobytes() == (3 * torch.ones(1, 3)).numpy().tobytes()
    assert ep["obs/h"].tobytes() == half[:1].to(torch.float32).numpy().tobytes()


def test_a_slow_commit_spaces_the_next_by_the_commit_pace(broker: Broker, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy run commits every ``commit_interval`` at the most often, and no sooner than
    ``COMMIT_PACE`` times what its last commit took on the writer thread: a term of hundreds
    of columns rewrites hundreds of partial chunks a commit, which at every half second would
    take the writer's whole time. The clock is the test's: each commit job "takes" 2 s. Bug
    caught: commits paced by the interval alone (a commit due 0.5 s after one that took 2 s)."""
    import storage.assembly as assembly

    clock = [1000.0]
    monkeypatch.setattr(assembly.time, "monotonic", lambda: clock[0])
    real_job = assembly._commit_job

    def slow_job(*args: Any) -> None:
        real_job(*args)
        clock[0] += 2.0

    monkeypatch.setattr(assembly, "_commit_job", slow_job)
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0.5)
    broker.subscribe("", daemon)
    sim = Sim(broker, 6, reset_p=0.5)
    sim.step(10)
    (asm,) = daemon.runs.values()
    assert asm.due() is False  # the interval has not elapsed
    clock[0] += 0.5
    assert asm.due() is True  # nothing committed yet: the interval alone
    began = clock[0]
    asm.commit(wait=True)  # took 2 s on the writer thread
    sim.step(10)
    assert asm.pending
    clock[0] += 0.5
    assert asm.due() is False  # 2.5 s since it began: the interval elapsed, the pace has not
    clock[0] = began + assembly.COMMIT_PACE * 2.0 - 0.01
    assert asm.due() is False
    clock[0] += 0.02
    assert asm.due() is True
    daemon.close()
    assert daemon.statistics().episodes_stored == len(sim.outcome)
