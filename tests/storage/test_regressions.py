"""Regression corpus of the daemon: one named test per case of the malformed-message campaign
and the review (issue 11, items 5, 6, 11, 16, 17, 23, 24, 25, 27, 28).

Each test feeds real messages of a Recorder run (``storage_sim.Sim``), with the case's message
injected, to :class:`StoreDaemon` and checks the documented behaviour byte for byte against
what was published; the docstring names the defect it catches.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import tracemalloc
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from storage_sim import Sim, assert_episode_equal, owned

from broker import (
    Batch,
    Broker,
    EpisodeEnd,
    Message,
    RunEnd,
    Subscriber,
    VariationSample,
    ZmqPublisher,
)
from storage import RunStore, StoreDaemon, StoreDamagedError

pytestmark = pytest.mark.timeout(120)


# -- helpers ----------------------------------------------------------------------------------


def record(run: str = "run-a", *, worlds: int = 4, steps: int = 30, seed: int = 0,
           reset_p: float = 0.2) -> tuple[Sim, list[Message]]:
    """A real Recorder run: the Sim (which remembers every row) and every message it published."""
    got: list[Message] = []
    broker = Broker(strict=True)
    broker.subscribe("", lambda m: got.append(owned(m)))
    sim = Sim(broker, worlds, run=run, seed=seed, reset_p=reset_p)
    sim.step(steps)
    sim.close()
    return sim, got


def renumber(messages: Iterable[Message]) -> list[Message]:
    """The messages with sequence numbers 0, 1, 2, ... in the order given."""
    return [dataclasses.replace(m, seq=i) for i, m in enumerate(messages)]


def feed(daemon: StoreDaemon, messages: Iterable[Any]) -> None:
    for m in messages:
        daemon.handle(m)


def check_run(reader: RunStore, run: str, sim: Sim, *, skip: Iterable[tuple[int, int]] = ()) -> int:
    """Every episode the Sim ended (but ``skip``) is stored once, byte for byte; nothing else is."""
    table = reader.episodes(run)
    got = [(r["world"], r["index"]) for r in table.rows()]
    assert len(got) == len(set(got)), "an episode is stored twice"
    assert set(got) == set(sim.outcome) - set(skip)
    for row in table.rows():
        key = (row["world"], row["index"])
        assert row["success"] == sim.outcome[key]
        assert_episode_equal(reader.episode(run, *key), sim.arrays(key))
    return len(got)


def failed_runs(daemon: StoreDaemon) -> int:
    return int(getattr(daemon.statistics(), "runs_failed", 0))


def first(messages: list[Message], kind: type, **where: Any) -> int:
    return next(i for i, m in enumerate(messages) if isinstance(m, kind)
                and all(getattr(m, k) == v for k, v in where.items()))


def mid_episode(sim: Sim, messages: list[Message], *, not_first: bool = False) -> tuple[int, int, int]:
    """``(position, world, episode)``: a post-step batch at which ``world`` is in the middle of
    an episode that ends later in the run (so it would be stored); with ``not_first``, an
    episode after the world's first."""
    episode = dict.fromkeys(range(sim.num_worlds), 0)
    rows = dict.fromkeys(range(sim.num_worlds), 0)
    for i, m in enumerate(messages):
        if isinstance(m, EpisodeEnd):
            for w in m.worlds.tolist():
                episode[w] += 1
                rows[w] = 0
        elif isinstance(m, Batch) and m.term == "obs":
            for w in m.worlds.tolist():
                rows[w] += 1
                if rows[w] == 2 and (w, episode[w]) in sim.outcome and episode[w] >= not_first:
                    return i, w, episode[w]
    raise AssertionError("no episode long enough")


# -- item 6: well-formed messages the store cannot take ------------------------------------------


def test_huge_world_indices_are_rejected_before_any_allocation() -> None:
    """Item 6/27: world indices 2**40, 2**62, negative, or past the run's ``num_worlds`` made
    ``np.bincount`` allocate without bound (MemoryError, 18 GB); an EpisodeEnd naming world 52
    of a 4-world run, or a joined run discovering world 2**24-1, reallocated buffers far past the
    budget. Each must be a counted rejection, checked before anything is allocated."""
    sim, msgs = record(steps=12)
    budget = 1 << 20
    daemon = StoreDaemon(zarr.storage.MemoryStore(), memory_budget=budget, commit_interval=0)
    feed(daemon, msgs[:-1])
    batch = msgs[first(msgs, Batch, topic="batch/obs")]
    end = msgs[first(msgs, EpisodeEnd)]
    seq = msgs[-1].seq
    bad: list[Message] = []
    for world in (2**40, 2**62, -1, 4, 52):
        w = torch.tensor([world])
        bad.append(dataclasses.replace(batch, worlds=w, episodes=torch.tensor([0]),
                                       fields={k: v[:1] for k, v in batch.fields.items()}))
        bad.append(dataclasses.replace(end, worlds=w, episodes=torch.tensor([0]), success=end.success[:1],
                                       terminated=end.terminated[:1], truncated=end.truncated[:1],
                                       length=end.length[:1]))
    joined = [dataclasses.replace(m, run="joined") for m in bad[:2]]  # a run without RunStart
    joined.append(dataclasses.replace(batch, run="joined", worlds=torch.tensor([(1 << 24) - 1]),
                                      episodes=torch.tensor([0]),
                                      fields={k: v[:1] for k, v in batch.fields.items()}))
    tracemalloc.start()
    try:
        for i, m in enumerate([*bad, *joined]):
            daemon.handle(dataclasses.replace(m, seq=seq + 1 + i))
            assert daemon.statistics().memory_bytes <= budget
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated for rejected messages"
    stats = daemon.statistics()
    assert stats.rejected["worlds"] == len(bad) + 2
    assert stats.rejected["budget"] == 1  # 2**24 worlds' bookkeeping exceeds the budget
    daemon.handle(dataclasses.replace(msgs[-1], seq=seq + 100))
    daemon.close()
    assert failed_runs(daemon) == 0
    reader = RunStore(daemon.writers[0].store)
    # every world's episode in progress when the untrusted worlds came is dropped, the rest exact
    stored = {(r["world"], r["index"]) for r in reader.episodes("run-a").rows()}
    assert stored
    assert stored <= set(sim.outcome)
    for key in stored:
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


def test_metadata_with_bytes_nan_and_nesting_is_stored_and_read_back(tmp_path: Path) -> None:
    """Item 6: metadata holding bytes could not be stored in JSON attributes (the run's writer
    failed). Bytes, non-finite floats and nesting are stored and read back as given."""
    sim, msgs = record(steps=10)
    metadata = {"blob": b"\x00\xff raw", "nan": math.nan, "inf": -math.inf, "big": 2**70,
                "nested": {"list": [1, b"x", {"deep": None, "s": "\x00"}], "t": "s"}}
    msgs[0] = dataclasses.replace(msgs[0], metadata=metadata)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    assert failed_runs(daemon) == 0
    reader = RunStore(tmp_path / "runs.zarr")
    got = reader.info("run-a")["metadata"]
    assert got["blob"] == b"\x00\xff raw"
    assert math.isnan(got["nan"])
    assert got["inf"] == -math.inf
    assert got["big"] == 2**70
    assert got["nested"] == {"list": [1, b"x", {"deep": None, "s": "\x00"}], "t": "s"}
    check_run(reader, "run-a", sim)


def test_unstorable_metadata_is_a_counted_rejection_not_a_failed_run() -> None:
    """Item 6: metadata JSON cannot hold (an arbitrary object) failed the run's writer thread,
    and every later message of the run was refused. The RunStart is rejected and counted; the
    run is joined from its next message and every episode is stored."""
    sim, msgs = record(steps=10)
    msgs[0] = dataclasses.replace(msgs[0], metadata={"obj": object()})
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    assert failed_runs(daemon) == 0
    assert daemon.statistics().rejected["metadata"] == 1
    check_run(RunStore(daemon.writers[0].store), "run-a", sim)


def test_schema_conflicting_with_the_stored_one_after_a_restart_is_a_counted_rejection(
        tmp_path: Path) -> None:
    """Item 6: after a restart, a batch whose fields differ from the run's stored schema raised
    ``StoreFormatError`` out of ``StoreDaemon.handle`` (exit 3, "locked or not a run store").
    It is a counted rejection; the daemon keeps serving that run and the others."""
    sim, msgs = record(steps=30)
    store = tmp_path / "runs.zarr"
    half = len(msgs) // 2
    first_daemon = StoreDaemon(store, commit_interval=0)
    feed(first_daemon, msgs[:half])
    first_daemon.close()
    i = first(msgs[half:], Batch, topic="batch/obs") + half
    wrong = dataclasses.replace(msgs[i], fields={**msgs[i].fields,
                                                 "state": msgs[i].fields["state"].double()})
    other_sim, other = record("other", steps=10, seed=5)
    daemon = StoreDaemon(store, commit_interval=0)
    feed(daemon, renumber([*msgs[:half], wrong])[half:])  # the conflicting batch comes first
    feed(daemon, [dataclasses.replace(m, seq=m.seq + 1) for m in msgs[half:]])
    feed(daemon, other)
    daemon.close()
    assert daemon.statistics().rejected["schema"] == 1
    assert failed_runs(daemon) == 0
    reader = RunStore(store)
    assert reader.info("run-a")["fields"]["obs"]["state"] == {"dtype": "float32", "shape": [3]}
    check_run(reader, "other", other_sim)
    for row in reader.episodes("run-a").rows():  # what is stored is what was published
        key = (row["world"], row["index"])
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


def test_variation_whose_value_shape_changes_is_rejected_not_a_failed_run() -> None:
    """Item 6: a variation whose value shape changes failed the run's writer thread (every
    later episode lost). That sample is rejected and counted; the run goes on."""
    sim, msgs = record(steps=30)
    samples = [i for i, m in enumerate(msgs) if isinstance(m, VariationSample) and m.key == "friction"]
    i = samples[1]
    msgs[i] = dataclasses.replace(msgs[i], value=msgs[i].value[:, None].repeat(1, 2))
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    assert daemon.statistics().rejected["schema"] == 1
    assert failed_runs(daemon) == 0
    reader = RunStore(daemon.writers[0].store)
    assert reader.info("run-a")["status"] == "complete"
    kept = [msgs[j] for j in samples if j != i]
    values = reader.variation_samples("run-a", "friction")["value"]
    assert values.tobytes() == torch.cat([m.value for m in kept]).numpy().tobytes()
    # the worlds the rejected sample was for lose the episode it applied to; the rest are exact
    lost = {(w, e) for w, e in zip(msgs[i].worlds.tolist(), msgs[i].episodes.tolist(), strict=True)}
    check_run(reader, "run-a", sim, skip=lost & set(sim.outcome))


# -- item 5: what the decoder refuses, should it reach the daemon --------------------------------


def _zero_rows_huge(msgs: list[Message]) -> Message:
    b = msgs[first(msgs, Batch, topic="batch/obs")]
    empty = torch.zeros(0, dtype=torch.int64)
    return dataclasses.replace(b, topic="batch/huge", worlds=empty, episodes=empty,
                               fields={"z": torch.empty((0, 1 << 60, 2))})


def _end_length_float(msgs: list[Message]) -> Message:
    end = msgs[first(msgs, EpisodeEnd)]
    return dataclasses.replace(end, length=end.length.double())


# case -> (how the message enters the run, the message, rejections expected)
DECODER_CASES: dict[str, tuple[str, Any, int]] = {
    "zero-row field of shape [0, 2**60, 2]": ("insert", _zero_rows_huge, 1),
    "run/start num_worlds as a str": ("replace", lambda m: dataclasses.replace(m[0], num_worlds="4"), 1),
    "run/start num_worlds 0": ("replace", lambda m: dataclasses.replace(m[0], num_worlds=0), 1),
    "run/start metadata a list": ("replace", lambda m: dataclasses.replace(m[0], metadata=[1, 2]), 1),
    "run/start device None": ("replace", lambda m: dataclasses.replace(m[0], device=None), 1),
    "run/end schema of ints": ("insert", lambda m: dataclasses.replace(m[-1], schema={"batch/obs": 3}), 1),
    "step 2**63": ("insert", lambda m: dataclasses.replace(m[first(m, Batch)], step=2**63), 1),
    "seq a numpy int": ("replace", lambda m: dataclasses.replace(m[3], seq=np.int64(m[3].seq)), 0),
    "batch topic 'batch/'": ("insert", lambda m: dataclasses.replace(m[first(m, Batch)], topic="batch/"), 1),
    "batch fields None": ("insert", lambda m: dataclasses.replace(m[first(m, Batch)], fields=None), 1),
    "variation labels of objects": ("insert", lambda m: dataclasses.replace(
        m[first(m, VariationSample, key="friction")], labels=(object(),)), 1),
    "episode end length float": ("insert", _end_length_float, 1),
}


@pytest.mark.parametrize("case", sorted(DECODER_CASES))
def test_values_the_decoder_refuses_are_counted_rejections_at_the_daemon(case: str) -> None:
    """Item 5: values of the decoder's campaign (a zero-row field of a huge shape, wrong-typed
    run/start and run/end values, a step past int64, non-tensor fields) raised ``TypeError``,
    ``OverflowError`` or ``RuntimeError`` at the daemon or failed the run's writer thread.
    Should one reach ``handle`` (an in-process publisher), it is a counted rejection: the run
    does not fail, what it stores is what was published, and a run published afterwards is
    stored byte for byte."""
    sim, msgs = record(steps=12)
    mode, make, rejections = DECODER_CASES[case]
    bad = make(msgs)
    i = next(j for j, m in enumerate(msgs) if m.seq == bad.seq)
    # "replace": in the message's place; "insert": one more message, numbered in order
    fed = [*msgs[:i], bad, *msgs[i + 1:]] if mode == "replace" else renumber([*msgs[:i], bad, *msgs[i:]])
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, fed)
    other_sim, other = record("after", steps=8, seed=9)
    feed(daemon, other)
    daemon.close()
    assert failed_runs(daemon) == 0, getattr(daemon, "_failed", None)
    assert sum(daemon.statistics().rejected.values()) == rejections
    reader = RunStore(daemon.writers[0].store)
    check_run(reader, "after", other_sim)
    assert len(reader.episodes("run-a")) > 0
    for row in reader.episodes("run-a").rows():
        key = (row["world"], row["index"])
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


# -- item 16: sessions ----------------------------------------------------------------------------


@pytest.mark.parametrize("restart", [False, True])
def test_second_session_reusing_a_run_id_is_stored_as_a_new_run(tmp_path: Path, restart: bool) -> None:
    """Item 16: a second session reusing a run id was merged into the first run (episode
    indices restarting at 0, duplicate keys, the reader returning one of them). It is stored
    as ``run#2``, never merged, and both read back byte for byte."""
    sim1, msgs1 = record(steps=12, seed=1)
    sim2, msgs2 = record(steps=12, seed=2)
    store = tmp_path / "runs.zarr"
    daemon = StoreDaemon(store, commit_interval=0)
    feed(daemon, msgs1)
    if restart:
        daemon.close()
        daemon = StoreDaemon(store, commit_interval=0)
    feed(daemon, msgs2)
    daemon.close()
    reader = RunStore(store)
    assert reader.runs() == ["run-a", "run-a#2"]
    assert reader.info("run-a#2")["session_of"] == "run-a"
    check_run(reader, "run-a", sim1)
    check_run(reader, "run-a#2", sim2)


# -- items 17 and 28: names ---------------------------------------------------------------------


@pytest.mark.parametrize("run", ["__x", "..y", "..", "a/b", "nul\x00id", "r" * 300, "zarr.json",
                                 "100%", "x.partial"])
def test_run_ids_round_trip_exactly(tmp_path: Path, run: str) -> None:
    """Item 17: run ids starting with ``__`` or ``..`` (and ``/``, NUL, 300 characters) did not
    round-trip through the name escaping: the run was listed under another name and read back
    empty. Every id is listed as given and its episodes read back byte for byte."""
    sim, msgs = record(run, steps=15)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    reader = RunStore(tmp_path / "runs.zarr")
    assert reader.runs() == [run]
    assert check_run(reader, run, sim) > 0


def test_missing_group_with_committed_rows_is_an_error_not_an_empty_table(tmp_path: Path) -> None:
    """Item 17: a run whose episode table is gone read back as an empty table. A group that is
    missing while rows are committed is reported as damage."""
    sim, msgs = record(steps=15)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    assert len(RunStore(tmp_path / "runs.zarr").episodes("run-a")) == len(sim.outcome) > 0
    import shutil

    shutil.rmtree(tmp_path / "runs.zarr" / "runs" / "run-a" / "episodes")
    with pytest.raises(StoreDamagedError, match="episodes"):
        RunStore(tmp_path / "runs.zarr").episodes("run-a")


TERMS = {"obs": "zarr.json", "final": "..", "init": "\x00i" + "t" * 300}
FIELDS = {"state": "..", "flag": "zarr.json", "nest/x": "n" * 300, "reward": "\x00", "q": "a/b/../c"}


def test_term_and_field_names_round_trip_exactly(tmp_path: Path) -> None:
    """Item 28: term and field names became zarr paths unescaped: ``batch/..``, a NUL byte and
    300-character names crashed, and ``zarr.json`` as a run's first term turned the ``data``
    group's metadata into a directory. They are escaped reversibly and read back as given."""
    sim, msgs = record(steps=15)
    renamed = [dataclasses.replace(m, topic=f"batch/{TERMS[m.term]}",
                                   fields={FIELDS[k]: v for k, v in m.fields.items()})
               if isinstance(m, Batch) else m for m in msgs]
    assert renamed[first(renamed, Batch)].topic == "batch/zarr.json"  # the run's first term
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0)
    feed(daemon, renamed)
    daemon.close()
    reader = RunStore(tmp_path / "runs.zarr")
    assert sorted(reader.info("run-a")["fields"]) == sorted(TERMS.values())
    assert len(reader.episodes("run-a")) == len(sim.outcome) > 0
    for key in sim.outcome:
        want = {f"{TERMS[name.split('/', 1)[0]]}/{FIELDS[name.split('/', 1)[1]]}": value
                for name, value in sim.arrays(key).items()}
        assert_episode_equal(reader.episode("run-a", *key), want)
    root = zarr.open_group(tmp_path / "runs.zarr", mode="r")
    assert isinstance(root["runs/run-a/data"], zarr.Group)


def test_fields_named_step_and_hook_are_stored_not_rejected() -> None:
    """Item 28: a field named ``_step`` or ``_hook`` collided with the rows' own step and hook
    columns (the run's buffers failed with a shape mismatch, and the run with them); then such
    a batch was rejected (reason ``name``). The row columns are kept apart from the fields, so
    the fields are stored and read back by their names, byte for byte, and the rows' steps and
    hooks come from ``episode_rows``."""
    sim, msgs = record(steps=12)
    renamed = {"state": "_step", "flag": "_hook"}
    msgs = [dataclasses.replace(m, fields={renamed.get(k, k): v for k, v in m.fields.items()})
            if isinstance(m, Batch) and m.term == "obs" else m for m in msgs]
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    assert failed_runs(daemon) == 0
    assert sum(daemon.statistics().rejected.values()) == 0
    reader = RunStore(daemon.writers[0].store)
    assert sorted(reader.info("run-a")["fields"]["obs"]) == ["_hook", "_step", "nest/x"]
    assert len(reader.episodes("run-a")) == len(sim.outcome) > 0
    for key in sim.outcome:
        want = {f"obs/{renamed[n[4:]]}" if n[4:] in renamed else n: v for n, v in sim.arrays(key).items()}
        got = reader.episode("run-a", *key)
        assert_episode_equal(got, want)
        rows = reader.episode_rows("run-a", *key)["obs"]
        assert len(rows["step"]) == len(got["obs/_step"]) > 0
        assert np.all(np.diff(rows["step"]) == 1)
        assert set(rows["hook"].tolist()) == {"post_step"}


# -- item 23: rejected batches, bfloat16 -------------------------------------------------------------


@pytest.mark.parametrize("defect", ["duplicate worlds", "world out of range", "dtype change",
                                   "shape change", "bfloat16 change"])
def test_rejected_batch_mid_episode_makes_the_episode_incomplete(defect: str) -> None:
    """Item 23: a batch the daemon rejected mid-episode was skipped, yet its episode was
    committed as complete with the EpisodeEnd's length and rows missing. That episode is
    dropped and counted incomplete; every other episode is stored byte for byte."""
    sim, msgs = record(steps=30)
    i, world, episode = mid_episode(sim, msgs)
    batch = msgs[i]
    w = torch.tensor([world])
    e = torch.tensor([episode])
    one = {k: v[batch.worlds == world] for k, v in batch.fields.items()}
    if defect == "duplicate worlds":
        bad = dataclasses.replace(batch, worlds=torch.tensor([world, world]), episodes=torch.cat([e, e]),
                                  fields={k: torch.cat([v, v]) for k, v in one.items()})
    elif defect == "world out of range":
        bad = dataclasses.replace(batch, worlds=torch.tensor([world, 99]), episodes=torch.cat([e, e]),
                                  fields={k: torch.cat([v, v]) for k, v in one.items()})
    elif defect == "dtype change":
        bad = dataclasses.replace(batch, worlds=w, episodes=e, fields={**one, "state": one["state"].double()})
    elif defect == "shape change":
        bad = dataclasses.replace(batch, worlds=w, episodes=e, fields={**one, "state": one["state"][:, :2]})
    else:
        bad = dataclasses.replace(batch, worlds=w, episodes=e,
                                  fields={**one, "state": one["state"].to(torch.bfloat16)})
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, renumber([*msgs[:i], bad, *msgs[i:]]))
    daemon.close()
    stats = daemon.statistics()
    assert sum(stats.rejected.values()) == 1
    assert stats.episodes_incomplete >= 1
    check_run(RunStore(daemon.writers[0].store), "run-a", sim, skip={(world, episode)})


def test_batches_naming_every_world_are_checked_unless_they_are_in_order() -> None:
    """Batches of every world in order skip the distinct-worlds check (the per-step case); one as
    long, but in another order, is stored as any other batch, and one as long with a world twice
    is rejected, not taken for the per-step case."""
    sim, msgs = record(steps=30)
    i = next(i for i, m in enumerate(msgs) if isinstance(m, Batch) and m.term == "obs"
             and m.worlds.tolist() == list(range(sim.num_worlds)))
    batch = msgs[i]
    order = torch.tensor([2, 0, 3, 1])
    shuffled = dataclasses.replace(batch, worlds=batch.worlds[order], episodes=batch.episodes[order],
                                   fields={k: v[order] for k, v in batch.fields.items()})
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, [*msgs[:i], shuffled, *msgs[i + 1:]])
    daemon.close()
    assert sum(daemon.statistics().rejected.values()) == 0
    check_run(RunStore(daemon.writers[0].store), "run-a", sim)  # every episode, byte for byte
    twice = dataclasses.replace(batch, worlds=torch.tensor([0, 1, 2, 2]))
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, renumber([*msgs[:i + 1], twice, *msgs[i + 1:]]))
    daemon.close()
    assert dict(daemon.statistics().rejected) == {"worlds": 1}


def test_bfloat16_field_stores_and_reads_back_as_float32() -> None:
    """Item 23: with a bfloat16 field every episode was "complete" with 0 rows. bfloat16 travels
    on the wire, so it is stored (as its bits) and read back as float32 values equal to the
    bfloat16 ones."""
    sim, msgs = record(steps=20)
    msgs = [dataclasses.replace(m, fields={**m.fields, "state": m.fields["state"].to(torch.bfloat16)})
            if isinstance(m, Batch) and m.term == "obs" else m for m in msgs]
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, msgs)
    daemon.close()
    reader = RunStore(daemon.writers[0].store)
    assert reader.info("run-a")["fields"]["obs"]["state"]["dtype"] == "bfloat16"
    assert len(reader.episodes("run-a")) == len(sim.outcome) > 0
    for key in sim.outcome:
        want = sim.arrays(key)
        want["obs/state"] = torch.from_numpy(want["obs/state"]).to(torch.bfloat16).float().numpy()
        got = reader.episode("run-a", *key)
        assert len(got["obs/state"]) == len(want["obs/state"]) > 0
        assert_episode_equal(got, want)


# -- item 24: replays ----------------------------------------------------------------------------


def test_replayed_or_backward_messages_are_never_stored_twice() -> None:
    """Item 24: a replayed or duplicated message (same sequence number, or going backwards) was
    stored again (4 rows for an episode of length 3). Repeats are rejected, counted as
    ``replay``, and every episode reads back exactly as published."""
    sim, msgs = record(steps=25)
    fed: list[Message] = []
    replays = 0
    for i, m in enumerate(msgs[:-1]):
        fed.append(m)
        if i % 4 == 1:
            fed.append(m)  # the same message again
            replays += 1
        if i % 9 == 8:
            fed.append(msgs[i - 5])  # an older one, going backwards
            replays += 1
    fed.append(msgs[-1])
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, fed)
    daemon.close()
    assert daemon.statistics().rejected["replay"] == replays
    check_run(RunStore(daemon.writers[0].store), "run-a", sim)


def test_a_message_refused_because_another_took_its_seq_drops_the_episodes_it_touched() -> None:
    """Found by a larger daemon fuzz campaign: when a different message arrived first under a
    batch's sequence number, the batch was refused as a replay, as if it were stored already,
    and the episodes of its worlds were committed without its rows (steps 0, 2, ...). Such a
    message is a conflict, not a replay: counted as ``conflict``, and the episodes it touched
    are dropped as incomplete; every other episode is stored byte for byte."""
    sim, msgs = record(steps=30)
    msgs = renumber(msgs)
    i, _, _ = mid_episode(sim, msgs)
    batch = msgs[i]
    impostor = dataclasses.replace(  # an empty batch of another term, numbered as the batch
        batch, topic="batch/final", worlds=torch.zeros(0, dtype=torch.int64),
        episodes=torch.zeros(0, dtype=torch.int64),
        fields={"reward": torch.zeros(0, dtype=torch.float32)})
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, [*msgs[:i], impostor, *msgs[i:]])
    daemon.close()
    stats = daemon.statistics()
    assert dict(stats.rejected) == {"conflict": 1}
    lost = set(zip(batch.worlds.tolist(), batch.episodes.tolist(), strict=True)) & set(sim.outcome)
    assert lost
    assert stats.episodes_incomplete >= len(lost)
    check_run(RunStore(daemon.writers[0].store), "run-a", sim, skip=lost)


def test_a_stale_episode_end_does_not_cut_the_episode_in_progress() -> None:
    """Found by a larger daemon fuzz campaign: a copy of a world's earlier ``EpisodeEnd``
    arriving as a new message (a fresh sequence number) dropped the rows of the world's episode
    in progress, yet marked the world clean, so that episode was committed without its first
    rows. The episode in progress is now dropped as incomplete; every other episode is stored
    byte for byte."""
    sim, msgs = record(steps=30)
    i, world, current = mid_episode(sim, msgs, not_first=True)
    ends = [m for m in msgs[:i] if isinstance(m, EpisodeEnd)]
    stale = next(m for m in reversed(ends) if world in m.worlds.tolist())
    # the episodes in progress of every world the stale end names (it may name several)
    cut = {(w, sum(w in m.worlds.tolist() for m in ends)) for w in stale.worlds.tolist()} & set(sim.outcome)
    assert (world, current) in cut
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, renumber([*msgs[:i], stale, *msgs[i:]]))
    daemon.close()
    assert daemon.statistics().episodes_incomplete >= len(cut)
    check_run(RunStore(daemon.writers[0].store), "run-a", sim, skip=cut)


# -- item 25: RunStart after data ----------------------------------------------------------------


def test_message_before_run_start_does_not_hide_the_run_start() -> None:
    """Item 25: one message of a run arriving before its RunStart made the daemon ignore the
    RunStart (num_worlds, device and metadata never recorded; first episodes dropped). The
    RunStart is adopted by the run joined a moment before, and nothing is lost."""
    sim, msgs = record(steps=20)
    start = dataclasses.replace(msgs[0], metadata={"task": "lift", "seed": 3})
    assert msgs[1].seq == 1
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, [msgs[1], start, *msgs[2:]])
    daemon.close()
    reader = RunStore(daemon.writers[0].store)
    info = reader.info("run-a")
    assert (info["num_worlds"], info["device"], info["metadata"]) == (4, "cpu", {"task": "lift", "seed": 3})
    check_run(reader, "run-a", sim)
    assert reader.variation_samples("run-a", "mass")["value"].tobytes() == msgs[1].value.numpy().tobytes()


# -- item 27: memory and runs ----------------------------------------------------------------------


def test_world_count_growth_stays_within_the_budget() -> None:
    """Item 27: a run whose world count grew (a joined run discovering its worlds) reallocated
    its buffers at the old per-world capacity times the new world count before re-budgeting
    (1.3-1.6 GB under a 64 MiB budget). Memory stays within the budget at every message, a
    world count that cannot fit is rejected before allocation, and episodes read back exact."""
    budget = 256 << 10
    sim, msgs = record(worlds=24, steps=20, reset_p=0.1)
    seq = msgs[-1].seq
    daemon = StoreDaemon(zarr.storage.MemoryStore(), memory_budget=budget, commit_interval=0,
                         chunk_bytes=8 << 10)  # the writer's chunk tails are not the assembly's
    tracemalloc.start()
    try:
        # joined without its RunStart: worlds 0..23 are discovered from the messages
        for m in msgs[1:]:
            daemon.handle(m)
            assert daemon.statistics().memory_bytes <= budget
        huge = msgs[first(msgs, Batch, topic="batch/obs")]
        daemon.handle(dataclasses.replace(
            huge, run="grows", seq=1, worlds=torch.tensor([0, 1_000_000]), episodes=torch.tensor([0, 0]),
            fields={k: v[:2] for k, v in huge.fields.items()}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, f"peak {peak} bytes with a budget of {budget}"
    assert daemon.statistics().rejected["budget"] == 1
    daemon.handle(dataclasses.replace(msgs[-1], seq=seq + 1))
    daemon.close()
    assert failed_runs(daemon) == 0
    check_run(RunStore(daemon.writers[0].store), "run-a", sim)


def test_thousands_of_one_message_runs_stay_bounded_in_files_and_memory(tmp_path: Path) -> None:
    """Item 27: fresh run ids created runs without bound (3,000 one-message runs: 18,002 files,
    +960 MB never released). Runs held stay within ``max_runs`` (the least recently active is
    retired), a run that never started and has nothing to store leaves no files, and memory
    does not grow with the number of runs."""
    _, msgs = record(steps=3)
    batch = msgs[first(msgs, Batch, topic="batch/obs")]
    store = tmp_path / "runs.zarr"
    daemon = StoreDaemon(store, commit_interval=0, max_runs=8, memory_budget=1 << 20)
    tracemalloc.start()
    try:
        for i in range(1500):
            daemon.handle(dataclasses.replace(batch, run=f"stray-{i}", seq=7))
            assert len(daemon.runs) <= 8
            if i == 200:
                base = tracemalloc.get_traced_memory()[0]
            if i % 100 == 99:
                files = sum(1 for p in store.rglob("*") if p.is_file())
                assert files <= 4, f"{files} files after {i + 1} one-message runs"
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 4 << 20, f"{grown} bytes more after 1,300 more runs"  # the defect: ~320 KiB a run
    sim, clean = record("clean", steps=10)
    feed(daemon, clean)  # the daemon still serves
    daemon.close()
    reader = RunStore(store)
    assert reader.runs() == ["clean"]
    check_run(reader, "clean", sim)


def test_idle_runs_expire() -> None:
    """Item 27: idle runs that never started properly were held for good. ``tick()`` retires a
    run idle for longer than ``idle_timeout``; its messages resume it should they come back."""
    sim, msgs = record(steps=20)
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0, idle_timeout=0.05)
    half = len(msgs) // 2
    feed(daemon, msgs[:half])
    deadline = threading.Event()
    while daemon.runs and not deadline.wait(0.02):
        daemon.tick()
    assert not daemon.runs
    feed(daemon, msgs[half:])
    daemon.close()
    reader = RunStore(daemon.writers[0].store)
    assert reader.info("run-a")["resumed"] == 1
    for row in reader.episodes("run-a").rows():
        key = (row["world"], row["index"])
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


# -- item 11: joining late -----------------------------------------------------------------------


def test_joining_a_run_late_in_process_records_the_join_gap() -> None:
    """Item 11: a daemon that joined a run late (its first message neither RunStart nor seq 1)
    dropped the episodes in progress and recorded nothing. The run sequence numbers it never
    saw are a gap of source 2 (joined late), and the episodes that start after the join are
    stored byte for byte."""
    sim, msgs = record(steps=30)
    k = first(msgs, EpisodeEnd) + 1
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    feed(daemon, msgs[k:])
    daemon.close()
    reader = RunStore(daemon.writers[0].store)
    gaps = reader.gaps("run-a")
    assert gaps.rows() == [{"expected": 0, "received": msgs[k].seq, "source": 2, "topic": ""}]
    stored = {(r["world"], r["index"]) for r in reader.episodes("run-a").rows()}
    assert stored
    for key in stored:
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))


def test_joining_late_over_zeromq_records_the_join_as_a_gap() -> None:
    """Item 11: a fresh subscriber joining a stream late (first wire number > 0) dropped the
    episodes in progress without recording anything in ``gaps/``. Through a real ZeroMQ
    publisher and subscriber: the daemon subscribes after some steps were published; the
    transport's gaps (which arrive before the run's first message) and the join (source 2)
    are recorded, and every episode stored reads back byte for byte."""
    broker = Broker(strict=True)
    pub = ZmqPublisher("tcp://127.0.0.1:*", bind=True, send_timeout=20.0)
    broker.subscribe("", pub)
    sub: Subscriber | None = None
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0)
    done = threading.Event()
    errors: list[BaseException] = []

    def receive() -> None:
        assert sub is not None
        try:
            while not done.is_set():
                item = sub.recv(timeout=0.1)
                if item is None:
                    continue
                daemon.handle(item)
                if isinstance(item, RunEnd):
                    done.set()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            done.set()

    thread = threading.Thread(target=receive, daemon=True)
    try:
        sim = Sim(broker, 4, run="late", seed=11, reset_p=0.2)
        sim.step(15)  # nobody listens yet: these are never received
        sub = Subscriber(pub.endpoints[0])
        pub.wait_for_subscribers(1, timeout=20.0)  # readiness, not a sleep
        thread.start()
        sim.step(25)
        sim.close()
        assert done.wait(30.0), "the RunEnd never arrived"
        pub.close()
    finally:
        done.set()
        if thread.is_alive():
            thread.join(10.0)
        if sub is not None:
            sub.close()
        pub.close()
        daemon.close()
    assert not errors, errors
    reader = RunStore(daemon.writers[0].store)
    gaps = reader.gaps("late").rows()
    assert [g for g in gaps if g["source"] == 2 and g["expected"] == 0 and g["received"] > 1], gaps
    transport = [g for g in gaps if g["source"] == 0]
    assert transport, gaps
    assert all(g["expected"] == 0 and g["received"] > 0 for g in transport), gaps
    stored = {(r["world"], r["index"]) for r in reader.episodes("late").rows()}
    assert stored
    for key in stored:
        assert_episode_equal(reader.episode("late", *key), sim.arrays(key))


def test_field_specs_depend_on_the_field_s_own_dtype_and_the_row_limit_not_only_its_bytes() -> None:
    """A field's spec is remembered across messages (it is worked out once per dtype, row shape
    and memory share): a bfloat16 field read as its 16 bits, its uint16 twin, a torch tensor and
    a share too small for a row each get their own answer, whatever was asked before."""
    from broker import BFloat16Bits
    from storage._message_values import RejectedMessage, _spec_of

    bits = np.zeros((4, 3), np.uint16)
    assert _spec_of(bits, bits, "u", 1 << 20).dtype == "uint16"
    assert _spec_of(bits.view(BFloat16Bits), bits, "h", 1 << 20).dtype == "bfloat16"
    assert _spec_of(bits, bits, "u", 1 << 20).dtype == "uint16"
    half = torch.zeros(4, 3, dtype=torch.bfloat16)
    assert _spec_of(half, half.view(torch.int16).numpy(), "t", 1 << 20).dtype == "bfloat16"
    assert _spec_of(torch.zeros(4, 3, dtype=torch.int16), bits.view(np.int16), "i", 1 << 20).dtype == "int16"
    with pytest.raises(RejectedMessage, match=r"one world's row of shape \[3\] spans 6 bytes"):
        _spec_of(bits, bits, "u", 5)
    assert _spec_of(bits, bits, "u", 6).shape == (3,)


def test_a_batch_s_bad_fields_are_named_by_topic_and_field_in_its_rejection() -> None:
    """The daemon spells a field's topic and name only when it rejects something (not for
    every field of every message): the rejection still names both."""
    from storage._message_values import RejectedMessage, _spec_of, as_numpy

    where = ("batch/obs", "joint pos")
    with pytest.raises(RejectedMessage, match=r"^[a-z]+: topic 'batch/obs' field 'joint pos': expected a tensor, got list"):
        as_numpy([1.0], where)
    f8 = getattr(torch, "float8_e4m3fn", None)
    if f8 is not None:
        with pytest.raises(RejectedMessage, match=r"^[a-z]+: topic 'batch/obs' field 'joint pos': dtype torch.float8"):
            as_numpy(torch.zeros(2, 1, dtype=f8), where)
    wide = np.zeros((2, 7), np.float32)
    with pytest.raises(RejectedMessage, match=r"^[a-z]+: topic 'batch/obs' field 'joint pos': one world's row of shape \[7\]"):
        _spec_of(wide, wide, where, 27)


def test_a_batch_field_without_a_name_is_a_rejection_naming_its_topic(caplog: pytest.LogCaptureFixture) -> None:
    """A batch field named ``""`` is rejected (reason ``name``), the log naming its topic, and
    the run goes on."""
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.0)
    sim.step(2)
    with caplog.at_level("WARNING", logger="storage"):
        daemon.handle(Batch("run-a", sim.rec.next_seq(), 2, "batch/obs", torch.arange(3),
                            torch.zeros(3, dtype=torch.int64), {"": torch.zeros(3)}))
    assert "topic 'batch/obs' field name: expected a non-empty str, got ''" in caplog.text
    sim.step(1, force_reset=[0, 1, 2])
    sim.close()
    daemon.close()
    assert dict(daemon.statistics().rejected) == {"name": 1}


def test_a_wide_variation_value_is_chunked_by_the_store_s_chunk_bytes() -> None:
    """Bug: a variation's value table was chunked by 16384 samples whatever one value holds:
    a value of 32,768 float32 numbers a world made a chunk over 2 GiB, which the codecs refuse,
    and the run failed at its next commit. Its chunks are now sized like the data arrays'."""
    sim, msgs = record(steps=30)
    samples = [i for i, m in enumerate(msgs) if isinstance(m, VariationSample) and m.key == "friction"]
    for i in samples:  # 100 numbers a world: 800 bytes
        msgs[i] = dataclasses.replace(msgs[i], value=msgs[i].value[:, None].repeat(1, 100))
    row_bytes = 100 * msgs[samples[0]].value.element_size()
    chunk_bytes = 4096
    daemon = StoreDaemon(zarr.storage.MemoryStore(), commit_interval=0, chunk_bytes=chunk_bytes)
    feed(daemon, msgs)
    daemon.close()
    assert failed_runs(daemon) == 0
    assert sum(daemon.statistics().rejected.values()) == 0
    reader = RunStore(daemon.writers[0].store)
    assert reader.info("run-a")["status"] == "complete"
    node = reader.info("run-a")["variation_samples"]["friction"]["node"]
    array = zarr.open_group(daemon.writers[0].store, mode="r")[f"runs/run-a/variations/{node}/value"]
    assert isinstance(array, zarr.Array)
    assert array.chunks[0] == chunk_bytes // row_bytes  # 5 samples, not 16384
    values = reader.variation_samples("run-a", "friction")["value"]
    assert values.tobytes() == torch.cat([msgs[i].value for i in samples]).numpy().tobytes()
    check_run(reader, "run-a", sim)
