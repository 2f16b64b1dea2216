"""Bulk reads: ``RunStore.read_batch`` and ``RunStore.read_episodes`` give every episode byte for
byte as ``RunStore.episode`` does (and as it was published), on every store kind and path,
never beyond the committed counts, never zeros for a damaged chunk.

The stores are real daemon runs (``read_store``): three terms (``obs`` every step, ``final`` at
a reset and ``init`` after it: partial batches, episodes without rows in a term), a bfloat16
field, variable episode lengths, and chunks and a memory budget small enough that episodes
span chunks and are stored in several fragments.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from read_store import assert_same, expected, two_runs, write
from storage_sim import Sim, assert_episode_equal

from broker import FieldSpec
from storage import EpisodeNotFoundError, RunStore, RunStoreWriter, StoreDamagedError, Table
from storage._format import APPEND_CONFIG
from storage.run_writer import EpisodeRows

pytestmark = pytest.mark.timeout(120)


Key = tuple[int, int]


@dataclass(frozen=True)
class Built:
    path: Path
    sims: dict[str, Sim]
    episodes: dict[str, dict[Key, dict[str, np.ndarray]]]  # run -> key -> RunStore.episode()


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The store, and every episode as ``RunStore.episode`` reads it (checked against what was
    published by the first test)."""
    path = tmp_path_factory.mktemp("bulk") / "runs.zarr"
    sims = two_runs(path)
    reader = RunStore(path)
    return Built(path, sims, {run: {k: reader.episode(run, *k) for k in keys(reader.episodes(run))}
                              for run in sims})


def keys(table: Table) -> list[Key]:
    return list(zip(table["world"].tolist(), table["index"].tolist(), strict=True))


def test_the_store_has_what_the_bulk_paths_must_handle(built: Built) -> None:
    """The fixture is what the tests below rely on: fragments, chunk-spanning episodes,
    episodes without rows in a term, a bfloat16 field."""
    reader = RunStore(built.path)
    table = reader.episodes("run-a")
    assert int(table["segments"].max()) >= 5  # obs in >= 3 fragments, plus final and init
    assert int(table["length"].max()) > 21  # more rows than one chunk of obs/state holds
    assert reader.info("run-a")["fields"]["obs"]["h"]["dtype"] == "bfloat16"
    assert any(len(e["init/q"]) == 0 for e in built.episodes["run-a"].values())


def test_bulk_reads_equal_episode_and_what_was_published(built: Built) -> None:
    """Bugs caught: segments joined out of order, fragments or partial-batch rows dropped or
    duplicated, a term without rows in an episode missing or non-empty, bfloat16 returned as
    its bits, rows of one episode given to another."""
    reader = RunStore(built.path)
    for run, sim in built.sims.items():
        table = reader.episodes(run)
        assert len(table) == len(sim.outcome) > 20
        per_episode = list(reader.read_episodes(run))
        batch = reader.read_batch(run)
        assert len(batch) == len(per_episode) == len(table)
        assert batch.run == run
        np.testing.assert_array_equal(batch.table["world"], table["world"])
        for i, key in enumerate(keys(table)):
            want = built.episodes[run][key]
            assert_episode_equal(want, expected(sim, key))
            assert_same(per_episode[i], want, (run, key))
            assert_same(batch.episode(i), want, (run, key))
            assert per_episode[i]["obs/h"].dtype == np.float32
    everything = list(reader.read_episodes())  # every run, in episodes() order
    table = reader.episodes()
    assert len(everything) == len(table)
    for got, row in zip(everything, table.rows(), strict=True):
        assert_same(got, built.episodes[row["run"]][row["world"], row["index"]])


def test_a_batch_is_rows_concatenated_with_offsets(built: Built) -> None:
    """The concatenated layout: field ``name`` of episode ``i`` is
    ``data[name][offsets[name][i]:offsets[name][i + 1]]``, fields of one term share offsets."""
    reader = RunStore(built.path)
    table = reader.episodes("run-a")
    batch = reader.read_batch("run-a", fields=["obs/state", "final"])
    assert set(batch.data) == set(batch.offsets) == {"obs/state", "final/reward"}
    offsets = batch.offsets["obs/state"]
    assert offsets.dtype == np.int64
    assert offsets[0] == 0
    assert len(offsets) == len(table) + 1
    np.testing.assert_array_equal(np.diff(offsets), table["length"])  # obs: one row per step
    np.testing.assert_array_equal(np.diff(batch.offsets["final/reward"]), np.ones(len(table)))
    rows = np.concatenate([built.episodes["run-a"][k]["obs/state"] for k in keys(table)])
    np.testing.assert_array_equal(batch.data["obs/state"], rows)


@pytest.mark.parametrize("kind", ["directory", "file-url", "fsspec", "memory"])
def test_every_store_kind_and_fetch_path_reads_the_same(kind: str, built: Built,
                                                        tmp_path: Path) -> None:
    """Local directories and memory stores fetch and decode chunks on threads; an fsspec store
    takes zarr's asynchronous path. Bugs caught: a path that places chunks wrong, or reads the
    wrong chunk keys of a store that is not a directory."""
    path, sims, reference = built.path, built.sims, built.episodes
    location: Any = {"directory": path, "file-url": f"file://{path}",
                     "fsspec": zarr.storage.FsspecStore.from_url(f"file://{path}", read_only=True)}.get(kind)
    if kind == "memory":
        location = zarr.storage.MemoryStore()
        sims = write(location, ("run-m", 3, 60))
        reference = {}
    reader = RunStore(location)
    for run, sim in sims.items():
        batch = reader.read_batch(run)
        assert len(batch) > 5
        for i, key in enumerate(keys(batch.table)):
            assert_episode_equal(batch.episode(i), expected(sim, key))
            assert_same(batch.episode(i), reference[run][key] if reference else reader.episode(run, *key))


CHUNK_KEY = re.compile(r"/c([./]\d+)+$")
"""The end of a chunk's key (``.../c/0/0`` or ``.../c.0.0``): what is left is its array's."""


class ReadCounting(zarr.storage.LocalStore):
    """A local store that counts the reads of each chunk key."""

    reads: ClassVar[Counter[str]] = Counter()

    @classmethod
    def count(cls, key: str) -> None:
        if CHUNK_KEY.search(key):
            cls.reads[key] += 1

    def get_sync(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.count(key)
        return super().get_sync(key, *args, **kwargs)

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.count(key)
        return await super().get(key, *args, **kwargs)


def test_episodes_read_one_at_a_time_fetch_each_chunk_once(built: Built) -> None:
    """``episode()`` and ``episode_rows()`` take the bulk path for one episode: the run's
    episode table is read once (until ``refresh``) and decoded chunks are cached, so reading
    every episode of a run one at a time fetches each chunk of the store once. Bug caught: an
    ``episode()`` that reads the episode table's columns again at every call (n episodes read
    the table n times: 42x slower per episode on the read benchmark)."""
    reader = RunStore(ReadCounting(built.path, read_only=True))
    table = reader.episodes("run-a")
    ReadCounting.reads.clear()
    for key in keys(table):
        assert_same(reader.episode("run-a", *key), built.episodes["run-a"][key], ("run-a", key))
        rows = reader.episode_rows("run-a", *key)
        assert len(rows["obs"]["step"]) == len(built.episodes["run-a"][key]["obs/state"])
    assert ReadCounting.reads, "no chunk was read"
    again = {k: n for k, n in ReadCounting.reads.items() if n > 1}
    assert not again, f"chunks fetched more than once: {sorted(again.items())[:5]}"


def test_an_object_store_s_arrays_are_read_at_once(built: Built) -> None:
    """On zarr's asynchronous path (object stores), the arrays of a read are fetched
    concurrently, so reading an episode costs about one round trip, not one per field. Bug
    caught: fields read one after the other (a read of n fields waited n round trips; 116 vs
    26 ms per episode at 20 ms a round trip, 6 fields)."""
    store = Together(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True))
    reader = RunStore(store, cache_bytes=0)  # every read goes to the store
    first, second = keys(reader.episodes("run-a"))[:2]
    reader.episode("run-a", *first)  # the episode index read, the arrays opened
    Together.watch(chunk_array)
    assert_same(reader.episode("run-a", *second), built.episodes["run-a"][second], ("run-a", second))
    peak = max(map(len, Together.together), default=0)
    assert peak >= 2, f"at most {peak} array read at a time"


def test_the_episode_table_is_read_once_per_refresh(built: Built) -> None:
    """The episode list, the episode index of ``episode()`` and the bulk reads, and the (X, Y)
    table share one read of a run's episode table until ``refresh``; what a caller does to a
    returned table never reaches the next. Bug caught: ``episodes()`` reading every column of
    the table again at each call (28 round trips, 600 ms at 20 ms a round trip, each time)."""
    reader = RunStore(ReadCounting(built.path, read_only=True))
    ReadCounting.reads.clear()
    table = reader.episodes("run-a")
    first = keys(table)[0]
    assert len(reader.episodes("run-a", success=True)) == int(table["success"].sum())
    assert_same(reader.episode("run-a", *first), built.episodes["run-a"][first])
    reader.read_batch("run-a", fields=["obs/flag"])
    assert len(reader.variation_table("run-a").arrays().run) == len(table)
    reads = {k: n for k, n in ReadCounting.reads.items() if "/episodes/" in k}
    assert reads, "the episode table was never read"
    assert set(reads.values()) == {1}, f"episode table chunks read more than once: {reads}"
    world = table["world"].copy()
    table["world"][:] = -1
    assert np.array_equal(reader.episodes("run-a")["world"], world)
    reader.refresh()  # commits made since are seen: the table is read again
    assert np.array_equal(reader.episodes("run-a")["world"], world)
    assert {ReadCounting.reads[k] for k in reads} == {2}


class Slow(zarr.storage.WrapperStore[Any]):
    """A store whose every read (chunks and metadata) takes 30 ms, counting the reads in
    flight at once: ``peak`` of all, ``meta_peak`` of metadata documents."""

    flight: ClassVar[Counter[str]] = Counter()
    runs: ClassVar[Counter[str]] = Counter()
    peak: ClassVar[int] = 0
    meta_peak: ClassVar[int] = 0
    runs_peak: ClassVar[int] = 0

    @classmethod
    def reset(cls) -> None:
        cls.peak = cls.meta_peak = cls.runs_peak = 0

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        kind = "meta" if key.endswith("zarr.json") else "chunk"
        run = key.split("/")[1] if key.startswith("runs/") and key.count("/") > 1 else ""
        Slow.flight[kind] += 1
        Slow.runs[run] += 1
        Slow.peak = max(Slow.peak, Slow.flight["meta"] + Slow.flight["chunk"])
        Slow.meta_peak = max(Slow.meta_peak, Slow.flight["meta"])
        Slow.runs_peak = max(Slow.runs_peak, sum(1 for r, k in Slow.runs.items() if r and k))
        try:
            await asyncio.sleep(0.03)
            return await self._store.get(key, *args, **kwargs)
        finally:
            Slow.flight[kind] -= 1
            Slow.runs[run] -= 1

    def _with_store(self, store: Any) -> Slow:
        return Slow(store)


def test_an_object_store_s_runs_tables_and_arrays_are_opened_at_once(built: Built) -> None:
    """On an object store, a reader opens the runs, reads a table's columns and opens a read's
    arrays concurrently: a first read costs a few round trips, not a few per column. Bug
    caught: each opened or read one after the other (6 fields, 20 ms a round trip: the first
    ``episode()`` 778 ms, ``episodes()`` 601 ms, a fresh ``read_batch`` 1379 ms; now 161, 161
    and 324), and every run's episode table read one run after the other."""
    Slow.reset()
    reader = RunStore(Slow(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    assert reader.runs() == ["run-a", "run-b"]
    assert Slow.meta_peak >= 2, "the runs were opened one after the other"
    Slow.reset()
    table = reader.episodes("run-a")
    assert Slow.peak >= 2, "the episode table's columns were read one after the other"
    Slow.reset()
    first = keys(table)[0]
    assert_same(reader.episode("run-a", *first), built.episodes["run-a"][first])
    assert Slow.meta_peak >= 2, "the arrays of a first read were opened one after the other"
    assert_same(reader.read_batch("run-b").episode(0), built.episodes["run-b"][keys(reader.episodes("run-b"))[0]])
    reader.refresh()
    Slow.reset()
    every = reader.episodes()  # every run's episode table
    assert Slow.runs_peak >= 2, "the runs' episode tables were read one run after the other"
    assert sorted(set(every["run"].tolist())) == ["run-a", "run-b"]
    np.testing.assert_array_equal(every.where(every["run"] == "run-a")["world"], table["world"])
    Slow.reset()
    for got, key in zip(reader.read_episodes(episodes=every, fields=["obs/flag"]), keys(every), strict=False):
        assert np.array_equal(got["obs/flag"], built.episodes["run-a"][key]["obs/flag"])
        break  # the runs' indexes are built before the first episode
    assert Slow.runs_peak >= 2, "the runs' segment tables were read one run after the other"


def test_read_episodes_opens_every_run_s_arrays_at_once(built: Built) -> None:
    """On an object store, ``read_episodes()`` over several runs opens the arrays of every run
    before the first batch, at once: one run's, then the next's, one array after the other,
    took 12 round trips a run for 6 fields (6 runs at 20 ms a request: 1946 ms, now 632).
    Every episode still byte-equal to what was published, in order."""
    reader = RunStore(Slow(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    every = reader.episodes()
    for _ in reader.read_episodes(episodes=every, fields=["obs/flag"]):
        break  # every run's index built, one array open in each
    Slow.reset()
    got = list(reader.read_episodes(episodes=every))
    assert Slow.runs_peak >= 2, "the runs' arrays were opened one run after the other"
    assert len(got) == len(every)
    for episode, run, key in zip(got, every["run"].tolist(), keys(every), strict=True):
        assert_same(episode, built.episodes[run][key])


@pytest.mark.parametrize("kind", ["directory", "fsspec"])
def test_a_run_s_damaged_array_raises_when_read_after_the_runs_before(built: Built, tmp_path: Path,
                                                                     kind: str) -> None:
    """Opening every run's arrays at once does not move the error: the runs before a run whose
    array cannot be opened are read, then its first batch raises, naming it."""
    path = tmp_path / "damaged.zarr"
    shutil.copytree(built.path, path)
    (path / "runs/run-b/data/obs/state/zarr.json").write_text('{"zarr_format": 3, "node_ty')
    location: Any = path if kind == "directory" else zarr.storage.FsspecStore.from_url(f"file://{path}",
                                                                                     read_only=True)
    reader = RunStore(location)
    every = reader.episodes()
    episodes = reader.read_episodes(episodes=every)  # no error yet
    first_b = every["run"].tolist().index("run-b")
    for key in keys(every)[:first_b]:
        assert_same(next(episodes), built.episodes["run-a"][key])
    with pytest.raises(StoreDamagedError, match=r"run 'run-b'.*obs/state.*cannot be opened"):
        next(episodes)


class Asked(zarr.storage.WrapperStore[Any]):
    """A store that counts the questions asked of it, by kind."""

    asked: ClassVar[Counter[str]] = Counter()

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        Asked.asked["get"] += 1
        return await self._store.get(key, *args, **kwargs)

    async def exists(self, key: str) -> bool:
        Asked.asked["exists"] += 1
        return await self._store.exists(key)

    def _with_store(self, store: Any) -> Asked:
        return Asked(store)


def test_an_object_store_s_table_chunks_are_fetched_without_asking_first(built: Built) -> None:
    """A table column's chunks are fetched once each on an object store, a missing one known by
    its empty answer: asking whether each exists first was a round trip more per column (20 ms
    a request: a fresh ``episodes()`` 161 -> 77 ms). The columns equal the local reader's."""
    Asked.asked.clear()
    reader = RunStore(Asked(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    got = reader.episodes()
    assert Asked.asked["get"] > 0
    assert Asked.asked["exists"] == 0, Asked.asked
    want = RunStore(built.path).episodes()
    assert list(got.columns) == list(want.columns)
    for name in want.columns:
        np.testing.assert_array_equal(got[name], want[name])


class Together(zarr.storage.WrapperStore[Any]):
    """A store whose reads take 20 ms, noting each set of labels (``label(key)``; "" counts
    for nothing) that had reads in flight at once: :meth:`watch` sets the label and forgets."""

    label: ClassVar[Callable[[str], str]] = staticmethod(lambda key: "")
    flight: ClassVar[Counter[str]] = Counter()
    together: ClassVar[set[frozenset[str]]] = set()

    @classmethod
    def watch(cls, label: Callable[[str], str]) -> None:
        cls.label = staticmethod(label)
        cls.together.clear()

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        label = Together.label(key)
        Together.flight[label] += 1
        Together.together.add(frozenset(t for t, k in Together.flight.items() if t and k))
        try:
            await asyncio.sleep(0.02)
            return await self._store.get(key, *args, **kwargs)
        finally:
            Together.flight[label] -= 1

    def _with_store(self, store: Any) -> Together:
        return Together(store)


def chunk_array(key: str) -> str:
    """The array a chunk key belongs to ("" for metadata)."""
    array = CHUNK_KEY.sub("", key)
    return "" if array == key else array


def table_of(key: str) -> str:
    """The table (or data, or variations) a key of a run lies in."""
    parts = key.split("/")
    return parts[2] if len(parts) > 3 and parts[0] == "runs" else ""


def run_of_data_chunk(key: str) -> str:
    """The run of a key that is a data chunk."""
    parts = key.split("/")
    return parts[1] if len(parts) > 4 and parts[2] == "data" and not key.endswith("zarr.json") else ""


@pytest.mark.parametrize("read", ["episode", "read_batch", "read_episodes"])
def test_a_first_read_reads_the_episode_and_segment_tables_at_once(built: Built, read: str) -> None:
    """A fresh reader's first ``episode()``, ``read_batch()`` or ``read_episodes()`` needs the
    run's episode and segment tables: on an object store both are read at once (the segments
    after the episodes took three round trips more: 20 ms a request, a first ``episode()``
    219 -> 152 ms, ``read_batch()`` 218 -> 157 ms). Bug caught: one table after the other."""
    Together.watch(table_of)
    reader = RunStore(Together(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    key = keys(RunStore(built.path).episodes("run-a"))[0]
    if read == "episode":
        assert_same(reader.episode("run-a", *key), built.episodes["run-a"][key])
    elif read == "read_batch":
        assert_same(reader.read_batch("run-a").episode(0), built.episodes["run-a"][key])
    else:
        assert_same(next(iter(reader.read_episodes("run-a"))), built.episodes["run-a"][key])
    assert any({"episodes", "segments"} <= t for t in Together.together), \
        "the tables were read one after the other"


def test_read_episodes_reads_small_runs_at_once(built: Built) -> None:
    """Runs smaller than a batch are read at once on an object store (6 runs of 30 episodes at
    20 ms a request: ``read_episodes()`` 363 -> 264 ms); episodes still come in order, each
    byte-equal. Bug caught: one run's chunks after the other's."""
    reader = RunStore(Together(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    every = reader.episodes()
    Together.watch(run_of_data_chunk)
    got = list(reader.read_episodes(episodes=every))
    assert max(map(len, Together.together)) >= 2, "the runs' chunks were read one run after the other"
    assert len(got) == len(every)
    for episode, run, key in zip(got, every["run"].tolist(), keys(every), strict=True):
        assert_same(episode, built.episodes[run][key])
    reader = RunStore(Together(zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True)))
    Together.watch(run_of_data_chunk)
    small = list(reader.read_episodes(episodes=every, batch_bytes=1))  # a batch per episode, one at a time
    assert max(map(len, Together.together)) == 1
    for a, b in zip(small, got, strict=True):
        assert_same(a, b)


def test_without_cache_and_after_many_small_batches(built: Built) -> None:
    """``cache_bytes=0`` reads every chunk from the store; a ``batch_bytes`` smaller than an
    episode reads one episode per batch. Bug caught: results that depend on the cache or on
    where batches are cut."""
    bare = RunStore(built.path, cache_bytes=0)
    table = bare.episodes("run-b")
    for got, key in zip(bare.read_episodes("run-b", batch_bytes=1), keys(table), strict=True):
        assert_same(got, built.episodes["run-b"][key])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_selections_fields_and_spans(built: Built, data: st.DataObject) -> None:
    """Any episodes (repeats, any order), any fields, any row span read as ``episode()`` cut
    the same way. Bugs caught: unsorted chunk placement, repeated episodes, spans clipped
    wrong across fragment boundaries, a field list that changes what other fields read."""
    reader = RunStore(built.path, cache_bytes=data.draw(st.sampled_from([0, 4096, 64 << 20])))
    run = data.draw(st.sampled_from(["run-a", "run-b"]))
    table = reader.episodes(run)
    picks = data.draw(st.lists(st.integers(0, len(table) - 1), max_size=25))
    names = ["obs", "obs/state", "obs/flag", "obs/nest/x", "obs/h", "final/reward", "init", "init/q"]
    fields = data.draw(st.none() | st.lists(st.sampled_from(names), min_size=1, unique=True))
    span = data.draw(st.none() | st.tuples(st.integers(0, 60), st.integers(0, 80)))
    selection = table.where(np.asarray(picks, dtype=np.int64))
    start, stop = (None, None) if span is None else span
    batch = reader.read_batch(run, selection, fields, start=start, stop=stop)
    assert len(batch) == len(picks)
    for i, key in enumerate(keys(selection)):
        whole = built.episodes[run][key]
        wanted = {n for n in whole if fields is None or n in fields or n.split("/", 1)[0] in fields}
        want = {n: v[slice(start, stop)] for n, v in whole.items() if n in wanted}
        assert_same(batch.episode(i), want, (key, fields, span))
    if span is None:
        got = list(reader.read_episodes(run, selection, fields, batch_bytes=2000))
        assert len(got) == len(picks)
        for i, episode in enumerate(got):
            assert_same(episode, batch.episode(i), (i, fields))


def committed_run(path: Path, chunk_bytes: int = 1 << 20) -> Any:
    """A run ``r`` written with the writer: episode (0, 0) of rows 0-3 committed."""
    writer = RunStoreWriter(path, chunk_bytes=chunk_bytes)
    run = writer.run("r", num_worlds=2)
    run.declare_term("t", {"v": FieldSpec("float32", (2,))})
    run.create_term("t")
    off = run.append("t", {"v": np.arange(8, dtype=np.float32).reshape(4, 2)}, np.arange(4), np.ones(4, np.uint8))
    run.commit(EpisodeRows(episode_columns(0, 0, 4, 4), np.array([[0, off, 4]])))
    return run


def episode_columns(world: int, index: int, length: int, end: int) -> dict[str, np.ndarray]:
    return {"world": np.array([world]), "index": np.array([index]), "length": np.array([length]),
            "success": np.array([True]), "terminated": np.array([False]), "truncated": np.array([False]),
            "end_step": np.array([end]), "end_seq": np.array([end]), "segment_count": np.array([1])}


def test_rows_after_the_commit_are_invisible_and_refresh_shows_the_next_commit(tmp_path: Path) -> None:
    """Rows appended but not committed share the committed rows' chunk, and an interrupted
    commit left an episode row behind: bulk reads see neither. After the next commit and
    ``refresh()``, the new episode reads back as written. Bugs caught: reading the episode
    table or data past the committed counts; a decoded chunk kept in the cache across
    ``refresh()`` (the new episode would read the old chunk's zeros)."""
    path = tmp_path / "s.zarr"
    run = committed_run(path)
    first = np.arange(8, dtype=np.float32).reshape(4, 2)
    reader = RunStore(path)
    np.testing.assert_array_equal(reader.read_batch("r").data["t/v"], first)  # chunk 0 now cached
    more = 100 + np.arange(6, dtype=np.float32).reshape(3, 2)
    off = run.append("t", {"v": more}, np.arange(4, 7), np.ones(3, np.uint8))  # not committed yet
    # an interrupted commit's debris right after the committed rows: episode (1, 0) -> the
    # segment of the rows just appended
    for table, values in (("episodes", {"world": 1, "index": 0, "segment_start": 1, "segment_count": 1}),
                          ("segments", {"episode": 1, "topic": 0, "offset": off, "rows": 3})):
        for column, value in values.items():
            run.group[f"{table}/{column}"].with_config(APPEND_CONFIG)[1] = value
    for fresh in (False, True):
        r = RunStore(path) if fresh else reader
        assert len(list(r.read_episodes("r"))) == 1
        with pytest.raises(EpisodeNotFoundError, match="world=1 index=0"):
            r.read_batch("r", Table({"world": np.array([1]), "index": np.array([0])}))
    run.commit(EpisodeRows(episode_columns(1, 0, 3, 7), np.array([[0, off, 3]])))
    reader.refresh()
    batch = reader.read_batch("r")
    assert len(batch) == 2
    np.testing.assert_array_equal(batch.episode(0)["t/v"], first)
    np.testing.assert_array_equal(batch.episode(1)["t/v"], more)
    np.testing.assert_array_equal(reader.episode("r", 1, 0)["t/v"], more)


def damaged_copy(built: Built, tmp_path: Path, how: str) -> Path:
    path = tmp_path / "damaged.zarr"
    shutil.copytree(built.path, path)
    chunk = sorted((path / "runs/run-a/data/obs/state").glob("c.*"))[1]
    if how == "missing":
        chunk.unlink()
    else:
        raw = bytearray(chunk.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        chunk.write_bytes(bytes(raw))
    return path


@pytest.mark.parametrize("how", ["missing", "corrupt"])
@pytest.mark.parametrize("kind", ["directory", "fsspec"])
def test_a_damaged_chunk_raises_on_the_bulk_path_never_zeros(built: Built, tmp_path: Path,
                                                              how: str, kind: str) -> None:
    """A deleted chunk (zarr would read the fill value) and a flipped byte (the crc32c check)
    inside the committed rows raise StoreDamagedError naming the run and the array, on both
    fetch paths; the other run and the other fields stay readable."""
    path = damaged_copy(built, tmp_path, how)
    location: Any = path if kind == "directory" else zarr.storage.FsspecStore.from_url(f"file://{path}",
                                                                                     read_only=True)
    reader = RunStore(location)
    what = "lacks chunk" if how == "missing" else "cannot be read"
    with pytest.raises(StoreDamagedError, match=rf"run 'run-a'.*obs/state.*{what}"):
        reader.read_batch("run-a")
    with pytest.raises(StoreDamagedError, match=r"run 'run-a'.*obs/state"):
        list(reader.read_episodes("run-a", batch_bytes=1))
    reader.read_batch("run-a", fields=["obs/flag", "final", "init"])
    for got, key in zip(reader.read_episodes("run-b"), keys(reader.episodes("run-b")), strict=True):
        assert_same(got, built.episodes["run-b"][key])


@pytest.mark.parametrize("kind", ["directory", "fsspec"])
def test_a_missing_table_chunk_raises_on_the_bulk_path(built: Built, tmp_path: Path, kind: str) -> None:
    """Bug caught: the bulk path reading the episode or segment table without the missing-chunk
    check (a missing chunk of segment offsets would read as offsets 0). On an object store
    (``fsspec``) the table's columns are read at once: the damaged one is named all the same,
    and the other run stays readable."""
    for column, read, pattern in (
            ("segments/offset", lambda r: r.read_batch("run-a"), r"run 'run-a'.*offset"),
            ("episodes/length", lambda r: r.episodes("run-a"), r"run 'run-a'.*episodes/length.*lacks chunk")):
        path = tmp_path / column.replace("/", "-")  # one damage at a time
        shutil.copytree(built.path, path)
        chunks = [p for p in (path / "runs/run-a" / column).rglob("*") if p.is_file() and p.name != "zarr.json"]
        assert chunks
        for chunk in chunks:
            chunk.unlink()
        location: Any = path if kind == "directory" else zarr.storage.FsspecStore.from_url(f"file://{path}",
                                                                                         read_only=True)
        reader = RunStore(location)
        with pytest.raises(StoreDamagedError, match=pattern):
            read(reader)
        assert_same(reader.read_batch("run-b").episode(0), built.episodes["run-b"][keys(reader.episodes("run-b"))[0]])


def test_bad_arguments_are_named(built: Built) -> None:
    path = built.path
    reader = RunStore(path)
    with pytest.raises(ValueError, match="fields: run 'run-a' has no field or term 'obs/nope'"):
        reader.read_batch("run-a", fields=["obs/nope"])
    with pytest.raises(TypeError, match="fields: expected a list of names"):
        reader.read_batch("run-a", fields="obs")
    with pytest.raises(ValueError, match="read_batch reads one run"):
        reader.read_batch()
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['index'\]"):
        reader.read_batch("run-a", Table({"world": np.array([0])}))
    with pytest.raises(ValueError, match=r"run='run-a' was asked but the table holds rows of run\(s\) \['run-b'\]"):
        reader.read_batch("run-a", reader.episodes("run-b"))
    with pytest.raises(TypeError, match="episodes: expected a Table"):
        reader.read_batch("run-a", [1, 2])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="start: expected an integer >= 0"):
        reader.read_batch("run-a", start=-1)
    with pytest.raises(ValueError, match="stop: expected an integer >= 0 or one per episode"):
        reader.read_batch("run-a", stop=np.array([1, 2]))
    with pytest.raises(ValueError, match="batch_bytes: expected a positive integer"):
        reader.read_episodes("run-a", batch_bytes=0)
    with pytest.raises(ValueError, match="cache_bytes: expected an integer >= 0"):
        RunStore(path, cache_bytes=-1)
    with pytest.raises(EpisodeNotFoundError, match="world=0 index=999"):
        reader.read_batch("run-a", Table({"world": np.array([0]), "index": np.array([999])}))
    empty = reader.read_batch("run-a", "index < 0")
    assert len(empty) == 0
    assert all(len(v) == 0 for v in empty.data.values())
    assert set(empty.data) == set(reader.read_batch("run-a").data)


def test_a_where_expression_selects(built: Built) -> None:
    reader = RunStore(built.path)
    batch = reader.read_batch("run-a", "not success and world in [1, 2]", fields=["obs/state"])
    table = reader.episodes("run-a")
    want = table.where(~table["success"] & np.isin(table["world"], [1, 2]))
    assert keys(batch.table) == keys(want)
    assert len(want) > 3
    for i, key in enumerate(keys(want)):
        np.testing.assert_array_equal(batch.episode(i)["obs/state"], built.episodes["run-a"][key]["obs/state"])
