"""PyTorch datasets over a run store (``storage.dataset``): every item byte for byte as published,
the window padding rules, every episode exactly once across DataLoader workers and distributed
ranks, DataLoader worker processes (each opens the store again) on a local directory, an fsspec
store and a memory store."""

from __future__ import annotations

import pickle
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from read_store import expected, two_runs, write
from storage_sim import Sim, assert_episode_equal
from torch.utils.data import DataLoader, RandomSampler

from broker import Broker
from storage import QueryError, RunStore, StoreDaemon
from storage.dataset import (
    BlockShuffleSampler,
    Concatenated,
    EpisodeDataset,
    IterableEpisodeDataset,
    Packed,
    WindowDataset,
    concatenate,
    stack,
)

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Built:
    path: Path
    sims: dict[str, Sim]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    path = tmp_path_factory.mktemp("dataset") / "runs.zarr"
    return Built(path, two_runs(path))


def key_of(table: Any, p: int) -> tuple[str, int, int]:
    return str(table["run"][p]), int(table["world"][p]), int(table["index"][p])


def check_episode(item: dict[str, torch.Tensor], sims: dict[str, Sim], table: Any, fields: Any = None) -> None:
    """``item`` is the episode its ``"episode"`` names, as published (fields only)."""
    run, world, index = key_of(table, int(item["episode"]))
    want = {n: v for n, v in expected(sims[run], (world, index)).items()
            if fields is None or n in fields or n.split("/")[0] in fields}
    got = {n: v.numpy() for n, v in item.items() if n != "episode"}
    assert_episode_equal(got, want)
    if fields is not None:
        assert set(got) <= {n for n in got if n in fields or n.split("/")[0] in fields}


def test_episode_dataset_items_are_the_published_episodes(built: Built) -> None:
    """Bugs caught: an item of the wrong episode, a batch (``__getitems__``) read in the wrong
    order, a run's rows given to another run."""
    ds = EpisodeDataset(built.path)  # every run
    assert len(ds) == sum(len(s.outcome) for s in built.sims.values())
    for i in range(len(ds)):
        item = ds[i]
        assert int(item["episode"]) == i
        check_episode(item, built.sims, ds.table)
    picks = [5, -1, 0, 5, len(ds) // 2]
    for p, item in zip(picks, ds.__getitems__(picks), strict=True):
        assert int(item["episode"]) == p % len(ds)
        check_episode(item, built.sims, ds.table)
    with pytest.raises(IndexError, match=f"index {len(ds)} is out of range"):
        ds[len(ds)]


def test_where_and_fields_select(built: Built) -> None:
    ds = EpisodeDataset(built.path, "run-a", where="not success and world in [0, 1]", fields=["obs/h", "final"])
    table = RunStore(built.path).query("not success and world in [0, 1]", "run-a")
    np.testing.assert_array_equal(ds.table["index"], table["index"])
    assert len(ds) > 2
    for item in ds.__getitems__(list(range(len(ds)))):
        assert set(item) == {"episode", "obs/h", "final/reward"}
        assert item["obs/h"].dtype == torch.float32
        check_episode(item, built.sims, ds.table, fields=["obs/h", "final"])
    with pytest.raises(ValueError, match="fields: run 'run-a' has no field or term 'obs/nope'"):
        EpisodeDataset(built.path, "run-a", fields=["obs/nope"])
    with pytest.raises(QueryError, match="unknown column 'mas'"):
        EpisodeDataset(built.path, where="mas > 1")
    with pytest.raises(ValueError, match="cache_bytes: expected an integer >= 0"):
        EpisodeDataset(built.path, cache_bytes=-1)


def windows_by_hand(length: int, window: int, stride: int, pad: str) -> list[int]:
    """Window starts, from the rule: every whole window; with padding, also the first start
    whose window runs past the end, when it is inside the episode."""
    starts, s = [], 0
    while s < length:
        if s + window <= length:
            starts.append(s)
        else:
            if pad != "drop":
                starts.append(s)
            break
        s += stride
    return starts


@pytest.mark.parametrize(("window", "stride", "pad"), [
    (4, 4, "zeros"), (4, 3, "edge"), (5, 2, "drop"), (3, 7, "zeros"), (1, 1, "drop"), (64, 64, "edge")])
def test_window_dataset_follows_its_padding_rules(built: Built, window: int, stride: int, pad: str) -> None:
    """Every window is the episode's rows ``[start, start + window)``, never crossing into the
    next episode; the last one padded with zeros or the last row, or dropped; ``mask`` true on
    real rows. Bugs caught: windows crossing episodes, off-by-one window counts, padding from
    the wrong row, a mask that covers padding."""
    ds = WindowDataset(built.path, "run-b", fields=["obs"], window=window, stride=stride, pad=pad)  # type: ignore[arg-type]
    sim = built.sims["run-b"]
    items = ds.__getitems__(list(range(len(ds))))
    got: dict[int, list[dict[str, torch.Tensor]]] = {}
    for item in items:
        got.setdefault(int(item["episode"]), []).append(item)
    total = 0
    for p in range(len(ds.table)):
        _, world, index = key_of(ds.table, p)
        want = {n: v for n, v in expected(sim, (world, index)).items() if n.startswith("obs/")}
        length = len(want["obs/state"])
        starts = windows_by_hand(length, window, stride, pad)
        mine = got.get(p, [])
        assert [int(i["start"]) for i in mine] == starts, (p, length)
        total += len(starts)
        for item, start in zip(mine, starts, strict=True):
            real = min(window, length - start)
            assert item["mask"].tolist() == [True] * real + [False] * (window - real)
            assert set(item) == {"episode", "start", "mask", *want}
            for name, rows in want.items():
                value = item[name].numpy()
                assert value.shape == (window, *rows.shape[1:])
                assert value.dtype == rows.dtype
                assert value[:real].tobytes() == rows[start:start + real].tobytes()
                fill = rows[-1:] if pad == "edge" else np.zeros_like(rows[:1])
                assert value[real:].tobytes() == np.repeat(fill, window - real, axis=0).tobytes()
    assert len(ds) == total > 0
    if pad != "drop" and stride <= window:  # every row is in some window
        covered = sum(int(i["mask"].sum()) for i in items)
        assert covered >= int(ds.table["length"].sum())


@pytest.mark.parametrize(("window", "stride", "pad"), [(5, 2, "drop"), (4, 3, "edge"), (1, 1, "drop")])
def test_window_items_are_numbered_episode_after_episode(built: Built, window: int, stride: int, pad: str) -> None:
    """Item ``i`` is the ``i``-th of the rule's windows, episode after episode, episodes without
    a window skipped; negative indices count from the end. (The numbering is kept per episode:
    16 bytes a window, as before, was 16 GB for 10^9 windows.)"""
    ds = WindowDataset(built.path, "run-b", fields=["obs"], window=window, stride=stride, pad=pad)  # type: ignore[arg-type]
    want = [(p, s) for p in range(len(ds.table)) for s in windows_by_hand(int(ds.lengths[p]), window, stride, pad)]
    if pad == "drop" and window > 1:
        assert (ds.lengths < window).any()  # episodes without a window lie among the others
    assert len(ds) == len(want)
    episodes, starts = ds.locate(range(len(ds)))
    assert list(zip(episodes.tolist(), starts.tolist(), strict=True)) == want
    episodes, starts = ds.locate([-1, -len(ds)])
    assert list(zip(episodes.tolist(), starts.tolist(), strict=True)) == [want[-1], want[0]]
    with pytest.raises(IndexError, match=f"index {len(ds)} is out of range"):
        ds.locate([len(ds)])


def test_windows_batch_with_the_default_collate(built: Built) -> None:
    ds = WindowDataset(built.path, "run-a", fields=["obs/state", "obs/flag"], window=6, stride=3)
    batches = list(DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0)))
    assert sum(len(b["start"]) for b in batches) == len(ds)
    first = batches[0]
    assert first["obs/state"].shape == (8, 6, 3)
    assert first["mask"].shape == (8, 6)
    seen = sorted((int(e), int(s)) for b in batches for e, s in zip(b["episode"], b["start"], strict=True))
    episodes, starts = ds.locate(range(len(ds)))
    assert seen == sorted(zip(episodes.tolist(), starts.tolist(), strict=True))


@pytest.mark.parametrize("workers", [0, 2])
def test_stacked_windows_equal_the_default_collate_s_and_cross_as_one_piece(built: Built, workers: int) -> None:
    """``stack`` batches what the default collate batches, byte for byte, and a worker sends
    the batch as one piece of shared memory. Bug caught: a dict of stacked tensors sent from a
    worker one shared-memory handle per key (5 here)."""
    ds = WindowDataset(built.path, "run-a", fields=["obs/state", "obs/flag"], window=6, stride=3)
    order = list(BlockShuffleSampler(ds, block=4, seed=1))
    plain = list(DataLoader(ds, batch_size=8, sampler=order))
    packed = list(DataLoader(ds, batch_size=8, sampler=order, collate_fn=stack, num_workers=workers))
    assert len(plain) == len(packed)
    for want, got in zip(plain, packed, strict=True):
        assert isinstance(got, Packed)
        assert list(got) == list(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype
            assert torch.equal(got[key], value)
        if workers:
            assert len({t.untyped_storage().data_ptr() for t in got.values()}) == 1
    with pytest.raises(ValueError, match="'obs/state' differ in shape"):
        stack([{"obs/state": torch.zeros(2, 3)}, {"obs/state": torch.zeros(3, 3)}])
    with pytest.raises(ValueError, match="no items"):
        stack([])
    nested = Packed(a=torch.arange(3), b={"x": torch.ones(2, 2, dtype=torch.bool), "y": torch.zeros(0, 4)}, c={})
    again = pickle.loads(pickle.dumps(nested))
    assert list(again) == ["a", "b", "c"]
    assert torch.equal(again["a"], nested["a"])
    assert again["b"]["x"].dtype == torch.bool
    assert torch.equal(again["b"]["x"], nested["b"]["x"])
    assert again["b"]["y"].shape == (0, 4)
    assert again["c"] == {}


def test_windows_need_fields_of_terms_with_equal_rows(built: Built, tmp_path: Path) -> None:
    """Fields of terms whose row counts differ (``obs`` per step, ``final`` per episode) are
    refused naming both terms; two ``post_step`` terms window together."""
    with pytest.raises(ValueError, match=r"rows of term 'obs' and \d+ of term 'final'; pass fields of one term"):
        WindowDataset(built.path, "run-a", window=4)
    with pytest.raises(ValueError, match="window: expected an integer >= 1"):
        WindowDataset(built.path, "run-a", fields=["obs"], window=0)
    with pytest.raises(ValueError, match="stride: expected an integer >= 1"):
        WindowDataset(built.path, "run-a", fields=["obs"], window=2, stride=0)
    with pytest.raises(ValueError, match="pad: expected 'zeros', 'edge' or 'drop'"):
        WindowDataset(built.path, "run-a", fields=["obs"], window=2, pad="wrap")  # type: ignore[arg-type]
    from capture.recorder import Recorder
    from capture.terms import FunctionTerm

    store = tmp_path / "two.zarr"
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", daemon)
    rec = Recorder(2, broker=broker, run="two")
    rec.add_term("a", FunctionTerm(post_step=lambda: {"x": torch.full((2,), float(rec.step)) + torch.arange(2)}))
    rec.add_term("b", FunctionTerm(post_step=lambda: {"y": -torch.full((2,), float(rec.step)) - torch.arange(2)}))
    rec.start()
    for step in range(23):
        rec.record_post_step()
        if step % 7 == 6:
            rec.record_pre_reset(torch.tensor([0, 1]), success=torch.tensor([True, False]),
                                 truncated=torch.tensor([False, True]))
            rec.record_post_reset(torch.tensor([0, 1]))
    rec.close()
    daemon.close()
    ds = WindowDataset(store, "two", window=3, stride=3, pad="drop")
    assert len(ds) == 2 * 3 * 2  # 3 closed episodes of 7 steps per world, 2 windows each
    for item in ds.__getitems__(list(range(len(ds)))):
        np.testing.assert_array_equal(item["a/x"].numpy(), -item["b/y"].numpy())
        x = item["a/x"].numpy()
        np.testing.assert_array_equal(np.diff(x), [1.0, 1.0])  # consecutive steps of one world


@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_cover_every_episode_exactly_once(built: Built, shuffle: bool) -> None:
    """Over every (rank, worker) of world sizes 1-3 and 1-3 workers, per epoch. Bugs caught: a
    shard formula that skips or repeats blocks, ranks shuffling with different permutations."""
    ds = IterableEpisodeDataset(built.path, shuffle=shuffle, seed=3, block=5)
    n = len(ds.table)
    orders = []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        for world_size in (1, 2, 3):
            for workers in (1, 2, 3):
                parts = [ds.shard(r, world_size, w, workers) for r in range(world_size) for w in range(workers)]
                joined = np.concatenate(parts)
                assert sorted(joined.tolist()) == list(range(n)), (epoch, world_size, workers)
                assert max(len(p) for p in parts) - min(len(p) for p in parts) < 2 * ds.block
        orders.append(ds.shard().tolist())
    if shuffle:
        assert orders[0] != orders[1] != list(range(n))
        again = IterableEpisodeDataset(built.path, shuffle=True, seed=3, block=5)
        assert again.shard().tolist() == orders[0]  # the same seed and epoch: the same order
    else:
        assert orders[0] == orders[1] == list(range(n))
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size"):
        ds.shard(2, 2)
    with pytest.raises(ValueError, match="rank and world_size go together"):
        IterableEpisodeDataset(built.path, rank=0)


def test_dataloader_workers_and_ranks_read_every_episode_once(built: Built) -> None:
    """Two ranks (given explicitly) of two DataLoader worker processes each: together they
    yield every episode exactly once, each byte for byte as published. Bug caught: workers
    that ignore ``get_worker_info`` (every worker yields the whole shard) or that share the
    parent's zarr objects in a broken way after the fork."""
    seen: list[int] = []
    for rank in (0, 1):
        ds = IterableEpisodeDataset(built.path, shuffle=True, seed=1, block=4, rank=rank, world_size=2)
        for item in DataLoader(ds, batch_size=None, num_workers=2):
            seen.append(int(item["episode"]))
            check_episode(item, built.sims, ds.table)
    assert sorted(seen) == list(range(len(ds.table)))


def test_the_rank_defaults_from_torch_distributed(built: Built, tmp_path: Path) -> None:
    import torch.distributed as dist

    ds = IterableEpisodeDataset(built.path, "run-b", block=3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        assert [int(i["episode"]) for i in ds] == list(range(len(ds.table)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", ["fsspec", "memory"])
def test_map_style_batches_in_worker_processes(built: Built, kind: str) -> None:
    """``__getitems__`` in two DataLoader workers on an fsspec store (zarr's asynchronous
    path) and on a zarr MemoryStore (copied into each worker by the fork)."""
    if kind == "memory":
        location: Any = zarr.storage.MemoryStore()
        sims = write(location, ("m", 2, 40))
    else:
        location, sims = zarr.storage.FsspecStore.from_url(f"file://{built.path}", read_only=True), built.sims
    ds = EpisodeDataset(location)
    seen = []
    for batch in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list):
        for item in batch:
            seen.append(int(item["episode"]))
            check_episode(item, sims, ds.table)
    assert sorted(seen) == list(range(len(ds)))


def test_a_pickled_dataset_opens_the_store_again(built: Built) -> None:
    """What a spawned worker gets: no open store, which it opens on first use."""
    ds = EpisodeDataset(built.path, "run-a", fields=["obs"])
    copy = pickle.loads(pickle.dumps(ds))
    assert copy.source._reader is None
    for i in (0, len(copy) - 1):
        check_episode(copy[i], built.sims, copy.table, fields=["obs"])


def check_concatenated(batch: Concatenated, ds: EpisodeDataset, sims: dict[str, Sim], fields: Any = None) -> None:
    """``batch`` holds its episodes as published: each one cut out by its offsets."""
    assert isinstance(batch, Concatenated)
    assert batch["episode"].dtype == torch.int64
    for i in range(len(batch["episode"])):
        for key, offsets in batch["offsets"].items():
            assert offsets.dtype == torch.int64
            assert len(offsets) == len(batch["episode"]) + 1
            assert len(batch["data"][key]) == int(offsets[-1])
        check_episode(batch.episode(i), sims, ds.table, fields)


def test_concatenate_keeps_one_read_s_tensors_uncopied(built: Built) -> None:
    """The items of one ``__getitems__`` call are views of one tensor per key, in order:
    ``concatenate`` hands that tensor on uncopied; items of separate reads are copied. Bugs
    caught: offsets off by an episode, a batch that shares a tensor covering other rows, keys
    of different items silently dropped."""
    ds = EpisodeDataset(built.path, "run-a")
    picks = [3, 0, 7, 2]
    items = ds.__getitems__(picks)
    batch = concatenate(items)
    assert batch["episode"].tolist() == picks
    for key in batch["data"]:
        assert batch["data"][key].data_ptr() == items[0][key].data_ptr()  # no copy
    check_concatenated(batch, ds, built.sims)
    apart = concatenate([ds[p] for p in picks])  # separate reads: copied, the same bytes
    for key, value in batch["data"].items():
        assert apart["data"][key].data_ptr() != value.data_ptr()
        assert torch.equal(apart["data"][key], value)
        assert torch.equal(apart["offsets"][key], batch["offsets"][key])
    changed = ds.__getitems__(picks)
    changed[1]["obs/state"] = changed[1]["obs/state"] * 2  # what a transform between read and collate does
    doubled = concatenate(changed)
    a, b = int(doubled["offsets"]["obs/state"][1]), int(doubled["offsets"]["obs/state"][2])
    assert torch.equal(doubled["data"]["obs/state"][a:b], items[1]["obs/state"] * 2)
    assert torch.equal(doubled["data"]["obs/state"][:a], items[0]["obs/state"])
    part = concatenate(items[1:3])  # consecutive views of part of their tensor: a view of those rows
    assert torch.equal(part["data"]["obs/state"], torch.cat([items[1]["obs/state"], items[2]["obs/state"]]))
    assert part["data"]["obs/state"].data_ptr() == items[1]["obs/state"].data_ptr()
    gap = concatenate([items[0], items[2]])  # not consecutive: copied
    assert torch.equal(gap["data"]["obs/state"], torch.cat([items[0]["obs/state"], items[2]["obs/state"]]))
    again = pickle.loads(pickle.dumps(batch))  # one packed tensor, views rebuilt
    assert isinstance(again, Concatenated)
    for key, value in batch["data"].items():
        assert torch.equal(again["data"][key], value)
        assert again["data"][key].dtype == value.dtype
    assert torch.equal(again["episode"], batch["episode"])
    batch["note"] = "mine"  # changed by its user: pickled as it is
    assert pickle.loads(pickle.dumps(batch))["note"] == "mine"
    odd = dict(items[1])
    odd.pop("obs/state")
    with pytest.raises(ValueError, match=r"keys of item 1 and item 0 differ in \['obs/state'\]"):
        concatenate([items[0], odd])
    with pytest.raises(ValueError, match="no items"):
        concatenate([])


@pytest.mark.parametrize("workers", [0, 2])
def test_concatenated_batches_cross_from_worker_processes(built: Built, workers: int) -> None:
    """Batches from DataLoader workers (each sent as one packed tensor, rebuilt as views in the
    main process) hold every episode once, as published, every run included. Bug caught: a
    batch sent as a dict of tensors, one shared-memory handle per tensor (2 workers, 8,000
    episodes: 4,494 episodes/s and 0.72 s of the main process's CPU, against 8,010 and 0.20)."""
    ds = EpisodeDataset(built.path, fields=["obs", "final"])
    seen: list[int] = []
    for batch in DataLoader(ds, batch_size=5, num_workers=workers, collate_fn=concatenate, shuffle=True,
                            generator=torch.Generator().manual_seed(0)):
        seen += batch["episode"].tolist()
        check_concatenated(batch, ds, built.sims, ["obs", "final"])
        if workers:  # one piece of shared memory crossed, not one per tensor
            tensors = [batch["episode"], *batch["data"].values(), *batch["offsets"].values()]
            assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    assert sorted(seen) == list(range(len(ds)))


def test_block_shuffle_permutes_blocks_of_consecutive_indices() -> None:
    """Every index once per epoch, in blocks of consecutive indices; the same order for the
    same seed and epoch, another for another epoch; ``block=1`` a full permutation."""
    sampler = BlockShuffleSampler(1000, block=64, seed=3)
    order = list(sampler)
    assert sorted(order) == list(range(1000))
    assert len(sampler) == 1000
    a = 0
    while a < 1000:  # each block is drawn whole before the next (the last one is short)
        first = order[a] // 64 * 64
        block = list(range(first, min(1000, first + 64)))
        assert sorted(order[a:a + len(block)]) == block
        a += len(block)
    assert order != sorted(order)
    assert list(BlockShuffleSampler(1000, block=64, seed=3)) == order
    sampler.set_epoch(1)
    assert sorted(list(sampler)) == list(range(1000))
    assert list(sampler) != order
    assert sorted(BlockShuffleSampler(50, block=1)) == list(range(50))
    assert list(BlockShuffleSampler(0)) == []
    for bad in ({"block": 0}, {"seed": -1}, {"block": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            BlockShuffleSampler(10, **bad)


@pytest.mark.parametrize("drop_last", [False, True])
def test_block_shuffle_shares_whole_blocks_evenly_among_ranks(drop_last: bool) -> None:
    """Each rank takes whole blocks of the same permutation, and every rank yields as many
    indices (DistributedSampler's contract: ranks that disagree on the count hang at the last
    collective). Without ``drop_last`` every index is yielded and the repeats even the ranks
    out; with it nothing repeats and every rank stops at the shortest share."""
    n, block, world_size = 1000, 64, 3
    shares = [list(BlockShuffleSampler(n, block=block, seed=5, rank=r, world_size=world_size,
                                       drop_last=drop_last)) for r in range(world_size)]
    lengths = {len(s) for s in shares}
    assert len(lengths) == 1
    assert len(BlockShuffleSampler(n, block=block, seed=5, rank=1, world_size=world_size,
                                   drop_last=drop_last)) == lengths.pop()
    everything = [i for s in shares for i in s]
    if drop_last:
        assert len(set(everything)) == len(everything)
    else:
        assert set(everything) == set(range(n))
        assert len(everything) - n < world_size * block
    whole = list(BlockShuffleSampler(n, block=block, seed=5))
    blocks = []
    a = 0
    while a < n:  # the permuted blocks, in order, cut where each ends (the last one is short)
        size = min(block, n - whole[a] // block * block)
        blocks.append(whole[a:a + size])
        a += size
    for r, share in enumerate(shares):
        own = [i for b in blocks[r::world_size] for i in b]
        assert share[:min(len(own), len(share))] == own[:len(share)]
    # more ranks than blocks: a rank without a block repeats indices of the whole order
    assert list(BlockShuffleSampler(2, block=64, rank=2, world_size=3)) == list(BlockShuffleSampler(2, block=64))
    with pytest.raises(ValueError, match="rank and world_size go together"):
        BlockShuffleSampler(n, rank=0)
    with pytest.raises(ValueError, match="rank: expected 0 <= rank < world_size"):
        BlockShuffleSampler(n, rank=3, world_size=3)


CHUNK = re.compile(r"/c([./]\d+)+$")


class CountingStore(zarr.storage.LocalStore):
    """A local store that counts its chunk reads."""

    reads: ClassVar[Counter[str]] = Counter()

    def get_sync(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if CHUNK.search(key):
            CountingStore.reads[key] += 1
        return super().get_sync(key, *args, **kwargs)


def test_block_shuffled_windows_read_each_chunk_about_once(built: Built) -> None:
    """With data larger than the chunk cache, windows drawn block-wise decode each chunk
    about once an epoch, where a full shuffle decodes chunks again and again. Bug caught: a
    random order of windows decoding a chunk per field for most items (8,000 episodes, 64 MB
    of rows: 992 windows/s shuffled against 11,657-16,187 block-shuffled)."""
    def epoch(sampler: Any) -> tuple[int, int]:
        ds = WindowDataset(CountingStore(built.path, read_only=True), "run-a", fields=["obs"], window=4,
                           stride=4, cache_bytes=4096)  # 16 chunks of 256 bytes: far less than the data
        CountingStore.reads.clear()
        seen = []
        for batch in DataLoader(ds, batch_size=8, sampler=sampler(ds)):
            seen += list(zip(batch["episode"].tolist(), batch["start"].tolist(), strict=True))
        assert len(seen) == len(set(seen)) == len(ds)
        return sum(CountingStore.reads.values()), len(CountingStore.reads)

    fetched, chunks = epoch(lambda ds: BlockShuffleSampler(ds, block=16, seed=0))
    shuffled, _ = epoch(lambda ds: RandomSampler(ds, generator=torch.Generator().manual_seed(0)))
    assert fetched <= 2 * chunks, (fetched, chunks)  # 106 reads of 74 chunks here; shuffled: 422
    assert shuffled > 2 * fetched, (shuffled, fetched)


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64, torch.uint8, torch.bool,
           torch.int16, torch.float16]


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=3)))
    t = (torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * 100).to(dtype)
    if t.dim() >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # not contiguous
    if t.dim() >= 1 and t.shape[0] > 1 and draw(st.booleans()):
        t = t[::2]  # a strided view of a larger tensor
    return t


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8),
                       st.one_of(_tensors(), st.dictionaries(st.text(min_size=1, max_size=8), _tensors(), max_size=4)),
                       max_size=5))
def test_packed_pickles_any_dict_of_tensors_exactly(value: dict[str, Any]) -> None:
    """A Packed dict comes back from pickling with the same keys in the same order and every
    tensor's dtype, shape and values, whatever the dtypes, shapes (empty, 0-d), strides and
    nesting. Bugs caught: a misaligned view for a dtype, a non-contiguous tensor packed as its
    storage, an empty tensor or nested dict lost, keys reordered."""
    packed = Packed(value)
    again = pickle.loads(pickle.dumps(packed))
    assert type(again) is Packed
    assert list(again) == list(value)
    for key, want in value.items():
        got = again[key]
        pairs = [(want, got)] if isinstance(want, torch.Tensor) else [(want[k], got[k]) for k in want]
        if isinstance(want, dict):
            assert list(got) == list(want)
        for w, g in pairs:
            assert g.dtype == w.dtype
            assert g.shape == w.shape
            assert torch.equal(g, w)
