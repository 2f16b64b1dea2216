"""``worldtap-store info``: the table and the ``--json`` document, checked against what a real
daemon stored; a damaged run is listed as damaged (exit 3), never a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from procs import ENV
from storage_sim import Sim

from broker import Broker
from storage import RunStore, StoreDaemon
from storage.cli import main

pytestmark = pytest.mark.timeout(120)


def _write(path: Path) -> dict[str, Sim]:
    daemon = StoreDaemon(path, commit_interval=0.0, chunk_bytes=512)
    sims = {}
    for i, run in enumerate(("run-a", "run-b")):
        broker = Broker()
        broker.subscribe("", daemon)
        sim = Sim(broker, 3, run=run, seed=i, reset_p=0.2)
        sim.step(25)
        sim.close()
        sims[run] = sim
    daemon.close()
    return sims


def _bytes(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def test_info_json_describes_every_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "runs.zarr"
    sims = _write(path)
    assert main(["info", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["store"] == str(path)
    assert doc["damaged"] == []
    assert [r["run"] for r in doc["runs"]] == ["run-a", "run-b"]
    reader = RunStore(path)
    for r in doc["runs"]:
        sim, info = sims[r["run"]], reader.info(r["run"])
        assert r["status"] == "complete"
        assert (r["num_worlds"], r["metadata"]) == (3, {})
        assert r["episodes"] == len(sim.outcome)
        assert r["succeeded"] == sum(sim.outcome.values())
        assert r["fields"] == {"obs/state": {"dtype": "float32", "shape": [3]},
                               "obs/flag": {"dtype": "bool", "shape": []},
                               "obs/nest/x": {"dtype": "int64", "shape": [2]},
                               "final/reward": {"dtype": "float32", "shape": []},
                               "init/q": {"dtype": "float32", "shape": [2]}}
        assert r["variations"] == {"friction": {"kind": None, "phase": "runtime"},
                                   "mass": {"kind": None, "phase": "build"}}
        assert r["bytes"] == _bytes(path / "runs" / r["run"])
        assert r["started_at"] == info["started_at"]
        assert r["ended_at"] == info["ended_at"]
        assert r["duration"] == pytest.approx(info["ended_at"] - info["started_at"])
        assert r["gaps"] == {"count": 0, "missing": 0}
        assert (r["repaired"], r["dirty"], r["resumed"]) == (None, False, 0)
    assert main(["info", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:6] == ["run", "status", "worlds", "episodes", "succeeded", "gaps"]
    assert lines[1].split()[:6] == ["run-a", "complete", "3", str(len(sims["run-a"].outcome)),
                                    str(sum(sims["run-a"].outcome.values())), "0"]


def test_info_lists_a_damaged_run_as_damaged(tmp_path: Path) -> None:
    path = tmp_path / "runs.zarr"
    _write(path)
    shutil.rmtree(path / "runs/run-b/episodes/world")  # its episode table cannot be read
    (path / "runs/run-a/zarr.json").write_text("{not json")  # its attributes cannot be read
    exe = shutil.which("worldtap-store")
    cmd = [exe] if exe else [sys.executable, "-m", "storage"]
    out = subprocess.run([*cmd, "info", "--json", str(path)], capture_output=True, text=True,
                         env=ENV, timeout=60, check=False)
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr
    doc = json.loads(out.stdout)
    assert doc["runs"] == []
    assert sorted(d["run"] for d in doc["damaged"]) == ["run-a", "run-b"]
    assert "episodes/world" in next(d["error"] for d in doc["damaged"] if d["run"] == "run-b")


def test_info_shows_each_runs_rejections_and_a_resumed_run_counts_on(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rejected messages are counted per run in the run's attributes at each commit (before,
    only the running daemon knew them): ``info`` shows them, the other run shows none, and a
    daemon that resumes the run after a restart counts on from what was stored."""
    from broker import Batch, Message

    path = tmp_path / "runs.zarr"
    seen: list[Message] = []
    broker = Broker()
    first = StoreDaemon(path, commit_interval=0.0)
    sub = broker.subscribe("", first)
    broker.subscribe("", seen.append)
    sim = Sim(broker, 3, run="run-a", seed=0, reset_p=0.2)
    sim.step(10)
    old = next(m for m in seen if isinstance(m, Batch))
    first(old)
    first(old)  # two replays
    sim.step(3)
    assert dict(first.statistics().rejected) == {"replay": 2}
    first.close()  # the run stays open: a later daemon resumes it
    sub.cancel()
    second = StoreDaemon(path, commit_interval=0.0)
    broker.subscribe("", second)
    second(old)  # one more, through the resumed run
    sim.step(3)
    sim.close()
    other = Broker()
    other.subscribe("", second)
    clean = Sim(other, 3, run="run-b", seed=1, reset_p=0.2)
    clean.step(5)
    clean.close()
    second.close()
    assert main(["info", "--json", str(path)]) == 0
    runs = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs["run-a"]["resumed"] == 1
    assert runs["run-a"]["rejected"] == {"replay": 3}
    assert runs["run-b"]["rejected"] == {}
    assert main(["info", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[6] == "rejected"
    assert lines[1].split()[6] == "3"
