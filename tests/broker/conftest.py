"""Fixtures for the transport tests: free loopback endpoints, and publishers/subscribers that are
closed (linger 0) at teardown even when a test fails."""

from __future__ import annotations

import contextlib
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


@pytest.fixture(name="drain")
def drain_fixture() -> Callable[..., list[Any]]:
    """:func:`drain`, for tests."""
    return drain
