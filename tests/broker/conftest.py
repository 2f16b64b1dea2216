"""Fixtures for the transport tests: free loopback endpoints, publishers/subscribers that are
closed (linger 0) at teardown even when a test fails, batches whose every byte derives from their
number (and the check of a received one), and a TCP relay that cuts connections on cue."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from broker import Batch, Broker, RunStart, Subscriber, ZmqPublisher

FreeEndpoint = Callable[[], str]


@pytest.fixture(params=["tcp", "ipc"])
def transport(request: pytest.FixtureRequest) -> str:
    """Each transport test runs over tcp:// and ipc:// loopback."""
    return str(request.param)


@pytest.fixture
def ipc_dir(tmp_path: Path) -> Iterator[Path]:
    """A folder for ipc:// sockets; short, because socket paths are limited to ~100 bytes."""
    if len(str(tmp_path)) < 80:
        yield tmp_path
        return
    with tempfile.TemporaryDirectory(prefix="wt-") as short:  # pragma: no cover - long tmp paths
        yield Path(short)


@pytest.fixture
def free_endpoint(transport: str, ipc_dir: Path) -> FreeEndpoint:
    """Returns a new bindable endpoint on each call (tcp: a wildcard port on 127.0.0.1)."""
    counter = iter(range(1000))

    def make() -> str:
        if transport == "tcp":
            return "tcp://127.0.0.1:*"
        return f"ipc://{ipc_dir}/s{next(counter)}.ipc"

    return make


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Objects appended here are closed at teardown, last first, whatever happened."""
    objects: list[Any] = []
    yield objects
    for obj in reversed(objects):
        with contextlib.suppress(Exception):
            if isinstance(obj, ZmqPublisher):
                obj.close(timeout=0.5)
            else:
                obj.close()


@pytest.fixture
def make_pub(closing: list[Any]) -> Callable[..., ZmqPublisher]:
    def make(endpoint: str | list[str], **kwargs: Any) -> ZmqPublisher:
        kwargs.setdefault("send_timeout", 5.0)
        pub = ZmqPublisher(endpoint, **kwargs)
        closing.append(pub)
        return pub

    return make


@pytest.fixture
def make_sub(closing: list[Any]) -> Callable[..., Subscriber]:
    def make(endpoint: str | list[str], **kwargs: Any) -> Subscriber:
        sub = Subscriber(endpoint, **kwargs)
        closing.append(sub)
        return sub

    return make


@pytest.fixture
def broker() -> Iterator[Broker]:
    with Broker(strict=True) as b:
        yield b


def batch(seq: int, worlds: int = 4, width: int = 3, *, run: str = "run-a", topic: str = "batch/obs",
          value: float | None = None) -> Batch:
    """A small batch whose contents encode ``seq`` (so order and integrity can be checked)."""
    idx = torch.arange(worlds)
    fill = float(seq) if value is None else value
    return Batch(run, seq, seq, topic, idx, torch.zeros(worlds, dtype=torch.int64),
                 {"x": torch.full((worlds, width), fill), "done": torch.zeros(worlds, dtype=torch.bool)})


def numbered(seq: int, worlds: int = 4, width: int = 3, *, run: str = "run-a",
             topic: str = "batch/obs") -> Batch:
    """A batch whose every byte derives from ``seq``: a message torn from two others, or one
    that arrives under another's header, fails :func:`check_numbered`."""
    n = worlds * width
    x = ((torch.arange(n, dtype=torch.int64) + seq * 100_003) % (1 << 24)).to(torch.float32)
    ids = torch.arange(n, dtype=torch.int64) * 1_000_003 + seq
    return Batch(run, seq, seq, topic, torch.arange(worlds), torch.full((worlds,), seq, dtype=torch.int64),
                 {"x": x.reshape(worlds, width), "id": ids.reshape(worlds, width)})


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def check_numbered(item: Any, *, run: str = "run-a", topic: str = "batch/obs") -> int:
    """Assert that ``item`` is byte for byte the :func:`numbered` batch of its ``seq`` (header
    fields too); returns the seq."""
    assert isinstance(item, Batch), item
    worlds, width = item.fields["x"].shape
    want = numbered(item.seq, worlds, width, run=run, topic=topic)
    assert (item.run, item.topic, item.step, item.hook) == (want.run, want.topic, want.step, want.hook)
    for name in ("worlds", "episodes"):
        a, b = getattr(item, name), getattr(want, name)
        assert a.dtype == b.dtype, f"{name} of message {item.seq}"
        assert _bytes(a) == _bytes(b), f"{name} of message {item.seq}"
    assert item.fields.keys() == want.fields.keys()
    for name, t in want.fields.items():
        got = item.fields[name]
        assert got.dtype == t.dtype, f"field {name!r} of message {item.seq}"
        assert got.shape == t.shape, f"field {name!r} of message {item.seq}"
        assert _bytes(got) == _bytes(t), f"field {name!r} of message {item.seq} is not its own"
    return int(item.seq)


class Relay:
    """A TCP relay to ``target`` (a bound subscriber) that a publisher connects to. Fault
    injection: after ``cut_on(marker)``, the first chunk from the publisher that holds
    ``marker`` is dropped and both connections are closed at once, as a network failure would;
    the publisher reconnects through the relay."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.accepted = 0
        self.cuts = 0
        self._marker: bytes | None = None
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="test-relay", daemon=True)
        self._thread.start()

    def cut_on(self, marker: bytes) -> None:
        self._marker = marker

    def _pump(self) -> None:
        while not self._stop.is_set():
            sockets = [self._listener] + [s for pair in self._pairs for s in pair]
            ready, _, _ = select.select(sockets, [], [], 0.02)
            for sock in ready:
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    self._pairs.append((client, socket.create_connection(self._target)))
                    self.accepted += 1
                    continue
                pair = next((p for p in self._pairs if sock in p), None)
                if pair is None:
                    continue
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                marker = self._marker
                if data and sock is pair[0] and marker is not None and marker in data:
                    self._marker = None
                    self.cuts += 1
                    data = b""
                if not data:
                    self._close(pair)
                    continue
                (pair[1] if sock is pair[0] else pair[0]).sendall(data)

    def _close(self, pair: tuple[socket.socket, socket.socket]) -> None:
        self._pairs.remove(pair)
        for s in pair:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # linger 0: a reset, whatever was in flight is lost

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for pair in list(self._pairs):
            self._close(pair)
        self._listener.close()


def run_start(run: str = "run-a", worlds: int = 4) -> RunStart:
    return RunStart(run, 0, 0, worlds, "cpu")


def drain(sub: Subscriber, *, idle: float = 0.5, limit: int = 100_000) -> list[Any]:
    """Everything ``sub`` receives until nothing arrives for ``idle`` seconds."""
    items = []
    while len(items) < limit:
        item = sub.recv(timeout=idle)
        if item is None:
            break
        items.append(item)
    return items


def close_and_drain(pub: ZmqPublisher, sub: Subscriber, **kwargs: Any) -> list[Any]:
    """``pub.close()`` while ``sub`` drains in this thread, as a store in another process would:
    close() waits until every subscriber has confirmed each RunEnd it was sent."""
    closer = threading.Thread(target=pub.close)
    closer.start()
    try:
        return drain(sub, **kwargs)
    finally:
        closer.join(30)


def join(pub: ZmqPublisher, *subs: Subscriber, timeout: float = 10.0) -> None:
    """``pub.wait_for_subscribers(len(subs))`` while the subscribers receive: a *bound* SUB socket
    only sends its subscriptions to a connecting publisher while its owner is inside ``recv``."""
    deadline = time.monotonic() + timeout
    while pub.statistics().subscribers < len(subs) and time.monotonic() < deadline:
        for sub in subs:
            assert sub.recv(timeout=0.02) is None
    pub.wait_for_subscribers(len(subs), timeout=0.1)


@pytest.fixture(name="join")
def join_fixture() -> Callable[..., None]:
    """:func:`join`, for tests."""
    return join


@pytest.fixture(name="batch")
def batch_fixture() -> Callable[..., Batch]:
    """:func:`batch`, for tests (helpers travel as fixtures: test folders are not packages)."""
    return batch


@pytest.fixture(name="close_and_drain")
def close_and_drain_fixture() -> Callable[..., list[Any]]:
    """:func:`close_and_drain`, for tests."""
    return close_and_drain


@pytest.fixture(name="numbered")
def numbered_fixture() -> Callable[..., Batch]:
    """:func:`numbered`, for tests."""
    return numbered


@pytest.fixture(name="check_numbered")
def check_numbered_fixture() -> Callable[..., int]:
    """:func:`check_numbered`, for tests."""
    return check_numbered


@pytest.fixture
def make_relay(closing: list[Any]) -> Callable[[str], Relay]:
    """Relays (see :class:`Relay`), closed at teardown."""
    def make(target: str) -> Relay:
        relay = Relay(target)
        closing.append(relay)
        return relay

    return make


@pytest.fixture(name="drain")
def drain_fixture() -> Callable[..., list[Any]]:
    """:func:`drain`, for tests."""
    return drain
