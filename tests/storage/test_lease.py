"""The lease that keeps stores that are not local directories to one daemon at a time."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from waiting import wait_until

from storage import RunStore, RunStoreWriter, StoreLease, StoreLock, StoreLockedError
from storage.cli import build_parser, store_locks

pytestmark = pytest.mark.timeout(60)
pytest.importorskip("fsspec")


def _url() -> str:
    return f"memory://lease-{uuid.uuid4().hex}"


def test_a_second_daemon_is_refused_until_the_first_releases() -> None:
    url = _url()
    first = StoreLease(url)
    with first:
        assert first.held
        with pytest.raises(StoreLockedError, match=r"is leased by another storage daemon \(host "
                                                   r"'[^']+', pid \d+\) for \d+ s more"):
            StoreLease(url).acquire()
    with StoreLease(url) as second:  # released: the key is gone
        assert second.held


def test_a_crashed_holders_lease_expires_and_a_live_one_is_renewed() -> None:
    url = _url()
    live = StoreLease(url, ttl=2.0).acquire()
    try:
        time.sleep(3.0)  # longer than the ttl: only renewal keeps it
        with pytest.raises(StoreLockedError):
            StoreLease(url).acquire()
    finally:
        live.release()
    crashed = StoreLease(url, ttl=0.5).acquire()
    crashed._stop.set()  # renewal stops as in a crash; the key stays in the store
    assert crashed._thread is not None
    crashed._thread.join()
    with pytest.raises(StoreLockedError):
        StoreLease(url).acquire()
    resumed = StoreLease(url)
    wait_until(lambda: _try(resumed), "the resumed lease to be acquired", timeout=20, poll=0.05)
    assert resumed.held
    resumed.release()


def _try(lease: StoreLease) -> bool:
    try:
        lease.acquire()
    except StoreLockedError:
        return False
    return True


def test_a_holder_that_finds_another_lease_knows_it_lost() -> None:
    url = _url()
    holder = StoreLease(url, ttl=0.6).acquire()
    intruder = StoreLease(url)
    intruder._write()  # e.g. an operator forced a second daemon in after a long stall
    wait_until(holder.lost.is_set, "the holder to lose its lease", timeout=20, poll=0.05)
    assert not holder.held
    holder.release()  # never deletes the intruder's lease
    assert intruder._read() is not None


def test_a_run_store_opens_and_reads_beside_its_lease() -> None:
    url = _url()
    with StoreLease(url):
        writer = RunStoreWriter(url)
        run = writer.run("r", num_worlds=2)
        run.commit()
        assert RunStore(url).runs() == ["r"]
        writer.close()
    assert RunStore(url).runs() == ["r"]
    assert np.asarray(RunStore(url).episodes("r")["world"]).size == 0


def test_the_daemon_locks_directories_and_leases_urls(tmp_path: Path) -> None:
    url = _url()
    args = build_parser().parse_args([url, "--export", "split", "--lease-ttl", "5"])
    locks = store_locks(args)
    assert [type(lock) for lock in locks] == [StoreLease, StoreLease]
    assert isinstance(locks[1], StoreLease)
    assert locks[1].url == f"{url}_failed.lock"
    assert locks[0].ttl == 5
    local = store_locks(build_parser().parse_args([str(tmp_path / "runs.zarr")]))
    assert [type(lock) for lock in local] == [StoreLock]
    assert store_locks(build_parser().parse_args([url, "--export", "none"])) == []


def test_a_holder_cut_off_from_the_store_stops_writing_before_its_lease_expires() -> None:
    """Item: the lease did not fence its holder. A daemon whose renewals fail (cut off from the
    store) kept writing after its lease expired while another daemon took over. Now every
    write through its FencedStore is refused once the last renewal is older than ttl - margin,
    and the store's bytes stay exactly as they were, while a second daemon takes over."""
    import fsspec
    import zarr
    from storage_sim import Sim

    from broker import Broker
    from storage import FencedStore, LeaseExpiredError, StoreDaemon

    url = _url()
    lease = StoreLease(url, ttl=1.2).acquire()
    fs = fsspec.filesystem("memory")
    base = zarr.storage.FsspecStore.from_url(url)
    broker = Broker()
    daemon = StoreDaemon(FencedStore(base, lease), commit_interval=0.0)
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.3)
    sim.step(10)
    assert daemon.statistics().episodes_stored > 0

    class CutOff:  # this holder's view of the lease object: renewals fail from now on
        def __getattr__(self, name: str) -> object:
            if name in ("pipe_file", "cat_file", "rm_file"):
                raise ConnectionError("injected: the object store is unreachable")
            return getattr(fs, name)

    lease.fs = CutOff()  # the store itself still accepts the daemon's writes
    wait_until(lease.lost.is_set, "the lease to be lost", timeout=5, poll=0.05)
    with pytest.raises(LeaseExpiredError, match="stopped writing"):
        lease.check()
    root = url.removeprefix("memory://")
    before = {p: fs.cat_file(p) for p in fs.find(root)}
    sim.step(20)  # more messages: commits are due every message
    sim.close()
    daemon.close()
    after = {p: fs.cat_file(p) for p in fs.find(root)}
    assert after == before  # not one byte written after the fence
    assert daemon.statistics().runs_failed == 1
    # the lease expires on the store's clock: a second daemon takes over and reads what was committed
    wait_until(lambda: _try(StoreLease(url)), "a new lease to be acquired", timeout=5, poll=0.05)
    reader = RunStore(url)
    assert len(reader.episodes("run-a")) > 0
    lease.release()  # never deletes the new holder's lease
    assert StoreLease(url)._read() is not None


def test_fencing_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="margin"):
        StoreLease(_url(), ttl=3, margin=2.5)
    with pytest.raises(ValueError, match="ttl"):
        StoreLease(_url(), ttl=float("nan"))


def test_every_write_method_of_a_fenced_store_is_refused_once_the_lease_lapsed() -> None:
    """A lapsed lease refuses every way zarr writes through the store, not only set(): before,
    _set_many (zarr writes several nodes at once through it) and clear() went straight to the
    wrapped store. Nothing changes in the store."""
    import asyncio

    import zarr
    from zarr.buffer import default_buffer_prototype

    from storage import FencedStore, LeaseExpiredError

    class Lapsed:
        def check(self) -> None:
            raise LeaseExpiredError("injected: the lease lapsed")

    base = zarr.storage.MemoryStore()
    buf = default_buffer_prototype().buffer.from_bytes(b"kept")
    asyncio.run(base.set("a/zarr.json", buf))
    fenced = FencedStore(base, Lapsed())  # type: ignore[arg-type]
    new = default_buffer_prototype().buffer.from_bytes(b"new")
    writes = {
        "set": lambda: fenced.set("b", new),
        "set_if_not_exists": lambda: fenced.set_if_not_exists("b", new),
        "_set_many": lambda: fenced._set_many([("b", new), ("a/zarr.json", new)]),
        "delete": lambda: fenced.delete("a/zarr.json"),
        "delete_dir": lambda: fenced.delete_dir("a"),
        "clear": lambda: fenced.clear(),
    }
    for name, write in writes.items():
        with pytest.raises(LeaseExpiredError):
            asyncio.run(write())  # type: ignore[no-untyped-call]
        assert {k: bytes(v.to_bytes()) for k, v in base._store_dict.items()} == {"a/zarr.json": b"kept"}, name
