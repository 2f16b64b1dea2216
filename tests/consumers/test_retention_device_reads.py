"""Issue 20: the append path reads the device (a CUDA sync) at most once per capacity/2 appends.

Every way of turning a tensor into a host value (``int()``, ``bool()``, ``.item()``,
``.tolist()``, ``torch.equal``, ...) is wrapped with a counter, so a read anywhere on the append
path is seen, whatever function it hides in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch

from broker import Batch
from consumers import Retention
from consumers import retention as retention_module

_TENSOR_READS = ("__int__", "__index__", "__bool__", "__float__", "item", "tolist", "numpy", "cpu")


class HostReads:
    """Counts host reads of tensors while ``counting`` is set."""

    def __init__(self) -> None:
        self.count = 0
        self.counting = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.count += 1
            return fn(*args, **kwargs)
        return counted


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> HostReads:
    # The append path as on a CUDA device: the worlds' values are not read there (on the CPU,
    # where a read is no sync, Retention checks them against the run's worlds).
    monkeypatch.setattr(retention_module, "_readable", lambda t: False)
    counter = HostReads()
    for name in _TENSOR_READS:
        monkeypatch.setattr(torch.Tensor, name, counter.wrap(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", counter.wrap(torch.equal))
    return counter


def _append(retention: Retention, reads: HostReads, step: int, worlds: list[int], hook: str,
            idx: torch.Tensor | None = None) -> int:
    """Append one batch (built outside the counted region); returns the reads it made."""
    idx = torch.tensor(worlds) if idx is None else idx
    x = torch.tensor([[step * 100.0 + w] for w in worlds])
    batch = Batch("r", step, step, "batch/t", idx, torch.zeros(len(worlds), dtype=torch.int64), {"x": x},
                  hook)  # type: ignore[arg-type]
    before = reads.count
    reads.counting = True
    try:
        retention(batch)
    finally:
        reads.counting = False
    return reads.count - before


def _assert_spaced(log: list[tuple[int, int]]) -> None:
    """``log`` holds (append index, capacity after it) of every append that read the device:
    consecutive reads are at least half the capacity apart."""
    for (i, cap), (j, _) in itertools.pairwise(log):
        assert j - i >= cap / 2, f"device reads at appends {i} and {j} with capacity {cap} ({len(log)} reads)"


def test_the_counter_sees_a_read(reads: HostReads) -> None:
    """The instrument works: a read on the append path would be counted."""
    reads.counting = True
    int(torch.tensor(3))
    torch.tensor([1, 2]).tolist()
    reads.counting = False
    assert reads.count == 2


def test_step_topic_with_episodes_just_under_capacity(reads: HostReads) -> None:
    """Fixed episode length 15 with capacity 16, worlds staggered: the oldest live start is
    always ~15 appends back, which used to cost a device read every ~2 appends."""
    n, length = 5, 15
    retention = Retention(num_worlds=n, initial_capacity=16)
    log: list[tuple[int, int]] = []
    everyone = torch.arange(n)  # the same tensor every step, as the recorder passes
    for step in range(400):
        if _append(retention, reads, step, list(range(n)), "post_step", everyone):
            log.append((step, retention.capacity["batch/t"]))
        ending = [w for w in range(n) if (step + 1 + 3 * w) % length == 0]
        if ending:
            retention.reset(torch.tensor(ending))
    assert log, "the ring was never checked"
    _assert_spaced(log)
    assert len(log) <= 400 / 8  # capacity >= 16 at every read


def test_reset_topic_with_one_world_holding_its_rows(reads: HostReads) -> None:
    """World 0 keeps capacity - 1 rows of a reset-only topic; the other worlds reset and append
    one row each time. The per-world counters used to be read on every append."""
    n, cap = 4, 8
    retention = Retention(num_worlds=n, initial_capacity=cap)
    log: list[tuple[int, int]] = []
    step = 0
    for _ in range(cap - 1):
        _append(retention, reads, step, list(range(n)), "post_reset")
        step += 1
    for _ in range(300):
        others = [1 + step % (n - 1)]
        retention.reset(torch.tensor(others))
        if _append(retention, reads, step, others, "post_reset"):
            log.append((step, retention.capacity["batch/t"]))
        step += 1
    assert log, "the counters were never checked"
    _assert_spaced(log)
    assert retention.episode_length(0, "t") == cap - 1
