"""The kill campaign: a daemon process killed (SIGKILL) at each stage of a run's life, then
restarted on the same store with what a transport would deliver to it then.

After each: every stored episode is byte-equal to what was published, nothing partial is
visible (plain zarr sees exactly the committed rows, no ``.partial`` file), every published
episode that is not stored lies inside a recorded gap, and the restarted daemon serves (a new
run is stored whole).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kill_child import STAGES, STEPS, WORLDS
from procs import ENV
from storage_sim import Sim
from store_checks import Spans, check_store

from broker import Broker

pytestmark = pytest.mark.timeout(120)

CHILD = Path(__file__).with_name("kill_child.py")
LOST = 3
"""Messages published while the daemon is down (lost to it)."""


def _child(store: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHILD), str(store), *args], env=ENV, text=True,
                          capture_output=True, timeout=100, check=False)


def _expected(seed: int, run: str, steps: int) -> tuple[Sim, Spans]:
    broker = Broker()
    spans = Spans()
    broker.subscribe("", spans)
    sim = Sim(broker, WORLDS, run=run, seed=seed, reset_p=0.12)
    sim.step(steps)
    sim.close()
    return sim, spans


@pytest.mark.parametrize("stage", STAGES)
def test_kill_at_each_stage_then_restart(tmp_path: Path, stage: str) -> None:
    store = tmp_path / "runs.zarr"
    first = _child(store, "--stage", stage)
    assert first.returncode == -signal.SIGKILL, first.stderr[-3000:]
    assert f"stage {stage}" in first.stdout  # killed where the test meant to
    handled = [int(line.split()[1]) for line in first.stdout.splitlines() if line.startswith("handled")]
    last = handled[-1] if handled else -1
    # What the transport delivers to the restarted daemon: messages published while it was
    # down are lost, except a RunEnd it had not confirmed, which the publisher sends again.
    resend_end = stage in ("run-end-received", "run-end-committed", "trim")
    start = last + 1 if resend_end else last + 1 + LOST
    second = _child(store, "--from-seq", str(start))
    assert second.returncode == 0, second.stderr[-3000:]
    sim, spans = _expected(0, "run-a", STEPS)
    stored = check_store(store, sim, spans, "run-a", f"killed at {stage}")
    if stage in ("run-end-committed", "trim"):
        assert stored == len(sim.outcome)  # the run's end was committed: nothing of it is lost
    sim_b, spans_b = _expected(1, "run-b", 20)
    assert check_store(store, sim_b, spans_b, "run-b", f"after {stage}") == len(sim_b.outcome)
