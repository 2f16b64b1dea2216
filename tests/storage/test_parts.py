"""Smaller parts: the lock, sizes, status lines, fsync stores, failed-store names."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import pytest
import zarr
from hypothesis import given, settings
from hypothesis import strategies as st
from storage_sim import Sim

from broker import Broker
from storage import RunStore, StoreDaemon, StoreLock, StoreLockedError, _format, failed_store_location
from storage._format import SyncedLocalStore, name_of, node_name, open_store
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


# Names a node must never take inside its group. ``c`` (zarr v3's chunk prefix) is not one of
# them: chunks live under arrays, and every escaped node is a child of a group, where a child
# named ``c`` is an ordinary node (a field named "c" is stored and read back like any other).
RESERVED = ("zarr.json", ".", "..", "_step", "_hook", ".zattrs", ".zgroup", ".zarray")


@settings(max_examples=400, deadline=None)
@given(st.text(min_size=1, max_size=300))
def test_node_names_round_trip_and_never_land_on_reserved_names(name: str) -> None:
    node = node_name(name)
    assert node == node_name(name)  # stable
    for bad in ("/", "\\", "\x00"):
        assert bad not in node
    assert not node.startswith(("_", "."))
    assert node not in RESERVED
    assert not node.endswith(".partial")
    assert len(node.encode()) <= 120
    back = name_of(node)
    assert back == name or (back is None and "~" in node)


@pytest.mark.parametrize("name", ["__x", "..", ".", "batch/..", "a/b", "100%", "_step", "zarr.json",
                                  "x.partial", "\x00", "é", "a" * 300, "%41"])
def test_node_names_of_the_campaign_cases(name: str) -> None:
    node = node_name(name)
    assert name_of(node) in (name, None)
    if len(name) < 30:
        assert name_of(node) == name
    assert node not in RESERVED
    assert "/" not in node


def test_node_names_do_not_collide() -> None:
    names = ["a/b", "a%2Fb", "a_b", "_ab", "A", "a", "a" * 300, "a" * 301, "%", "%25"]
    nodes = [node_name(n) for n in names]
    assert len(set(nodes)) == len(names)
    with pytest.raises(ValueError, match="expected a non-empty name"):
        node_name("")


def test_locations(tmp_path: Path) -> None:
    assert failed_store_location(tmp_path / "runs.zarr") == str(tmp_path / "runs_failed.zarr")
    assert failed_store_location("s3://bucket/runs.zarr") == "s3://bucket/runs_failed.zarr"
    assert failed_store_location(str(tmp_path / "plain")) == str(tmp_path / "plain_failed")
    assert isinstance(open_store(tmp_path / "x", fsync=True), SyncedLocalStore)
    assert isinstance(open_store("memory://x"), zarr.abc.store.Store)


def test_fsync_store_syncs_every_file_before_it_replaces_the_old_one(
        broker: Broker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file of the store, chunks and metadata, is written to a temporary file that is
    fsync-ed *before* it is renamed over its key (a power cut between the rename and a later
    sync could leave an empty commit point), and its directory is fsync-ed after."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", f"{src} -> {dst}"))
        real_replace(src, dst)

    def link(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        events.append(("rename", f"{src} -> {dst}"))
        real_link(src, dst)

    monkeypatch.setattr(_format.os, "fsync", fsync)
    monkeypatch.setattr(_format.os, "replace", replace)
    monkeypatch.setattr(_format.os, "link", link)
    daemon = StoreDaemon(tmp_path / "runs.zarr", fsync=True)
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, reset_p=0.2)
    sim.step(20)
    sim.close()
    daemon.close()
    monkeypatch.undo()
    assert len(RunStore(tmp_path / "runs.zarr").episodes("run-a")) == len(sim.outcome) > 0
    renames = [(i, text.split(" -> ")) for i, (kind, text) in enumerate(events) if kind == "rename"]
    written = {dst for _, (_, dst) in renames}
    root_meta = str(tmp_path / "runs.zarr" / "zarr.json")
    files = {str(p) for p in (tmp_path / "runs.zarr").rglob("*") if p.is_file()} - {root_meta}
    assert files <= written, sorted(files - written)[:5]  # every file went through the synced path
    for i, (src, dst) in renames:
        synced_before = [j for j, (kind, path) in enumerate(events[:i]) if kind == "fsync" and path == src]
        assert synced_before, f"{dst} was renamed into place before its bytes were synced"
        dir_after = [j for j, (kind, path) in enumerate(events[i:]) if kind == "fsync"
                     and path == str(Path(dst).parent)]
        assert dir_after, f"the directory of {dst} was not synced after the rename"


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


@pytest.mark.parametrize(("argv", "message"), [
    (["--commit-interval", "nan"], "argument --commit-interval: expected"),
    (["--commit-interval", "-1"], "argument --commit-interval: expected"),
    (["--commit-interval", "inf"], "argument --commit-interval: expected"),
    (["--status-interval", "0"], "argument --status-interval: expected"),
    (["--lease-ttl", "nan"], "argument --lease-ttl: expected"),
    (["--idle-timeout", "-5"], "argument --idle-timeout: expected"),
    (["--hwm", "-1"], "argument --hwm: expected a positive integer, got '-1'"),
    (["--hwm", "0"], "argument --hwm: expected a positive integer, got '0'"),
    (["--max-runs", "0"], "argument --max-runs: expected a positive integer"),
    (["--bind", "tcp://127.0.0.1:99999"], "argument --bind:"),
    (["--connect", "tcp://127.0.0.1:0"], "argument --connect:"),
    (["--bind", "ipc:///nonexistent-dir-worldtap/x.sock"], "argument --bind:"),
])
def test_bad_option_values_are_usage_errors(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Item 30: ``nan`` and negative intervals were accepted (with ``nan`` nothing was ever
    committed), ``--hwm -1`` escaped as a raw ZMQError and ``--hwm 0`` meant an unbounded
    queue, and ``--bind tcp://127.0.0.1:99999`` listened on another port."""
    from storage.cli import build_parser

    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["runs.zarr", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
