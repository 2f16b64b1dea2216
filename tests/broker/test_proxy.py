"""worldtap-proxy: many publishers and subscribers through one XSUB/XPUB forwarder.

In process: what arrives through the proxy is byte for byte what was published, subscribers
behind it count, confirm and leave as if connected directly, backpressure is lossless, and the
control commands work. As processes: publisher processes, the ``worldtap-proxy`` command and a
storage daemon, with a proxy restart in the middle of a run.
"""

from __future__ import annotations

import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zarr
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))

from procs import Proc
from storage_sim import assert_episode_equal
from store_checks import check_store, replay
from waiting import wait_until

from broker import (
    Batch,
    BrokerClosedError,
    CurveClient,
    CurveServer,
    Gap,
    KeyPair,
    RunEnd,
    Subscriber,
    ZmqPublisher,
)
from broker.allocator import malloc_is_glibc
from broker.proxy import Proxy, main
from broker.zmq_publisher import hello_subscription
from storage import RunStore

MakePub = Callable[..., ZmqPublisher]
MakeSub = Callable[..., Subscriber]
MakeProxy = Callable[..., Proxy]
Numbered = Callable[..., Batch]
Check = Callable[..., int]
SIM = Path(__file__).with_name("proxy_sim.py")
WIDE = 5_000  # 4 worlds x 5k: 80 kB and 160 kB frames, sent zero-copy


@pytest.fixture
def make_proxy(closing: list[Any]) -> MakeProxy:
    """Started in-process proxies on free loopback ports, closed at teardown."""
    def make(**kwargs: Any) -> Proxy:
        proxy = Proxy("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", **kwargs)
        closing.append(proxy)
        return proxy.start()

    return make


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """``python ARGS...`` in ``tmp_path``; every process is killed and reaped at teardown."""
    procs: list[Proc] = []

    def make(*args: str) -> Proc:
        procs.append(Proc([sys.executable, *args], tmp_path))
        return procs[-1]

    yield make
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.wait(10)


class _Reader(threading.Thread):
    """Receives until the ``RunEnd`` of every run in ``runs`` arrived (or ``idle`` s of
    silence); stops reading for ``stall`` seconds after the first item."""

    def __init__(self, sub: Subscriber, runs: set[str], stall: float = 0.0, idle: float = 10.0) -> None:
        super().__init__(name="test-reader", daemon=True)
        self.sub, self.runs, self.stall, self.idle = sub, set(runs), stall, idle
        self.items: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            ended: set[str] = set()
            while ended != self.runs:
                item = self.sub.recv(timeout=self.idle)
                if item is None:
                    return
                self.items.append(item)
                if isinstance(item, RunEnd):
                    ended.add(item.run)
                if len(self.items) == 1 and self.stall:
                    time.sleep(self.stall)  # a subscriber that stops reading for a while
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.error = exc

    def result(self) -> list[Any]:
        self.join(30)
        assert not self.is_alive()
        assert self.error is None, self.error
        return self.items


def _check_streams(items: list[Any], runs: dict[str, int], check: Check) -> None:
    """Each run's batches arrived whole and in order, numbers ``0..n-1``, byte for byte the
    :func:`numbered` batch of their number, with no gap, then the run's ``RunEnd``."""
    got: dict[str, list[int]] = {run: [] for run in runs}
    for item in items:
        assert not isinstance(item, Gap), item
        if isinstance(item, Batch):
            got[item.run].append(check(item, run=item.run))
        elif isinstance(item, RunEnd):
            assert got[item.run] == list(range(runs[item.run])), item.run
    assert {run: len(seqs) for run, seqs in got.items()} == runs
    assert {i.run for i in items if isinstance(i, RunEnd)} == set(runs)


def _close_in_background(pub: ZmqPublisher, errors: list[BaseException]) -> threading.Thread:
    def close() -> None:
        try:
            pub.close(timeout=15)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=close, name="test-closer", daemon=True)
    thread.start()
    return thread


# -- in process --------------------------------------------------------------------------------

def test_two_publishers_reach_two_subscribers_byte_exact_and_close_waits_for_confirmation(
        make_proxy: MakeProxy, make_pub: MakePub, make_sub: MakeSub, numbered: Numbered,
        check_numbered: Check) -> None:
    """Every message of two publishers reaches both subscribers behind the proxy, whole, in
    order and byte-exact; ``wait_for_subscribers`` counts them there; ``close()`` returns only
    once the subscriber that confirms late has confirmed both runs' ends (its confirmations
    travel upstream through the proxy)."""
    proxy = make_proxy()
    front, back = proxy.frontend_endpoints[0], proxy.backend_endpoints[0]
    quick = make_sub(back)
    store = make_sub(back, confirm_run_ends=False)  # confirms as a storage daemon does: when told
    pubs = [make_pub(front, bind=False, send_timeout=10) for _ in range(2)]
    for pub in pubs:
        pub.wait_for_subscribers(2, timeout=15)
    runs = {"run-0": 20, "run-1": 20}
    readers = [_Reader(sub, set(runs)) for sub in (quick, store)]
    for reader in readers:
        reader.start()
    for i in range(20):
        for k, pub in enumerate(pubs):
            pub(numbered(i, width=WIDE, run=f"run-{k}"))
    for k, pub in enumerate(pubs):
        pub(RunEnd(f"run-{k}", 20, 20, 4, "cpu"))
    errors: list[BaseException] = []
    closers = [_close_in_background(pub, errors) for pub in pubs]
    for reader in readers:
        _check_streams(reader.result(), runs, check_numbered)
    time.sleep(0.3)  # not a readiness wait: close() must still be waiting for the confirmations
    assert all(c.is_alive() for c in closers)
    for run in runs:
        store.confirm_run_end(run)
    for closer in closers:
        closer.join(20)
        assert not closer.is_alive()
    assert errors == []
    for pub in pubs:
        stats = pub.statistics()
        assert stats.drops == stats.failed == 0
        assert stats.published == stats.messages == 21
    stats = proxy.statistics()
    assert stats.frames_in == stats.frames_out > 0


def test_a_size_limit_announced_behind_the_proxy_is_kept(
        make_proxy: MakeProxy, make_pub: MakePub, make_sub: MakeSub, numbered: Numbered,
        check_numbered: Check) -> None:
    """The ``max_message_size`` a subscriber announces reaches the publisher through the proxy:
    a larger message is never sent (a counted drop, a gap), the connection is never lost, and
    the messages around it arrive byte-exact."""
    proxy = make_proxy()
    pub = make_pub(proxy.frontend_endpoints[0], bind=False, policy="drop")
    sub = make_sub(proxy.backend_endpoints[0], max_message_size=20_000)
    pub.wait_for_subscribers(1, timeout=15)
    reader = _Reader(sub, {"run-a"})
    reader.start()
    for i, width in enumerate((3, WIDE, 3)):  # 160 kB in the middle
        pub(numbered(i, width=width))
    pub(RunEnd("run-a", 3, 3, 4, "cpu"))
    pub.close(timeout=15)
    items = reader.result()
    assert [type(i).__name__ for i in items] == ["Batch", "Gap", "Batch", "RunEnd"]
    assert items[1] == Gap("run-a", "batch/obs", 1, 2, pub.id)
    assert [check_numbered(i) for i in items if isinstance(i, Batch)] == [0, 2]
    assert pub.statistics().oversized == 1
    stats = sub.statistics()
    assert stats.reconnects == stats.bad_messages == 0


_FROZEN = r"""
import sys, time, zmq
endpoint, hello = sys.argv[1], bytes.fromhex(sys.argv[2])
sock = zmq.Context().socket(zmq.SUB)
sock.setsockopt(zmq.HEARTBEAT_IVL, 100)
sock.setsockopt(zmq.SUBSCRIBE, b"")
sock.setsockopt(zmq.SUBSCRIBE, hello)
sock.connect(endpoint)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_subscribers_behind_the_proxy_count_while_alive(
        make_proxy: MakeProxy, make_pub: MakePub, make_sub: MakeSub, spawn: Callable[..., Proc]) -> None:
    """A publisher that connects before or after a subscriber joined counts it (the proxy
    sends a new publisher the subscriptions in place); a subscriber closed without a goodbye
    stops counting at every publisher; so does one that is alive but silent (a stopped
    process: its connection stays open) once the proxy's heartbeat (1.5 s) has passed."""
    proxy = make_proxy(heartbeat=1.5)
    front, back = proxy.frontend_endpoints[0], proxy.backend_endpoints[0]
    early = make_pub(front, bind=False)
    first = make_sub(back, heartbeat=1.0)  # pings every 0.2 s
    early.wait_for_subscribers(1, timeout=15)
    late = make_pub(front, bind=False)
    late.wait_for_subscribers(1, timeout=15)
    second = make_sub(back, heartbeat=1.0)
    for pub in (early, late):
        pub.wait_for_subscribers(2, timeout=15)
    second.close()
    wait_until(lambda: early.statistics().subscribers == late.statistics().subscribers == 1,
               "the closed subscriber to stop counting", timeout=15)
    frozen = spawn("-c", _FROZEN, back, hello_subscription("frozen", 1 << 20).hex())
    frozen.wait_line("ready", stream="out")
    for pub in (early, late):
        pub.wait_for_subscribers(2, timeout=15)
    frozen.popen.send_signal(signal.SIGSTOP)  # silent from now on, connection open
    wait_until(lambda: early.statistics().subscribers == late.statistics().subscribers == 1,
               "the silent subscriber to stop counting", timeout=15)
    assert first.recv(timeout=0.05) is None  # the live one still counts
    assert early.statistics().subscribers == 1


def test_backpressure_is_lossless_and_pause_resume_statistics_terminate(
        make_proxy: MakeProxy, make_pub: MakePub, make_sub: MakeSub, numbered: Numbered,
        check_numbered: Check) -> None:
    """A paused proxy holds messages (publishers wait) and forwards all of them on resume. A
    subscriber that stops reading for 3 s, longer than every heartbeat, slows the publisher
    down through the proxy and loses nothing: the proxy waits for it (``XPUB_NODROP``), pings
    the publisher while it cannot read from it, and does not time the publisher out for its
    silence. Statistics count the frames; close() terminates the proxy."""
    proxy = make_proxy(hwm=1, heartbeat=1.0)
    front, back = proxy.frontend_endpoints[0], proxy.backend_endpoints[0]
    pub = make_pub(front, bind=False, hwm=1, slots=2, send_timeout=20, heartbeat=1.0)
    sub = make_sub(back, hwm=1, heartbeat=0.5)
    pub.wait_for_subscribers(1, timeout=15)
    proxy.pause()
    for i in range(3):
        pub(numbered(i))
    assert sub.recv(timeout=0.3) is None
    stats = proxy.statistics()
    assert stats.paused
    assert stats.frames_in == stats.frames_out == 0  # held upstream of the proxy
    proxy.resume()
    reader = _Reader(sub, {"run-a"}, stall=3.0)
    reader.start()
    n = 40  # 37 x 960 kB: far more than the queues and socket buffers on the way hold
    for i in range(3, n):
        pub(numbered(i, width=WIDE * 4))
    pub(RunEnd("run-a", n, n, 4, "cpu"))
    pub.close(timeout=20)
    _check_streams(reader.result(), {"run-a": n}, check_numbered)
    stats = proxy.statistics()
    assert not stats.paused
    assert stats.frames_in == stats.frames_out
    assert stats.bytes_in == stats.bytes_out > (n - 3) * 4 * (WIDE * 4) * 12  # x: float32, id: int64
    assert stats.subscriptions_in == stats.subscriptions_out > 0
    proxy.close()
    assert not proxy.running
    with pytest.raises(BrokerClosedError, match="not forwarding"):
        proxy.statistics()
    proxy.close()  # idempotent


def test_every_subscription_reaches_publishers_and_leaves_with_its_last_subscriber(
        make_proxy: MakeProxy, make_sub: MakeSub) -> None:
    """Each subscriber's join and leave reach the publishers, and a topic is withdrawn upstream
    when its last subscriber leaves. Bug this catches: a proxy that passes every subscription
    but only the last unsubscription of a topic (``XPUB_VERBOSE`` without ``VERBOSER``) left
    topics subscribed upstream after every subscriber had gone (publishers kept sending them
    to the proxy for nobody)."""
    proxy = make_proxy()
    ctx: zmq.Context[Any] = zmq.Context()
    raw = ctx.socket(zmq.XPUB)  # a publisher that sees every (un)subscription reaching it
    try:
        raw.setsockopt(zmq.XPUB_VERBOSER, 1)
        raw.connect(proxy.frontend_endpoints[0])
        seen: list[bytes] = []

        def until(*wanted: bytes) -> None:
            deadline = time.monotonic() + 15
            while not set(wanted) <= set(seen):
                assert time.monotonic() < deadline, (wanted, seen)
                if raw.poll(50):
                    seen.append(raw.recv())

        a = make_sub(proxy.backend_endpoints[0], topics=("batch/",), id="sub-a")
        b = make_sub(proxy.backend_endpoints[0], topics=("batch/",), id="sub-b")
        hello_a, hello_b = (hello_subscription(s.id, s.max_message_size) for s in (a, b))
        until(b"\x01" + hello_a, b"\x01" + hello_b)
        assert b"\x01batch/" in seen
        assert b"\x01run/end" in seen
        seen.clear()
        a.close()
        until(b"\x00" + hello_a)
        assert seen == [b"\x00" + hello_a]  # b still wants batch/ and run/end
        seen.clear()
        b.close()
        until(b"\x00batch/", b"\x00run/end", b"\x00" + hello_b)
    finally:
        raw.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("sides", ["frontend", "backend", "both"])
def test_curve_on_either_side(make_proxy: MakeProxy, make_pub: MakePub, make_sub: MakeSub,
                              numbered: Numbered, check_numbered: Check, sides: str) -> None:
    """On an encrypted side only the peers on its allow-list get through: a subscriber without
    the keys (or with keys not allowed) joins nothing and receives nothing, a publisher without
    them reaches nobody; with the keys, every message arrives byte-exact."""
    keys, pub_keys, sub_keys, stranger = (KeyPair.generate() for _ in range(4))
    front = CurveServer(keys, frozenset({pub_keys.public})) if sides != "backend" else None
    back = CurveServer(keys, frozenset({sub_keys.public})) if sides != "frontend" else None
    proxy = make_proxy(frontend_curve=front, backend_curve=back)
    fe, be = proxy.frontend_endpoints[0], proxy.backend_endpoints[0]
    pub = make_pub(fe, bind=False, curve=CurveClient(pub_keys, keys.public) if front else None)
    good = make_sub(be, curve=CurveClient(sub_keys, keys.public) if back else None)
    outsiders = [make_sub(be), make_sub(be, curve=CurveClient(stranger, keys.public))] if back else []
    intruders = [make_pub(fe, bind=False), make_pub(fe, bind=False, curve=CurveClient(stranger, keys.public))] \
        if front else []
    pub.wait_for_subscribers(1, timeout=15)
    for k, intruder in enumerate(intruders):
        intruder(numbered(0, run=f"intruder-{k}"))
    reader = _Reader(good, {"run-a"})
    reader.start()
    for i in range(5):
        pub(numbered(i, width=WIDE))
    pub(RunEnd("run-a", 5, 5, 4, "cpu"))
    pub.close(timeout=15)
    _check_streams(reader.result(), {"run-a": 5}, check_numbered)  # and nothing from intruders
    for sub in outsiders:
        assert sub.recv(timeout=0.2) is None
    assert pub.statistics().subscribers == 1
    assert all(i.statistics().subscribers == 0 for i in intruders)


def test_command_line_errors_are_one_line_and_an_exit_code(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A port in use: exit 5; a missing ipc folder, a bad key file, CURVE options that do not
    go together: exit 2 (usage); each with one line saying what was wrong."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--frontend", f"tcp://127.0.0.1:{port}", "--backend", "tcp://127.0.0.1:*"]) == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(f"worldtap-proxy: frontend: bind 'tcp://127.0.0.1:{port}' failed: Address already in use")
    with pytest.raises(SystemExit) as usage:
        main(["--backend", f"ipc://{tmp_path}/missing/back.ipc"])
    assert usage.value.code == 2
    assert "the folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["--curve-keys", str(tmp_path / "proxy.key_secret")])
    assert usage.value.code == 2
    assert "--curve-keys goes with --curve-publishers and/or --curve-subscribers" in capsys.readouterr().err
    assert main(["--curve-keys", str(tmp_path / "none.key_secret"), "--curve-subscribers", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "none.key_secret" in err[0]


# -- processes ---------------------------------------------------------------------------------

def _proxy(spawn: Callable[..., Proc], front: str, back: str) -> Proc:
    proc = spawn("-m", "broker.proxy", "--frontend", front, "--backend", back, "--status-interval", "0.5")
    proc.wait_line("worldtap-proxy ready", timeout=60)  # signal handlers are installed
    return proc


def _daemon(spawn: Callable[..., Proc], store: Path, back: str, runs: int) -> Proc:
    return spawn("-m", "storage", str(store), "--connect", back, "--exit-after-runs", str(runs),
                 "--status-interval", "0.2", "--commit-interval", "0.05")




def _stop(proxy: Proc) -> None:
    proxy.popen.send_signal(signal.SIGTERM)
    assert proxy.wait(30) == 0, proxy.stderr[-3000:]
    assert "worldtap-proxy done: frames_in=" in proxy.stderr
    # --malloc keep, the default, made glibc keep freed memory (see broker.allocator)
    assert ("malloc=keep" in proxy.stderr) == malloc_is_glibc(), proxy.stderr[-3000:]


def test_three_publisher_processes_through_the_proxy_into_one_daemon(
        spawn: Callable[..., Proc], tmp_path: Path, ipc_dir: Path) -> None:
    """Three simulation processes, each its own run, published at the same time through one
    ``worldtap-proxy`` process into one storage daemon: every episode of every run is stored
    byte for byte, per-run counts are whole, no gaps, every run complete, and each publisher's
    close() returned once the daemon had confirmed its run's end. SIGTERM stops the proxy
    with exit 0."""
    front, back = f"ipc://{ipc_dir}/front.ipc", f"ipc://{ipc_dir}/back.ipc"
    store, go = tmp_path / "runs.zarr", tmp_path / "go"
    runs = {f"run-{k}": 10 + k for k in range(3)}  # run -> seed
    steps = 50
    proxy = spawn("-m", "broker.proxy", "--frontend", front, "--backend", back, "--status-interval", "0.5")
    daemon = _daemon(spawn, store, back, len(runs))
    pubs = [spawn(str(SIM), front, "--run", run, "--seed", str(seed), "--steps", str(steps), "--delay", "0.01",
                  "--start", str(go)) for run, seed in runs.items()]
    proxy.wait_line("worldtap-proxy ready", timeout=60)
    for pub in pubs:  # everyone connected before the proxy or after: each sees the daemon join
        pub.wait_line("joined", stream="out", timeout=60)
    go.touch()
    for pub in pubs:
        assert pub.wait(60) == 0, pub.stderr[-3000:]
        assert "closed" in pub.out[-1]
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    _stop(proxy)
    reader = RunStore(store)
    assert sorted(reader.runs()) == sorted(runs)
    for run, seed in runs.items():
        sim, spans = replay(run, seed, steps)
        assert check_store(store, sim, spans, run, run) == len(sim.outcome) > 0
        assert len(reader.gaps(run)) == 0
    infos = [reader.info(run) for run in runs]
    assert max(i["started_at"] for i in infos) < min(i["ended_at"] for i in infos)  # interleaved


def test_a_proxy_restart_mid_run_loses_what_was_in_flight_and_the_run_completes(
        spawn: Callable[..., Proc], tmp_path: Path, ipc_dir: Path) -> None:
    """The proxy is killed in the middle of a run and started again: what it held and what
    was published while it was down is lost and recorded as gaps at the daemon (source 0),
    every stored episode is byte-exact and nothing partial is visible, episodes from before
    the crash and after the restart are stored, and the run goes on through the new proxy to a
    complete end (publisher and daemon re-join by themselves)."""
    front, back = f"ipc://{ipc_dir}/front.ipc", f"ipc://{ipc_dir}/back.ipc"
    store, gate = tmp_path / "runs.zarr", tmp_path / "gate"
    first = spawn("-m", "broker.proxy", "--frontend", front, "--backend", back)
    daemon = _daemon(spawn, store, back, 1)
    pub = spawn(str(SIM), front, "--seed", "5", "--steps", "300", "--delay", "0.005", "--gate", str(gate),
                "--steps2", "80")
    daemon.wait_stored(3)
    first.popen.kill()  # a crash: no goodbye to anyone
    assert first.wait(30) == -signal.SIGKILL
    second = _proxy(spawn, front, back)
    pub.wait_line("gate", stream="out", timeout=60)
    gate.touch()
    assert pub.wait(60) == 0, pub.stderr[-3000:]
    assert daemon.wait(60) == 0, daemon.stderr[-3000:]
    _stop(second)
    sim, _ = replay("run-a", 5, 380)
    reader = RunStore(store)
    info = reader.info("run-a")
    assert info["status"] == "complete"
    stored = reader.episodes("run-a")
    for row in stored.rows():
        key = (int(row["world"]), int(row["index"]))
        assert row["success"] == sim.outcome[key], key
        assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))
    root = zarr.open_group(store, mode="r")  # nothing partial, even to plain zarr
    assert root["runs/run-a/episodes/world"].shape[0] == info["committed"]["episodes"] == len(stored)
    for term, rows in info["committed"]["rows"].items():
        assert root[f"runs/run-a/data/{term}/_step"].shape[0] == rows, term
    assert not list(store.rglob("*.partial"))
    gaps = reader.gaps("run-a")
    assert (gaps["source"] == 0).sum() > 0, gaps.rows()
    lost = [g for g in gaps.rows() if g["source"] == 3]
    assert len(lost) == 1, gaps.rows()
    ends = root["runs/run-a/episodes/end_seq"][:]
    assert (ends < lost[0]["expected"]).any()  # stored before the crash
    assert (ends >= lost[0]["received"]).any()  # and after the restart
    assert len(stored) < len(sim.outcome)
