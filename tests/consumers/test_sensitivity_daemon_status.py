"""``worldtap-sensitivity --daemon-status``: the storage daemon's numbers beside the tool's own,
asked of a real status socket in the background."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from consumers.sensitivity.cli import _DaemonWatch, describe_daemon, main
from storage.status import StatusServer

_DOC: dict[str, Any] = {
    "format": 1, "lag_steps": 7, "gaps": 2, "episodes": {"stored": 41},
    "rate": {"mb_per_s": 12.5, "episodes_per_s": 3.0, "interval_s": 5.0},
    "rejected": {"header": 1, "budget": 2},
}


@pytest.fixture
def status_endpoint(tmp_path: Path) -> Iterator[str]:
    """A status socket answering ``_DOC``, served by a thread as the daemon's loop would."""
    stop = threading.Event()
    server = StatusServer(f"ipc://{tmp_path}/status.ipc", lambda: _DOC)

    def serve() -> None:
        while not stop.is_set():
            server.poll()
            stop.wait(0.005)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.endpoint
    finally:
        stop.set()
        thread.join(5)
        server.close()


def test_the_daemon_line_shows_its_numbers(status_endpoint: str) -> None:
    """Bugs caught: a lag, rate, gap or rejection count lost or mislabelled on the way from
    the daemon's status document to the report line; a watch that never gets an answer."""
    want = describe_daemon(status_endpoint, _DOC)
    assert want == (f"daemon {status_endpoint}: lag 7 steps, 12.5 MB/s, 3.0 episodes/s, "
                    f"41 episodes stored, gaps 2, rejected 3 (budget 2, header 1)")
    with _DaemonWatch(status_endpoint, interval=0.05) as watch:
        deadline = time.monotonic() + 10
        while watch.line() != want:
            assert time.monotonic() < deadline, watch.line()
            time.sleep(0.01)


def test_a_silent_daemon_is_reported_not_waited_for(tmp_path: Path) -> None:
    """Bug caught: the watch blocks (or dies) when no daemon answers."""
    endpoint = f"ipc://{tmp_path}/nobody.ipc"
    with _DaemonWatch(endpoint, interval=0.05) as watch:
        deadline = time.monotonic() + 10
        while "no status from" not in watch.line():
            assert time.monotonic() < deadline, watch.line()
            time.sleep(0.01)


def test_daemon_status_needs_live_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug caught: ``--daemon-status`` silently ignored offline."""
    assert main(["--store", str(tmp_path / "s.zarr"), "--daemon-status", "tcp://127.0.0.1:1"]) == 2
    assert "--daemon-status goes with --connect" in capsys.readouterr().err
