"""Injected store failures: a store that fails its Nth write, for N over a run's whole life.

After each failure the daemon keeps serving (the run that hit it stops at its last commit),
and a restarted daemon on the same directory finishes the run. Then: every stored episode is
byte-equal to what was published, nothing partial is visible (plain zarr sees exactly the
committed rows), and every published episode that is not stored lies inside a recorded gap of run sequence
numbers (source 1: what a resumed daemon never saw; 2: a run joined late; 3: lost).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faulty_store import FaultyStore, fail_at
from storage_sim import Sim
from store_checks import Spans, check_store

from broker import Broker, RunEnd
from storage import StoreDaemon

pytestmark = pytest.mark.timeout(300)

WORLDS, STEPS = 4, 30


def _steps(sim: Sim, n: int) -> Iterator[int]:
    for k in range(n):
        sim.step(1)
        yield k


def run_with_fault(tmp_path: Path, n: int, *, persistent: bool, seed: int) -> dict[str, Any]:
    """Publish one run into a daemon whose store fails write ``n``; restart on a healthy store
    as soon as the run failed (or at the end); then a second run through the restarted daemon."""
    path = tmp_path / f"fault-{n}-{int(persistent)}.zarr"
    broker = Broker()
    spans = Spans()
    broker.subscribe("", spans)
    ends: list[RunEnd] = []
    broker.subscribe("run/end", ends.append)
    confirmed: list[str] = []  # runs whose RunEnd a daemon confirmed (after its commit)
    store = FaultyStore(path, before=fail_at(n, persistent=persistent))
    first: StoreDaemon | None
    try:
        first = StoreDaemon(store, commit_interval=0.0, memory_budget=48 << 10,
                            on_run_end=confirmed.append)
    except OSError:  # the store's own creation failed: restarted before the run starts
        first = None
    sub = broker.subscribe("", first) if first is not None else None
    restarted: StoreDaemon | None = None
    if first is None:
        restarted = StoreDaemon(path, commit_interval=0.0, memory_budget=48 << 10,
                                    on_run_end=confirmed.append)
        broker.subscribe("", restarted)
    sim = Sim(broker, WORLDS, seed=seed, reset_p=0.15)
    failed_at_step = None
    for k in _steps(sim, STEPS):
        if first is not None and restarted is None and first.statistics().runs_failed:
            failed_at_step = k
            assert sub is not None
            sub.cancel()
            first.close()
            restarted = StoreDaemon(path, commit_interval=0.0, memory_budget=48 << 10,
                                    on_run_end=confirmed.append)
            broker.subscribe("", restarted)
    sim.close()
    stats_first = first.statistics() if first is not None else None
    if first is not None and restarted is None:
        first.close()  # a failure in the last commit or the trim shows up here at the latest
    if restarted is not None:
        restarted.close()
    # A restart after everything: it finishes whatever the failure left (trim) and serves.
    again = StoreDaemon(path, commit_interval=0.0, on_run_end=confirmed.append)
    if "run-a" not in confirmed:  # what the publisher does: send the unconfirmed RunEnd again
        again.handle(ends[0])
    assert confirmed.count("run-a") == 1
    broker2 = Broker()
    spans2 = Spans()
    broker2.subscribe("", spans2)
    broker2.subscribe("", again)
    sim2 = Sim(broker2, WORLDS, run="run-b", seed=seed + 1, reset_p=0.15)
    sim2.step(12)
    sim2.close()
    again.close()
    assert again.statistics().runs_failed == 0
    what = f"write {n} failing{' and every later one' if persistent else ''}"
    stored = check_store(path, sim, spans, "run-a", what)
    assert check_store(path, sim2, spans2, "run-b", what) == len(sim2.outcome)
    return {"writes": store.writes, "failed": bool(stats_first and stats_first.runs_failed),
            "stored": stored, "published": len(sim.outcome), "restart_step": failed_at_step}


def test_a_healthy_run_counts_its_writes(tmp_path: Path) -> None:
    """The sweep below covers the whole life of a run: this is how many writes it has."""
    result = run_with_fault(tmp_path, 10**9, persistent=False, seed=0)
    assert not result["failed"]
    assert result["stored"] == result["published"]
    assert result["writes"] > 100


@pytest.mark.parametrize("persistent", [False, True], ids=["once", "disk-full"])
def test_a_store_that_fails_its_nth_write(tmp_path: Path, persistent: bool) -> None:
    total = run_with_fault(tmp_path, 10**9, persistent=False, seed=0)["writes"]
    rng = np.random.default_rng(7 + persistent)
    # the run's creation, its first commits, the middle, and its end (commit, trim); the two
    # modes take different points, so together they cover more of the run's life
    edges = [1, 5, total - 2, total] if persistent else [3, 8, total - 1]
    points = sorted({*edges, *rng.integers(11, total - 3, size=3).tolist()})
    failed = 0
    for n in points:
        result = run_with_fault(tmp_path, int(n), persistent=persistent, seed=0)
        failed += result["failed"]
    assert failed >= len(points) // 2  # most failures hit the run (the rest: store creation)
