"""LiveStatistics(kernel="compile"): one compiled function per dtype of a layout serves every batch
size, leaves the published tensors as they were, and a machine that cannot compile falls back to
the eager reduction with one warning. Its accuracy is tested with the eager mode's, in
test_live_stats_accuracy.py (the tests run in both modes)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from test_live_stats_accuracy import (
    FLOAT32_BOUNDS,
    FLOAT64_BOUNDS,
    assert_matches,
    assert_same_counts_and_extremes,
    batch,
)
from torch._dynamo.utils import counters

from consumers import LiveStatistics, live_stats


def steps(sizes: list[int], seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Batches of four dtypes (one of them 3-D per world) and a bool flag, ``sizes`` rows each."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        out.append({
            "x": torch.randn(n, 5, generator=gen) * torch.arange(1.0, 6.0) + 1e3,
            "y": torch.randn(n, 2, generator=gen),
            "h": (torch.randn(n, 2, 3, generator=gen) + 50).half(),
            "d": torch.randn(n, 3, generator=gen, dtype=torch.float64) - 7,
            "k": torch.randint(-300, 300, (n, 4), generator=gen, dtype=torch.int16),
            "flag": torch.rand(n, generator=gen) < 0.3,
        })
    return out


def check(stats: LiveStatistics, data: list[dict[str, torch.Tensor]]) -> None:
    summary = stats.summary()
    for name in data[0]:
        rows = np.concatenate([s[name].double().numpy() for s in data])
        assert_matches(summary.fields[f"t/{name}"], rows, FLOAT64_BOUNDS if name == "d" else FLOAT32_BOUNDS, name)


def test_one_compiled_function_per_dtype_serves_every_batch_size() -> None:
    # Four dtypes that are not bool: four compilations, whatever the batch sizes after the
    # first (batches of fewer than 32 rows are reduced eagerly). Before each group compiled its own
    # copy of the function under its own name, torch.compile took another group's widths for a
    # change of this one's and compiled the functions again (8 graphs for these batches).
    data = steps([64, 64, 3, 1, 64, 17, 2, 4096, 16, 31, 32, 33, 64, 4095])
    before = counters["stats"]["unique_graphs"]
    stats = LiveStatistics(kernel="compile")
    for i, fields in enumerate(data):
        stats(batch(fields, i))
    assert counters["stats"]["unique_graphs"] - before == 4
    check(stats, data)
    for fields in data:  # the published tensors carry no marks of the compiler
        for t in fields.values():
            assert not [a for a in vars(t) if a.startswith("_dynamo")], t


def test_compiled_and_eager_reductions_agree() -> None:
    data = steps([300, 1, 2, 511, 300] * 3, seed=1)
    eager, compiled = LiveStatistics(), LiveStatistics(kernel="compile")
    for i, fields in enumerate(data):
        eager(batch(fields, i))
        compiled(batch(fields, i))
    a, b = eager.summary(), compiled.summary()
    assert_same_counts_and_extremes(b, a)
    for key, got in b.fields.items():
        ref = a.fields[key]
        bound = 1e-12 if key == "t/d" else 1e-6  # both within it of the truth (test_live_stats_accuracy.py)
        assert np.all(np.abs(got.mean - ref.mean) <= 2 * bound * (ref.std + np.abs(ref.mean))), key
        np.testing.assert_allclose(got.std, ref.std, rtol=2 * bound, atol=0, err_msg=key)


def test_a_machine_that_cannot_compile_warns_once_and_reduces_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def broken(*args: Any) -> torch.Tensor:
        calls.append(args)
        raise RuntimeError("Compiler: cc is not found")

    monkeypatch.setattr(live_stats, "_compiled_moments", lambda: broken)
    data = steps([40, 40, 7, 40], seed=2)
    stats = LiveStatistics(kernel="compile")
    with pytest.warns(RuntimeWarning, match=r"torch.compile failed .*cc is not found.*reducing without it") as seen:
        stats(batch(data[0], 0))
    assert len(seen) == 4  # once for each of the four groups that would be compiled
    for i, fields in enumerate(data[1:], 1):  # no more warnings: this suite makes them errors
        stats(batch(fields, i))
    assert len(calls) == 4  # and never tried again
    check(stats, data)


@pytest.mark.cuda
def test_compiled_on_cuda_gives_what_the_cpu_gives() -> None:
    data = steps([4096, 33, 4096, 1, 512, 4096] * 3, seed=3)
    cpu, cuda = LiveStatistics(kernel="compile"), LiveStatistics(kernel="compile")
    for i, fields in enumerate(data):
        cpu(batch(fields, i))
        cuda(batch({k: v.cuda() for k, v in fields.items()}, i))
    check(cuda, data)
    assert_same_counts_and_extremes(cuda.summary(), cpu.summary())
