"""``worldtap-store verify`` and ``repair`` on real stores written by the daemon, damaged on
purpose: verify names the damage and exits 7; repair keeps exactly the longest verified prefix
of episodes (byte-equal to what was published), records the rest as a source-4 gap, and leaves
a store that verifies, that a second repair does not touch, and that a daemon still serves. A
repair killed at any of its writes leaves the damaged run or the repaired one, and a second
repair completes it.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import zarr
from faulty_store import FaultyStore
from procs import ENV
from storage_sim import Sim, assert_episode_equal
from store_checks import Spans

from broker import Broker
from storage import RunStore, StoreDaemon, StoreLock, repair_store, verify_store
from storage.cli import main

pytestmark = pytest.mark.timeout(120)


def _write(path: Path, runs: tuple[str, ...] = ("run-a", "run-b"),
           chunk_bytes: int = 256) -> tuple[dict[str, Sim], dict[str, Spans]]:
    """Runs of a small simulation, in many small chunks; long episodes are flushed in
    several segments (a small memory budget)."""
    daemon = StoreDaemon(path, commit_interval=0.0, chunk_bytes=chunk_bytes, memory_budget=6000)
    sims, spans = {}, {}
    for i, run in enumerate(runs):
        broker = Broker()
        broker.subscribe("", daemon)
        spans[run] = Spans()
        broker.subscribe("", spans[run])
        sim = Sim(broker, 4, run=run, seed=i, reset_p=0.1)
        sim.step(40)
        sim.close()
        sims[run] = sim
    daemon.close()
    return sims, spans


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Sim], dict[str, Spans]]:
    path = tmp_path_factory.mktemp("verify") / "base.zarr"
    sims, spans = _write(path)
    return path, sims, spans


def _copy(base: Path, tmp_path: Path) -> Path:
    path = tmp_path / "runs.zarr"
    shutil.copytree(base, path)
    return path


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _segments(path: Path, run: str) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Plain zarr: per committed segment its episode row, topic and [offset, offset + rows)."""
    group = zarr.open_group(str(path / "runs" / run), mode="r")
    meta = group.attrs["worldtap_run"]
    n = meta["committed"]["segments"]
    cols = {c: np.asarray(group[f"segments/{c}"][:n]) for c in ("episode", "topic", "offset", "rows")}
    return cols["episode"], np.stack([cols["topic"], cols["offset"], cols["offset"] + cols["rows"]], 1), \
        meta["topics"]


def _first_touching(path: Path, run: str, term: str, lo: int, hi: int) -> int:
    """The first episode (commit order) with rows of ``term`` in ``[lo, hi)``: the longest
    verified prefix when those rows are damaged."""
    owner, segs, topics = _segments(path, run)
    code = topics.index(term)
    hit = (segs[:, 0] == code) & (segs[:, 1] < hi) & (segs[:, 2] > lo) & (segs[:, 2] > segs[:, 1])
    return int(owner[hit].min())


def _chunk(path: Path, run: str, array: str, k: int) -> tuple[Path, int, int]:
    """Chunk file ``k`` of ``array`` and the rows it holds."""
    arr = zarr.open_array(str(path / "runs" / run / array), mode="r")
    key = arr.metadata.encode_chunk_key((k, *(0,) * (arr.ndim - 1)))
    return path / "runs" / run / array / key, k * arr.chunks[0], (k + 1) * arr.chunks[0]


def _flip(path: Path) -> int:
    f, lo, hi = _chunk(path, "run-a", "data/obs/state", 3)
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    return _first_touching(path, "run-a", "obs", lo, hi)


def _delete(path: Path) -> int:
    f, lo, hi = _chunk(path, "run-a", "data/obs/nest%2Fx", 4)
    f.unlink()
    return _first_touching(path, "run-a", "obs", lo, hi)


def _truncate(path: Path) -> int:
    f, lo, hi = _chunk(path, "run-a", "data/obs/_step", 2)
    f.write_bytes(f.read_bytes()[:7])
    return _first_touching(path, "run-a", "obs", lo, hi)


def _segments_chunk(path: Path) -> int:
    f = path / "runs/run-a/segments/offset/c/0"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 3] ^= 0x55
    f.write_bytes(bytes(raw))
    return 0  # the segment table is one chunk: no episode's segments can be read


def _array_metadata(path: Path) -> int:
    (path / "runs/run-a/data/final/reward/zarr.json").write_text('{"zarr_format": 3, "node_ty')
    return _first_touching(path, "run-a", "final", 0, 1 << 40)


DAMAGE: dict[str, tuple[Callable[[Path], int], str]] = {
    "flipped byte": (_flip, r"data/obs/state chunk 3 .*checksum"),
    "deleted chunk": (_delete, r"data/obs/nest%2Fx chunk 4 .*missing"),
    "truncated chunk": (_truncate, r"data/obs/_step chunk 2 .*cannot be read"),
    "segments chunk": (_segments_chunk, r"segments/offset chunk 0 .*checksum"),
    "array zarr.json": (_array_metadata, r"data/final/reward .*cannot be opened"),
}


def _same_report(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two reports say the same of every run (the store's name aside; an array that cannot be
    opened is named by the error's type, whose text names the store)."""
    def strip(report: dict[str, Any]) -> str:
        text = json.dumps(report["runs"])
        return re.sub(r"cannot be opened: (\w+)\(.*?\)\\?\"", r"cannot be opened: \1", text)
    return strip(a) == strip(b)


class InFlight(zarr.storage.WrapperStore[Any]):
    """A store whose every read takes 20 ms, counting the arrays of runs (``runs/<run>/<group>/
    <array>`` and deeper; not the runs, which a reader opens at once) read at once."""

    flight: ClassVar[Counter[str]] = Counter()
    peak: ClassVar[int] = 0
    chunks: ClassVar[int] = 0
    chunks_peak: ClassVar[int] = 0
    runs_peak: ClassVar[int] = 0

    async def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        node = re.sub(r"/(c([./]\d+)+|zarr\.json)$", "", key)  # the array of a chunk or document
        chunk = node != key and not key.endswith("zarr.json")
        InFlight.flight[node] += 1
        InFlight.chunks += chunk
        InFlight.peak = max(InFlight.peak, sum(1 for n, k in InFlight.flight.items() if k and n.count("/") >= 3))
        InFlight.runs_peak = max(InFlight.runs_peak, len({n.split("/")[1] for n, k in InFlight.flight.items()
                                                          if k and n.count("/") >= 3}))
        InFlight.chunks_peak = max(InFlight.chunks_peak, InFlight.chunks)
        try:
            await asyncio.sleep(0.02)
            return await self._store.get(key, *args, **kwargs)
        finally:
            InFlight.flight[node] -= 1
            InFlight.chunks -= chunk

    def _with_store(self, store: Any) -> InFlight:
        return InFlight(store)


def test_an_object_store_s_arrays_are_verified_at_once(base: tuple[Path, dict[str, Sim], dict[str, Spans]]) -> None:
    """On an object store, verify opens and reads a run's arrays at once, not one after the
    other, and checks the runs at once (6 runs of 30 episodes, 20 ms a request: 12.9 s, 1.9 s
    with a run's arrays at once, 0.6 s with 32 arrays at once, 0.38 s with the runs at once);
    its report is the local one, and progress counts every chunk once. Bug caught: one array,
    or one run, at a time."""
    path = base[0]
    local: list[int] = []
    want = verify_store(path, progress=local.append)
    InFlight.peak = InFlight.chunks_peak = InFlight.runs_peak = 0
    counted: list[int] = []
    got = verify_store(InFlight(zarr.storage.FsspecStore.from_url(f"file://{path}", read_only=True)),
                       progress=counted.append)
    assert InFlight.peak >= 2, "the arrays were read one after the other"
    assert InFlight.runs_peak >= 2, "the runs were checked one after the other"
    assert got.sound
    assert _same_report(got.to_dict(), want.to_dict())
    assert sum(counted) == sum(local) > 0


def test_arrays_read_at_once_hold_no_more_chunks_than_one_array_read_alone(tmp_path: Path) -> None:
    """Each chunk read is held decoded until its batch is checked: arrays read at once read
    in smaller batches, at most 64 chunks in all, as one array read alone. Bug caught: 8
    arrays of 64-chunk batches (8x the memory; 4 GiB with 8 MiB chunks)."""
    path = tmp_path / "runs.zarr"
    _write(path, ("run-a",), chunk_bytes=16)  # a chunk of a row or two
    InFlight.peak = InFlight.chunks_peak = 0
    report = verify_store(InFlight(zarr.storage.FsspecStore.from_url(f"file://{path}", read_only=True)))
    assert report.sound
    assert InFlight.peak >= 2
    assert 32 < InFlight.chunks_peak <= 64, InFlight.chunks_peak


def test_a_sound_store_verifies_clean(base: tuple[Path, dict[str, Sim], dict[str, Spans]]) -> None:
    """Long (multi-segment) episodes and variation samples verify, every chunk of every run
    read; a repair changes no byte."""
    path, sims, _ = base
    reader = RunStore(path)
    assert int(reader.episodes("run-a")["segments"].max()) > 3  # flushed in fragments
    assert reader.variation_samples("run-a", "friction")["world"].size > 0
    report = verify_store(path)
    assert report.sound, [str(p) for p in report.problems]
    assert [(r.run, r.episodes, r.verified) for r in report.runs] == [
        (run, len(sims[run].outcome), len(sims[run].outcome)) for run in ("run-a", "run-b")]
    before = _files(path)
    assert main(["verify", str(path)]) == 0
    assert main(["repair", str(path)]) == 0
    assert _files(path) == before


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_repair_keeps_the_longest_verified_prefix(base: tuple[Path, dict[str, Sim], dict[str, Spans]],
                                                  tmp_path: Path, damage: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    src, sims, spans = base
    path = _copy(src, tmp_path)
    written = RunStore(path).episodes("run-a")
    order = [(int(w), int(i)) for w, i in zip(written["world"], written["index"], strict=True)]
    harm, message = DAMAGE[damage]
    prefix = harm(path)
    assert prefix < len(order)  # the damage reaches a committed episode

    assert main(["verify", str(path)]) == 7
    out = capsys.readouterr().out
    assert f"run-a: DAMAGED, verified episodes {prefix}/{len(order)}" in out
    assert "run-b: ok" in out
    report = verify_store(path)
    assert not report.sound
    assert any(re.search(message, str(p)) for p in report.problems), \
        [str(p) for p in report.problems]
    assert {p.run for p in report.problems} == {"run-a"}
    # through an object-store API (each run's arrays read at once): the same report
    remote = verify_store(zarr.storage.FsspecStore.from_url(f"file://{path}", read_only=True))
    assert _same_report(remote.to_dict(), report.to_dict())

    assert main(["repair", str(path)]) == 0
    assert f"kept {prefix} episode(s), removed {len(order) - prefix}" in capsys.readouterr().out
    reader = RunStore(path)
    kept = reader.episodes("run-a")
    assert [(int(w), int(i)) for w, i in zip(kept["world"], kept["index"], strict=True)] == order[:prefix]
    for key, got in zip(order[:prefix], reader.read_episodes("run-a"), strict=True):
        assert_episode_equal(got, sims["run-a"].arrays(key))
    gaps = [g for g in reader.gaps("run-a").rows() if g["source"] == 4]
    assert len(gaps) == 1
    for key in order[prefix:]:  # every removed episode lies in the recorded range
        a, b = spans["run-a"].first[key], spans["run-a"].last[key]
        assert gaps[0]["expected"] <= a, (key, gaps)
        assert b < gaps[0]["received"], (key, gaps)
    repaired = reader.info("run-a")["repaired"]
    assert repaired["removed_episodes"] == len(order) - prefix
    for key in sims["run-b"].outcome:  # the other run is untouched
        assert_episode_equal(reader.episode("run-b", *key), sims["run-b"].arrays(key))

    assert verify_store(path).sound
    assert main(["verify", str(path)]) == 0
    before = _files(path)
    assert main(["repair", str(path)]) == 0  # idempotent
    assert _files(path) == before

    daemon = StoreDaemon(path, commit_interval=0.0, chunk_bytes=256)  # the store still serves
    broker = Broker()
    broker.subscribe("", daemon)
    sim = Sim(broker, 4, run="run-c", seed=7)
    sim.step(20)
    sim.close()
    daemon.close()
    reader = RunStore(path)
    assert len(reader.episodes("run-c")) == len(sim.outcome)
    for key in sim.outcome:
        assert_episode_equal(reader.episode("run-c", *key), sim.arrays(key))
    assert verify_store(path).sound


def test_damaged_run_attributes_are_reported_and_left_alone(
        base: tuple[Path, dict[str, Sim], dict[str, Spans]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """No index, no prefix to keep: repair says so (exit 7) and writes nothing."""
    path = _copy(base[0], tmp_path)
    meta = path / "runs/run-a/zarr.json"
    doc = json.loads(meta.read_text())
    doc["attributes"]["worldtap_run"]["committed"] = "garbage"
    meta.write_text(json.dumps(doc))
    report = verify_store(path)
    assert [(r.run, r.sound, r.repairable) for r in report.runs] == [("run-b", True, True),
                                                                     ("run-a", False, False)]
    assert "attributes are not a worldtap run's" in str(report.problems[0])
    assert main(["verify", str(path)]) == 7
    capsys.readouterr()
    before = _files(path)
    assert main(["repair", str(path)]) == 7
    assert "run 'run-a': cannot be repaired" in capsys.readouterr().out
    assert _files(path) == before


def test_damaged_variation_samples_are_cut_not_the_episodes(
        base: tuple[Path, dict[str, Sim], dict[str, Spans]], tmp_path: Path) -> None:
    path = _copy(base[0], tmp_path)
    f = path / "runs/run-a/variations/friction/value/c/0"
    f.write_bytes(f.read_bytes()[:-3])
    report = verify_store(path)
    assert report.problems
    assert all("variations/friction/value chunk 0" in str(p) for p in report.problems)
    n = len(RunStore(path).episodes("run-a"))
    _, repairs = repair_store(path)
    assert [(r.run, r.removed_episodes) for r in repairs] == [("run-a", 0)]
    reader = RunStore(path)
    assert len(reader.episodes("run-a")) == n
    assert len(reader.variation_samples("run-a", "friction")) == 0
    assert reader.info("run-a")["repaired"]["removed_samples"] == {
        "friction": len(RunStore(base[0]).variation_samples("run-a", "friction"))}
    assert verify_store(path).sound


def test_repair_refuses_a_store_a_daemon_holds(base: tuple[Path, dict[str, Sim], dict[str, Spans]],
                                              tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _copy(base[0], tmp_path)
    _flip(path)
    before = _files(path)
    with StoreLock(path):  # the lock a daemon on this store holds
        assert main(["repair", str(path)]) == 3
        err = capsys.readouterr().err
        assert "is locked by another storage daemon" in err
        assert len(err.strip().splitlines()) == 1
        assert main(["repair", "--dry-run", str(path)]) == 7  # a dry run only reads
    assert _files(path) == before


def test_verify_and_repair_through_the_installed_command(
        base: tuple[Path, dict[str, Sim], dict[str, Spans]], tmp_path: Path) -> None:
    path = _copy(base[0], tmp_path)
    prefix = _delete(path)
    exe = shutil.which("worldtap-store")
    cmd = [exe] if exe else [sys.executable, "-m", "storage"]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cmd, *args], capture_output=True, text=True, env=ENV, timeout=60,
                              check=False)

    out = run("verify", "--json", str(path))
    assert out.returncode == 7, out.stderr
    doc = json.loads(out.stdout)
    assert doc["sound"] is False
    assert (doc["runs"][0]["run"], doc["runs"][0]["verified"]) == ("run-a", prefix)
    assert doc["runs"][0]["problems"][0]["array"] == "data/obs/nest%2Fx"
    fixed = run("repair", "--run", "run-a", str(path))
    assert fixed.returncode == 0, fixed.stderr
    again = run("verify", str(path))
    assert again.returncode == 0, again.stdout
    missing = run("verify", "--run", "nope", str(path))
    assert missing.returncode == 2
    assert "Traceback" not in missing.stderr + out.stderr + fixed.stderr


def _removed_range_by_the_rule(world: np.ndarray, end_seq: np.ndarray, readable: np.ndarray, verified: int,
                               num_worlds: int, seq_high: int) -> tuple[int, int]:
    """The messages the episodes after the first ``verified`` span, worked out row by row: a
    readable episode from its world's previous end, an unreadable one from the lowest previous
    end of any world (0 for a world with none), up to ``seq_high``."""
    ends_so_far: dict[int, int] = {}
    starts, stops = [], []
    for i in range(len(world)):
        if i >= verified:
            if readable[i]:
                starts.append(ends_so_far.get(int(world[i]), 0))
                stops.append(int(end_seq[i]) + 1)
            else:
                starts.append(min(ends_so_far.get(x, 0) for x in range(num_worlds)))
                stops.append(seq_high + 1)
        if readable[i]:
            ends_so_far[int(world[i])] = int(end_seq[i])
    return min(starts), max(max(stops), min(starts))


def test_the_removed_range_matches_the_rule_row_by_row() -> None:
    """verify's removed range worked out every world's lowest boundary again for each unreadable
    episode row (a damaged chunk of 16384 rows at 65536 worlds: about 10^9 lookups); it is now
    worked out once per run of unreadable rows. Random episode tables, damage in runs of rows,
    against the rule row by row."""
    from storage.verify import _Column, _removed_range

    rng = np.random.default_rng(17)
    for _ in range(400):
        n, num_worlds = int(rng.integers(1, 40)), int(rng.integers(1, 6))
        world = rng.integers(0, num_worlds, n)
        end_seq = rng.integers(0, 60, n)  # any order: a damaged table promises nothing
        bad = np.zeros(n, bool)
        for _ in range(int(rng.integers(0, 3))):  # damage comes a chunk of rows at a time
            first = int(rng.integers(0, n))
            bad[first:first + int(rng.integers(1, 8))] = True
        which = rng.integers(0, 2, n).astype(bool)  # the world or the end column unreadable
        ep = {"world": _Column(world, bad & which), "end_seq": _Column(end_seq, bad & ~which)}
        verified, seq_high = int(rng.integers(0, n)), int(end_seq.max()) + int(rng.integers(0, 5))
        got = _removed_range(ep, bad, verified, num_worlds, seq_high)
        assert got == _removed_range_by_the_rule(world, end_seq, ~bad, verified, num_worlds, seq_high)


class _Killed(BaseException):
    """A kill: raised at one write and at every write after it, so the store holds what a process
    killed just before that write leaves (no ``except Exception`` catches it)."""


def _kill_at(n: int) -> Callable[[int, str, bytes | None], None]:
    def before(k: int, key: str, value: bytes | None) -> None:
        if k >= n:
            raise _Killed(f"write {k} ({key})")
    return before


# A repair in its own process, killed (SIGKILL) just before write number argv[2] of the store.
_KILLED_REPAIR = """
import sys
sys.path.insert(0, sys.argv[3])
from faulty_store import FaultyStore, kill_when
from storage import repair_store
repair_store(FaultyStore(sys.argv[1], before=kill_when(lambda k, key, value: k == int(sys.argv[2]))))
"""


def _order(path: Path, run: str = "run-a") -> list[tuple[int, int]]:
    table = RunStore(path).episodes(run)
    return [(int(w), int(i)) for w, i in zip(table["world"], table["index"], strict=True)]


@pytest.mark.parametrize("damage", ["flipped byte", "array zarr.json"])
def test_a_repair_killed_at_any_write_leaves_what_a_second_repair_completes(
        base: tuple[Path, dict[str, Sim], dict[str, Spans]], tmp_path: Path, damage: str) -> None:
    """A repair killed before any one of its writes (a sample of them spread over the whole
    repair, and each write around its commit point): what a reader sees is the whole damaged
    run or exactly the repaired one (never a mix), and a second repair leaves the longest
    verified prefix, byte-equal to what was published, with the removed range as one gap. Also
    a real repair process killed by SIGKILL just before its commit point leaves the same files as
    the simulated kill there. ("array zarr.json" removes the unreadable array before the commit.)
    Bugs it would catch: the arrays cut before the commit point names the kept rows; the gap
    committed apart from the cut (a kill between the two loses the record of the loss)."""
    src, sims, spans = base
    damaged = tmp_path / "damaged.zarr"
    shutil.copytree(src, damaged)
    order = _order(damaged)
    prefix = DAMAGE[damage][0](damaged)
    commits: list[int] = []  # the write of the commit point that names the kept rows

    def find_commit(n: int, key: str, value: bytes | None) -> None:
        if key == "runs/run-a/zarr.json" and value is not None and b'"repaired"' in value and not commits:
            commits.append(n)

    counted = FaultyStore(_copy(damaged, tmp_path / "counted"), before=find_commit)
    repair_store(counted)
    assert len(commits) == 1
    points = sorted({*range(1, counted.writes + 1, 13), counted.writes,
                     *(commits[0] + d for d in (-1, 0, 1, 2))})
    for n in points:
        path = tmp_path / f"kill{n}.zarr"
        shutil.copytree(damaged, path)
        with pytest.raises(_Killed):
            repair_store(FaultyStore(path, before=_kill_at(n)))
        seen = _order(path)
        assert seen in (order, order[:prefix]), f"killed at write {n}: {len(seen)} episodes visible"
        repair_store(path)
        assert verify_store(path).sound, f"killed at write {n}"
        reader = RunStore(path)
        assert _order(path) == order[:prefix], f"killed at write {n}"
        for key, got in zip(order[:prefix], reader.read_episodes("run-a"), strict=True):
            assert_episode_equal(got, sims["run-a"].arrays(key))
        gaps = [g for g in reader.gaps("run-a").rows() if g["source"] == 4]
        assert len(gaps) == 1, f"killed at write {n}: {gaps}"
        for key in order[prefix:]:
            assert gaps[0]["expected"] <= spans["run-a"].first[key], (n, key, gaps)
            assert spans["run-a"].last[key] < gaps[0]["received"], (n, key, gaps)
        assert reader.info("run-a")["repaired"]["removed_episodes"] == len(order) - prefix
        for key in sims["run-b"].outcome:
            assert_episode_equal(reader.episode("run-b", *key), sims["run-b"].arrays(key))
        if n == commits[0]:  # no time in the store yet: the two are byte-equal
            real = tmp_path / "real.zarr"
            shutil.copytree(damaged, real)
            child = subprocess.run([sys.executable, "-c", _KILLED_REPAIR, str(real), str(n),
                                    str(Path(__file__).parent)], capture_output=True, text=True,
                                   env=ENV, timeout=60, check=False)
            assert child.returncode == -signal.SIGKILL, child.stderr
            simulated = tmp_path / "simulated.zarr"
            shutil.copytree(damaged, simulated)
            with pytest.raises(_Killed):
                repair_store(FaultyStore(simulated, before=_kill_at(n)))
            assert _files(real) == _files(simulated)
        shutil.rmtree(path)
