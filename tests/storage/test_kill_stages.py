"""The kill campaign: a daemon process killed (SIGKILL) at each stage of a run's life, and
before a few of its writes, then restarted on the same store with what a transport would
deliver to it then (``kill_campaign.py``; run as a script, it kills before every write).

After each: every stored episode is byte-equal to what was published, nothing partial is
visible (plain zarr sees exactly the committed rows, no ``.partial`` file), every published
episode that is not stored lies inside a recorded gap, and the restarted daemon serves (a new
run is stored whole).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kill_campaign import expected, kill_then_restart, run_writes
from kill_child import STAGES, STEPS

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("stage", STAGES)
def test_kill_at_each_stage_then_restart(tmp_path: Path, stage: str) -> None:
    stored = kill_then_restart(tmp_path / "runs.zarr", ["--stage", stage], stage)
    if stage in ("run-end-committed", "trim"):  # the run's end was committed: nothing of it is lost
        assert stored == len(expected(0, "run-a", STEPS)[0].outcome)


@pytest.fixture(scope="module")
def writes(tmp_path_factory: pytest.TempPathFactory) -> int:
    return run_writes(tmp_path_factory.mktemp("count") / "runs.zarr")


@pytest.mark.parametrize("where", [0.31, 0.62, 0.93])
def test_kill_before_a_write_then_restart(tmp_path: Path, writes: int, where: float) -> None:
    """Kills before the write at these fractions of the run's life (the campaign script kills
    before every write)."""
    n = max(1, round(where * writes))
    kill_then_restart(tmp_path / "runs.zarr", ["--kill-at-write", str(n)], f"write {n} ")
