"""LiveStatistics does the same tensor work per batch whatever the number of fields, never waits
for the device, and gives on CUDA what it gives on the CPU."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_live_stats_accuracy import FLOAT32_BOUNDS, assert_matches, assert_same_counts_and_extremes, batch
from torch.utils._python_dispatch import TorchDispatchMode

from consumers import LiveStatistics
from consumers.live_stats import _BLOCK_ROWS

SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default"}


class OpLog(TorchDispatchMode):
    """Every tensor operation that is not a view (views run no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def payload(fields: int, worlds: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """``fields`` float32 fields of assorted per-world shapes and ``fields`` bool flags."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(), (3,), (2, 2), (7,)]
    out = {f"x{i}": torch.randn(worlds, *shapes[i % 4], generator=gen) * (i + 1) + 10 * i for i in range(fields)}
    out.update({f"done{i}": torch.rand(worlds, generator=gen) < 0.5 for i in range(fields)})
    return {k: v.to(device) for k, v in out.items()}


def floats(fields: int, worlds: int, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """``fields`` float32 fields of assorted per-world shapes (one dtype)."""
    return {k: v for k, v in payload(fields, worlds, device, seed).items() if k.startswith("x")}


def steady_ops(fields: int, worlds: int, kernel: str = "eager") -> list[str]:
    stats = LiveStatistics(kernel=kernel)
    first, second, third = (batch(payload(fields, worlds, seed=i), i) for i in range(3))
    stats(first)  # the first batch of a layout sets it up
    stats(second)
    with OpLog() as log:
        stats(third)
    return log.ops


@pytest.mark.parametrize("worlds", [8, 4096, 9000, 12288])  # one block; blocks of 4096 rows, the last partial or not
def test_tensor_ops_per_batch_do_not_grow_with_the_number_of_fields(worlds: int) -> None:
    few, many = steady_ops(4, worlds), steady_ops(40, worlds)
    assert few == many  # the same operations, in the same order, for 8 or 80 fields
    blocks = -(-worlds // _BLOCK_ROWS)
    # floats: at most 9 per block (concatenate, min, max, shift, two sums, square, and two
    # copies for a block of rows not a multiple of 16); bools: concatenate and count
    assert len(few) <= 9 * blocks + 2, few
    assert not SYNCING_OPS & set(few)  # nothing reads a value back to the host


@pytest.mark.parametrize("worlds", [8, 4096, 9000])
def test_the_numba_kernels_leave_no_tensor_operations_to_a_batch(worlds: int) -> None:
    # floats and bools alike are reduced by the kernels, straight from the fields
    assert steady_ops(4, worlds, "numba") == steady_ops(40, worlds, "numba") == []


@pytest.mark.parametrize(("kernel", "steps", "merged"), [("eager", 40, [16, 32]), ("numba", 70, [64])])
def test_windows_merge_every_so_many_blocks_and_on_read(kernel: str, steps: int, merged: list[int]) -> None:
    # The accumulators change only when a window is merged: after 64 window rows or when read;
    # every row is counted exactly once either way. Eager, a batch of 4 blocks takes 4 rows
    # (a merge every 16 batches); the numba kernel reduces a whole batch into one row.
    stats = LiveStatistics(kernel=kernel)
    merges = []
    rows = 4 * _BLOCK_ROWS
    for step in range(steps):
        with OpLog() as log:
            stats(batch(floats(3, rows, seed=step), step))
        merges.append("aten.addcmul_.default" in log.ops)
    assert [i for i, m in enumerate(merges) if m] == merged
    assert stats.summary().fields["t/x0"].count == steps * rows
    assert stats.summary().fields["t/x0"].count == steps * rows  # a second read merges nothing


def test_summary_reads_each_layout_back_once() -> None:
    stats = LiveStatistics()
    for step in range(3):
        stats(batch(payload(6, 16, seed=step), step))
    with OpLog() as log:
        summary = stats.summary()
    assert len(summary.fields) == 12
    assert log.ops.count("aten.cat.default") == 1  # the accumulators of the one layout, stacked


def run_both(device: str, steps: list[dict[str, torch.Tensor]]) -> LiveStatistics:
    stats = LiveStatistics()
    for i, fields in enumerate(steps):
        stats(batch({k: v.to(device) for k, v in fields.items()}, i))
    return stats


def device_steps() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    out = []
    for i, n in enumerate([4096, 33, 4096, 1, 512, 4096] * 5):
        out.append({
            "x": torch.randn(n, 5, generator=gen) * 0.5 + 3e4,
            "h": (torch.randn(n, 3, generator=gen) + 100).half(),
            "i": torch.randint(-(10**9), 10**9, (n, 2), generator=gen),
            "flag": torch.rand(n, generator=gen) < 0.1 * (i % 10),
        })
    return out


@pytest.mark.cuda
def test_cuda_gives_what_the_cpu_gives() -> None:
    steps = device_steps()
    cpu, cuda = run_both("cpu", steps).summary(), run_both("cuda", steps).summary()
    assert_same_counts_and_extremes(cuda, cpu)
    for key, got in cuda.fields.items():
        rows = np.concatenate([s[key.removeprefix("t/")].double().numpy() for s in steps])
        assert_matches(got, rows, FLOAT32_BOUNDS, key)
        assert_matches(cpu.fields[key], rows, FLOAT32_BOUNDS, key)


def cuda_launches(fields: int, worlds: int, make: Any = payload) -> tuple[int, int]:
    """Kernels, copies and fills on the device for one steady-state batch of ``make``'s fields,
    and apart from them the memsets (torch's reductions over many columns clear their own
    scratch with one each)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    stats = LiveStatistics()
    data = [batch(make(fields, worlds, "cuda", seed=i), i) for i in range(3)]
    stats(data[0])
    stats(data[1])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        stats(data[2])
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    memsets = sum(1 for name in names if name.startswith("Memset"))
    return len(names) - memsets, memsets


@pytest.mark.cuda
def test_cuda_launches_per_batch_do_not_grow_with_the_number_of_fields() -> None:
    (few, few_memsets), (many, many_memsets) = cuda_launches(4, 4096), cuda_launches(40, 4096)
    assert few > 0
    assert few == many
    assert few_memsets <= few  # at most one per reduction
    assert many_memsets <= many


@pytest.mark.cuda
def test_cuda_launches_per_batch_of_one_dtype_do_not_grow_with_the_number_of_fields() -> None:
    (few, few_memsets), (many, many_memsets) = cuda_launches(5, 4096, floats), cuda_launches(50, 4096, floats)
    assert 0 < few <= 12  # concatenate, min and max, shift, two sums, square (and a few fills)
    assert few == many
    assert few_memsets <= few
    assert many_memsets <= many


@pytest.mark.cuda
def test_cuda_batches_never_synchronize_with_the_host() -> None:
    stats = LiveStatistics()
    data = [batch(payload(5, 1024, "cuda", seed=i), i) for i in range(4)]
    stats(data[0])  # buffers are allocated on the first batch of a layout
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for message in data[1:]:
            stats(message)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert stats.summary().fields["t/x0"].count == 4 * 1024
