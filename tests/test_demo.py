"""The end-to-end demo through its console entry point: a daemon process, ZeroMQ, Zarr, the
randomized gymnasium CartPole worlds and the sensitivity analysis."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from storage import RunStore
from storage.demo import PLACEBO

PHYSICAL = ("length", "masspole", "masscart", "force_mag")


def _demo(*args: str) -> list[str]:
    exe = shutil.which("worldtap-demo")
    assert exe, "worldtap-demo is not installed (bash deploy/install.sh demo)"
    return [exe, *args]


@pytest.mark.timeout(300)
def test_demo_stores_every_episode_with_the_parameters_the_worlds_used(tmp_path: Path) -> None:
    """Catches: episodes lost between the simulation and the store (the count the demo saw end
    differs from the store's); a variation sample recorded for an episode other than the one it
    shaped, or drawn after the episode's first step (the parameters the environment stepped
    with, recorded every step, differ from the episode's sample); an analysis that cannot tell
    a factor that drives success (the pole's length) from one that cannot (the paint)."""
    out = tmp_path / "runs"
    proc = subprocess.run(_demo("--out", str(out), "--worlds", "32", "--episodes", "700",
                                "--max-steps", "80", "--seed", "3", "--resamples", "30", "--quiet"),
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ended = int(re.search(r"(\d+) episodes ended", proc.stdout).group(1))  # type: ignore[union-attr]
    assert ended >= 700

    reader = RunStore(str(out / "demo.zarr"))
    (run,) = reader.runs()
    info = reader.info(run)
    assert info["status"] == "complete"
    assert info["started_at"] <= info["ended_at"]
    assert set(info["variations"]) == {*PHYSICAL, PLACEBO}
    episodes = reader.episodes(run)
    assert len(episodes) == ended  # every episode that ended is stored, none other

    table = reader.variation_table(run).arrays()
    columns = list(table.x_columns)
    rows = {(int(w), int(e)): i for i, (w, e) in enumerate(zip(table.world, table.episode, strict=True))}
    rng = np.random.default_rng(0)
    for i in rng.choice(len(episodes), size=min(60, len(episodes)), replace=False):
        world, index = int(episodes["world"][i]), int(episodes["index"][i])
        stored = reader.episode(run, world, index)
        row = rows[(world, index)]
        for name in PHYSICAL:
            used = stored[f"step/physics/{name}"]
            sample = np.float64(np.float32(table.x[row, columns.index(name)]))
            assert used.size > 0
            assert np.all(used == sample), (name, world, index, used[:3], sample)

    folder = out / "sensitivity" / run
    result = json.loads((folder / "indices.json").read_text())
    assert (folder / "indices.csv").exists()
    assert (folder / "sensitivity.png").exists()
    influential = {(r["factor"], r["method"]) for r in result["indices"]
                   if r["output"] == "success" and r.get("influential") and r.get("control", "none") == "none"}
    assert any(f == "length" for f, _ in influential), result["indices"][:8]
    assert not any(f.startswith(PLACEBO) for f, _ in influential)


@pytest.mark.timeout(120)
def test_ctrl_c_commits_the_complete_episodes_and_marks_the_run_interrupted(tmp_path: Path) -> None:
    """Catches: Ctrl-C hanging on the publisher's flush, printing tracebacks, leaving the run
    ``open`` or losing complete episodes (the store's count differs from what ended)."""
    out = tmp_path / "runs"
    proc = subprocess.Popen(_demo("--out", str(out), "--worlds", "16", "--episodes", "100000",
                                  "--seed", "1", "--quiet"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True)
    try:
        log = out / "daemon.log"
        # Readiness: the daemon logged a status line with episodes stored.
        deadline = 60.0
        import time

        start = time.monotonic()
        while time.monotonic() - start < deadline:
            if log.exists() and re.search(r"episodes=[1-9]", log.read_text()):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        else:
            pytest.fail("the demo's daemon never stored an episode")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole group
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stdout + stderr
    assert "Traceback" not in stdout + stderr
    reader = RunStore(str(out / "demo.zarr"))
    (run,) = reader.runs()
    assert reader.info(run)["status"] == "interrupted"
    ended = int(re.search(r"(\d+) episodes ended", stdout).group(1))  # type: ignore[union-attr]
    assert len(reader.episodes(run)) == ended


def test_bad_sizes_are_one_clear_line(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "storage.demo", "--out", str(tmp_path), "--worlds", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "worldtap-demo: --worlds must be at least 1"
