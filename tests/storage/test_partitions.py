"""Several daemons on one store, one per partition (``worldtap-store serve --partition K/N``).

As processes: publisher processes, a ``worldtap-proxy`` and three partitioned daemons started
together on one empty store; one daemon killed mid-run and restarted. In process: the
partition of a run id, the locks (one daemon per partition, none beside a whole-store daemon
or one of another count), race-safe root creation, and two partitions on S3.
"""

from __future__ import annotations

import os
import re
import signal
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from procs import Proc
from storage_sim import Sim
from store_checks import Spans, check_store, replay
from test_conformance import make_backend, s3_endpoint  # noqa: F401 (the fixture)
from waiting import wait_until

from broker import Broker
from storage import Partition, RunStore, RunStoreWriter, StoreDaemon, StoreLease, StoreLock, StoreLockedError
from storage.cli import main, subscriber_id

PUB = Path(__file__).with_name("partition_pub.py")
STEPS, STEPS2 = 30, 20


def _runs_of(partitions: int, per: int) -> dict[str, int]:
    """``per`` run ids of every partition of ``partitions`` (run -> seed)."""
    found: dict[int, list[str]] = {k: [] for k in range(partitions)}
    for i in range(1000):
        run = f"run-{i}"
        k = zlib.crc32(run.encode()) % partitions
        if len(found[k]) < per:
            found[k].append(run)
    return {run: 100 + i for i, run in enumerate(sorted(r for rs in found.values() for r in rs))}




@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """The proxy's frontend and backend as ipc endpoints (socket paths are short)."""
    with tempfile.TemporaryDirectory(prefix="wt-") as short:
        yield f"ipc://{short}/front.ipc", f"ipc://{short}/back.ipc"


def _started_runs(daemon: Proc) -> set[str]:
    return {m[1] for line in list(daemon.err) if (m := re.search(r"run '([^']+)': (started|resumed)", line))}


def test_partition_of_a_run_is_a_stable_hash_of_its_id() -> None:
    """crc32 of the UTF-8 id mod N, the same in every process (never the salted ``hash``);
    sessions are placed by the id they were published under. Bad specs are ValueErrors."""
    p = Partition.parse("1/3")
    assert (p.index, p.count, str(p)) == (1, 3, "1/3")
    for run in ("run-0", "ä/ü", "x" * 300):
        k = zlib.crc32(run.encode()) % 3
        assert [Partition(i, 3).owns(run) for i in range(3)] == [i == k for i in range(3)]
        assert Partition(k, 3).owns_meta({"run": "other#2", "session_of": run})
    assert Partition().owns("anything")
    assert Partition.parse("0/1").whole
    for bad in ("3/3", "-1/3", "1", "a/b", "1/0", ""):
        with pytest.raises(ValueError, match="partition"):
            Partition.parse(bad)
    ids = {subscriber_id("s.zarr", Partition(k, 3)) for k in range(3)}
    assert len(ids) == 3
    assert subscriber_id("s.zarr") not in ids
    assert subscriber_id("s.zarr", Partition(0, 1)) == subscriber_id("s.zarr")


def test_three_partitioned_daemons_store_every_run_once_and_a_killed_one_resumes_its_own(
        spawn: Callable[..., Proc], tmp_path: Path, sockets: tuple[str, str]) -> None:
    """Two publisher processes (three runs each, two per partition) through a real
    worldtap-proxy into three daemons, ``0/3``, ``1/3``, ``2/3``, started together on one empty
    store. The daemon of partition 1 is SIGKILLed in the middle of its runs and started again.
    Every run is stored once, complete and byte-exact (what the killed daemon lost lies in
    recorded gaps), each daemon stored only runs of its partition and dropped the others'
    messages, the restarted daemon resumed only its own runs, the other daemons' runs have no
    gap, and a plain reader sees every run. Bugs caught: a daemon storing (or recovering, or
    cutting) another partition's runs, partitions sharing a subscriber id (a RunEnd confirmed
    by the wrong daemon, or publishers counting one subscriber), a RunEnd of another partition
    left unconfirmed (publishers never close), a root-creation race on the empty store."""
    front, back = sockets
    store, go, gate = tmp_path / "runs.zarr", tmp_path / "go", tmp_path / "gate"
    runs = _runs_of(3, 2)
    parts = {run: zlib.crc32(run.encode()) % 3 for run in runs}
    proxy = spawn("-m", "broker.proxy", "--frontend", front, "--backend", back)

    def daemon(k: int) -> Proc:
        return spawn("-m", "storage", "serve", str(store), "--partition", f"{k}/3", "--connect", back,
                     "--exit-after-runs", str(sum(p == k for p in parts.values())),
                     "--status-interval", "0.2", "--commit-interval", "0.05", "--idle-timeout", "60")

    daemons = [daemon(k) for k in range(3)]  # together, on an empty store
    names = sorted(runs)
    pubs = [spawn(str(PUB), front, *(a for run in names[i::2] for a in ("--run", f"{run}:{runs[run]}")),
                  "--subscribers", "3", "--start", str(go), "--steps", str(STEPS), "--delay", "0.01",
                  "--gate", str(gate), "--steps2", str(STEPS2)) for i in range(2)]
    for pub in pubs:
        pub.wait_line("joined", stream="out", timeout=60)
    go.touch()
    for pub in pubs:
        pub.wait_line("gate", stream="out", timeout=60)
    daemons[1].wait_stored(1)
    # and it has admitted both its runs (the proxy may forward one publisher's backlog before
    # the other's first message: "stored 1" alone let it be killed before it saw its second run)
    mine = {run for run, p in parts.items() if p == 1}
    wait_until(lambda: _started_runs(daemons[1]) == mine, f"daemon 1/3 to admit {sorted(mine)}", timeout=60)
    daemons[1].popen.send_signal(signal.SIGKILL)  # in the middle of its runs: no goodbye
    assert daemons[1].wait(30) == -signal.SIGKILL
    restarted = daemon(1)
    restarted.wait_line("worldtap-store ready", timeout=60)
    gate.touch()
    for pub in pubs:
        assert pub.wait(90) == 0, pub.stderr[-3000:]
        assert "closed" in pub.out[-1]
    for d in (daemons[0], daemons[2], restarted):
        assert d.wait(60) == 0, d.stderr[-3000:]
        other = re.search(r"other_partition=(\d+)", d.err[-1])
        assert other is not None, d.err[-1]
        assert int(other[1]) > 0, d.err[-1]
    proxy.popen.send_signal(signal.SIGTERM)
    assert proxy.wait(30) == 0, proxy.stderr[-3000:]

    reader = RunStore(store)
    assert sorted(reader.runs()) == names  # each once: no second session, nothing lost
    for k, d in enumerate((daemons[0], restarted, daemons[2])):
        assert _started_runs(d) == {run for run, p in parts.items() if p == k}, d.stderr[-3000:]
    assert _started_runs(daemons[1]) == {run for run, p in parts.items() if p == 1}
    cut = {m[1] for line in restarted.err if (m := re.search(r"run '([^']+)': cut to its last commit", line))}
    assert cut == {run for run, p in parts.items() if p == 1}, restarted.stderr[-3000:]
    assert "cut to its last commit" not in daemons[0].stderr + daemons[2].stderr
    for run, seed in runs.items():
        sim, spans = replay(run, seed, STEPS + STEPS2)
        assert check_store(store, sim, spans, run, run) > 0
        if parts[run] != 1:
            assert len(reader.gaps(run)) == 0, run
        else:
            assert reader.info(run)["resumed"] == 1, run


def test_one_daemon_per_partition_and_no_overlap(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A second daemon of a held partition exits 3 with one line naming the partition; a
    daemon of another count or of the whole store is refused while partitions are held (their
    runs overlap), and partitions of one count coexist. Bugs caught: one lock file for all
    partitions (N daemons cannot share a store), or none across counts."""
    store = tmp_path / "runs.zarr"
    held = [StoreLock(store, Partition(k, 3)).acquire() for k in (0, 1)]
    try:
        assert main([str(store), "--partition", "1/3", "--connect", "tcp://127.0.0.1:1"]) == 3
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert re.fullmatch(r"worldtap-store: partition 1/3 of store '.*runs\.zarr' is locked by another "
                            r"storage daemon \(pid \d+, .*\); stop it or choose another store", err[0]), err
        for other, what in ((Partition(1, 2), "partition 0/3"), (Partition(), "partition 0/3")):
            with pytest.raises(StoreLockedError, match=re.escape(what)):
                StoreLock(store, other).acquire()
        with StoreLock(store, Partition(2, 3)):  # the third of its count
            pass
    finally:
        for lock in held:
            lock.release()
    # the whole store, once the partitions are gone; and it excludes them
    with StoreLock(store), pytest.raises(StoreLockedError, match="all its runs"):
        StoreLock(store, Partition(0, 3)).acquire()


def test_root_creation_is_race_safe(tmp_path: Path) -> None:
    """Eight writers (partitions k/8) open one empty store at the same instant: all succeed and the root
    holds the run-store attributes, whatever the order. Bug caught: creating an empty root
    first and its attributes after (another writer sees "a zarr group but not a run store"),
    or creating ``runs/`` with zarr's check-then-create (it raises when another won)."""
    store = tmp_path / "runs.zarr"
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def open_one(k: int) -> None:
        barrier.wait()
        try:
            RunStoreWriter(store, partition=Partition(k, 8))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert RunStore(store).runs() == []


@pytest.mark.usefixtures("s3_endpoint")
def test_two_partitions_on_s3(request: pytest.FixtureRequest) -> None:
    """Two daemons (in process), partitions 0/2 and 1/2, each holding its own lease on one S3
    store, are fed every message of two runs: each stores only its own run, byte-exact, and a
    reader sees both. Bug caught: one lease for every partition (the second daemon refused),
    or runs stored by the wrong partition's daemon on object stores."""
    url = make_backend("s3", Path(tempfile.gettempdir()), request).url
    assert url is not None
    runs = _runs_of(2, 1)
    leases = [StoreLease(url, ttl=30, partition=Partition(k, 2)).acquire() for k in range(2)]
    try:
        with pytest.raises(StoreLockedError, match="leased by a storage daemon of partition"):
            StoreLease(url, ttl=30).acquire()
        daemons = [StoreDaemon(url, partition=Partition(k, 2), commit_interval=3600) for k in range(2)]
        broker = Broker()
        for d in daemons:
            broker.subscribe("", d)
        sims = {run: Sim(broker, 4, run=run, seed=seed, terms=("obs",), variations=())
                for run, seed in runs.items()}
        for sim in sims.values():
            sim.step(6, force_reset=[0])
            sim.close()
        for d in daemons:
            d.close()
        for d in daemons:
            stats = d.statistics()
            assert stats.runs_ended == 1, stats
            assert stats.other_partition > 0, stats
    finally:
        for lease in leases:
            lease.release()
    reader = RunStore(url)
    assert sorted(reader.runs()) == sorted(runs)
    for run, sim in sims.items():
        spans = Spans()
        assert check_store(url, sim, spans, run, run) == len(sim.outcome) > 0


def test_creating_nodes_writes_nothing_beside_the_shared_metadata(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """zarr writes the ``zarr.json`` of every ancestor group (``set_if_not_exists``) each time
    it creates an array. Through zarr's own LocalStore each such call wrote a temporary file
    beside the root's and ``runs/``'s metadata, and a daemon killed there (one in twenty runs of
    the three-daemon test above) left it outside every run, where no partition's startup
    cleans: a ``*.partial`` file visible in the store for good. worldtap's local store writes
    nothing for a key that exists."""
    from storage._format import open_store

    store = open_store(tmp_path / "runs.zarr")
    RunStoreWriter(tmp_path / "runs.zarr", partition=Partition(0, 3))  # the root and runs/ exist
    opened: list[Path] = []
    real_open = os.open

    def recording_open(path: str | Path, flags: int, *args: int, **kwargs: object) -> int:
        if flags & os.O_CREAT:
            opened.append(Path(path))
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", recording_open)
    import zarr

    zarr.create_array(store, name="runs/r/data/t/x", shape=(4,), dtype="int32")
    root = tmp_path / "runs.zarr"
    assert opened, "the new nodes' metadata is written"
    assert not [p for p in opened if p.parent in (root, root / "runs")], opened


def test_a_partition_daemon_removes_debris_beside_the_shared_metadata(tmp_path: Path) -> None:
    """The temporary files of a daemon killed while creating the root's or ``runs/``'s metadata
    are removed by the next partition daemon's startup (only those directly there, and those
    inside its own runs); a write whose temporary file such a startup removes is written again."""
    path = tmp_path / "runs.zarr"
    RunStoreWriter(path, partition=Partition(0, 3))
    debris = [path / "zarr.0123456789abcdef0123456789abcdef.partial",
              path / "runs" / "zarr.json.fedcba9876543210fedcba9876543210.partial"]
    for d in debris:
        d.write_bytes(b"{")
    writer = RunStoreWriter(path, partition=Partition(1, 3))
    assert writer.debris_removed == 2
    assert not [d for d in debris if d.exists()]
    assert RunStore(path).runs() == []

    from zarr.buffer import default_buffer_prototype

    from storage._format import _write

    calls = []
    real_replace = os.replace

    def replace_after_cleanup(src: str | Path, dst: str | Path) -> None:
        calls.append(src)
        if len(calls) == 1:
            Path(src).unlink()  # another daemon's startup took it for debris
        real_replace(src, dst)

    target = path / "runs" / "x"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(os, "replace", replace_after_cleanup)
        _write(target, default_buffer_prototype().buffer.from_bytes(b"abc"), False, False)
    assert len(calls) == 2
    assert target.read_bytes() == b"abc"
    assert not list(target.parent.glob("x.*.partial"))
