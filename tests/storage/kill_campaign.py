"""The parent side of the kill campaign (``kill_child.py`` is the daemon process it kills):
kill a daemon at one point of a run's life, restart it on the same store with what a transport
would deliver to it then, and check the store's promise. Used by ``test_kill_stages.py``.

Run as a script it is the whole campaign, outside the suite: a kill before every ``--stride``-th
write of the run's life (about 800 writes)::

    python tests/storage/kill_campaign.py --stride 1

It prints one line per kill and exits 1 if any kill broke the promise.
"""

from __future__ import annotations

import argparse
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kill_child import STEPS, WORLDS
from procs import ENV
from storage_sim import Sim
from store_checks import Spans, check_store

from broker import Broker

CHILD = Path(__file__).with_name("kill_child.py")
LOST = 3
"""Messages published while the daemon is down (lost to it)."""


def child(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHILD), str(store), *args], env=ENV, text=True,
                          capture_output=True, timeout=100, check=False)


def expected(seed: int, run: str, steps: int) -> tuple[Sim, Spans]:
    broker = Broker()
    spans = Spans()
    broker.subscribe("", spans)
    sim = Sim(broker, WORLDS, run=run, seed=seed, reset_p=0.12)
    sim.step(steps)
    sim.close()
    return sim, spans


def run_writes(store: Path) -> int:
    """The writes of run ``run-a``'s whole life, counted by a daemon that is not killed."""
    done = child(store)
    assert done.returncode == 0, done.stderr[-3000:]
    found = re.search(r"^run-a writes (\d+)$", done.stdout, re.MULTILINE)
    assert found, done.stdout[-3000:]
    return int(found[1])


def kill_then_restart(store: Path, kill: list[str], stage: str) -> int:
    """Kill the daemon with the arguments ``kill`` (``--stage S`` or ``--kill-at-write N``),
    restart it and check run ``run-a`` and a new run ``run-b``; returns the episodes of
    ``run-a`` stored. ``stage`` is what the killed child prints after ``stage``."""
    first = child(store, *kill)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert f"stage {stage}" in first.stdout, first.stdout[-3000:]  # killed where it was meant to be
    handled = [int(line.split()[1]) for line in first.stdout.splitlines() if line.startswith("handled")]
    last = handled[-1] if handled else -1
    # What the transport delivers to the restarted daemon: messages published while it was
    # down are lost, except the RunEnd, which the publisher sends again until a daemon confirms
    # it (and a confirmed RunEnd sent again changes nothing).
    second = child(store, "--from-seq", str(last + 1 + LOST), "--end")
    assert second.returncode == 0, second.stderr[-3000:]
    sim, spans = expected(0, "run-a", STEPS)
    stored = check_store(store, sim, spans, "run-a", f"killed at {stage}")
    sim_b, spans_b = expected(1, "run-b", 20)
    assert check_store(store, sim_b, spans_b, "run-b", f"after {stage}") == len(sim_b.outcome)
    return stored


def main() -> int:
    p = argparse.ArgumentParser(description="kill a daemon before every STRIDE-th write of a run's life")
    p.add_argument("--stride", type=int, default=1)
    p.add_argument("--first", type=int, default=1)
    args = p.parse_args()
    bad = 0
    with tempfile.TemporaryDirectory(prefix="worldtap-kills-") as tmp:
        total = run_writes(Path(tmp) / "count.zarr")
        print(f"run-a's life: {total} writes", flush=True)
        for n in range(args.first, total + 1, args.stride):
            store = Path(tmp) / f"kill{n}.zarr"
            t0 = time.monotonic()
            try:
                stored = kill_then_restart(store, ["--kill-at-write", str(n)], f"write {n} ")
            except AssertionError as exc:
                bad += 1
                print(f"write {n}: BROKEN: {str(exc)[:2000]}", flush=True)
            else:
                print(f"write {n}: ok, {stored} episodes stored ({time.monotonic() - t0:.1f} s)", flush=True)
            shutil.rmtree(store, ignore_errors=True)
    print(f"{bad} broken" if bad else "every kill kept the promise", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
