"""Read benchmark: a run store read back for training, one episode at a time, in bulk, through a
DataLoader, and with plain zarr-python.

``python -m benchmarks.read [--json] [--episodes 2000] [--worlds 64] [--episode-length 100]``

The store is written in process by the daemon's own path (a Recorder publishing the seed
payload, each row stamped with its step and world, through a Broker to a StoreDaemon writing a
local directory), episodes of random lengths around ``--episode-length``. Then, side by side
in randomized paired trials, each on a freshly opened store (no chunk cached):

- ``episode_loop``: ``RunStore.episode()`` for ``--loop-episodes`` episodes picked at random
  (the reader one episode at a time);
- ``read_episodes``: ``RunStore.read_episodes()`` over every episode (per-episode dicts);
- ``read_batch``: ``RunStore.read_batch()`` of every episode (rows concatenated, offsets);
- ``dataloader``: ``torch.utils.data.DataLoader`` over ``storage.dataset.EpisodeDataset``
  (``--batch-size`` episodes per ``__getitems__``) over every episode, in process; and
  ``dataloader_<N>_workers`` the same with ``--workers`` worker processes (their start and
  the transfer of every batch to the main process included); ``dataloader_concatenate`` and
  ``dataloader_<N>_workers_concatenate`` the same batches through
  ``storage.dataset.concatenate`` (each key's rows concatenated, with offsets: a batch crosses
  from a worker as one piece of shared memory) instead of a list of items;
- ``windows_shuffle`` and ``windows_block_shuffle``: ``storage.dataset.WindowDataset``
  (``--window`` rows, the same stride: every row once) through a DataLoader in batches of 64,
  drawn in a random order (``shuffle=True``'s sampler) and block-wise
  (``storage.dataset.BlockShuffleSampler``), with a chunk cache (``--window-cache-bytes``)
  smaller than the rows read, as a long run's store is; ``windows_<N>_workers`` and
  ``windows_<N>_workers_stack`` block-shuffled with ``--workers`` worker processes, batched by
  the default collate and by ``storage.dataset.stack`` (sent as one piece of shared memory);
- ``zarr``: plain zarr-python reading every field array of the run whole (``arr[:rows]``):
  the same bytes with no episode logic, the floor.

Reported: episodes/s and GB/s (the fields' bytes of the episodes read) of each, each one's
speed per episode over the episode loop's, and its fraction of the zarr floor's GB/s; and
byte equality: every loop episode as the recorder published it and as ``read_episodes`` gives
it, and every DataLoader item.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._timing import base_parser, machine, paired_trials, print_json, stats, table, versions
from .pipeline import _pool, _stamped

RUN = "bench"
TERM = "seed"


def build_store(path: Path, args: Any, run: str = RUN) -> dict[str, Any]:
    """Record ``args.episodes`` episodes (at least) of run ``run`` into a store at ``path``
    through the daemon's path, in process; returns what was written."""
    from broker import Broker
    from capture.recorder import Recorder
    from capture.terms import FunctionTerm
    from storage import StoreDaemon

    pool = _pool(args.worlds)
    rng = np.random.default_rng(args.seed)
    lo, hi = max(1, args.episode_length // 2), max(2, 3 * args.episode_length // 2)
    broker = Broker()
    daemon = StoreDaemon(path, memory_budget=args.memory_budget, chunk_bytes=args.chunk_size,
                         compression=args.compression, commit_interval=0.5)
    broker.subscribe("", daemon)
    rec = Recorder(args.worlds, broker=broker, run=run)
    current: dict[str, torch.Tensor] = {}
    rec.add_term(TERM, FunctionTerm(post_step=lambda: current))
    remaining = rng.integers(lo, hi, args.worlds)
    ended = 0
    try:
        while ended < args.episodes:
            current.clear()
            current.update({k: torch.from_numpy(v) for k, v in _stamped(pool, rec.step).items()})
            rec.record_post_step()
            remaining -= 1
            done = np.flatnonzero(remaining == 0)
            if len(done):
                success = torch.from_numpy(rng.random(len(done)) < 0.5)
                rec.record_pre_reset(torch.from_numpy(done), success=success, truncated=~success)
                remaining[done] = rng.integers(lo, hi, len(done))
                ended += len(done)
        rec.close()
    finally:
        daemon.close()
    return {"steps": int(rec.step), "episodes": ended}


def store_arguments(parser: argparse.ArgumentParser, *, chunk_size: int = 1 << 20) -> None:
    """The options of :func:`build_store` (with ``--episodes``, ``--worlds`` and
    ``--episode-length``, which each benchmark gives its own defaults), and where the store goes."""
    parser.add_argument("--memory-budget", type=int, default=1 << 30,
                        help="the daemon's memory budget (small: episodes stored in fragments)")
    parser.add_argument("--compression", default="lz4", choices=("lz4", "zstd", "none"))
    parser.add_argument("--chunk-size", type=int, default=chunk_size)
    parser.add_argument("--dir", default=None, help="where the store goes (default: a temp dir)")
    parser.add_argument("--seed", type=int, default=0)


def in_scratch(args: Any, name: str, run: Callable[[Any, Path], dict[str, Any]]) -> dict[str, Any]:
    """``run(args, root)`` with ``root`` a fresh folder under ``--dir`` (the temp dir by
    default), removed afterwards whatever happens."""
    root = Path(tempfile.mkdtemp(prefix=f"worldtap-{name}-", dir=args.dir))
    try:
        return run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _nbytes(episode: dict[str, np.ndarray]) -> int:
    return sum(v.nbytes for v in episode.values())


def _keep(items: list[Any]) -> list[Any]:
    """The DataLoader's collate_fn: the batch's items as they are (episodes differ in length)."""
    return items


def run_case(args: Any, root: Path) -> dict[str, Any]:
    import zarr

    from storage import RunStore
    from storage.dataset import BlockShuffleSampler, EpisodeDataset, WindowDataset, concatenate, stack

    path = root / "read.zarr"
    written = build_store(path, args)
    reader = RunStore(path)
    eps = reader.episodes(RUN)
    n = len(eps)
    pick = np.sort(np.random.default_rng(args.seed).choice(n, size=min(args.loop_episodes, n), replace=False))
    keys = list(zip(eps["world"][pick].tolist(), eps["index"][pick].tolist(), strict=True))
    committed = reader.info(RUN)["committed"]["rows"][TERM]
    names = list(reader.info(RUN)["fields"][TERM])
    total_bytes = sum(_nbytes(e) for e in reader.read_episodes(RUN))
    loop_bytes = sum(_nbytes(reader.episode(RUN, w, i)) for w, i in keys)

    state: dict[str, Any] = {}

    def fresh() -> None:
        state["store"] = RunStore(path)

    def loop() -> None:
        for w, i in keys:
            state["store"].episode(RUN, w, i)

    def bulk() -> None:
        for _ in state["store"].read_episodes(RUN):
            pass

    def batch() -> None:
        state["store"].read_batch(RUN)

    def loader(workers: int, collate: Any = _keep) -> None:
        ds = EpisodeDataset(state["store"], RUN)
        kw: dict[str, Any] = {"batch_size": None} if args.batch_size == 0 else \
            {"batch_size": args.batch_size, "collate_fn": collate}
        for _ in torch.utils.data.DataLoader(ds, num_workers=workers, **kw):
            pass

    def fresh_windows() -> None:  # a fresh reader whose chunk cache holds less than the rows
        state["windows"] = WindowDataset(path, RUN, window=args.window, stride=args.window,
                                         cache_bytes=args.window_cache_bytes)

    def windows(block: bool, workers: int = 0, collate: Any = None) -> None:
        ds = state["windows"]
        sampler = BlockShuffleSampler(ds, seed=args.seed) if block else \
            torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(args.seed))
        kw: dict[str, Any] = {} if collate is None else {"collate_fn": collate}
        for _ in torch.utils.data.DataLoader(ds, batch_size=64, sampler=sampler, num_workers=workers, **kw):
            pass

    def fresh_zarr() -> None:
        group = zarr.open_group(path, mode="r")
        state["arrays"] = [group[f"runs/{RUN}/data/{TERM}/{name}"] for name in names]

    def floor() -> None:
        for arr in state["arrays"]:
            np.asarray(arr[:committed])

    cases = {"episode_loop": (fresh, loop), "read_episodes": (fresh, bulk), "read_batch": (fresh, batch),
             "dataloader": (fresh, lambda: loader(0)), "zarr": (fresh_zarr, floor)}
    if args.batch_size:
        cases["dataloader_concatenate"] = (fresh, lambda: loader(0, concatenate))
    if args.window:
        cases["windows_shuffle"] = (fresh_windows, lambda: windows(False))
        cases["windows_block_shuffle"] = (fresh_windows, lambda: windows(True))
    if args.workers:
        cases[f"dataloader_{args.workers}_workers"] = (fresh, lambda: loader(args.workers))
        if args.batch_size:
            cases[f"dataloader_{args.workers}_workers_concatenate"] = (
                fresh, lambda: loader(args.workers, concatenate))
        if args.window:
            cases[f"windows_{args.workers}_workers"] = (fresh_windows, lambda: windows(True, args.workers))
            cases[f"windows_{args.workers}_workers_stack"] = (fresh_windows,
                                                             lambda: windows(True, args.workers, stack))
    ms, orders = paired_trials(cases, trials=args.trials, repeats=1, device="cpu", seed=args.seed)

    # Byte equality: each loop episode as the recorder published it (its world's rows at the
    # steps episode_rows gives) and as read_episodes gives it; every DataLoader item.
    check = RunStore(path)
    bulk_eps = list(check.read_episodes(RUN))
    pool = _pool(args.worlds)
    equal = True
    for j, (w, i) in zip(pick.tolist(), keys, strict=True):
        want, got = check.episode(RUN, w, i), bulk_eps[j]
        steps = check.episode_rows(RUN, w, i)[TERM]["step"]
        sent = [_stamped(pool, int(step)) for step in steps]
        published = {f"{TERM}/{k}": np.stack([row[k][w] for row in sent]) for k in pool}
        equal &= bool(len(steps)) and want.keys() == got.keys() == published.keys() and all(
            want[k].dtype == got[k].dtype == published[k].dtype and
            want[k].shape == got[k].shape == published[k].shape and
            want[k].tobytes() == got[k].tobytes() == published[k].tobytes() for k in want)
    ds = EpisodeDataset(path, RUN)
    seen = 0
    for item in torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers):
        p = int(item["episode"])
        equal &= all(item[k].numpy().tobytes() == bulk_eps[p][k].tobytes() for k in bulk_eps[p])
        seen += 1
    equal &= seen == n
    seen = 0
    for got in torch.utils.data.DataLoader(ds, batch_size=max(args.batch_size, 1), num_workers=args.workers,
                                           collate_fn=concatenate):
        for j, p in enumerate(got["episode"].tolist()):
            item = got.episode(j)
            equal &= item.keys() - {"episode"} == bulk_eps[p].keys() and all(
                item[k].numpy().tobytes() == bulk_eps[p][k].tobytes() for k in bulk_eps[p])
            seen += 1
    equal &= seen == n

    per_case = {}
    for name, samples in ms.items():
        episodes = len(keys) if name == "episode_loop" else n
        nbytes = loop_bytes if name == "episode_loop" else total_bytes
        median_s = stats(samples)["median"] / 1000.0
        per_case[name] = {"ms": stats(samples), "episodes": episodes, "bytes": nbytes,
                          "episodes_per_s": episodes / median_s, "gb_per_s": nbytes / median_s / 1e9}
    base = per_case["episode_loop"]["episodes_per_s"]
    floor_gb = per_case["zarr"]["gb_per_s"]
    for result in per_case.values():
        result["speedup_vs_episode_loop"] = result["episodes_per_s"] / base
        result["fraction_of_zarr"] = result["gb_per_s"] / floor_gb
    return {"worlds": args.worlds, "episodes": n, "steps": written["steps"], "rows": int(committed),
            "bytes": total_bytes, "mean_episode_bytes": total_bytes / max(n, 1),
            "segments_per_episode": float(eps["segments"].mean()) if n else 0.0,
            "workers": args.workers, "batch_size": args.batch_size, "results": per_case,
            "byte_equal": bool(equal), "orders": orders}


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "read")
    parser.add_argument("--episodes", type=int, default=2000, help="episodes to record (at least)")
    parser.add_argument("--worlds", type=int, default=64)
    parser.add_argument("--episode-length", type=int, default=100, help="mean rows per episode")
    parser.add_argument("--loop-episodes", type=int, default=200,
                        help="episodes the episode() loop reads per trial")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    parser.add_argument("--batch-size", type=int, default=32,
                        help="episodes per DataLoader batch (0: one at a time, batch_size=None)")
    parser.add_argument("--window", type=int, default=32,
                        help="rows per window of the windows cases (stride the same: every row once; 0: none)")
    parser.add_argument("--window-cache-bytes", type=int, default=32 << 20,
                        help="the chunk cache of the windows cases: less than the rows read, as a long run's")
    store_arguments(parser)
    args = parser.parse_args(argv)
    case = in_scratch(args, "read", run_case)
    if args.json:
        print_json({"benchmark": "read", "machine": machine(), "versions": versions(), "cases": [case]})
    else:
        print(f"{case['episodes']} episodes, {case['rows']} rows, {case['bytes'] / 1e6:.1f} MB "
              f"({case['segments_per_episode']:.2f} segments per episode); byte-equal: {case['byte_equal']}")
        print(table(["case", "episodes", "median ms", "episodes/s", "GB/s", "x episode loop", "of zarr"],
                    [[name, r["episodes"], r["ms"]["median"], r["episodes_per_s"], r["gb_per_s"],
                      r["speedup_vs_episode_loop"], r["fraction_of_zarr"]]
                     for name, r in case["results"].items()]))
    return 0 if case["byte_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
