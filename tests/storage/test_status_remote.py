"""The daemon's status socket (``serve --status``), ``storage.daemon_status`` and the
``worldtap-store status`` command, through a real daemon process and real sockets."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import ENV, Proc
from storage_sim import Sim, assert_episode_equal

from broker import Batch, Broker, Message, WireFormatError, ZmqPublisher
from storage import RunStore, daemon_status
from storage.status import StatusTimeoutError

_LIMIT = 1 << 20  # the publisher's max_message_size: a larger message is dropped (a gap)


def _free_tcp() -> str:
    """A loopback endpoint nobody listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _wait_status(endpoint: str, done: Callable[[dict[str, Any]], bool], proc: Proc,
                 timeout: float = 30.0) -> dict[str, Any]:
    """Ask until ``done(status)`` (the daemon reports it: the readiness signal)."""
    deadline = time.monotonic() + timeout
    doc: dict[str, Any] = {}
    while time.monotonic() < deadline:
        assert proc.popen.poll() is None, proc.stderr[-2000:]
        doc = daemon_status(endpoint, timeout=5)
        if done(doc):
            return doc
    raise AssertionError(f"status never reached the expected state: {doc}")


class _LoseOne:
    """Forwards messages to a publisher, making the ``nth`` batch too large to send: the
    publisher numbers it and drops it, so the daemon sees exactly one gap."""

    def __init__(self, pub: ZmqPublisher, nth: int) -> None:
        self.pub, self.nth, self.batches = pub, nth, 0

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self.batches += 1
            if self.batches == self.nth:
                pad = torch.zeros(len(message.worlds), _LIMIT // 4)
                message = dataclasses.replace(message, fields={**message.fields, "pad": pad})
        try:
            self.pub(message)
        except WireFormatError as exc:  # raised once, from the call after the dropped one
            if exc.reason != "too large":
                raise


def _store_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "storage", *args], capture_output=True, text=True,
                          env=ENV, timeout=60)


def test_status_socket_reports_what_was_stored(tmp_path: Path, spawn: Callable[..., Proc]) -> None:
    """Bugs caught: per-run or total episode counts that are not the committed ones, bytes or
    gaps not reported (or a gap invented), a status socket that stalls or never answers, the
    CLI printing other numbers than the socket."""
    store = tmp_path / "runs.zarr"
    status = f"ipc://{tmp_path}/status.ipc"
    with ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20, max_message_size=_LIMIT) as pub:
        proc = spawn("-m", "storage", str(store), "--connect", pub.endpoints[0], "--status", status,
                     "--status-interval", "0.2", "--commit-interval", "0.05",
                     "--memory-budget", "64MiB")
        proc.wait_line("worldtap-store ready")
        pub.wait_for_subscribers(1, timeout=30)
        broker = Broker(strict=True)
        broker.subscribe("", pub)
        sim = Sim(broker, 4, seed=5, reset_p=0.2)
        sim.step(30)
        sim.close()
        first = _wait_status(status, lambda d: d["runs"]["ended"] == 1, proc)
        assert first["runs"] == {"active": 0, "ended": 1, "failed": 0,
                                 "episodes": {"run-a": len(sim.outcome)}}
        assert first["episodes"]["stored"] == len(sim.outcome) > 0
        assert first["episodes"]["incomplete"] == 0
        assert first["gaps"] == 0
        assert first["bad_messages"] == 0
        assert first["rejected"] == {}
        assert first["bytes_written"] > 0
        assert first["messages"] > 0
        assert first["memory"]["budget_bytes"] == 64 << 20
        assert first["store"] == str(store)
        assert first["endpoints"] == [pub.endpoints[0]]
        assert first["bind"] is False
        assert first["subscriber"]["publishers"] == 1
        assert first["version"]
        assert first["format"] == 1
        assert first["uptime_s"] > 0
        # What the status counts is what the store holds, value for value.
        reader = RunStore(store)
        episodes = reader.episodes("run-a")
        assert len(episodes) == len(sim.outcome)
        for row in episodes.rows():
            key = (int(row["world"]), int(row["index"]))
            assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))

        lossy = Broker(strict=True)
        lossy.subscribe("", _LoseOne(pub, nth=10))
        sim_b = Sim(lossy, 4, run="run-b", seed=6, reset_p=0.2)
        sim_b.step(30)
        sim_b.close()
        second = _wait_status(status, lambda d: d["runs"]["ended"] == 2, proc)
        assert second["gaps"] == 1
        assert second["runs"]["episodes"]["run-a"] == len(sim.outcome)
        assert second["runs"]["episodes"]["run-b"] == len(RunStore(store).episodes("run-b"))
        assert second["episodes"]["incomplete"] >= 1  # the episodes the lost batch touched

        text = _store_cli("status", status)
        assert text.returncode == 0, text.stderr
        assert "episodes stored" in text.stdout
        assert "run-b" in text.stdout
        as_json = _store_cli("status", status, "--json")
        assert as_json.returncode == 0, as_json.stderr
        doc = json.loads(as_json.stdout)
        assert doc["runs"]["episodes"] == second["runs"]["episodes"]
        assert doc["gaps"] == 1
        assert doc["bytes_written"] == second["bytes_written"]
        with pytest.raises(WireFormatError):  # close() reports the dropped message again
            pub.close(timeout=20)
    proc.popen.terminate()
    assert proc.wait(30) == 0, proc.stderr[-2000:]


def test_status_of_a_dead_endpoint(tmp_path: Path) -> None:
    """Bugs caught: a hang, a traceback, or another exit code when nothing answers."""
    endpoint = _free_tcp()
    out = _store_cli("status", endpoint, "--timeout", "0.3")
    assert out.returncode == 5
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1
    assert endpoint in lines[0]
    assert "Traceback" not in out.stderr
    with pytest.raises(StatusTimeoutError, match="no status from"):
        daemon_status(endpoint, timeout=0.2)
    with pytest.raises(ValueError, match="timeout"):
        daemon_status(endpoint, timeout=0)


def test_status_endpoint_in_use_is_one_line(tmp_path: Path) -> None:
    """Bug caught: a status socket that cannot bind fails with a traceback or exit code 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        out = _store_cli(str(tmp_path / "s.zarr"), "--connect", _free_tcp(), "--status", busy)
    assert out.returncode == 5, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1
    assert "--status" in lines[0]
    assert "Address already in use" in lines[0]
