"""Smaller parts: the lock, sizes, status lines, fsync stores, failed-store names."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import zarr
from storage_sim import Sim

from broker import Broker
from storage import RunStore, StoreDaemon, StoreLock, StoreLockedError, _zarr_io, failed_store_location
from storage._zarr_io import SyncedLocalStore, decode_name, encode_name, open_store
from storage.cli import parse_size
from storage.status import StatusReporter

pytestmark = pytest.mark.timeout(60)


def test_lock_refuses_a_second_holder_and_is_released(tmp_path: Path) -> None:
    store = tmp_path / "runs.zarr"
    with StoreLock(store) as lock:
        assert lock.held
        with pytest.raises(StoreLockedError, match=r"is locked by another storage daemon \(pid \d+"):
            StoreLock(store).acquire()
    with StoreLock(store):  # released: a new holder gets it
        pass


@pytest.mark.parametrize(("text", "value"), [("512", 512), ("1KiB", 1024), ("64MiB", 64 << 20),
                                             ("1.5GB", 1_500_000_000), ("2gib", 2 << 30)])
def test_parse_size(text: str, value: int) -> None:
    assert parse_size(text) == value


def test_parse_size_rejects() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="expected a size such as 512MiB"):
        parse_size("lots")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive size"):
        parse_size("0")


def test_names_and_locations(tmp_path: Path) -> None:
    for name in ("run-a", "a/b", "__x", ".", "100%"):
        node = encode_name(name)
        assert "/" not in node
        assert not node.startswith("__")
        assert node not in (".", "..")
    assert decode_name(encode_name("a/b")) == "a/b"
    assert failed_store_location(tmp_path / "runs.zarr") == str(tmp_path / "runs_failed.zarr")
    assert failed_store_location("s3://bucket/runs.zarr") == "s3://bucket/runs_failed.zarr"
    assert failed_store_location(str(tmp_path / "plain")) == str(tmp_path / "plain_failed")
    assert isinstance(open_store(tmp_path / "x", fsync=True), SyncedLocalStore)
    assert isinstance(open_store("memory://x"), zarr.abc.store.Store)


def test_fsync_store_round_trip(broker: Broker, tmp_path: Path,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    synced: set[Path] = set()
    real = _zarr_io._fsync_path

    def spy(path: Path) -> None:
        synced.add(Path(path))
        real(path)

    monkeypatch.setattr(_zarr_io, "_fsync_path", spy)
    daemon = StoreDaemon(tmp_path / "runs.zarr", fsync=True)
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.2)
    sim.step(20)
    sim.close()
    daemon.close()
    assert len(RunStore(tmp_path / "runs.zarr").episodes("run-a")) == len(sim.outcome) > 0
    files = {p for p in (tmp_path / "runs.zarr").rglob("*") if p.is_file()}
    chunks = {p for p in files if p.name != "zarr.json"}
    assert chunks, "no chunk files written"
    assert files <= synced  # every file, chunks and metadata, went through fsync


def test_status_log_lines(broker: Broker, caplog: pytest.LogCaptureFixture) -> None:
    daemon = StoreDaemon(zarr.storage.MemoryStore())
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.3)
    sim.step(10)
    reporter = StatusReporter(daemon.statistics, lambda: {"bad_messages": 2, "gaps": 1},
                              interval=0.0, tty=False)
    with caplog.at_level(logging.INFO, logger="worldtap.storage"), reporter:
        reporter.poll()
    assert "status episodes=" in caplog.text
    assert "bad=2" in caplog.text
    assert "gaps=1" in caplog.text
    sim.close()
    daemon.close()
