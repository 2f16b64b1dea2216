"""A storage daemon process for the kill campaign (run by tests/storage/test_kill_stages.py).

It runs a seeded simulation in process and hands the daemon every message whose run sequence
number is at least ``--from-seq`` (what a transport delivers to a daemon (re)started at that
point). With ``--stage``, it kills itself with SIGKILL (no cleanup, no flush) at that stage of
the run's life, printing ``stage <name>`` first:

- ``creation``: right after the run's group was created in the store;
- ``first-commit``: just before the run's first commit point is written (its data written);
- ``mid-run``: just before the run's 8th commit point is written;
- ``run-end-received``: on receiving the run's ``RunEnd``, before handling it;
- ``run-end-committed``: right after the commit point that marks the run complete;
- ``trim``: at the first write after that (cutting the arrays to their committed rows).

With ``--kill-at-write N`` it kills itself just before the store's Nth write instead (printing
``stage write N <key>``). With ``--end`` the run's ``RunEnd`` is delivered whatever
``--from-seq`` says (the publisher sends a ``RunEnd`` again until a daemon confirms it).

Without either it runs to the end, printing ``run-a writes <n>`` (on a new store, the writes of
run ``run-a``'s whole life), then stores a second run (``run-b``) to show it serves. Prints ``handled <seq>`` after
each message the daemon handled.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from faulty_store import FaultyStore
from storage_sim import Sim

from broker import Broker, Message, RunEnd
from storage import StoreDaemon

STAGES = ("creation", "first-commit", "mid-run", "run-end-received", "run-end-committed", "trim")
STEPS, WORLDS = 40, 4


def _die(stage: str) -> None:
    sys.stdout.write(f"\nstage {stage}\n")  # one write: the main thread may be printing too
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class Killer:
    """Store hooks that kill the process at one stage of run ``run-a``'s life."""

    def __init__(self, stage: str | None, at_write: int | None = None) -> None:
        self.stage = stage
        self.at_write = at_write
        self.commits = 0
        self.complete = False

    def before(self, n: int, key: str, value: bytes | None) -> None:
        if n == self.at_write:
            _die(f"write {n} {key}")
        if key == "runs/run-a/zarr.json" and value is not None:
            if self.commits == 1 and self.stage == "first-commit":
                _die("first-commit")
            if self.commits == 8 and self.stage == "mid-run":
                _die("mid-run")
        elif self.complete and key.startswith("runs/run-a/") and self.stage == "trim":
            _die("trim")

    def after(self, n: int, key: str, value: bytes | None) -> None:
        if key == "runs/run-a/zarr.json" and value is not None:
            self.commits += 1
            if self.commits == 1 and self.stage == "creation":
                _die("creation")
            if b'"complete"' in value and not self.complete:
                self.complete = True
                if self.stage == "run-end-committed":
                    _die("run-end-committed")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("store", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stage", choices=STAGES)
    p.add_argument("--from-seq", type=int, default=0)
    p.add_argument("--kill-at-write", type=int, default=None)
    p.add_argument("--end", action="store_true", help="deliver the RunEnd whatever --from-seq says")
    args = p.parse_args()
    killer = Killer(args.stage, args.kill_at_write)
    store = FaultyStore(args.store, before=killer.before, after=killer.after)
    daemon = StoreDaemon(store, commit_interval=0.0, memory_budget=24 << 10)  # fragments too

    def deliver(msg: Message) -> None:
        if msg.seq < args.from_seq and not (args.end and isinstance(msg, RunEnd)):
            return
        if isinstance(msg, RunEnd) and args.stage == "run-end-received":
            _die("run-end-received")
        daemon.handle(msg)
        sys.stdout.write(f"handled {msg.seq}\n")
        sys.stdout.flush()

    broker = Broker()
    broker.subscribe("", deliver)
    sim = Sim(broker, WORLDS, seed=args.seed, reset_p=0.12)
    sim.step(STEPS)
    sim.close()
    daemon.tick()
    stats: Any = daemon.statistics()
    if args.stage is None and args.kill_at_write is None:  # the restarted daemon serves a new run too
        print(f"run-a writes {store.writes}", flush=True)
        broker2 = Broker()
        broker2.subscribe("", daemon)
        sim2 = Sim(broker2, WORLDS, run="run-b", seed=args.seed + 1, reset_p=0.12)
        sim2.step(20)
        sim2.close()
    daemon.close()
    stats = daemon.statistics()
    print(f"done failed={stats.runs_failed} stored={stats.episodes_stored}", flush=True)
    return 0 if stats.runs_failed == 0 else 4


if __name__ == "__main__":
    sys.exit(main())
