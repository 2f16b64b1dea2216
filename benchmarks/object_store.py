"""Object-store benchmark: a reader's first reads, and ``verify``, from a store that answers every
request after a fixed latency, as an object store (S3, GCS) does.

``python -m benchmarks.object_store [--json] [--runs 6] [--episodes 30] [--latency-ms 20]``

The runs are written to a local directory by the daemon's own path (as ``benchmarks.read``
writes its store); they are then read through zarr's fsspec store (``file://``, the path every
object store takes: asynchronous requests, no local shortcuts) wrapped in a store that waits
``--latency-ms`` before answering each ``get`` and ``exists`` and counts them. Each case on a
fresh reader, the median of ``--trials``:

- ``open``: ``RunStore(store)`` (the runs' attributes);
- ``episodes``: ``episodes()`` of every run;
- ``first_episode``: ``episode()`` of one episode of the first run;
- ``read_batch``: ``read_batch()`` of every episode of the first run;
- ``read_episodes``: ``read_episodes()`` of every episode of every run, the episode tables
  read before the clock starts;
- ``query``: ``query("success")`` over every run (episode tables, variation samples, the join);
- ``verify``: ``storage.verify_store`` of the whole store (every chunk read).

Reported per case: milliseconds, requests, and round trips' worth of latency
(``ms / latency``: how many requests the case waited for one after the other); and byte
equality: every episode ``read_episodes`` gives through the slow store equals the local
reader's, and ``verify`` finds the store sound.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ._timing import base_parser, machine, print_json, table, versions
from .read import build_store, in_scratch, store_arguments


def _latency_store(root: Path, latency: float) -> Any:
    """A read-only fsspec view of ``root`` whose every get and exists waits ``latency`` s."""
    import zarr

    class Latency(zarr.storage.WrapperStore[Any]):
        requests: ClassVar[int] = 0

        async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
            Latency.requests += 1
            await asyncio.sleep(latency)
            return await self._store.get(key, *args, **kwargs)

        async def exists(self, key: str) -> bool:
            Latency.requests += 1
            await asyncio.sleep(latency)
            return bool(await self._store.exists(key))

        def _with_store(self, store: Any) -> Any:
            return Latency(store)

    return Latency(zarr.storage.FsspecStore.from_url(f"file://{root}", read_only=True))


def run_case(args: Any, root: Path) -> dict[str, Any]:
    from storage import RunStore, verify_store

    path = root / "runs.zarr"
    for i in range(args.runs):
        build_store(path, args, run=f"run-{i}")
    latency = args.latency_ms / 1000.0

    first = RunStore(path).episodes("run-0")
    key = int(first["world"][0]), int(first["index"][0])

    def reader(store: Any) -> Any:
        return RunStore(store)

    def with_tables(store: Any) -> Any:
        opened = RunStore(store)
        opened.episodes()
        return opened

    # each case: made ready off the clock (from the fresh store), then timed
    cases: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
        "open": (lambda store: store, RunStore),
        "episodes": (reader, lambda r: r.episodes()),
        "first_episode": (reader, lambda r: r.episode("run-0", *key)),
        "read_batch": (reader, lambda r: r.read_batch("run-0")),
        "read_episodes": (with_tables, lambda r: sum(1 for _ in r.read_episodes())),
        "query": (reader, lambda r: r.query("success")),
        "verify": (lambda store: store, verify_store),
    }
    results: dict[str, dict[str, Any]] = {}
    sound = True
    for name, (ready, case) in cases.items():
        samples, requests = [], []
        for _ in range(args.trials):
            store = _latency_store(path, latency)
            state = ready(store)
            type(store).requests = 0
            t0 = time.perf_counter()
            out = case(state)
            samples.append((time.perf_counter() - t0) * 1000.0)
            requests.append(type(store).requests)
            if name == "verify":
                sound &= out.sound
        results[name] = {"ms": float(np.median(samples)), "requests": int(np.median(requests))}
    for r in results.values():
        r["round_trips"] = r["ms"] / args.latency_ms if args.latency_ms else 0.0

    local, remote = RunStore(path), RunStore(_latency_store(path, latency))
    equal = sound
    count = 0
    for want, got in zip(local.read_episodes(), remote.read_episodes(), strict=True):
        equal &= want.keys() == got.keys() and all(
            want[k].dtype == got[k].dtype and want[k].shape == got[k].shape and
            want[k].tobytes() == got[k].tobytes() for k in want)
        count += 1
    return {"runs": args.runs, "episodes": count, "latency_ms": args.latency_ms, "results": results,
            "byte_equal": bool(equal and count > 0)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "object store")
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument("--episodes", type=int, default=30, help="episodes per run (at least)")
    parser.add_argument("--worlds", type=int, default=8)
    parser.add_argument("--episode-length", type=int, default=20, help="mean rows per episode")
    parser.add_argument("--latency-ms", type=float, default=20.0, help="added to every get and exists")
    parser.add_argument("--trials", type=int, default=3)
    store_arguments(parser, chunk_size=1 << 16)
    args = parser.parse_args(argv)
    case = in_scratch(args, "object-store", run_case)
    if args.json:
        print_json({"benchmark": "object_store", "machine": machine(), "versions": versions(), "cases": [case]})
    else:
        print(f"{case['runs']} runs, {case['episodes']} episodes, {case['latency_ms']} ms a request; "
              f"byte-equal: {case['byte_equal']}")
        print(table(["case", "ms", "requests", "round trips"],
                    [[name, r["ms"], r["requests"], r["round_trips"]] for name, r in case["results"].items()]))
    return 0 if case["byte_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
