"""Fixtures of the storage tests (helpers live in ``storage_sim`` and ``procs``)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # make ``storage_sim`` and ``procs`` importable

from procs import Proc


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start ``python ARGS...`` in ``tmp_path``; every process is killed at teardown."""
    procs: list[Proc] = []

    def make(*args: str) -> Proc:
        proc = Proc([sys.executable, *args], tmp_path)
        procs.append(proc)
        return proc

    yield make
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.wait(10)
