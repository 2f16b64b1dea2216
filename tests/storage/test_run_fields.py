"""Issue 12's run data in the store: variation declarations, the run seed, wall-clock start and
end times (``RunStart``/``RunEnd``), and episode outcomes (``EpisodeEnd.outcomes``) as float64
columns of the episode table and extra Y columns of the (X, Y) table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from broker import Batch, Broker, EpisodeEnd, RunEnd, RunStart, VariationSample
from consumers.sample_table import OUTCOME_COLUMNS, SampleTable
from storage import RunStore, RunStoreWriter, StoreDaemon
from storage.run_writer import EpisodeRows

pytestmark = pytest.mark.timeout(60)

MASS = {"kind": "uniform", "phase": "build", "shape": [], "seed": 11, "low": 0.5, "high": 2.0}
FRICTION = {"kind": "log_uniform", "phase": "runtime", "shape": [2], "seed": 12, "low": [0.1, 0.2],
            "high": [1.0, 2.0]}
NAN = float("nan")


class Run:
    """Publishes one run's messages by hand (consecutive seqs) and remembers each episode's
    outcomes as the store must hold them (float64, NaN where an episode lacks one)."""

    def __init__(self, broker: Broker, run: str = "run-a", worlds: int = 4) -> None:
        self.broker, self.run, self.worlds = broker, run, worlds
        self.seq = 0
        self.step = 0
        self.episode = np.zeros(worlds, np.int64)
        self.outcomes: dict[tuple[int, int], dict[str, float]] = {}
        self.gen = torch.Generator().manual_seed(5)

    def publish(self, cls: Any, *args: Any, **kw: Any) -> None:
        self.broker.publish(cls(self.run, self.seq, self.step, *args, **kw))
        self.seq += 1

    def start(self, **kw: Any) -> None:
        self.publish(RunStart, self.worlds, "cpu", **kw)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step += 1
            w = torch.arange(self.worlds)
            self.publish(Batch, "batch/obs", w, torch.from_numpy(self.episode.copy()),
                         {"state": torch.randn(self.worlds, 2, generator=self.gen)})

    def vary(self, key: str, phase: str, worlds: list[int], value: torch.Tensor) -> None:
        w = torch.tensor(worlds)
        self.publish(VariationSample, key, phase, w, torch.from_numpy(self.episode[worlds]), value)

    def end(self, worlds: list[int], outcomes: dict[str, torch.Tensor]) -> None:
        w = torch.tensor(worlds)
        n = len(worlds)
        success = torch.tensor([bool(x % 2) for x in worlds])
        self.publish(EpisodeEnd, w, torch.from_numpy(self.episode[worlds]), success,
                     torch.zeros(n, dtype=torch.bool), ~success, torch.full((n,), 3), outcomes=outcomes)
        for i, world in enumerate(worlds):
            self.outcomes[(world, int(self.episode[world]))] = {
                k: float(t[i].to(torch.float64)) for k, t in outcomes.items()
                if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_complex() and len(t) > i}
        self.episode[worlds] += 1

    def stop(self, **kw: Any) -> None:
        self.publish(RunEnd, self.worlds, "cpu", **kw)


def _publish_run(run: Run) -> None:
    """Outcome names change across messages: ``return`` first (committed alone), ``hits`` new
    after that commit, ``return`` missing later, and an episode end with none at all."""
    run.start(variations={"mass": MASS}, seed=42, wall_time=1000.5)
    run.vary("mass", "build", list(range(run.worlds)), torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64))
    run.steps(2)
    run.end([0, 1], {"return": torch.tensor([1.25, -3.5])})
    run.vary("friction", "runtime", [0, 1], torch.tensor([[0.1, 0.2], [0.3, 0.4]]))
    run.steps(2)
    run.end([2], {"return": torch.tensor([7.0], dtype=torch.float64), "hits": torch.tensor([9])})
    run.steps(1)
    run.end([0, 3], {"hits": torch.tensor([2, 5], dtype=torch.int32), "ok": torch.tensor([True, False])})
    run.steps(1)
    run.end([1], {})
    run.stop(variations={"mass": MASS, "friction": FRICTION}, seed=42, wall_time=2000.25)


def _expected_column(run: Run, table: Any, name: str) -> bytes:
    keys = list(zip(table["world"].tolist(), table["index"].tolist(), strict=True))
    return np.asarray([run.outcomes[k].get(name, NAN) for k in keys], np.float64).tobytes()


def test_declarations_seed_times_and_outcomes_are_stored_and_read_back() -> None:
    """Bug caught: the store dropped RunStart/RunEnd declarations, seed and wall times, and
    EpisodeEnd outcomes (before issue 12 none of them was stored); an outcome first seen after
    a commit must get a NaN-backfilled column, one missing from a message NaN, never a shifted
    or zero value."""
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)  # a commit after every episode end
    broker.subscribe("", daemon)
    live = SampleTable()
    live.attach(broker)
    run = Run(broker)
    _publish_run(run)
    daemon.close()
    assert daemon.statistics().rejected == {}
    reader = RunStore(store)
    info = reader.info("run-a")
    assert info["variations"] == {"mass": MASS, "friction": FRICTION}  # RunEnd's superset
    assert info["seed"] == 42
    assert (info["started_at"], info["ended_at"]) == (1000.5, 2000.25)
    assert info["outcomes"] == ["hits", "ok", "return"]
    assert set(info["variation_samples"]) == {"mass", "friction"}
    table = reader.episodes("run-a")
    assert list(table.columns)[-3:] == ["hits", "ok", "return"]
    assert len(table) == 6
    for name in ("hits", "ok", "return"):
        assert table[name].dtype == np.float64
        assert table[name].tobytes() == _expected_column(run, table, name), name
    # plain zarr sees the same columns, cut at the committed count
    root = zarr.open_group(store, mode="r")
    assert root["runs/run-a/episodes/return"].shape == (6,)
    assert root["runs/run-a/episodes/return"].attrs["worldtap_outcome"] == "return"
    # the store's (X, Y) table equals the live one, byte for byte
    stored = reader.variation_table("run-a")
    a, b = stored.arrays(), live.arrays()
    assert a.y_columns == b.y_columns == (*OUTCOME_COLUMNS, "hits", "ok", "return")
    assert a.x_columns == b.x_columns == ("friction[0]", "friction[1]", "mass")
    order_a, order_b = np.lexsort((a.episode, a.world)), np.lexsort((b.episode, b.world))  # rows of one
    for field in ("world", "episode", "x", "y"):  # EpisodeEnd are stored succeeded first
        assert getattr(a, field)[order_a].tobytes() == getattr(b, field)[order_b].tobytes(), field
    assert a.run.tolist() == b.run.tolist() == ["run-a"] * 6
    assert stored.declarations("run-a") == live.declarations("run-a") == {"mass": MASS, "friction": FRICTION}
    assert stored.seed("run-a") == live.seed("run-a") == 42


def test_a_run_joined_without_its_run_start_gets_its_fields_from_run_end() -> None:
    """Bug caught: a run the daemon joined late had no declarations or seed (only RunStart
    carried them) and a start time it made up; RunEnd repeats every declaration."""
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    run = Run(broker)
    run.start(variations={"mass": MASS}, seed=7, wall_time=10.0)  # before the daemon subscribed
    broker.subscribe("", daemon)
    run.steps(1)
    run.end([0, 1, 2, 3], {"return": torch.arange(4, dtype=torch.float32)})
    run.stop(variations={"mass": MASS, "friction": FRICTION}, seed=7, wall_time=20.0)
    daemon.close()
    info = RunStore(store).info("run-a")
    assert info["variations"] == {"mass": MASS, "friction": FRICTION}
    assert (info["seed"], info["started_at"], info["ended_at"]) == (7, None, 20.0)


def test_run_end_declarations_replace_run_start_ones_key_by_key() -> None:
    """A RunEnd without declarations or seed (a publisher that closes a run itself) keeps
    the RunStart's; a RunEnd that re-declares a key replaces that declaration."""
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    run = Run(broker, worlds=1)
    run.start(variations={"mass": MASS, "friction": FRICTION}, seed=3, wall_time=5.0)
    run.stop(variations={"mass": {**MASS, "high": 3.0}})
    daemon.close()
    info = RunStore(store).info("run-a")
    assert info["variations"] == {"mass": {**MASS, "high": 3.0}, "friction": FRICTION}
    assert info["seed"] == 3
    assert info["started_at"] == 5.0
    assert info["ended_at"] is not None
    assert info["ended_at"] > 1e9


@pytest.mark.parametrize(("outcomes", "why"), [
    ({"length": torch.ones(2)}, "reserved"),
    ({"": torch.ones(2)}, "empty name"),
    ({"r": torch.ones(3)}, "wrong length"),
    ({"r": torch.ones(2, 1)}, "2-D"),
    ({"r": torch.ones(2, dtype=torch.complex64)}, "complex"),
    ({"r": [1.0, 2.0]}, "not a tensor"),
])
def test_bad_outcomes_are_rejected_and_counted(outcomes: dict[str, Any], why: str) -> None:
    """An EpisodeEnd whose outcomes cannot be stored is rejected (reason "outcomes"), its
    episodes are never stored, and the run goes on: later whole episodes of those worlds are
    (the one right after it is not: its start followed an end the daemon did not take)."""
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    run = Run(broker, worlds=2)
    run.start()
    run.steps(1)
    run.end([0, 1], outcomes)
    run.steps(1)
    run.end([0, 1], {"r": torch.tensor([0.5, 0.5])})  # its start followed an end never stored
    run.steps(1)
    run.end([0, 1], {"r": torch.tensor([1.0, 2.0])})
    run.stop()
    daemon.close()
    assert dict(daemon.statistics().rejected) == {"outcomes": 1}, why
    table = RunStore(store).episodes("run-a")
    assert sorted(zip(table["world"].tolist(), table["index"].tolist(), strict=True)) == [(0, 2), (1, 2)]
    assert dict(zip(table["world"].tolist(), table["r"].tolist(), strict=True)) == {0: 1.0, 1: 2.0}


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("variations", {"mass": 3}, "variations"),
    ("variations", {"": MASS}, "variations"),
    ("variations", {"mass": {"low": object()}}, "variations"),
    ("variations", {"mass": {"low": float("nan")}}, None),  # stored losslessly, like metadata
    ("seed", 1.5, "header"),
    ("wall_time", float("inf"), "header"),
    ("wall_time", -1.0, "header"),
])
def test_run_start_fields_that_cannot_be_stored_are_rejected(field: str, value: Any, reason: str | None) -> None:
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    run = Run(broker, worlds=1)
    run.start(**{field: value})
    run.stop()
    daemon.close()
    assert dict(daemon.statistics().rejected) == ({} if reason is None else {reason: 1})
    if reason is None:
        got = RunStore(store).info("run-a")["variations"]["mass"]["low"]
        assert np.isnan(got)


def _rows(n: int, first_world: int = 0) -> dict[str, np.ndarray]:
    return {"world": np.arange(first_world, first_world + n), "index": np.zeros(n, np.int64),
            "length": np.zeros(n, np.int64), "success": np.ones(n, bool), "terminated": np.zeros(n, bool),
            "truncated": np.zeros(n, bool), "end_step": np.ones(n, np.int64), "end_seq": np.ones(n, np.int64),
            "segment_count": np.zeros(n, np.int64)}


def test_outcomes_survive_a_crash_and_resume(tmp_path: Path) -> None:
    """Bug caught: outcome columns must follow the commit protocol: rows written after the last
    commit (and a new outcome's column made by a commit that never finished) are cut or removed
    on resume, and the resumed run appends after the committed rows, byte-exact."""
    from storage.daemon import _resume_job

    path = tmp_path / "s.zarr"
    writer = RunStoreWriter(path).run("r", num_worlds=8)
    writer.commit(EpisodeRows(_rows(2), outcomes={"return": np.array([1.5, 2.5])}))
    # a commit interrupted after its data writes, before its commit point: rows of "return"
    # past the committed count, and a new column "late" nobody registered
    from storage._columns import write_columns

    write_columns(writer._outcome_rows({"return": np.array([9.0]), "late": np.array([8.0])}, 2, 1))
    assert writer.group["episodes/late"].shape[0] >= 3
    reader = RunStore(path)
    assert reader.episodes("r")["return"].tolist() == [1.5, 2.5]
    assert "late" not in reader.episodes("r").columns
    again = RunStoreWriter(path).run("r", num_worlds=8)  # a new daemon on the same store
    _resume_job(again)
    assert "late" not in again.group["episodes"]  # the crash's debris is gone
    assert again.group["episodes/return"].shape == (2,)
    again.commit(EpisodeRows(_rows(1, 2), outcomes={"late": np.array([4.0])}))
    table = RunStore(path).episodes("r")
    assert table["return"].tobytes() == np.array([1.5, 2.5, NAN]).tobytes()
    assert table["late"].tobytes() == np.array([NAN, NAN, 4.0]).tobytes()


# -- the outcome columns as a state machine ----------------------------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

NAMES = ("return", "hits", "_x", "a.b")


class OutcomeColumns(RuleBasedStateMachine):
    """Commits of episodes whose outcome names change from commit to commit, interrupted
    commits (data written, no commit point) and crashes with a resume, against a model: the
    committed episodes' outcomes, NaN where an episode lacked one. Bug caught: a backfill that
    shifts rows, a missing outcome written as 0, debris of an interrupted commit read back or
    left in the way of a later column of the same name."""

    def __init__(self) -> None:
        super().__init__()
        self.store = zarr.storage.MemoryStore()
        self.writer = RunStoreWriter(self.store).run("r", num_worlds=1 << 20)
        self.writer.create()
        self.model: list[dict[str, float]] = []
        self.next_world = 0

    @rule(data=st.data(), n=st.integers(1, 3))
    def commit(self, data: st.DataObject, n: int) -> None:
        names = data.draw(st.sets(st.sampled_from(NAMES)))
        rows = [{name: data.draw(st.floats(allow_nan=False, width=64)) for name in names} for _ in range(n)]
        outcomes = {name: np.array([r[name] for r in rows]) for name in names}
        self.writer.commit(EpisodeRows(_rows(n, self.next_world), outcomes=outcomes))
        self.next_world += n
        self.model.extend(rows)

    @rule(data=st.data())
    def interrupted_commit(self, data: st.DataObject) -> None:
        """The data writes of a commit, then a crash before its commit point."""
        from storage._columns import write_columns

        names = data.draw(st.sets(st.sampled_from(NAMES), min_size=1))
        outcomes = {name: np.array([-1.0]) for name in names}
        write_columns(self.writer._outcome_rows(outcomes, len(self.model), 1))
        self.resume()

    @rule()
    def resume(self) -> None:
        from storage.daemon import _resume_job

        self.writer = RunStoreWriter(self.store).run("r", num_worlds=1 << 20)
        _resume_job(self.writer)

    @invariant()
    def store_holds_the_model(self) -> None:
        table = RunStore(self.store).episodes("r")
        assert len(table) == len(self.model)
        names = sorted({name for row in self.model for name in row})
        assert [c for c in table.columns if c in NAMES] == names
        order = np.argsort(table["world"])
        for name in names:
            want = np.array([row.get(name, NAN) for row in self.model])
            assert table[name][order].tobytes() == want.tobytes(), name


OutcomeColumns.TestCase.settings = settings(max_examples=12, stateful_step_count=8, deadline=None)
test_outcome_columns_state_machine = OutcomeColumns.TestCase


def test_an_interrupted_run_end_is_stored_as_interrupted() -> None:
    """A RunEnd with ``interrupted`` (the publisher was stopped early) ends the run with status
    ``interrupted``, its complete episodes stored, its end time kept."""
    broker = Broker()
    store = zarr.storage.MemoryStore()
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    run = Run(broker, worlds=2)
    run.start(wall_time=1.0)
    run.steps(1)
    run.end([0, 1], {"return": torch.tensor([1.0, 2.0])})
    run.steps(1)  # an episode in progress when it stopped
    run.stop(interrupted=True, wall_time=2.0)
    daemon.close()
    info = RunStore(store).info("run-a")
    assert info["status"] == "interrupted"
    assert info["run_end"]["interrupted"] is True
    assert (info["ended_at"], info["open_at_end"]) == (2.0, 2)
    assert len(RunStore(store).episodes("run-a")) == 2


def test_a_repeated_run_end_of_an_interrupted_run_is_confirmed_after_a_restart() -> None:
    """Catches: a daemon restarted on the store treating an interrupted run as open, so the
    publisher's re-sent RunEnd reopened it and was rejected (never confirmed, the publisher's
    close() waiting for ever)."""
    store = zarr.storage.MemoryStore()
    first = StoreDaemon(store, commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", first)
    run = Run(broker, worlds=2)
    run.start(wall_time=1.0)
    run.steps(1)
    run.end([0, 1], {"return": torch.tensor([1.0, 2.0])})
    run.stop(interrupted=True, wall_time=2.0)
    first.close()
    confirmed: list[str] = []
    second = StoreDaemon(store, commit_interval=0.0, on_run_end=confirmed.append)
    again = Broker()
    again.subscribe("", second)
    Run(again, worlds=2).stop(interrupted=True, wall_time=2.0)  # the same run id, its end again
    second.close()
    assert confirmed == ["run-a"]
    assert sum(second.statistics().rejected.values()) == 0
    assert RunStore(store).info("run-a")["status"] == "interrupted"
    assert len(RunStore(store).episodes("run-a")) == 2
