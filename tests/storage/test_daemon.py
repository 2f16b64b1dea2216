"""The daemon as a real process: CLI, crash and resume, SIGTERM, the lock, bad messages."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq
from procs import ENV, Proc
from storage_sim import assert_episode_equal, expected_sim

from broker.allocator import malloc_is_glibc
from broker.wire import SUBSCRIBER_HELLO
from storage import RunStore

pytestmark = pytest.mark.timeout(90)

SIM = Path(__file__).with_name("storage_sim.py")


def publisher(spawn: object, *extra: str) -> tuple[Proc, str]:
    pub = spawn(str(SIM), *extra)  # type: ignore[operator]
    endpoint = pub.wait_line("tcp://", stream="out").strip()
    return pub, endpoint


def daemon(spawn: object, store: Path, *extra: str) -> Proc:
    proc = spawn("-m", "storage", str(store), "--status-interval", "0.2", *extra)  # type: ignore[operator]
    proc.wait_line("worldtap-store ready")
    return proc


def _wait_status(proc: Proc, *, count: int, timeout: float = 30.0) -> None:
    """Wait until the daemon has printed ``count`` status lines (it reports every 0.2 s)."""
    deadline = time.monotonic() + timeout
    while sum("status episodes=" in line for line in list(proc.err)) < count:
        assert proc.popen.poll() is None, proc.stderr[-3000:]
        assert time.monotonic() < deadline, proc.stderr[-3000:]
        time.sleep(0.02)


def check_store(store: Path, *, seed: int, steps: int, worlds: int = 6) -> RunStore:
    """Every committed episode is byte-equal to what the publisher generated."""
    sim = expected_sim(seed, steps, worlds)
    reader = RunStore(store)
    for row in reader.episodes("run-a").rows():
        key = (row["world"], row["index"])
        assert row["success"] == sim.outcome[key]
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))
    return reader


def test_cli_round_trip_and_info_through_entry_point(spawn: object, tmp_path: Path) -> None:
    pub, ep = publisher(spawn, "--steps", "150")
    store = tmp_path / "runs.zarr"
    proc = daemon(spawn, store, "--connect", ep, "--exit-after-runs", "1")
    assert proc.wait() == 0, proc.stderr
    assert pub.wait() == 0
    assert "worldtap-store done: episodes=" in proc.stderr
    # --malloc keep, the default, made glibc keep freed memory (see broker.allocator)
    ready = next(line for line in proc.stderr.splitlines() if "worldtap-store ready" in line)
    assert ready.endswith(" malloc=keep" if malloc_is_glibc() else " malloc=system"), ready
    reader = check_store(store, seed=0, steps=150)
    n = len(reader.episodes("run-a"))
    assert n == len(expected_sim(0, 150, 6).outcome)
    exe = shutil.which("worldtap-store")
    cmd = [exe] if exe else [sys.executable, "-m", "storage"]
    out = subprocess.run([*cmd, "info", str(store)], capture_output=True, text=True, env=ENV,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[:4] == ["run-a", "complete", "6", str(n)]
    bad = subprocess.run([*cmd, "info", str(tmp_path / "nothing")], capture_output=True,
                         text=True, env=ENV, timeout=60)
    assert bad.returncode == 3
    assert "the directory does not exist" in bad.stderr
    usage = subprocess.run([*cmd, "--export", "bogus"], capture_output=True, text=True, env=ENV,
                           timeout=60)
    assert usage.returncode == 2
    assert "invalid choice: 'bogus'" in usage.stderr
    threads = subprocess.run([*cmd, str(tmp_path / "x.zarr"), "--io-threads", "0"], capture_output=True,
                             text=True, env=ENV, timeout=60)
    assert threads.returncode == 2
    assert "argument --io-threads: expected a positive integer, got '0'" in threads.stderr


@pytest.mark.parametrize("seed", [1])  # tests/storage/test_conformance.py kills on every backend too
def test_kill_9_then_resume(spawn: object, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    steps, steps2 = 600, 100
    gate = tmp_path / "gate"
    pub, ep = publisher(spawn, "--steps", str(steps), "--seed", str(seed), "--delay", "0.004",
                        "--gate", str(gate), "--steps2", str(steps2))
    store = tmp_path / "runs.zarr"
    first = daemon(spawn, store, "--connect", ep, "--commit-interval", "0.05",
                   "--memory-budget", "8KiB")  # tiny: fragments are in flight when killed
    first.wait_line("run 'run-a': started")
    time.sleep(rng.uniform(0.2, 0.8))  # a random moment of the run (not a wait for readiness)
    first.popen.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    before = check_store(store, seed=seed, steps=steps + steps2)  # intact; partial: invisible
    committed = len(before.episodes("run-a"))
    second = daemon(spawn, store, "--connect", ep, "--exit-after-runs", "1",
                    "--commit-interval", "0.05", "--memory-budget", "8KiB")
    gate.touch()
    assert pub.wait() == 0
    assert second.wait() == 0, second.stderr
    after = check_store(store, seed=seed, steps=steps + steps2)
    info = after.info("run-a")
    assert info["resumed"] == 1
    assert info["status"] == "complete"
    assert len(after.episodes("run-a")) > committed
    assert after.episodes("run-a")["segments"].max() > 3  # fragments were flushed and joined
    gaps = after.gaps("run-a")
    assert (gaps["source"] == 1).sum() == 1, gaps.rows()
    assert not list(store.rglob("*.partial"))


def test_sigterm_commits_and_exits_0(spawn: object, tmp_path: Path) -> None:
    _, ep = publisher(spawn, "--steps", "300", "--delay", "0.005")
    store = tmp_path / "runs.zarr"
    proc = daemon(spawn, store, "--connect", ep, "--commit-interval", "5", "--malloc", "system")
    proc.wait_line("run 'run-a': started")
    ready = next(line for line in proc.stderr.splitlines() if "worldtap-store ready" in line)
    assert ready.endswith(" malloc=system"), ready  # glibc's defaults, as asked
    _wait_status(proc, count=4)  # four status reports into the run (the interval never elapses)
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait() == 0, proc.stderr
    line = proc.wait_line("worldtap-store done")
    reader = check_store(store, seed=0, steps=300)
    stored = int(line.split("episodes=")[1].split()[0])
    assert stored == len(reader.episodes("run-a")) > 0  # commit interval never elapsed


def test_second_daemon_on_the_same_store_refuses(spawn: object, tmp_path: Path) -> None:
    store = tmp_path / "runs.zarr"
    first = daemon(spawn, store, "--connect", "tcp://127.0.0.1:9")
    second = spawn("-m", "storage", str(store), "--connect", "tcp://127.0.0.1:9")  # type: ignore[operator]
    assert second.wait(60) == 3
    assert "is locked by another storage daemon (pid" in second.stderr
    first.popen.send_signal(signal.SIGINT)
    assert first.wait() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_bad_messages_are_counted_and_skipped(spawn: object, tmp_path: Path) -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    store = tmp_path / "runs.zarr"
    proc = daemon(spawn, store, "--bind", endpoint, "--exit-after-runs", "1")
    ctx = zmq.Context()
    try:
        # An XPUB sees the daemon's subscriptions: its hello comes after its topics, so once
        # the hello is here the junk below reaches it (no waiting on the clock).
        sock = ctx.socket(zmq.XPUB)
        sock.setsockopt(zmq.LINGER, 10_000)  # close() delivers what was sent
        sock.setsockopt(zmq.RCVTIMEO, 30_000)
        sock.connect(endpoint)
        while not sock.recv().startswith(b"\x01" + SUBSCRIBER_HELLO):
            pass
        for junk in ([b"batch/obs", b"\x93not msgpack"], [b"episode/end"], [b"run/x", b"\xc1", b"1"]):
            sock.send_multipart(junk)
        sock.close()
    finally:
        ctx.term()
    pub, _ = publisher(spawn, "--steps", "80", "--connect", "--endpoint", endpoint)
    assert pub.wait() == 0
    assert proc.wait() == 0, proc.stderr
    line = proc.wait_line("worldtap-store done")
    assert int(line.split("bad=")[1].split()[0]) == 3
    check_store(store, seed=0, steps=80)


def test_a_run_end_missed_while_down_is_sent_again_and_finishes_the_run(spawn: object, tmp_path: Path) -> None:
    """Item 9: the daemon confirmed RunEnd on receipt, and a RunEnd it never stored was lost
    for good (the run stayed ``open`` forever). Now a daemon confirms a RunEnd only after its
    commit, under an id that is the same for every daemon on the store: killed mid-run, it
    misses the rest and the RunEnd; restarted on the same store, the publisher sends it the
    unconfirmed RunEnd again, and the run ends complete with what it missed recorded."""
    steps = 300
    gate = tmp_path / "end-gate"
    pub, ep = publisher(spawn, "--steps", str(steps), "--delay", "0.004", "--end-gate", str(gate))
    store = tmp_path / "runs.zarr"
    first = daemon(spawn, store, "--connect", ep, "--commit-interval", "0.05")
    first.wait_line("status episodes=", timeout=30)  # it has stored part of the run
    first.popen.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    pub.wait_line("ended", stream="out", timeout=60)  # RunEnd published while no daemon ran
    second = daemon(spawn, store, "--connect", ep, "--exit-after-runs", "1", "--commit-interval", "0.05")
    gate.touch()
    assert second.wait() == 0, second.stderr  # it received the RunEnd sent again
    assert pub.wait() == 0, pub.stderr  # and confirmed it: the publisher's close() succeeded
    assert "resent_run_ends=0" not in "".join(pub.out)  # the RunEnd went out again
    reader = check_store(store, seed=0, steps=steps)
    info = reader.info("run-a")
    assert info["status"] == "complete"
    assert info["resumed"] == 1
    assert len(reader.gaps("run-a")) >= 1  # what it missed while down is recorded


def test_run_fields_and_outcomes_through_the_wire_and_a_daemon_process(spawn: object, tmp_path: Path) -> None:
    """Issue 12 end to end over real sockets and processes: declarations, seed and wall times
    of RunStart/RunEnd and the changing EpisodeEnd outcomes are stored by a ``worldtap-store``
    process, and the store's (X, Y) table equals, byte for byte, the one a live remote
    subscriber built from the same stream. Bug caught: any of these fields lost or altered on
    the wire (encoder, decoder) or in the daemon (RunStart/RunEnd handling, outcome columns)."""
    import numpy as np
    from test_run_fields import FRICTION, MASS, Run, _expected_column, _publish_run

    from broker import Broker, RunEnd, Subscriber
    from consumers.sample_table import SampleTable

    pub = spawn(str(Path(__file__).with_name("run_fields_pub.py")), "--subscribers", "2")  # type: ignore[operator]
    endpoint = pub.wait_line("tcp://", stream="out").strip()
    store = tmp_path / "runs.zarr"
    proc = daemon(spawn, store, "--connect", endpoint, "--exit-after-runs", "1")
    live = SampleTable()
    sub = Subscriber(endpoint)
    try:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            item = sub.recv(timeout=1.0)
            if item is not None:
                live(item)  # type: ignore[arg-type]
                if isinstance(item, RunEnd):
                    break
        else:
            raise AssertionError(f"no RunEnd within 30 s: {pub.stderr[-2000:]}")
        assert sub.statistics().bad_messages == 0
    finally:
        sub.close()
    assert proc.wait() == 0, proc.stderr
    assert pub.wait() == 0, pub.stderr
    expected = Run(Broker())
    _publish_run(expected)  # the same messages, replayed here without a transport
    reader = RunStore(store)
    info = reader.info("run-a")
    assert info["variations"] == {"mass": MASS, "friction": FRICTION}
    assert (info["seed"], info["started_at"], info["ended_at"]) == (42, 1000.5, 2000.25)
    table = reader.episodes("run-a")
    assert len(table) == 6
    for name in ("hits", "ok", "return"):
        assert table[name].tobytes() == _expected_column(expected, table, name), name
    a, b = reader.variation_table("run-a").arrays(), live.arrays()
    assert a.y_columns == b.y_columns
    assert a.x_columns == b.x_columns
    order_a, order_b = np.lexsort((a.episode, a.world)), np.lexsort((b.episode, b.world))
    for field in ("world", "episode", "x", "y"):
        assert getattr(a, field)[order_a].tobytes() == getattr(b, field)[order_b].tobytes(), field
    assert live.declarations("run-a") == {"mass": MASS, "friction": FRICTION}
