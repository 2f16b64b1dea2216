"""The end-to-end demo through its console entry point: daemon process, ZeroMQ, Zarr."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from storage import RunStore


@pytest.mark.timeout(240)
def test_demo_stores_every_episode(tmp_path: Path) -> None:
    exe = shutil.which("worldtap-demo")
    assert exe, "worldtap-demo is not installed (bash deploy/install.sh demo)"
    store = tmp_path / "demo.zarr"
    proc = subprocess.run([exe, "--store", str(store), "--worlds", "16", "--steps", "250"],
                          capture_output=True, text=True, timeout=220, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "lossless: every ended episode is stored" in proc.stdout
    reader = RunStore(str(store))
    (run,) = reader.runs()
    episodes = reader.episodes(run)
    assert len(episodes) > 0
    x, y = reader.variation_table(run).to_numpy()
    assert x.shape == (len(episodes), 3)
    assert y.shape[0] == len(episodes)
