"""One suite of run-store behaviours, run against every backend a store can live on.

Backends (the ``backend`` and ``written`` fixtures):

- ``local``: a directory (zarr's synchronous write path, guarded by ``flock``);
- ``memory``: a ``zarr.storage.MemoryStore`` (synchronous path; it lives in one process);
- ``file``: a ``file://`` URL (served as the directory it names: ``flock``, synchronous path);
- ``s3``: an ``s3://`` URL on a real S3 API served on loopback by moto (zarr's asynchronous
  path through s3fs, guarded by the lease and fenced).

Every backend runs every test; a behaviour a backend cannot have is skipped with the reason.
Data is checked byte for byte against what the simulation published.
"""

from __future__ import annotations

import errno
import importlib
import json
import logging
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from faulty_store import faulty
from procs import ROOT, Proc
from storage_sim import Sim, assert_episode_equal
from store_checks import Spans, check_store
from waiting import wait_until
from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from broker import Broker, ZmqPublisher
from consumers.sample_table import SampleTable
from storage import (
    DaemonStatistics,
    EpisodeNotFoundError,
    FencedStore,
    LeaseExpiredError,
    RunStore,
    StoreDaemon,
    StoreFormatError,
    StoreLease,
    StoreLock,
    StoreLockedError,
    cli,
    verify_store,
)
from storage._format import StoreLocation, open_store
from storage.cli import build_parser, store_locks

pytestmark = pytest.mark.timeout(120)

BACKENDS = ("local", "memory", "file", "s3")
WORLDS, STEPS = 3, 16
DAEMON: dict[str, Any] = {"chunk_bytes": 128, "memory_budget": 6 << 10, "commit_interval": 3600.0}
"""Small chunks (several per array), a small budget (long episodes flushed as fragments), and
commits only where a test makes them (:func:`commit`), at run ends and at shutdown."""
IN_ONE_PROCESS = "a MemoryStore lives inside one process: no daemon process can open it"
FLOCK_CANNOT_LAPSE = ("a local directory is guarded by flock, which the kernel keeps for its holder "
                      "until it exits: a live holder cannot lose it, so there is nothing to fence")


# -- backends --------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 API on loopback (moto in server mode), one per session; AWS settings point
    every S3 client of this process, and of the processes it starts, at it."""
    pytest.importorskip("s3fs", reason="the s3 backend needs s3fs (pip install 'worldtap[s3]')")
    server_module = pytest.importorskip("moto.server", reason="the s3 backend needs moto[server]")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        nowhere = str(tmp_path_factory.mktemp("aws") / "none")
        with pytest.MonkeyPatch.context() as env:
            for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                               "AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere}.items():
                env.setenv(key, value)
            yield endpoint
    finally:
        server.stop()


@dataclass
class Backend:
    """A store on one backend: what a daemon or reader in this process is given (``location``)
    and what a daemon process is given (``url``; ``None`` for a store only this process sees)."""

    name: str
    location: StoreLocation
    url: str | None

    def read(self, key: str) -> bytes | None:
        """The bytes stored under ``key`` (``None``: absent)."""
        store = open_store(self.location, read_only=True)
        value = sync(store.get(key, default_buffer_prototype()))
        return None if value is None else value.to_bytes()

    def keys(self) -> list[str]:
        store = open_store(self.location, read_only=True)

        async def listing() -> list[str]:
            return sorted([key async for key in store.list()])

        return sync(listing())

    def fingerprint(self) -> dict[str, Any]:
        """Every key with its bytes; on S3 with its ETag (the MD5 of its bytes), one listing
        instead of a request per object."""
        store = open_store(self.location, read_only=True)
        if self.name == "s3":
            fs, root = store.fs, store.path  # type: ignore[attr-defined]
            found = sync(fs._find(root, detail=True))
            return {path.removeprefix(root + "/"): info["ETag"] for path, info in found.items()}
        return {key: self.read(key) for key in self.keys()}


def make_backend(name: str, folder: Path, request: pytest.FixtureRequest) -> Backend:
    if name == "local":
        return Backend(name, folder / "runs.zarr", str(folder / "runs.zarr"))
    if name == "memory":
        return Backend(name, zarr.storage.MemoryStore(), None)
    if name == "file":
        url = (folder / "runs.zarr").as_uri()
        return Backend(name, url, url)
    request.getfixturevalue("s3_endpoint")
    import s3fs

    bucket = f"worldtap-{uuid.uuid4().hex[:12]}"
    s3fs.S3FileSystem().mkdir(bucket)
    url = f"s3://{bucket}/runs.zarr"
    return Backend(name, url, url)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A new, empty store on each backend."""
    return make_backend(request.param, tmp_path, request)


def simulation(broker: Broker, *, run: str = "run-a", seed: int = 0) -> tuple[Sim, Spans]:
    """A small simulation publishing into ``broker`` (which records what each episode spans):
    a per-step term of three fields (one multi-dimensional, one bool, one with a name that is
    escaped), a term recorded at resets, and a variation drawn at resets."""
    spans = Spans()
    broker.subscribe("", spans)
    return Sim(broker, WORLDS, run=run, seed=seed, reset_p=0.15, terms=("obs", "final"),
               variations=("friction",)), spans


@dataclass
class Written:
    backend: Backend
    sim: Sim
    spans: Spans
    live: SampleTable
    stats: DaemonStatistics


@pytest.fixture(scope="module", params=BACKENDS)
def written(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Written:
    """One whole run written by the daemon on each backend (read only by the tests)."""
    backend = make_backend(request.param, tmp_path_factory.mktemp(request.param), request)
    broker = Broker(strict=True)
    live = SampleTable()
    live.attach(broker)
    daemon = StoreDaemon(backend.location, **DAEMON)
    broker.subscribe("", daemon)
    sim, spans = simulation(broker)
    sim.step(STEPS // 2)
    commit(daemon)
    sim.step(STEPS - STEPS // 2)
    sim.close()
    daemon.close()
    return Written(backend, sim, spans, live, daemon.statistics())


def commit(daemon: StoreDaemon, run: str = "run-a") -> None:
    """Commit what ``daemon`` holds complete of ``run`` now, and wait for the commit point
    (nothing if the run failed: it stopped at its last commit)."""
    if run in daemon.runs:
        daemon.runs[run].commit(wait=True)


def check_episodes(reader: RunStore, sim: Sim, run: str = "run-a") -> set[tuple[int, int]]:
    """Every committed episode of ``run`` is byte-equal to what ``sim`` published; returns them."""
    keys = {(int(r["world"]), int(r["index"])) for r in reader.episodes(run).rows()}
    for key in keys:
        assert_episode_equal(reader.episode(run, *key), sim.arrays(key))
    return keys


# -- writing and reading -----------------------------------------------------------------------


def test_round_trip(written: Written) -> None:
    """Every episode published is stored and reads back byte for byte; the run is complete,
    cut to its committed rows, with no temporary file left. Bug caught: a backend whose write
    path loses, reorders or mangles rows (zarr's asynchronous path, a store's set)."""
    stored = check_store(written.backend.location, written.sim, written.spans, "run-a",
                         written.backend.name)
    assert stored == len(written.sim.outcome) == written.stats.episodes_stored > 0
    assert written.stats.runs_failed == 0
    segments = RunStore(written.backend.location).episodes("run-a")["segments"]
    assert segments.max() > 2  # long episodes went through fragments, read back whole


def test_reader(written: Written) -> None:
    """``RunStore``: runs, info, episodes (filtered), episode, variation_table. Bug caught: a
    reader that lists, opens or reads a backend's nodes wrongly (missing runs or columns)."""
    sim = written.sim
    reader = RunStore(written.backend.location)
    assert reader.runs() == ["run-a"]
    info = reader.info("run-a")
    assert info["status"] == "complete"
    assert info["num_worlds"] == WORLDS
    assert info["committed"]["episodes"] == len(sim.outcome)
    assert set(info["variation_samples"]) == {"friction"}
    table = reader.episodes("run-a")
    keys = [(int(w), int(i)) for w, i in zip(table["world"], table["index"], strict=True)]
    assert sorted(keys) == sorted(sim.outcome)
    np.testing.assert_array_equal(table["success"], [sim.outcome[k] for k in keys])
    assert len(reader.episodes("run-a", success=True)) == sum(sim.outcome.values())
    key = max(sim.outcome, key=lambda k: len(sim.arrays(k)["obs/state"]))
    assert_episode_equal(reader.episode("run-a", *key), sim.arrays(key))
    with pytest.raises(EpisodeNotFoundError):
        reader.episode("run-a", 0, 999)
    stored, live = reader.variation_table("run-a"), written.live
    assert stored.columns == live.columns
    a, b = stored.arrays(), live.arrays()
    order_a, order_b = np.lexsort((a.episode, a.world)), np.lexsort((b.episode, b.world))
    assert len(order_a) == len(sim.outcome)
    for got, want in ((a.world, b.world), (a.episode, b.episode), (a.x, b.x), (a.y, b.y)):
        np.testing.assert_array_equal(got[order_a], want[order_b])


def test_bulk_reads_query_and_verify(written: Written) -> None:
    """``read_episodes`` (every episode, byte-equal, in the episode table's order),
    ``read_batch``, ``query`` and ``verify`` on every backend: on an object store (moto's S3)
    they take the concurrent paths (arrays, tables and runs at once). Bug caught: a concurrent
    read that loses, reorders or mixes up episodes, or a verify that reports a sound store
    damaged, on a real S3 API."""
    sim = written.sim
    location = written.backend.location
    reader = RunStore(location)
    table = reader.episodes("run-a")
    keys = [(int(w), int(i)) for w, i in zip(table["world"], table["index"], strict=True)]
    got = list(reader.read_episodes())
    assert len(got) == len(keys) == len(sim.outcome)
    for episode, key in zip(got, keys, strict=True):
        assert_episode_equal(episode, sim.arrays(key))
    batch = RunStore(location).read_batch("run-a")
    for j, key in enumerate(keys):
        assert_episode_equal(batch.episode(j), sim.arrays(key))
    succeeded = reader.query("success", "run-a")
    assert len(succeeded) == sum(sim.outcome.values())
    assert "friction" in succeeded.columns
    report = verify_store(location)
    assert report.sound, [str(p) for p in report.problems]
    assert [(r.run, r.episodes, r.verified) for r in report.runs] == [("run-a", len(keys), len(keys))]


def test_trim_at_run_end(written: Written) -> None:
    """Once a run has ended, plain zarr sees exactly the committed rows of every array, and no
    chunk lies past an array's end. Bug caught: capacity (rows past the committed counts, or
    their chunks) left behind on a backend whose resize does not delete chunks."""
    root = zarr.open_group(open_store(written.backend.location, read_only=True), mode="r")
    run = root["runs/run-a"]
    meta = run.attrs["worldtap_run"]
    committed = meta["committed"]
    assert meta["dirty"] is False
    expected = {f"data/{node}": committed["rows"][term] for term, node in meta["term_nodes"].items()}
    expected |= {name: committed[name] for name in ("episodes", "segments", "gaps")}
    expected |= {f"variations/{v['node']}": committed["variations"][key]
                 for key, v in meta["variations"].items()}
    keys = written.backend.keys()
    arrays = dict(_arrays(run))
    assert len(arrays) > 15
    for path, array in arrays.items():
        assert array.shape[0] == expected[path.rsplit("/", 1)[0]], path
        last = -(-array.shape[0] // int(array.chunks[0]))  # chunks of the rows there are
        prefix = f"runs/run-a/{path}/c"
        for key in keys:
            if key.startswith(prefix):
                assert int(re.split(r"[./]", key[len(prefix) + 1:])[0]) < last, (key, array.shape)


def _arrays(group: zarr.Group, prefix: str = "") -> Iterator[tuple[str, zarr.Array[Any]]]:
    for name, node in group.members():
        if isinstance(node, zarr.Array):
            yield prefix + name, node
        else:
            yield from _arrays(node, f"{prefix}{name}/")


def test_commit_visibility(backend: Backend) -> None:
    """A reader sees a run once it is committed, and never rows written after the last commit
    (until they are committed), whether it refreshes or opens anew. Bug caught: a reader that
    trusts array shapes, or a commit point written before the data it counts."""
    broker = Broker(strict=True)
    daemon = StoreDaemon(backend.location, **DAEMON)
    reader = RunStore(backend.location)  # opened before the run exists
    assert reader.runs() == []
    broker.subscribe("", daemon)
    sim, _ = simulation(broker)
    sim.step(6)
    commit(daemon)
    reader.refresh()
    before = reader.info("run-a")["committed"]
    seen = {(int(r["world"]), int(r["index"])) for r in reader.episodes("run-a").rows()}
    assert seen
    assert before["episodes"] == len(seen)
    sim.step(STEPS)  # more rows and episodes: written (fragments and pieces), never committed
    writer = daemon.runs["run-a"].primary
    daemon.runs["run-a"].queue.wait()
    writer.row_arrays("obs")  # the uncommitted partial chunks too: every row appended is stored
    steps = zarr.open_array(open_store(backend.location, read_only=True), path="runs/run-a/data/obs/_step",
                            mode="r")
    rows = writer.rows("obs")
    assert rows > before["rows"]["obs"]
    assert steps[before["rows"]["obs"]:rows].min() > 0  # the uncommitted rows are in the store
    fresh = RunStore(backend.location)
    reader.refresh()
    for view in (reader, fresh):
        assert view.info("run-a")["committed"] == before
    assert check_episodes(fresh, sim) == seen
    assert {(int(r["world"]), int(r["index"])) for r in reader.episodes("run-a").rows()} == seen
    sim.close()
    daemon.close()
    reader.refresh()
    assert len(reader.episodes("run-a")) == len(sim.outcome) > len(seen)


# -- crashes and resume --------------------------------------------------------------------------


def test_resume_after_an_abandoned_daemon(backend: Backend) -> None:
    """A daemon abandoned mid-run (never closed, like a crash: what it held in memory is lost,
    what it wrote after its last commit stays as debris) is followed by a new daemon on the
    same store, which resumes the run: every committed episode reads back byte for byte, and
    the episodes lost lie in recorded gaps. Bug caught: recovery (cutting back to the last
    commit, reclaiming fragments) that fails or loses data on a backend."""
    broker = Broker(strict=True)
    first = StoreDaemon(backend.location, **DAEMON)
    subscription = broker.subscribe("", first)
    sim, spans = simulation(broker)
    sim.step(6)
    commit(first)
    sim.step(4)  # written (fragments, pieces), never committed
    assembly = first.runs["run-a"]
    assembly.queue.wait()
    subscription.cancel()
    assembly.queue.close()  # its writer thread stops; nothing is committed or cut any more
    committed = len(RunStore(backend.location).episodes("run-a"))
    assert committed > 0
    sim.step(2)  # published while no daemon listens: lost
    second = StoreDaemon(backend.location, **DAEMON)
    broker.subscribe("", second)
    sim.step(STEPS)
    sim.close()
    second.close()
    assert second.statistics().runs_failed == 0
    stored = check_store(backend.location, sim, spans, "run-a", f"resumed on {backend.name}")
    assert stored > committed
    info = RunStore(backend.location).info("run-a")
    assert info["resumed"] == 1


def _daemon(store: str, endpoint: str, cwd: Path, *extra: str) -> Proc:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return Proc([sys.executable, "-m", "storage", store, "--connect", endpoint, "--commit-interval", "0.05",
                 "--memory-budget", "6KiB", "--chunk-size", "128", "--lease-ttl", "3",
                 "--status-interval", "0.2", "--io-threads", "2", *extra], cwd, env)


def _cli_in_process(*args: str) -> int:
    """``worldtap-store ARGS`` run in this process (the process settings it makes, undone)."""
    interval, workers = sys.getswitchinterval(), zarr.config.get("threading.max_workers")
    try:
        return cli.main(list(args))
    finally:
        sys.setswitchinterval(interval)
        zarr.config.set({"threading.max_workers": workers})


def _stop(procs: list[Proc]) -> None:
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.wait(10)


def test_resume_after_kill_9(backend: Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon process: a second one on the same store is refused (exit 3) while the first
    runs; the first is killed (SIGKILL) mid-run, and a new one started on the same store (on
    S3 once the dead daemon's lease expired) resumes the run: every committed episode reads
    back byte for byte, the lost ones lie in recorded gaps. A reader opened before the run
    sees it and its commits as they come. Bug caught: a backend's lock, lease, recovery or
    resume failing with real processes and a real crash; a reader that never sees runs
    another process adds."""
    if backend.url is None:
        pytest.skip(IN_ONE_PROCESS)
    procs: list[Proc] = []
    broker = Broker()
    publisher = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20.0)
    broker.subscribe("", publisher)
    try:
        endpoint = publisher.endpoints[0]
        first = _daemon(backend.url, endpoint, tmp_path)
        procs.append(first)
        first.wait_line("worldtap-store ready")
        reader = RunStore(backend.location)  # the store exists, the run not yet
        publisher.wait_for_subscribers(1, timeout=30)
        sim, spans = simulation(broker)
        sim.step(10)
        # a second daemon while the first holds the store (its command line, in this process)
        assert _cli_in_process(backend.url, "--connect", endpoint, "--lease-ttl", "3") == 3
        refused = capsys.readouterr().err
        assert re.search(r"is (locked|leased) by another storage daemon", refused), refused

        def committed() -> bool:
            reader.refresh()
            return "run-a" in reader.runs() and len(reader.episodes("run-a")) > 0

        wait_until(committed, "a committed episode", timeout=30, poll=0.05)
        first.popen.send_signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        wait_until(lambda: publisher.statistics().subscribers == 0, "the publisher to see it gone", timeout=30)
        sim.step(2)  # published while no daemon listens: lost
        if backend.name == "s3":  # the dead daemon's lease holds the store until it expires
            assert not _try_lease(backend.url)
            wait_until(lambda: _try_lease(backend.url), "the dead daemon's lease to expire",  # type: ignore[arg-type]
                       timeout=30, poll=0.05)
        second = _daemon(backend.url, endpoint, tmp_path, "--exit-after-runs", "1")
        procs.append(second)
        second.wait_line("worldtap-store ready")
        publisher.wait_for_subscribers(1, timeout=30)
        sim.step(STEPS - 10)
        sim.close()
        publisher.close(timeout=30)  # returns once the daemon confirmed the RunEnd (committed)
        assert second.wait() == 0, second.stderr
    finally:
        publisher.close(timeout=5)
        _stop(procs)
    stored = check_store(backend.location, sim, spans, "run-a", f"kill -9 on {backend.name}")
    assert stored > 0
    reader.refresh()
    assert reader.info("run-a")["resumed"] == 1
    assert 1 in reader.gaps("run-a")["source"].tolist()


def _try_lease(url: str) -> bool:
    try:
        StoreLease(url).acquire().release()
    except StoreLockedError:
        return False
    return True


# -- one writer per store ------------------------------------------------------------------------


def test_one_writer_at_a_time(backend: Backend) -> None:
    """The daemon's lock of each backend (``store_locks``: flock for directories, the lease for
    URLs): a second writer is refused while the first holds it, and takes the store over once
    the first is gone (flock: released with its holder's descriptor; lease: expired). Bug
    caught: a backend given no lock, or one a dead holder keeps forever."""
    if backend.url is None:
        pytest.skip(IN_ONE_PROCESS)
    args = build_parser().parse_args([backend.url, "--lease-ttl", "1"])
    [first] = store_locks(args)
    [second] = store_locks(args)
    assert isinstance(first, StoreLease if backend.name == "s3" else StoreLock)
    first.acquire()
    try:
        with pytest.raises(StoreLockedError, match=r"(locked|leased) by another storage daemon"):
            second.acquire()
        if isinstance(first, StoreLease):  # it dies: renewals stop, its lease stays until it expires
            first._stop.set()
            assert first._thread is not None
            first._thread.join()
        else:  # it dies: the kernel drops the flock with its descriptor
            assert first._fd is not None
            os.close(first._fd)
            first._fd = None
        wait_until(lambda: _try(second), "the takeover", timeout=30, poll=0.05)
        assert second.held
        if isinstance(first, StoreLease):
            with pytest.raises(LeaseExpiredError):
                first.check()  # were it to come back, it would be fenced
    finally:
        second.release()
        first.release()


def _try(lock: StoreLock | StoreLease) -> bool:
    try:
        lock.acquire()
    except StoreLockedError:
        return False
    return True


def test_fencing_stops_a_holder_cut_off_from_its_lease(backend: Backend) -> None:
    """A daemon whose lease renewals fail stops writing before its lease could expire: not one
    byte of the store changes afterwards, its run fails at its last commit, and a new holder
    takes over and reads every committed episode. Bug caught: writes (data or commit) that go
    through after the lease lapsed."""
    if backend.name == "memory":
        pytest.skip(IN_ONE_PROCESS)
    if backend.name != "s3":
        pytest.skip(FLOCK_CANNOT_LAPSE)
    assert isinstance(backend.location, str)
    lease = StoreLease(backend.location, ttl=1.2).acquire()
    try:
        broker = Broker()
        daemon = StoreDaemon(FencedStore(open_store(backend.location), lease), **DAEMON)
        broker.subscribe("", daemon)
        sim, _ = simulation(broker)
        sim.step(6)
        commit(daemon)
        assert daemon.statistics().episodes_stored > 0
        reachable = lease.fs

        class CutOff:  # the lease object is unreachable from now on; the store still is
            def __getattr__(self, name: str) -> Any:
                if name in ("pipe_file", "cat_file", "rm_file"):
                    raise ConnectionError("injected: the lease object is unreachable")
                return getattr(reachable, name)

        lease.fs = CutOff()
        wait_until(lease.lost.is_set, "the holder to fence itself", timeout=10, poll=0.05)
        before = backend.fingerprint()
        sim.step(STEPS - 6)
        commit(daemon)  # refused: the run fails here at the latest
        sim.close()
        daemon.close()
        assert backend.fingerprint() == before  # not one byte after the fence
        assert daemon.statistics().runs_failed == 1
        wait_until(lambda: _try_lease(backend.location), "the lapsed lease to expire",  # type: ignore[arg-type]
                   timeout=30, poll=0.05)
        assert check_episodes(RunStore(backend.location), sim)
    finally:
        lease.release()


# -- failures ------------------------------------------------------------------------------------


def test_a_failed_write_keeps_the_last_commit(backend: Backend) -> None:
    """A store write that fails mid-run (an injected disk or network error on the first data
    chunk written after two commits) stops that run at its last commit: the store's commit
    point is the last one written, and every episode it counts reads back byte for byte (a
    daemon resumes such a run like any other: see the resume tests). Bug caught: a commit that
    counts data whose write failed, or a failure that damages what was committed."""
    commit_key = "runs/run-a/zarr.json"
    commits: list[bytes] = []
    failed: list[str] = []

    def before(n: int, key: str, value: bytes | None) -> None:
        chunk = "/data/" in key and key.rsplit("/", 1)[-1].startswith("c")
        if len(commits) >= 2 and chunk and not failed:
            failed.append(key)
            raise OSError(errno.ENOSPC, f"injected: no space left on device ({key})")

    def after(n: int, key: str, value: bytes | None) -> None:
        if key == commit_key and value is not None:
            run = json.loads(value)["attributes"].get("worldtap_run", {})
            if run.get("committed", {}).get("episodes", 0) > 0:
                commits.append(value)  # commit points that count episodes

    store = faulty(open_store(backend.location), before=before, after=after)
    broker = Broker()
    daemon = StoreDaemon(store, **DAEMON)
    broker.subscribe("", daemon)
    sim, _ = simulation(broker)
    for _ in range(3):
        sim.step(5)
        commit(daemon)
    sim.close()
    daemon.close()
    assert failed, "no write failed"
    assert daemon.statistics().runs_failed == 1
    assert len(commits) == 2
    assert backend.read(commit_key) == commits[-1]  # the last commit point, intact
    reader = RunStore(backend.location)
    assert reader.info("run-a")["status"] == "open"
    assert check_episodes(reader, sim)  # each committed episode, byte for byte


# -- URL stores: what is missing, what vanishes ----------------------------------------------------


@pytest.fixture
def no_cloud_filesystems(monkeypatch: pytest.MonkeyPatch) -> None:
    """s3fs and gcsfs made impossible to import (as when they are not installed)."""
    registry = importlib.import_module("fsspec.registry")._registry  # classes imported so far
    for module in ("s3fs", "gcsfs"):
        monkeypatch.setitem(sys.modules, module, None)
    for protocol in ("s3", "s3a", "gs", "gcs"):
        monkeypatch.delitem(registry, protocol, raising=False)


@pytest.mark.parametrize(("url", "extra"), [("s3://bucket/runs.zarr", "s3"), ("gcs://bucket/runs.zarr", "gcs")])
def test_a_url_whose_filesystem_is_missing_names_the_extra(
        no_cloud_filesystems: None, capsys: pytest.CaptureFixture[str], url: str, extra: str) -> None:
    """The daemon's command line exits 3 with one line naming the extra to install, and
    ``RunStore`` raises a ``StorageError`` saying the same. Bug caught: fsspec's ImportError
    escaping as a traceback (exit 1) that does not say which extra installs it."""
    hint = f"pip install 'worldtap[{extra}]'"
    assert _cli_in_process(url, "--connect", "tcp://127.0.0.1:5555") == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "Traceback" not in err
    assert url in err
    assert hint in err
    with pytest.raises(StoreFormatError, match=re.escape(hint)):
        RunStore(url)


def test_a_memory_store_given_to_the_daemon_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """``worldtap-store memory://...`` serves a run, and warns that the store vanishes when the
    daemon exits. Bug caught: runs written where nothing outlives the daemon, silently."""
    broker = Broker()
    publisher = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20.0)
    broker.subscribe("", publisher)

    def publish() -> None:
        publisher.wait_for_subscribers(1, timeout=30)
        sim, _ = simulation(broker)
        sim.step(4)
        sim.close()
        publisher.close(timeout=30)  # until the daemon confirmed the run's end

    thread = threading.Thread(target=publish)
    try:
        thread.start()
        with caplog.at_level(logging.WARNING, logger="worldtap.storage"):
            assert _cli_in_process(f"memory://worldtap-{uuid.uuid4().hex}", "--connect",
                                   publisher.endpoints[0], "--exit-after-runs", "1") == 0
    finally:
        thread.join(30)
        publisher.close(timeout=5)
    assert re.search(r"store 'memory://worldtap-\w+' is held in this process's memory: it vanishes "
                     r"when the daemon exits", caplog.text), caplog.text
