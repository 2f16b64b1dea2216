"""LiveStatistics' kernels agree on what is hard to get right in a hand-written loop: NaN and
infinities in the minima and maxima, fields that are strided views, expanded or require grad,
float64 fields; the published tensors stay as they were; and the ``kernel`` argument is checked.
Their accuracy over long runs is tested in test_live_stats_accuracy.py (every kernel)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_live_stats_accuracy import FLOAT32_BOUNDS, FLOAT64_BOUNDS, assert_matches, batch
from test_live_stats_ops import steady_ops

from consumers import LiveStatistics, _kernels, live_stats

KERNELS = pytest.mark.parametrize("kernel", ["eager", "numba", "numba-parts", "compile"], indirect=True)


def odd_values(n: int, seed: int) -> torch.Tensor:
    """``[n, 6]`` float32: a NaN in column 0 of one row, +inf and -inf in columns 1 and 2, a
    column of both infinities, a constant column, and an ordinary one."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=gen) + 50
    x[n // 2, 0] = float("nan")
    x[n // 3, 1] = float("inf")
    x[n // 4, 2] = float("-inf")
    x[0, 3], x[-1, 3] = float("inf"), float("-inf")
    x[:, 4] = 7.25
    return x


@KERNELS
def test_nan_and_infinities_give_the_minima_and_maxima_numpy_gives(kernel: str) -> None:
    # A loop's minimum that tests `v < m` alone drops a NaN (and, compiled with fastmath, the
    # compiler may drop the NaN test itself); torch.amin and numpy propagate it.
    stats = LiveStatistics(kernel=kernel)
    rows = []
    for step, n in enumerate([64, 4096, 40, 1]):
        x = odd_values(n, step) if n > 1 else torch.full((1, 6), 3.0)
        stats(batch({"x": x}, step))
        rows.append(x.double().numpy())
    got = stats.summary().fields["t/x"]
    every = np.concatenate(rows)
    np.testing.assert_array_equal(got.min, every.min(0))
    np.testing.assert_array_equal(got.max, every.max(0))
    assert np.isnan(got.min[0])
    assert np.isnan(got.max[0])
    assert got.count == every.shape[0]
    # the columns without NaN or infinity: the usual bounds
    assert_matches(type(got)(got.count, got.mean[4:], got.std[4:], got.min[4:], got.max[4:]),
                   every[:, 4:], FLOAT32_BOUNDS)
    assert np.isnan(got.mean[0])
    assert np.isnan(got.std[0])


@pytest.mark.parametrize("kernel", ["eager", "numba", "numba-parts"], indirect=True)
def test_a_nan_in_any_row_of_a_batch_makes_its_column_minimum_and_maximum_nan(kernel: str) -> None:
    # The numba kernel reads whole chunks of 16 rows as wide rows, then the rows after them,
    # and searches a column for NaN only when its sum is not finite: a NaN in the first row,
    # in a chunk, or in the rows after the chunks; columns beside it stay exact.
    for n in (1, 17, 40, 300):
        for row in sorted({0, n // 2, n - 1}):
            x = torch.randn(n, 5, generator=torch.Generator().manual_seed(n + row)) * 4 + 9
            x[row, 2] = float("nan")
            stats = LiveStatistics(kernel=kernel)
            stats(batch({"x": x}))
            got = stats.summary().fields["t/x"]
            want_lo, want_hi = x.double().numpy().min(0), x.double().numpy().max(0)
            np.testing.assert_array_equal(got.min, want_lo, err_msg=f"{n} rows, NaN in row {row}")
            np.testing.assert_array_equal(got.max, want_hi, err_msg=f"{n} rows, NaN in row {row}")


@KERNELS
def test_strided_expanded_grad_and_float64_fields_match_numpy_and_stay_unchanged(kernel: str) -> None:
    """Float and bool fields that are views of any layout (the numba kernels read contiguous
    rows: they are given contiguous copies)."""
    gen = torch.Generator().manual_seed(5)
    stats = LiveStatistics(kernel=kernel)
    published: dict[str, list[np.ndarray]] = {}
    for step, n in enumerate([4096, 100, 4096, 33]):
        wide = torch.randn(n, 8, generator=gen) * 2 + 1e3
        base = torch.randn(7, n, generator=gen, dtype=torch.float64) - 40
        fields = {
            "strided": wide[:, ::2],                                  # every other column
            "transposed": base.T,                                      # float64, column-major
            "expanded": torch.randn(1, 3, generator=gen).expand(n, 3),  # one row, stride 0
            "grad": torch.randn(n, 2, generator=gen).requires_grad_(),
            "nested": torch.randn(n, 2, 3, generator=gen)[:, :, 1:],   # 3-D, not contiguous
            "flags": (torch.rand(3, n, generator=gen) > 0.5).T,         # bool, column-major
            "flag": (torch.rand(n, 2, generator=gen) > 0.5)[:, 1],      # bool, every other byte
        }
        before = {k: v.detach().clone() for k, v in fields.items()}
        stats(batch(fields, step))
        for k, v in fields.items():
            assert torch.equal(v.detach(), before[k]), k  # read, never written
            published.setdefault(k, []).append(v.detach().double().numpy())
    summary = stats.summary()
    for key, parts in published.items():
        bounds = FLOAT64_BOUNDS if key == "transposed" else FLOAT32_BOUNDS
        assert_matches(summary.fields[f"t/{key}"], np.concatenate(parts), bounds, key)


def test_the_kernel_argument_is_checked() -> None:
    with pytest.raises(ValueError, match=r"kernel: expected one of 'auto', 'eager', 'numba', 'compile', got 'fast'"):
        LiveStatistics(kernel="fast")


def test_without_numba_the_numba_kernel_is_refused_and_auto_reduces_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernels, "_importable", False)
    with pytest.raises(ImportError, match=r"needs numba: pip install 'worldtap\[fast\]'"):
        LiveStatistics(kernel="numba")
    assert steady_ops(4, 4096, "auto") == steady_ops(4, 4096, "eager")


def test_with_numba_auto_uses_it() -> None:
    assert _kernels.available()  # the dev install has it: the numba tests above must not be eager twins
    assert steady_ops(4, 4096, "auto") == steady_ops(4, 4096, "numba") != steady_ops(4, 4096, "eager")


def test_a_large_batch_is_reduced_in_parts_on_torch_s_threads(parts_calls: list[tuple[int, ...]]) -> None:
    # The numba kernel reads each field once, but on one thread it is held to one core's
    # bandwidth where torch's memcpy of the same payload uses every intra-op thread: a float
    # batch of at least two _PART_BYTES is cut into parts, one per thread (torch's count, at
    # most numba's), each reduced into a window row of its own; smaller batches stay whole.
    shapes = parts_calls
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(11)
    published: list[np.ndarray] = []
    try:
        stats = LiveStatistics(kernel="numba")
        for step, (count, n) in enumerate([(2, 4096), (1, 4096), (2, 300), (2, 4099)]):
            torch.set_num_threads(count)
            x = torch.randn(n, 165, generator=gen) * 3 + 1e3  # 4096 rows: 2.7 MB, the benchmark's
            x[n - 1, 7] = float("nan")  # in the last part's last row
            x[n // 3, 9] = float("inf")
            stats(batch({"x": x, "d": x[:, :2].double()}, step))
            published.append(x.double().numpy())
    finally:
        torch.set_num_threads(threads)
    assert shapes == [(2, 4, 165), (2, 4, 165)]  # 300 rows (198 kB) and one thread: whole
    got, every = stats.summary().fields["t/x"], np.concatenate(published)
    np.testing.assert_array_equal(got.min, every.min(0))
    np.testing.assert_array_equal(got.max, every.max(0))
    assert got.count == every.shape[0]
    finite = np.isfinite(every).all(0)
    assert finite.sum() == 163
    assert_matches(type(got)(got.count, got.mean[finite], got.std[finite], got.min[finite], got.max[finite]),
                   every[:, finite], FLOAT32_BOUNDS)


def test_batches_of_any_number_of_fields_are_reduced_whole_by_one_compiled_variant() -> None:
    # A batch under the parts threshold is reduced on the calling thread, ARITY fields a call
    # (a call per field cost the dispatch and the slicing of its outputs in Python each time).
    from consumers import _parallel

    gen = torch.Generator().manual_seed(13)
    for count in (1, _kernels.ARITY, _kernels.ARITY + 1, 130):
        stats = LiveStatistics(kernel="numba")
        steps = [{f"f{i}": torch.randn(30 + step, 1 + i % 3, generator=gen) * (1 + i) - i for i in range(count)}
                 for step in range(2)]
        steps[1]["f0"][3, 0] = float("nan")
        for step, fields in enumerate(steps):
            stats(batch(fields, step))
        summary = stats.summary()
        assert len(summary.fields) == count
        assert np.isnan(summary.fields["t/f0"].min[0])
        assert np.isnan(summary.fields["t/f0"].max[0])
        for key in list(steps[0])[1:]:
            rows = np.concatenate([fields[key].double().numpy() for fields in steps])
            assert_matches(summary.fields[f"t/{key}"], rows, FLOAT32_BOUNDS, f"{count} fields: {key}")
    assert _parallel.moments_group.signatures
    assert all(signature[0].count == _kernels.ARITY for signature in _parallel.moments_group.signatures)


def test_batches_of_any_number_of_fields_are_reduced_in_parts_by_one_compiled_variant(
        parts_calls: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch) -> None:
    # Bug: the parts kernel took a tuple of all the group's fields, and a tuple's length is
    # part of the type numba compiles for: each new number of fields compiled the kernel again
    # (seconds each; 20 s for 100 fields), and a batch of more than 100 float fields of one
    # dtype raised (numba refuses a tuple of more than 100 arrays in a parallel loop). Each call
    # now takes ARITY arrays, and a group of more fields takes several calls.
    from consumers import _parallel

    monkeypatch.setattr(live_stats, "_PART_BYTES", 16)  # every batch below goes in parts
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(12)
    try:
        for count in (3, _kernels.ARITY, _kernels.ARITY + 1, 130):
            stats = LiveStatistics(kernel="numba")
            steps = [{f"f{i}": torch.randn(40 + step, 1 + i % 3, generator=gen) * (1 + i) + i for i in range(count)}
                     for step in range(2)]
            for step, fields in enumerate(steps):
                stats(batch(fields, step))
            summary = stats.summary()
            assert len(summary.fields) == count
            for key in steps[0]:
                rows = np.concatenate([fields[key].double().numpy() for fields in steps])
                assert_matches(summary.fields[f"t/{key}"], rows, FLOAT32_BOUNDS, f"{count} fields: {key}")
    finally:
        torch.set_num_threads(threads)
    assert len(parts_calls) == 2 * (1 + 1 + 2 + 17)  # two batches of each, ARITY fields a call
    assert all(signature[0].count == _kernels.ARITY for signature in _parallel.moments_parts.signatures)


def test_the_threads_are_used_only_where_any_thread_may_launch_them(monkeypatch: pytest.MonkeyPatch) -> None:
    import numba

    monkeypatch.setattr(_kernels, "_threads", None)
    monkeypatch.setattr(numba, "threading_layer", lambda: "workqueue")  # aborts on concurrent launches
    assert _kernels.threads() == 1
    monkeypatch.setattr(_kernels, "_threads", None)
    monkeypatch.setattr(numba, "threading_layer", lambda: "omp")
    assert _kernels.threads() == numba.get_num_threads()
    monkeypatch.setattr(_kernels, "_forked", True)
    assert _kernels.threads() == 1


def test_a_child_of_a_fork_reduces_in_its_own_thread(tmp_path: object) -> None:
    # GNU OpenMP's threads do not survive a fork: numba terminates a child that launches them
    # ("fork() called from a process already using GNU OpenMP"). A child reduces in the
    # calling thread, and gets what its parent gets.
    if _kernels.threads() < 2:
        pytest.skip("numba's threading layer here may not be launched from any thread")
    x = torch.randn(4096, 165, generator=torch.Generator().manual_seed(3)) + 5
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parent = LiveStatistics(kernel="numba")
        parent(batch({"x": x}))  # the threading layer runs in this process
        want = parent.summary().fields["t/x"]
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 1
            try:
                os.close(read)
                child = LiveStatistics(kernel="numba")
                child(batch({"x": x}))
                got = child.summary().fields["t/x"]
                os.write(write, np.stack([got.mean, got.std, got.min, got.max]).tobytes())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(threads)
    assert os.waitstatus_to_exitcode(status) == 0
    got = np.frombuffer(data, np.float64).reshape(4, 165)
    np.testing.assert_array_equal(got[2:], np.stack([want.min, want.max]))
    np.testing.assert_allclose(got[:2], np.stack([want.mean, want.std]), rtol=1e-6)


def test_starting_the_threads_leaves_torch_s_thread_count_alone() -> None:
    # Starting numba's OpenMP layer sets OpenMP's thread count for the process, which is
    # torch's: a simulation that asked torch for one thread got every core's worth. In a fresh
    # process, as the layer starts once per process.
    script = """
import torch
torch.set_num_threads(1)
from consumers import LiveStatistics, _kernels, live_stats
from broker import Batch
stats = LiveStatistics(kernel="numba")
x = torch.randn(4096, 165)
stats(Batch("run", 0, 0, "batch/t", torch.arange(4096), torch.zeros(4096, dtype=torch.int64), {"x": x}))
print(_kernels.threads(), torch.get_num_threads())
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    numba_threads, torch_threads = map(int, out.stdout.split())
    assert torch_threads == 1
    assert numba_threads >= 1
