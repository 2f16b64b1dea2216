"""The deploy files work as written: the systemd unit passes ``systemd-analyze verify`` and its
command line is one the daemon accepts; the sysusers file creates the user the unit runs as;
the image's and compose's commands are ones worldtap-store, worldtap-proxy and
worldtap-sensitivity accept, on a named volume; the Kubernetes manifests are standard objects
whose commands those programs accept and whose references resolve."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

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


# -- the storage-only install (no torch) ----------------------------------------------------

STORE_ONLY = """
import sys
import numpy as np
import broker.proxy
from broker import Batch, EpisodeEnd, RunEnd, RunStart
from storage import RunStore, StoreDaemon
from storage.cli import build_main_parser, main
build_main_parser()  # imports every subcommand's module
w, e = np.arange(2), np.zeros(2, np.int64)
value = np.arange(6, dtype=np.float32).reshape(2, 3)
with StoreDaemon(sys.argv[1]) as daemon:  # lz4 (blosc) chunks with crc32c checksums
    for m in (RunStart("r", 0, 0, 2, "cpu", wall_time=1.0), Batch("r", 1, 1, "batch/x", w, e, {"v": value}),
              EpisodeEnd("r", 2, 1, w, e, np.ones(2, bool), np.zeros(2, bool), np.zeros(2, bool), np.ones(2, np.int64)),
              RunEnd("r", 3, 1, 2, "cpu", wall_time=2.0)):
        daemon.handle(m)
assert RunStore(sys.argv[1]).episode("r", 1, 0)["x/v"].tobytes() == value[1:].tobytes()
assert main(["info", sys.argv[1]]) == 0
assert main(["verify", sys.argv[1]]) == 0
"""
"""Run by a Python that sees only the standard library, the repository and what
requirements-store.txt lists."""


def _store_requirements() -> set[str]:
    """The canonical names of the distributions deploy/requirements-store.txt lists."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    lines = (DEPLOY / "requirements-store.txt").read_text().splitlines()
    return {canonicalize_name(Requirement(line).name) for line in lines if line.strip() and not line.startswith("#")}


def test_the_store_only_requirements_are_all_the_daemon_needs(tmp_path: Path) -> None:
    """What deploy/requirements-store.txt lists is closed under dependencies (``pip install
    --no-deps`` installs nothing else) and is all that ``storage`` (daemon, info, verify) and
    ``broker.proxy`` import: a Python that sees only the standard library, the repository and
    those distributions' files stores a run, reads and verifies it (torch is not there)."""
    from importlib.metadata import distribution, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    listed = _store_requirements()
    assert "torch" not in listed
    for name in listed:
        for text in requires(name) or []:
            need = Requirement(text)
            if need.marker is None or need.marker.evaluate({"extra": ""}):
                assert canonicalize_name(need.name) in listed, f"{name} needs {need.name}"
    # A site-packages of exactly the listed distributions' files (what --no-deps installs)
    site = tmp_path / "site-packages"
    site.mkdir()
    for name in listed:
        dist = distribution(name)
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-S", "-c", STORE_ONLY, str(tmp_path / "runs.zarr")],
                          capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
                          env={"PATH": os.environ.get("PATH", ""), "PYTHONPATH": f"{site}:{root}"})
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_images_default_target_is_the_store_only_install() -> None:
    """The image that ``docker build`` makes by default installs worldtap with --no-deps and the
    store-only set (no torch); the target ``analysis`` (for worldtap-sensitivity) adds torch."""
    stages: dict[str, list[str]] = {}
    bases: list[tuple[str, str]] = []
    for line in (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ").splitlines():
        if line.startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) > 3 else f"#{len(bases)}"
            bases.append((name, words[1]))
            stages[name] = []
        elif bases and line.strip() and not line.startswith("#"):
            stages[bases[-1][0]].append(line)

    def chain(name: str) -> list[str]:
        """The lines that build stage ``name``, its base stages' first."""
        base = dict(bases)[name]
        return (chain(base) if base in stages else []) + stages[name]

    default = chain(bases[-1][0])
    runs = " ".join(line for line in default if line.startswith("RUN "))
    assert "pip install --no-cache-dir --no-deps . -r deploy/requirements-store.txt" in runs
    assert "torch" not in runs
    assert "install.sh" not in runs
    assert "COPY deploy/requirements-store.txt ./deploy/requirements-store.txt" in default
    analysis = " ".join(line for line in chain("analysis") if line.startswith("RUN "))
    assert "bash deploy/install.sh analysis" in analysis  # installs torch when it is missing


# -- Kubernetes ---------------------------------------------------------------------------

K8S = DEPLOY / "k8s"
STANDARD_KINDS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1", "Service": "v1",
                  "ConfigMap": "v1", "Secret": "v1", "PersistentVolumeClaim": "v1"}
POD_INDEX = "metadata.labels['apps.kubernetes.io/pod-index']"


def k8s_documents() -> dict[tuple[str, str], dict[str, Any]]:
    """Every manifest of ``deploy/k8s`` (the kustomization aside) by ``(kind, name)``."""
    docs: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), path
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in docs, key
            docs[key] = doc
    return docs


def _expand(arg: str, env: dict[str, str]) -> str:
    """``$(VAR)`` replaced as Kubernetes does in a container's command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], arg)


def _container_env(doc: dict[str, Any], container: dict[str, Any], docs: dict[tuple[str, str], Any],
                   ordinal: int) -> dict[str, str]:
    """The container's environment: its ConfigMaps' data, then its own variables (the
    StatefulSet pod-index label of pod ``ordinal``)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(docs[("ConfigMap", source["configMapRef"]["name"])]["data"])
        else:
            assert ("Secret", source["secretRef"]["name"]) in docs, source
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == POD_INDEX, var
            assert doc["kind"] == "StatefulSet", var
            env[var["name"]] = str(ordinal)
    return env


def test_k8s_manifests_are_standard_kinds_listed_by_the_kustomization() -> None:
    """Every YAML document parses, has a standard kind and apiVersion, and every file is a
    resource of the kustomization (``kubectl apply -k deploy/k8s``)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    docs = k8s_documents()
    assert {kind for kind, _ in docs} == set(STANDARD_KINDS)
    for (kind, name), doc in docs.items():
        assert doc["apiVersion"] == STANDARD_KINDS[kind], (kind, name)


def test_k8s_workloads_run_commands_their_programs_accept_on_what_exists() -> None:
    """For every pod the workloads make (each StatefulSet ordinal), each container's command
    and probe commands, with ``$(VAR)`` expanded from its environment, are accepted by that
    program's own parser; the daemon of ordinal K is partition K/N with N = replicas and
    connects to the proxy Service's backend port; probes ask the daemon's --status endpoint;
    volumes, claims, ConfigMaps and Secrets referenced exist; Services select the pods and
    name ports they have; the image is the one compose builds; containers run as non-root on
    a read-only root filesystem with resource requests."""
    from storage import Partition

    docs = k8s_documents()
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    proxy_service = docs[("Service", "worldtap-proxy")]
    backend = {p["name"]: p["port"] for p in proxy_service["spec"]["ports"]}["backend"]
    workloads = [doc for (kind, _), doc in docs.items() if kind in ("Deployment", "StatefulSet")]
    assert {doc["kind"] for doc in workloads} == {"Deployment", "StatefulSet"}
    for doc in workloads:
        spec, pod = doc["spec"], doc["spec"]["template"]["spec"]
        labels = doc["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert pod["securityContext"]["runAsNonRoot"] is True
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in docs
        ordinals = range(spec["replicas"]) if doc["kind"] == "StatefulSet" else [0]
        for container in pod["containers"]:
            program = container["command"][0]
            assert container["image"] == compose["store"]["image"] == compose["proxy"]["image"]
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, mount
            for ordinal in ordinals:
                env = _container_env(doc, container, docs, ordinal)
                argv = [_expand(a, env) for a in [*container["command"][1:], *container["args"]]]
                args: Any = parse(program, argv)
                probes = [container[p]["exec"]["command"] for p in
                          ("startupProbe", "readinessProbe", "livenessProbe") if "exec" in container.get(p, {})]
                for probe in probes:
                    assert probe[0] == program, probe
                    assert parse(program, probe[1:]).endpoint == args.status  # type: ignore[attr-defined]
                if program == "worldtap-store":
                    assert args.command == "serve"
                    assert args.partition == Partition(ordinal, spec["replicas"])
                    assert args.connect == [f"tcp://{proxy_service['metadata']['name']}:{backend}"]
                    assert probes, "the daemon has no probe"
                else:
                    assert program == "worldtap-proxy"
                    assert args.backend == [f"tcp://0.0.0.0:{backend}"]
    for (kind, name), service in docs.items():
        if kind != "Service":
            continue
        selected = [doc for doc in workloads
                    if service["spec"]["selector"].items() <= doc["spec"]["template"]["metadata"]["labels"].items()]
        assert len(selected) == 1, name
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in service["spec"].get("ports", []):
            assert port["targetPort"] in ports, (name, port)
    stateful = docs[("StatefulSet", "worldtap-store")]
    assert stateful["spec"]["serviceName"] in {name for kind, name in docs if kind == "Service"}
