"""The daemon receives over CURVE with the right keys and nothing without them."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from procs import Proc
from storage_sim import Sim

from broker import Broker, CurveServer, SubscriberTimeoutError, ZmqPublisher, load_keypair
from broker.security import load_public_key, write_keypair
from storage import RunStore


def _daemon(spawn: Callable[..., Proc], store: Path, endpoint: str, *extra: str) -> Proc:
    proc = spawn("-m", "storage", str(store), "--connect", endpoint, "--exit-after-runs", "1",
                 "--status-interval", "0.5", *extra)
    proc.wait_line("worldtap-store ready")  # signal handlers are installed: SIGTERM exits 0
    return proc


def test_daemon_stores_a_run_received_over_curve(tmp_path: Path, spawn: Callable[..., Proc]) -> None:
    server_pub, server_secret = write_keypair(tmp_path / "keys", "publisher")
    daemon_pub, daemon_secret = write_keypair(tmp_path / "keys", "daemon")
    curve = CurveServer(load_keypair(server_secret), frozenset({load_public_key(daemon_pub)}))
    store = tmp_path / "secure.zarr"
    with ZmqPublisher("tcp://127.0.0.1:*", curve=curve, send_timeout=20) as pub:
        proc = _daemon(spawn, store, pub.endpoints[0], "--curve-keys", str(daemon_secret),
                       "--curve-server", str(server_pub))
        pub.wait_for_subscribers(1, timeout=30)
        broker = Broker(strict=True)
        broker.subscribe("", pub)
        sim = Sim(broker, 4, seed=3, reset_p=0.2)
        sim.step(30)
        sim.close()
        pub.close(timeout=20)
        assert proc.wait(60) == 0, proc.stderr[-2000:]
    episodes = RunStore(store).episodes("run-a")
    assert len(episodes) == len(sim.outcome) > 0


def test_a_daemon_without_the_keys_joins_nothing(tmp_path: Path, spawn: Callable[..., Proc]) -> None:
    _, server_secret = write_keypair(tmp_path / "keys", "publisher")
    curve = CurveServer(load_keypair(server_secret), frozenset())  # nobody is allowed
    with ZmqPublisher("tcp://127.0.0.1:*", curve=curve) as pub:
        proc = _daemon(spawn, tmp_path / "plain.zarr", pub.endpoints[0])
        with pytest.raises(SubscriberTimeoutError):
            pub.wait_for_subscribers(1, timeout=2)
        proc.popen.terminate()
        assert proc.wait(30) == 0, proc.stderr[-2000:]
    assert "episodes=0" in proc.stderr


def test_curve_flags_go_together(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "storage", str(tmp_path / "s.zarr"), "--curve-keys", "x"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "--curve-keys and --curve-server go together" in out.stderr
    out = subprocess.run([sys.executable, "-m", "storage", str(tmp_path / "s.zarr"), "--curve-keys",
                          str(tmp_path / "missing.key_secret"), "--curve-server", str(tmp_path / "p.key")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "missing.key_secret" in out.stderr
