"""The deploy files work as written: the systemd unit passes ``systemd-analyze verify`` and its
command line is one the daemon accepts; the sysusers file creates the user the unit runs as;
the image's and compose's commands are ones worldtap-store, worldtap-proxy and
worldtap-sensitivity accept, on a named volume."""

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


def dockerfile_entry() -> tuple[list[str], list[str]]:
    """The image's ENTRYPOINT and CMD (JSON form)."""
    import json

    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    found = {line.split(None, 1)[0]: json.loads(line.split(None, 1)[1]) for line in lines
             if line.startswith(("ENTRYPOINT ", "CMD "))}
    return found["ENTRYPOINT"], found["CMD"]


def parse(program: str, argv: list[str]) -> object:
    """``argv`` parsed by ``program``'s own parser (argparse exits 2 on anything it refuses)."""
    from broker.proxy import build_parser as proxy_parser
    from consumers.sensitivity.cli import _parser as sensitivity_parser

    parsers = {"worldtap-store": build_main_parser, "worldtap-proxy": proxy_parser,
               "worldtap-sensitivity": sensitivity_parser}
    return parsers[program]().parse_args(argv)


def test_the_images_default_command_is_accepted() -> None:
    entrypoint, cmd = dockerfile_entry()
    assert entrypoint == ["worldtap-store"]
    assert build_main_parser().parse_args(["serve", *cmd]).store == "/data/runs.zarr"


def test_compose_wires_proxy_daemon_and_live_tool_on_a_named_volume() -> None:
    """Every service runs a command its program accepts; the daemon and the live tool connect
    to the proxy's backend; the store lives on a named volume, not a bind mount."""
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"proxy", "store", "sensitivity"}
    default_entrypoint, _ = dockerfile_entry()
    for name, service in services.items():
        program = service.get("entrypoint", default_entrypoint)[0]
        parse(program, list(service["command"]))
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            assert source in compose["volumes"], f"{name}: {volume!r} is not a named volume"
    proxy = parse("worldtap-proxy", services["proxy"]["command"])
    backend_port = proxy.backend[0].rsplit(":", 1)[1]  # type: ignore[attr-defined]
    store = parse("worldtap-store", services["store"]["command"])
    assert store.connect == [f"tcp://proxy:{backend_port}"]  # type: ignore[attr-defined]
    live = parse("worldtap-sensitivity", services["sensitivity"]["command"])
    assert live.connect == [f"tcp://proxy:{backend_port}"]  # type: ignore[attr-defined]
