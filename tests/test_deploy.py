"""The deploy files work as written: the systemd unit passes ``systemd-analyze verify`` and its
command line is one the daemon accepts; the sysusers file creates the user the unit runs as;
compose's commands are ones the daemon and the proxy accept."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from storage.cli import build_main_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
PREFIX = "/opt/worldtap/venv/bin/"


def unit_lines() -> dict[str, str]:
    lines = (DEPLOY / "worldtap-store.service").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """Installed at the documented prefix (here: this environment's own scripts), the unit is
    one systemd accepts (the old unit named an executable the install never made)."""
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "worldtap-store").exists()
    unit = tmp_path / "worldtap-store.service"
    unit.write_text((DEPLOY / "worldtap-store.service").read_text().replace(PREFIX, f"{bin_dir}/"))
    done = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert not done.stderr.strip()


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="needs systemd-sysusers")
def test_the_sysusers_file_creates_the_units_user() -> None:
    unit = unit_lines()
    entries = [line.split() for line in (DEPLOY / "worldtap.sysusers").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert [e[:2] for e in entries] == [["u", unit["User"]]]
    assert unit["Group"] == unit["User"]  # sysusers' "u" makes a group of the same name
    done = subprocess.run(["systemd-sysusers", "--dry-run", str(DEPLOY / "worldtap.sysusers")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def test_the_units_command_is_one_the_daemon_accepts() -> None:
    argv = shlex.split(unit_lines()["ExecStart"])
    assert argv[0] == PREFIX + "worldtap-store"
    args = build_main_parser().parse_args(argv[1:])
    assert (args.command, args.store, args.bind, args.fsync) == (
        "serve", "/var/lib/worldtap/runs.zarr", ["tcp://127.0.0.1:5555"], True)


def test_compose_parses_and_its_daemon_command_is_accepted() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    store = compose["services"]["store"]
    args = build_main_parser().parse_args(["serve", *store["command"]])
    assert args.command == "serve"
