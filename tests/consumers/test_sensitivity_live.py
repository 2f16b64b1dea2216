"""The live analysis as a remote subscriber over real ZeroMQ sockets (tcp and ipc loopback):
it receives the run byte for byte, ends at the run's RunEnd with the same ranking as an
analysis of the same data in process, and stops cleanly on request and on Ctrl-C."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_sensitivity import TRUE, Kept, publish_run

from broker import Broker, RunEnd, VariationSample, ZmqPublisher
from consumers import SampleTable
from consumers.sensitivity import Analysis, LiveResult, analyze, run_live

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["tcp", "ipc"])
def endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """A bindable loopback endpoint (ipc: in a short temporary folder)."""
    if request.param == "tcp":
        yield "tcp://127.0.0.1:*"
        return
    with tempfile.TemporaryDirectory(prefix="wt-") as short:
        yield f"ipc://{short}/live.ipc"


@pytest.fixture
def publisher(endpoint: str) -> Iterator[ZmqPublisher]:
    pub = ZmqPublisher(endpoint, send_timeout=20.0)
    try:
        yield pub
    finally:
        pub.close(timeout=1.0)


class Background:
    """Runs ``run_live`` on a thread; its result or exception is kept; stopped at teardown."""

    def __init__(self, **kwargs: Any) -> None:
        self.stop = threading.Event()
        self.result: LiveResult | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, kwargs=kwargs, daemon=True)
        self.thread.start()

    def _run(self, **kwargs: Any) -> None:
        try:
            self.result = run_live(stop=self.stop, **kwargs)
        except BaseException as exc:  # handed to the test
            self.error = exc

    def join(self, timeout: float) -> LiveResult:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "run_live did not return"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


@pytest.fixture
def background() -> Iterator[Callable[..., Background]]:
    made: list[Background] = []

    def make(**kwargs: Any) -> Background:
        made.append(Background(**kwargs))
        return made[-1]

    yield make
    for b in made:
        b.stop.set()
        b.thread.join(30)


def test_live_analysis_ends_at_run_end(publisher: ZmqPublisher, background: Callable[..., Background],
                                       tmp_path: Path) -> None:
    """The subscriber takes run/ as well as variation/ and episode/, so it ends at the run's
    RunEnd (the README's remote loop filtered run/ out and never ended); what it analysed is
    byte for byte the table built in process, and its indices are those of the same analysis
    in process: the true factors above the dummy, the others below."""
    live = background(endpoint=publisher.endpoints[0], out=tmp_path / "out", every=500,
                      outputs=["success", "length"], resamples=20, seed=3, fractions=(0.75,))
    publisher.wait_for_subscribers(1, timeout=20)
    local, kept = SampleTable(), Kept()
    with Broker(strict=True) as broker:
        broker.subscribe("", publisher)
        local.attach(broker)
        broker.subscribe("run/", kept)
        publish_run(broker)
    publisher.close(timeout=20)  # returns once the RunEnd is confirmed
    result = live.join(120)
    assert result.ended
    assert not result.interrupted
    assert result.run == "known"
    assert result.gaps == 0
    assert result.recomputed >= 1
    mine, theirs = local.arrays(), result.arrays
    assert theirs is not None
    assert theirs.x_columns == mine.x_columns
    assert theirs.x.tobytes() == mine.x.tobytes()
    assert theirs.y.tobytes() == mine.y.tobytes()
    end = next(m for m in kept.messages if isinstance(m, RunEnd))
    assert result.declarations == {k: dict(v) for k, v in end.variations.items()}
    final = result.analysis
    assert final is not None
    expected = analyze(mine, result.declarations, run="known", outputs=["success", "length"],
                       resamples=20, seed=3, fractions=(0.75,))
    assert json.dumps([r.as_dict() for r in final.indices]) == json.dumps(
        [r.as_dict() for r in expected.indices])  # NaN where a method does not fit compares equal
    assert set(final.influential("success", "pawn")) == TRUE
    assert final.influential("length", "pawn") == ["a"]
    assert final.influential("success", "pawn", control="shuffled") == []
    assert set(result.paths) == {"indices.csv", "indices.json", "rates.csv", "sensitivity.png",
                                 "convergence.png"}
    assert all(p.stat().st_size > 0 for p in result.paths.values())


def test_live_stop_writes_what_arrived(publisher: ZmqPublisher, background: Callable[..., Background],
                                       tmp_path: Path) -> None:
    """Stopped in the middle of a run (what Ctrl-C does), it analyses the episodes that arrived
    and writes its outputs; provisional results came before."""
    first: queue.Queue[Analysis] = queue.Queue()
    live = background(endpoint=publisher.endpoints[0], out=tmp_path / "out", every=100,
                      outputs=["success"], methods=["pawn"], resamples=10, fractions=(),
                      on_result=first.put)
    publisher.wait_for_subscribers(1, timeout=20)
    with Broker(strict=True) as broker:
        broker.subscribe("", publisher)
        publish_run(broker, episodes=300, close=False)
        provisional = first.get(timeout=60)  # the readiness signal: a recomputation happened
        live.stop.set()
        result = live.join(60)
    assert provisional.episodes >= 100
    assert result.interrupted
    assert not result.ended
    assert result.analysis is not None
    assert result.episodes >= provisional.episodes
    assert (tmp_path / "out" / "indices.json").stat().st_size > 0


@pytest.fixture
def tcp_publisher() -> Iterator[ZmqPublisher]:
    pub = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20.0)
    try:
        yield pub
    finally:
        pub.close(timeout=1.0)


@pytest.mark.parametrize(("sig", "inherited"), [(signal.SIGINT, "default"), (signal.SIGINT, "ignored"),
                                                (signal.SIGTERM, "default")],
                         ids=["sigint", "sigint-inherited-ignored", "sigterm"])
def test_ctrl_c_ends_the_command_cleanly(tcp_publisher: ZmqPublisher, tmp_path: Path, sig: int,
                                         inherited: str) -> None:
    """``python -m consumers.sensitivity --connect`` stopped by SIGINT (or SIGTERM) in the middle
    of a run exits 0 without a traceback and leaves its outputs (one transport: a subprocess is
    slow). Also when it inherited SIGINT ignored, as a command a script starts in the background
    does. Bug caught: such a command ran on after SIGINT until the run's end (the fresh-clone
    CI, run in the background, hung here), and SIGTERM killed it with nothing written."""
    publisher = tcp_publisher
    out = tmp_path / "out"
    # -X faulthandler: a command that does not end is made to print every thread's stack
    # (SIGABRT), and the failure shows where it stood
    command = [sys.executable, "-X", "faulthandler", "-m", "consumers.sensitivity", "--connect",
               publisher.endpoints[0], "--out", str(out), "--every", "100000", "--resamples", "5",
               "--outputs", "success", "--methods", "pawn"]
    if inherited == "ignored":  # SIG_IGN survives exec: the command starts with SIGINT ignored
        command = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.argv[1], sys.argv[1:])", *command]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines: queue.Queue[str] = queue.Queue()
    err: list[str] = []
    out_lines: list[str] = []

    def pump(stream: Any, keep: list[str], signal_to: queue.Queue[str] | None) -> None:
        for line in stream:
            keep.append(line)
            if signal_to is not None:
                signal_to.put(line)

    readers = [threading.Thread(target=pump, args=(proc.stderr, err, lines), daemon=True),
               threading.Thread(target=pump, args=(proc.stdout, out_lines, None), daemon=True)]
    for reader in readers:
        reader.start()
    try:
        publisher.wait_for_subscribers(1, timeout=60)
        with Broker(strict=True) as broker:
            broker.subscribe("", publisher)
            publish_run(broker, episodes=200, close=False)
            while "receiving finished episodes" not in lines.get(timeout=60):  # readiness
                pass
            proc.send_signal(sig)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                proc.wait(10)
                for reader in readers:
                    reader.join(10)
                pytest.fail(f"the command did not end within 60 s of {signal.Signals(sig).name}; its "
                            f"stderr, with every thread's stack:\n" + "".join(err)[-8000:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for reader in readers:
            reader.join(10)
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[union-attr]
    stdout = "".join(out_lines)
    stderr = "".join(err)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "interrupted after" in stderr
    assert (out / "indices.json").stat().st_size > 0
    assert "indices.json: " in stdout


def test_a_message_that_does_not_fit_the_run_is_left_out_and_counted(
        publisher: ZmqPublisher, background: Callable[..., Background], tmp_path: Path) -> None:
    """A variation sample for world -1 (here sent beside the 40th sample of ``a``, its value
    shifted by 100) is left out of the analysis and counted, and the loop goes on: the table
    analysed is byte for byte that of the run without it. Bug caught: the sample was taken for
    the run's last world (numpy's index -1), whose next episode then joined the value 100 off,
    and a message the table refused (a value of another shape) ended the tool with a traceback."""
    status: list[str] = []
    live = background(endpoint=publisher.endpoints[0], out=tmp_path / "out", every=10_000,
                      outputs=["success"], methods=["pawn"], resamples=5, fractions=(),
                      on_status=status.append)
    publisher.wait_for_subscribers(1, timeout=20)
    samples = 0

    def with_a_bad_sample(msg: Any) -> None:
        nonlocal samples
        publisher(msg)
        if isinstance(msg, VariationSample) and msg.key == "a":
            samples += 1
            if samples == 40:
                publisher(dataclasses.replace(msg, worlds=torch.tensor([-1]), episodes=msg.episodes[:1],
                                              value=msg.value[:1] + 100))

    local = SampleTable()
    with Broker(strict=True) as broker:
        broker.subscribe("", with_a_bad_sample)
        local.attach(broker)
        publish_run(broker, episodes=300)
    publisher.close(timeout=20)
    result = live.join(120)
    assert samples >= 40
    assert result.ended
    assert result.gaps == 0
    assert result.rejected == 1
    assert any("left out: topic 'variation/a': worlds: expected indices of the run's 32 worlds, got -1..-1"
               in line for line in status), status
    mine, theirs = local.arrays(), result.arrays
    assert theirs is not None
    assert theirs.x.tobytes() == mine.x.tobytes()
    assert theirs.y.tobytes() == mine.y.tobytes()


def test_a_run_id_that_is_a_path_writes_inside_runs_sensitivity(
        publisher: ZmqPublisher, background: Callable[..., Background], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Bug: without ``out`` the live outputs went to ``runs/sensitivity/<run id>`` as a path, the
    run id as the remote publisher sent it: ``../../escaped-live`` wrote outside ``runs/``."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    live = background(endpoint=publisher.endpoints[0], every=10_000, outputs=["success"], resamples=10,
                      fractions=())
    publisher.wait_for_subscribers(1, timeout=20)
    with Broker(strict=True) as broker:
        broker.subscribe("", publisher)
        publish_run(broker, run="../../escaped-live", worlds=16, episodes=200)
    publisher.close(timeout=20)
    result = live.join(120)
    assert result.run == "../../escaped-live"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"]
    folder = work / "runs" / "sensitivity" / "%2E.%2F..%2Fescaped-live"
    assert sorted(p.parent for p in result.paths.values()) == [Path("runs/sensitivity/%2E.%2F..%2Fescaped-live")] * 5
    assert sorted(p.name for p in folder.iterdir()) == sorted(result.paths)
