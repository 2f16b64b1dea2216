"""Every benchmark runs at tiny sizes and prints a JSON document, so none of them rots."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks

ROOT = Path(__file__).resolve().parents[1]

TINY: dict[str, list[str]] = {
    "retention": ["--worlds", "8", "16", "--trials", "2", "--appends", "3"],
    "transport": ["--worlds", "8", "--seconds", "0.5", "--rounds", "2"],
    "pipeline": ["--worlds", "8", "--seconds", "1", "--trials", "1", "--scalar-fields", "6"],
    "capture": ["--worlds", "8", "--steps", "5", "--trials", "2"],
    "staging": ["--worlds", "8", "--camera", "4", "--repeats", "2", "--rounds", "1"],
    "read": ["--worlds", "4", "--episodes", "16", "--episode-length", "6", "--trials", "1",
             "--loop-episodes", "3", "--workers", "0"],
    "object_store": ["--runs", "2", "--episodes", "4", "--worlds", "2", "--episode-length", "4",
                     "--latency-ms", "1", "--trials", "1"],
}

MODULES = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.name.startswith("_"))


def test_every_benchmark_has_a_tiny_configuration() -> None:
    assert MODULES, "no benchmarks found"
    assert set(MODULES) <= set(TINY), f"add tiny arguments for {sorted(set(MODULES) - set(TINY))}"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", MODULES)
def test_benchmark_smoke(name: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--json", *TINY[name]],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=170,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    doc = json.loads(proc.stdout)
    assert doc["machine"]["python"]
    assert doc["cases"], doc
    if name == "retention":
        for case in doc["cases"]:
            assert case["byte_equal"] is True
            assert set(case["append_ms"]) == {"baseline", "batched", "floor"}
            assert len(case["append_ms"]["batched"]["samples"]) == 2
            assert case["speedup_vs_baseline"] > 0
    if name == "staging":
        assert [c["payload"] for c in doc["cases"]] == ["seed", "camera4"]
        for case in doc["cases"]:
            assert case["byte_equal"] is True
            assert case["staging_gbps"] > 0
            assert case["staging_vs_copy"] > 0
    if name == "transport":
        for case in doc["cases"]:
            assert case["lossless"] is True
            assert len(case["raw_copy"]) == len(case["copy_floor_ratios"]) == 2  # one per round
            assert all(r["messages"] > 1 for r in case["raw_copy"])
            assert case["raw_copy_gb_s"] > 0
            assert case["copy_floor_ratio"] > 0
            assert case["copy_floor_of_raw"] > 0
            threads = case["cpu_us_per_message_by_thread"]
            assert set(threads) == {"raw", "raw_copy", "worldtap"}
            if sys.platform == "linux":  # per-thread times come from /proc: the busy threads show
                assert threads["worldtap"]["publisher"]["main"] > 0
                assert threads["worldtap"]["receiver"]["main"] > 0
        assert doc["malloc"] == "keep"  # the receiver's allocator setting, as worldtap-store's default
        assert set(doc["copy_floor_ratios"]) == set(doc["cpu_bounds_of_raw"]) == set(doc["ratios"])
        assert all(case["cpu_bound_of_raw"] > 0 for case in doc["cases"])
    if name == "pipeline":
        case = doc["cases"][0]
        assert case["byte_equal"] is True
        assert case["fields"] == 7 + 6 + 1  # the seed payload's and --scalar-fields' (grouped in the daemon)
        per_gb = case["cpu_seconds_per_gb"]
        assert {"publisher", "daemon", "e2e", "writer", "zarr"} <= set(per_gb)
        assert per_gb["e2e"] == pytest.approx(per_gb["publisher"] + per_gb["daemon"])
        assert per_gb["writer"] > 0
        assert per_gb["publisher"] > 0
        if sys.platform == "linux":  # the daemon's CPU comes from /proc
            assert per_gb["daemon"] > 0
            assert case["daemon_page_faults_per_step"] > 0  # its start-up alone faults pages in
            assert 0 < case["cpu_bound_of_writer_ceiling"] == pytest.approx(per_gb["writer"] / per_gb["e2e"])
            assert case["e2e_cores_busy"] > 0
        assert case["malloc"] == "keep"
    if name == "read":
        case = doc["cases"][0]
        assert case["byte_equal"] is True
        assert set(case["results"]) == {"episode_loop", "read_episodes", "read_batch", "dataloader", "zarr",
                                        "dataloader_concatenate", "windows_shuffle", "windows_block_shuffle"}
        assert case["results"]["read_batch"]["episodes"] == case["episodes"] >= 16
        assert all(r["gb_per_s"] > 0 and r["speedup_vs_episode_loop"] > 0 for r in case["results"].values())


def test_readme_benchmark_table_has_a_row_for_every_benchmark() -> None:
    """The README's benchmark table is one table (a blank line between two rows ends it, and
    the rows after it render as a stray paragraph) with a row for every benchmark module."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Benchmarks\n", 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| benchmark |"))
    rows: list[str] = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    named = {row.split("`")[1].split()[0] for row in rows[2:]}  # after the header and its rule
    assert set(MODULES) <= named, f"benchmarks without a row in the README's table: {sorted(set(MODULES) - named)}"
    stray = [line for line in lines[first + len(rows):] if line.startswith("| `")]
    assert not stray, f"table rows cut off from the README's benchmark table: {[s[:40] for s in stray]}"
