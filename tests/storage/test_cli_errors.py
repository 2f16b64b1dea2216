"""Operational errors of ``worldtap-store serve`` and ``worldtap-proxy``: each is one line on
stderr naming its cause (never a traceback) and a documented exit code, through real
processes and real sockets."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from procs import ENV, Proc

from broker import CurveServer, SubscriberTimeoutError, ZmqPublisher, load_keypair
from broker.security import write_keypair
from storage import RunStore


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=ENV,
                          timeout=60)


def _one_line(out: subprocess.CompletedProcess[str], code: int, *words: str) -> str:
    """The single stderr line of a command that failed with ``code``, naming ``words``."""
    lines = out.stderr.splitlines()
    assert out.returncode == code, out.stderr
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[str]:
    """A loopback tcp endpoint another socket listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _free() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_port_in_use(tmp_path: Path, busy_port: str) -> None:
    """Bug caught: a bind failure that is a traceback, exit code 1, or does not name the port."""
    store = tmp_path / "s.zarr"
    _one_line(_run("-m", "storage", str(store), "--bind", busy_port), 5, busy_port,
              "Address already in use")
    _one_line(_run("-m", "broker.proxy", "--frontend", busy_port, "--backend", _free()), 5,
              busy_port, "Address already in use")


def test_missing_ipc_folder(tmp_path: Path) -> None:
    """Bug caught: a usage block (or a traceback) instead of one line naming the folder."""
    missing = tmp_path / "nope"
    endpoint = f"ipc://{missing}/daemon.ipc"
    _one_line(_run("-m", "storage", str(tmp_path / "s.zarr"), "--bind", endpoint), 2, str(missing))
    _one_line(_run("-m", "broker.proxy", "--frontend", endpoint), 2, str(missing))


def test_store_that_is_a_file_or_under_one(tmp_path: Path) -> None:
    """Bugs caught: a store path that is a file, or lies under one, crashes with exit code 1
    (or a traceback) instead of exit code 3 naming the store; the file is left as it was."""
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a store")
    _one_line(_run("-m", "storage", str(afile), "--connect", _free()), 3, str(afile))
    under = afile / "s.zarr"
    _one_line(_run("-m", "storage", str(under), "--connect", _free()), 3, str(under))
    assert afile.read_bytes() == b"not a store"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder(tmp_path: Path) -> None:
    """Bug caught: an unwritable store crashes with a traceback or exit code 1."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        store = folder / "s.zarr"
        _one_line(_run("-m", "storage", str(store), "--connect", _free()), 3, str(store))
    finally:
        folder.chmod(0o755)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed")
def test_missing_filesystem_extra() -> None:
    """Bug caught: a gs:// store without gcsfs fails without saying what to install."""
    _one_line(_run("-m", "storage", "gs://bucket/runs.zarr", "--connect", _free()), 3,
              "gs://", "pip install 'worldtap[gcs]'")


@pytest.mark.skipif(importlib.util.find_spec("s3fs") is None, reason="s3fs is not installed")
def test_store_without_credentials(tmp_path: Path) -> None:
    """Bug caught: a store URL whose filesystem raises its own error type (no credentials)
    ends in exit code 1 with a Python repr instead of exit code 3 naming the store."""
    env = {k: v for k, v in ENV.items() if not k.startswith("AWS_")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"), AWS_CONFIG_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")  # no credentials anywhere, and no network asked
    out = subprocess.run([sys.executable, "-m", "storage", "s3://bucket/runs.zarr", "--connect", _free()],
                         capture_output=True, text=True, env=env, timeout=60)
    _one_line(out, 3, "store 's3://bucket/runs.zarr' cannot be opened or written", "credentials")


def test_curve_key_not_on_the_allow_list(tmp_path: Path, spawn: Callable[..., Proc]) -> None:
    """Both sides name a refused CURVE key. Bugs caught: a daemon that waits in silence (or
    exits 0) when the publisher refuses its key; a publisher whose wait_for_subscribers only
    says "0 joined"; handshake failures not counted."""
    server_pub, server_secret = write_keypair(tmp_path / "keys", "publisher")
    _, daemon_secret = write_keypair(tmp_path / "keys", "daemon")
    curve = CurveServer(load_keypair(server_secret), frozenset())  # nobody is allowed
    with ZmqPublisher("tcp://127.0.0.1:*", curve=curve) as pub:
        endpoint = pub.endpoints[0]
        proc = spawn("-m", "storage", str(tmp_path / "s.zarr"), "--connect", endpoint,
                     "--curve-keys", str(daemon_secret), "--curve-server", str(server_pub),
                     "--handshake-grace", "0")
        assert proc.wait(30) == 6, proc.stderr[-2000:]
        with pytest.raises(SubscriberTimeoutError, match=r"0 joined; \d+ CURVE handshake\(s\) failed "
                                                         r"\(a subscriber's key is not on the allow-list\)"):
            pub.wait_for_subscribers(1, timeout=0.5)
        assert pub.statistics().handshake_failures >= 1
    last = proc.err[-1]
    assert endpoint in last, proc.stderr[-2000:]
    assert "allow-list" in last, proc.stderr[-2000:]
    assert last.startswith("worldtap-store: ")
    assert "Traceback" not in proc.stderr
    assert RunStore(tmp_path / "s.zarr").runs() == []


def test_a_bound_daemon_logs_a_refused_publisher_and_serves_on(tmp_path: Path,
                                                                spawn: Callable[..., Proc]) -> None:
    """Bug caught: one misconfigured publisher connecting to a bound daemon (which serves many)
    stops it, or is refused in silence."""
    server_pub, server_secret = write_keypair(tmp_path / "keys", "publisher")
    _, daemon_secret = write_keypair(tmp_path / "keys", "daemon")
    endpoint = f"ipc://{tmp_path}/daemon.ipc"
    proc = spawn("-m", "storage", str(tmp_path / "s.zarr"), "--bind", endpoint, "--curve-keys",
                 str(daemon_secret), "--curve-server", str(server_pub), "--handshake-grace", "0")
    proc.wait_line("worldtap-store ready")
    curve = CurveServer(load_keypair(server_secret), frozenset())  # refuses the daemon's key
    with ZmqPublisher(endpoint, bind=False, curve=curve) as pub:
        line = proc.wait_line("the CURVE handshake with")
        assert "allow-list" in line
        with pytest.raises(SubscriberTimeoutError, match="not on the allow-list"):
            pub.wait_for_subscribers(1, timeout=0.5)
        assert proc.popen.poll() is None, proc.stderr[-2000:]  # grace 0, and still serving
    proc.popen.terminate()
    assert proc.wait(30) == 0, proc.stderr[-2000:]
