"""Fields named like the row columns (issue 11, item 28): a term's fields ``_step`` and
``_hook`` are stored and read back as fields, apart from the row columns (the step and
lifecycle point of each row), through the daemon, and through a failure and a resume.

The runs are real Recorder runs (``storage_sim.Sim``) whose batches get two more fields,
``_step`` (int64) and ``_hook`` (uint8), with values no row column ever holds (negative steps,
hook codes past the four lifecycle points), so a reader or writer that mixed them up shows.
What was published is the reference: every field of every stored episode byte for byte via
``RunStore.episode``, and every row's step and hook via ``RunStore.episode_rows``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from faulty_store import FaultyStore, fail_at
from storage_sim import Sim, owned

from broker import Batch, Broker, EpisodeEnd, Message
from storage import RunStore, StoreDaemon, StoreDamagedError

pytestmark = pytest.mark.timeout(120)

Key = tuple[int, int]


def record(*, steps: int, seed: int, worlds: int = 4) -> list[Message]:
    """A real Recorder run whose batches also carry fields ``_step`` and ``_hook``."""
    got: list[Message] = []
    broker = Broker(strict=True)
    broker.subscribe("", lambda m: got.append(owned(m)))
    sim = Sim(broker, worlds, seed=seed, reset_p=0.2)
    sim.step(steps)
    sim.close()
    return [with_named_fields(m) if isinstance(m, Batch) else m for m in got]


def with_named_fields(batch: Batch) -> Batch:
    """``batch`` with a field ``_step`` (first, -1000*step - world - 1: never a row's step) and,
    but in term ``init``, a field ``_hook`` (last, >= 10: never a hook code)."""
    w = batch.worlds.to(torch.int64)
    fields: dict[str, torch.Tensor] = {"_step": -1000 * int(batch.step) - w - 1, **batch.fields}
    if batch.term != "init":
        fields["_hook"] = ((int(batch.step) + 3 * w) % 200 + 10).to(torch.uint8)
    return dataclasses.replace(batch, fields=fields)


class Published:
    """What a run published, per episode: each field's rows and each term's row columns."""

    def __init__(self, messages: list[Message]) -> None:
        self.fields: dict[Key, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))
        self.rows: dict[Key, dict[str, dict[str, list[Any]]]] = defaultdict(
            lambda: defaultdict(lambda: {"step": [], "hook": []}))
        self.ended: set[Key] = set()
        self.end_at: dict[Key, int] = {}  # position of the episode's EpisodeEnd in the messages
        for i, m in enumerate(messages):
            if isinstance(m, Batch):
                for row, key in enumerate(zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)):
                    for name, t in m.fields.items():
                        self.fields[key][f"{m.term}/{name}"].append(t[row].numpy().copy())
                    self.rows[key][m.term]["step"].append(int(m.step))
                    self.rows[key][m.term]["hook"].append(m.hook)
            elif isinstance(m, EpisodeEnd):
                for key in zip(m.worlds.tolist(), m.episodes.tolist(), strict=True):
                    self.ended.add(key)
                    self.end_at[key] = i

    def check(self, reader: RunStore, run: str, key: Key) -> None:
        """Episode ``key`` reads back as published: the fields (and nothing else) byte for byte,
        the row columns row for row."""
        got = reader.episode(run, *key)
        want = {name: np.stack(rows) for name, rows in self.fields[key].items()}
        assert set(got) >= set(want), key
        for name in set(got) - set(want):  # a term with no rows in this episode reads back empty
            assert len(got[name]) == 0, (key, name)
            assert name.split("/", 1)[0] not in self.rows[key], (key, name)
        for name, value in want.items():
            assert got[name].dtype == value.dtype, (key, name)
            assert got[name].shape == value.shape, (key, name)
            assert got[name].tobytes() == value.tobytes(), (key, name)
        rows = reader.episode_rows(run, *key)
        for term, columns in rows.items():
            published = self.rows[key].get(term, {"step": [], "hook": []})
            assert columns["step"].dtype == np.int64, (key, term)
            assert columns["step"].tolist() == published["step"], (key, term)
            assert columns["hook"].tolist() == published["hook"], (key, term)
            stored = [n for n in want if n.startswith(f"{term}/")]
            assert all(len(got[n]) == len(columns["step"]) for n in stored), (key, term)
        assert set(self.rows[key]) <= set(rows), key


def test_fields_named_step_and_hook_round_trip_apart_from_the_row_columns(tmp_path: Path) -> None:
    """Item 28: a batch field named ``_step`` or ``_hook`` was rejected (reason ``name``)
    because the buffers, the writer and the reader keyed the row columns in the same dicts
    as the fields. Such fields are stored like any other: read back byte for byte by
    ``episode()``, with the row columns from ``episode_rows()``, on nodes of their own."""
    messages = record(steps=16, seed=1)
    published = Published(messages)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    for m in messages:
        daemon.handle(m)
    daemon.close()
    stats = daemon.statistics()
    assert sum(stats.rejected.values()) == 0, stats.rejected
    assert stats.runs_failed == 0
    reader = RunStore(tmp_path / "runs.zarr")
    table = reader.episodes("run-a")
    stored = {(r["world"], r["index"]) for r in table.rows()}
    assert stored == published.ended
    assert len(stored) > 5
    for key in sorted(stored):
        published.check(reader, "run-a", key)
    fields = reader.info("run-a")["fields"]
    assert fields["obs"]["_step"] == {"dtype": "int64", "shape": []}
    assert fields["obs"]["_hook"] == {"dtype": "uint8", "shape": []}
    # on disk: the fields on escaped nodes, the row columns on their own, every array whole
    term = zarr.open_group(tmp_path / "runs.zarr", mode="r")["runs/run-a/data/obs"]
    assert isinstance(term, zarr.Group)
    nodes = {name: np.asarray(arr[:]) for name, arr in term.arrays()}
    assert {"%5Fstep", "%5Fhook", "_step", "_hook"} <= set(nodes)
    assert np.all(nodes["%5Fstep"] < 0)
    assert np.all(nodes["_step"] >= 0)
    assert set(nodes["_hook"].tolist()) == {1}  # post_step
    assert np.all(nodes["%5Fhook"] >= 10)


def test_fields_named_step_and_hook_survive_a_failure_and_a_resume(tmp_path: Path) -> None:
    """Item 28, through recovery: the store fails (every write from the Nth on, a full disk)
    mid-run, the run stops at its last commit, and a daemon restarted on the directory resumes
    the run; recovery cuts and reclaims the fields and the row columns alike (a writer that
    kept them in one dict could cut a field as a row column, or lose one). Every stored
    episode, before and after the restart, reads back as published."""
    messages = record(steps=24, seed=2)
    published = Published(messages)
    healthy = FaultyStore(tmp_path / "healthy.zarr")
    daemon = StoreDaemon(healthy, commit_interval=0, memory_budget=48 << 10)
    for m in messages:
        daemon.handle(m)
    daemon.close()
    assert sum(daemon.statistics().rejected.values()) == 0
    path = tmp_path / "runs.zarr"
    store = FaultyStore(path, before=fail_at(healthy.writes // 2, persistent=True))
    first = StoreDaemon(store, commit_interval=0, memory_budget=48 << 10)
    resume_at = None
    for i, m in enumerate(messages):
        first.handle(m)
        if first.statistics().runs_failed:
            resume_at = i + 1
            break
    first.close()
    assert resume_at is not None, "the store never failed"
    assert resume_at < len(messages) * 3 // 4, resume_at  # a good part of the run is left to resume
    before = {(r["world"], r["index"]) for r in RunStore(path).episodes("run-a").rows()}
    assert before, "nothing committed before the failure"
    again = StoreDaemon(path, commit_interval=0, memory_budget=48 << 10)
    for m in messages[resume_at:]:
        again.handle(m)
    again.close()
    assert again.statistics().runs_failed == 0
    reader = RunStore(path)
    assert reader.info("run-a")["resumed"] >= 1
    assert reader.info("run-a")["status"] == "complete"
    stored = {(r["world"], r["index"]) for r in reader.episodes("run-a").rows()}
    assert before < stored <= published.ended
    assert any(published.end_at[k] > resume_at for k in stored - before)
    for key in sorted(stored):
        published.check(reader, "run-a", key)
    # nothing past the committed rows is left in any array of any term (fields or row columns)
    committed = reader.info("run-a")["committed"]["rows"]
    data = zarr.open_group(path, mode="r")["runs/run-a/data"]
    assert isinstance(data, zarr.Group)
    for term, rows in committed.items():
        group = data[term]
        assert isinstance(group, zarr.Group)
        shapes = {name: arr.shape[0] for name, arr in group.arrays()}
        assert len(shapes) > 2, (term, shapes)
        assert set(shapes.values()) == {rows}, (term, shapes)


def test_damaged_row_columns_raise_never_read_as_rows(tmp_path: Path) -> None:
    """A hook code the store does not know, or a row column node that is gone, is damage:
    ``episode_rows`` raises ``StoreDamagedError`` naming it, and never returns a row with a
    made-up hook or no rows."""
    messages = record(steps=16, seed=2)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    for m in messages:
        daemon.handle(m)
    daemon.close()
    reader = RunStore(tmp_path / "runs.zarr")
    table = reader.episodes("run-a")
    key = next(k for k in zip(table["world"].tolist(), table["index"].tolist(), strict=True)
               if len(reader.episode_rows("run-a", *k).get("obs", {"step": []})["step"]))
    term = zarr.open_group(tmp_path / "runs.zarr", mode="r+")["runs/run-a/data/obs"]
    assert isinstance(term, zarr.Group)
    hooks = term["_hook"]
    assert isinstance(hooks, zarr.Array)
    kept = np.asarray(hooks[:])
    hooks[:] = 200
    with pytest.raises(StoreDamagedError, match="hook code 200"):
        RunStore(tmp_path / "runs.zarr").episode_rows("run-a", *key)
    hooks[:] = kept  # one damage at a time
    RunStore(tmp_path / "runs.zarr").episode_rows("run-a", *key)
    del term["_step"]
    with pytest.raises(StoreDamagedError, match="_step"):
        RunStore(tmp_path / "runs.zarr").episode_rows("run-a", *key)
