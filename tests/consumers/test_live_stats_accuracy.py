"""LiveStatistics against float64 numpy: long runs, large means, every real dtype, layouts.

Error bounds asserted (the reference is numpy float64 over every published value):

* float32, float16, bfloat16, bool, uint8, int8, int16 fields (reduced in float32): mean within
  1e-6 standard deviations (plus 1e-12 of its magnitude), standard deviation within a relative 1e-6;
* float64, int32, int64 fields (reduced in float64): mean within 1e-12 of its magnitude plus
  1e-12 standard deviations, standard deviation within a relative 1e-12;
* min and max: exact; counts exact.

The same bounds hold for ``kernel="numba"`` and ``kernel="compile"`` (the tests marked with
every mode): their sums are of chunks of 16 rows in float32 (a sequential sum, at most 16
roundings), then of the chunks in float64.

Why these bounds hold: values are summed only after a shift by a recent mean (an exact
subtraction for values within a factor of two of it), so the float32 sums are of numbers of the
order of the data's spread, not of its mean; torch sums a block of at most 1024 rows pairwise, to
a relative error of about ``log2(1024) * 2**-24`` (6e-7 at worst, far less on average) of that
spread, and everything after (the window's rows, Chan et al.'s merge) is in float64. Float64
sums carry the same argument with ``2**-53``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch

from broker import Batch, Broker, Message
from capture import FunctionTerm, Recorder
from consumers import FieldStatistics, LiveStatistics, LiveSummary, live_stats

FLOAT32_BOUNDS = (1e-6, 1e-6)   # mean error in standard deviations, relative std error
FLOAT64_BOUNDS = (1e-12, 1e-12)


def batch(fields: Mapping[str, torch.Tensor], seq: int = 0, topic: str = "batch/t") -> Batch:
    n = next(iter(fields.values())).shape[0]
    return Batch("run", seq, seq, topic, torch.arange(n), torch.zeros(n, dtype=torch.int64), fields)


MODES = pytest.mark.parametrize("kernel", ["eager", "numba", "numba-parts", "compile"], indirect=True)
"""The tests run with every reduction: eager torch operations, the numba kernel (in the calling
thread, and in parts on two threads: see conftest.py), and a function compiled with
torch.compile."""


def assert_matches(got: FieldStatistics, rows: np.ndarray, bounds: tuple[float, float], name: str = "") -> None:
    """``rows``: every published row of the field, float64, ``[count, *shape]``.

    The reference is taken about the first row (an exact subtraction for these data): numpy's
    own float64 variance of values near 1e8 with a standard deviation of 1e-3 is off by 1e-8.
    """
    mean_sd, std_rel = bounds
    centered = rows - rows[:1]
    ref_mean, ref_std = rows[0] + centered.mean(0), centered.std(0, ddof=1)
    assert got.count == rows.shape[0], name
    assert got.mean.shape == got.std.shape == got.min.shape == got.max.shape == rows.shape[1:], name
    mean_error = np.abs(got.mean - ref_mean)
    assert np.all(mean_error <= mean_sd * ref_std + 1e-12 * np.abs(ref_mean)), (name, mean_error / ref_std)
    np.testing.assert_allclose(got.std, ref_std, rtol=std_rel, atol=0, err_msg=name)
    np.testing.assert_array_equal(got.min, rows.min(0), err_msg=name)
    np.testing.assert_array_equal(got.max, rows.max(0), err_msg=name)


def assert_same_counts_and_extremes(got: LiveSummary, ref: LiveSummary) -> None:
    """Two summaries of the same batches (another device, another reduction): the same fields,
    counts, and exactly the same minima and maxima."""
    assert list(got.fields) == list(ref.fields)
    for key, field in got.fields.items():
        assert field.count == ref.fields[key].count, key
        np.testing.assert_array_equal(field.min, ref.fields[key].min, err_msg=key)
        np.testing.assert_array_equal(field.max, ref.fields[key].max, err_msg=key)


@MODES
def test_large_means_and_small_variances_over_ten_thousand_steps(kernel: str) -> None:
    # Means up to 3e5 standard deviations away from zero break a float32 sum of squares
    # (relative error ~ 6e-8 * (mean / std)**2); the last column drifts by one standard
    # deviation a step, 1e4 in all.
    steps, worlds = 10_000, 16
    rng = np.random.default_rng(3)
    mean = np.array([1e4, -2.5e4, 3e5, 0.0, 7.0, 0.0])
    std = np.array([1.0, 0.5, 1.0, 1e-3, 1e-2, 1.0])
    data = rng.standard_normal((steps, worlds, 6)) * std + mean
    data[:, :, 5] += np.arange(steps)[:, None]
    data = data.astype(np.float32)
    stats = LiveStatistics(kernel=kernel)
    for step in range(steps):
        stats(batch({"x": torch.from_numpy(data[step])}, step))
    got = stats.summary().fields["t/x"]
    rows = data.reshape(-1, 6).astype(np.float64)
    assert_matches(got, rows, FLOAT32_BOUNDS)
    within = np.array([data[:, :, c].std(1).mean() for c in range(6)], dtype=np.float64)
    assert np.all(np.abs(got.mean - rows.mean(0)) <= 1e-6 * within)  # also for the drifting column


@MODES
def test_every_real_dtype_recorded_with_partial_steps_matches_numpy(kernel: str) -> None:
    num_worlds, steps = 12, 300
    gen = torch.Generator().manual_seed(5)
    make = {
        "flag": lambda: torch.rand(num_worlds, generator=gen) < 0.3,
        "u8": lambda: torch.randint(0, 256, (num_worlds, 2), generator=gen, dtype=torch.uint8),
        "i8": lambda: torch.randint(-128, 128, (num_worlds,), generator=gen, dtype=torch.int8),
        "i16": lambda: torch.randint(-30000, 30000, (num_worlds,), generator=gen, dtype=torch.int16),
        "i32": lambda: torch.randint(-(2**31), 2**31 - 1, (num_worlds, 3), generator=gen, dtype=torch.int32),
        "i64": lambda: 10**12 + torch.randint(0, 100, (num_worlds,), generator=gen, dtype=torch.int64),
        "f16": lambda: (torch.randn(num_worlds, 2, generator=gen) * 3 + 1000).half(),
        "bf16": lambda: (torch.randn(num_worlds, generator=gen) * 10 - 500).bfloat16(),
        "f64": lambda: torch.randn(num_worlds, 2, 2, generator=gen, dtype=torch.float64) * 1e-3 + 1e8,
        "f32": lambda: torch.randn(num_worlds, 4, 1, generator=gen) * 2 + 50,
        "empty": lambda: torch.zeros(num_worlds, 0),
    }
    float64_reduced = {"i32", "i64", "f64"}
    broker = Broker(strict=True)
    stats = LiveStatistics(kernel=kernel)
    stats.attach(broker)
    published: dict[str, list[np.ndarray]] = {name: [] for name in make}

    def copy_rows(message: Message) -> None:
        assert isinstance(message, Batch)
        for name, t in message.fields.items():
            published[name].append(t.double().numpy().copy())

    broker.subscribe("batch/", copy_rows)
    current = {name: f() for name, f in make.items()}
    rec = Recorder(num_worlds, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: current))
    rng = np.random.default_rng(0)
    for step in range(steps):
        current = {name: f() for name, f in make.items()}
        # all worlds, one world, then a growing subset: the buffers are reused and regrown
        worlds = None if step % 3 == 0 else sorted(rng.choice(num_worlds, size=1 + step % num_worlds, replace=False))
        rec.record_post_step(None if worlds is None else [int(w) for w in worlds])
    rec.close()
    summary = stats.summary()
    assert list(summary.fields) == [f"t/{name}" for name in make]
    for name in make:
        rows = np.concatenate(published[name])
        bounds = FLOAT64_BOUNDS if name in float64_reduced else FLOAT32_BOUNDS
        assert_matches(summary.fields[f"t/{name}"], rows, bounds, name)


@MODES
def test_large_batches_of_any_row_count_reduce_exactly(kernel: str) -> None:
    # On the CPU, min and max of a large batch are taken in two stages over a regrouped view;
    # row counts with and without a large power-of-two factor take different paths.
    gen = torch.Generator().manual_seed(2)
    stats = LiveStatistics(kernel=kernel)
    rows: dict[str, list[np.ndarray]] = {"t/x": [], "t/i": [], "t/flag": [], "t/flags": []}
    for step, n in enumerate([4096, 768, 272, 4095, 256, 8192]):
        fields = {"x": torch.randn(n, 5, generator=gen) * torch.arange(1.0, 6.0) + 100,
                  "i": torch.randint(-1000, 1000, (n, 3), generator=gen),
                  "flag": torch.rand(n, generator=gen) < 0.01 * (step + 1),
                  "flags": torch.stack([torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
                                        torch.rand(n, generator=gen) < 0.5], dim=1)}
        stats(batch(fields, step))
        for name, t in fields.items():
            rows[f"t/{name}"].append(t.double().numpy())
    summary = stats.summary()
    for key, parts in rows.items():
        assert_matches(summary.fields[key], np.concatenate(parts), FLOAT32_BOUNDS, key)


def test_layouts_of_one_topic_merge_and_fields_keep_their_shapes() -> None:
    # A publisher other than the recorder may send a topic with different field sets; every
    # field's statistics cover all of its rows, whichever layout they came in.
    gen = torch.Generator().manual_seed(1)
    stats = LiveStatistics()
    rows: dict[str, list[np.ndarray]] = {"t/a": [], "t/b": [], "u/a": []}
    for step in range(40):
        n = 1 + step % 7
        a = torch.randn(n, 2, 3, generator=gen) + step
        b = torch.randint(-5, 5, (n,), generator=gen)
        fields = {"a": a, "b": b} if step % 2 else {"a": a}
        stats(batch(fields, step))
        stats(batch({"a": a[:, 0]}, step, topic="batch/u"))
        rows["t/a"].append(a.double().numpy())
        if step % 2:
            rows["t/b"].append(b.double().numpy())
        rows["u/a"].append(a[:, 0].double().numpy())
    summary = stats.summary()
    assert list(summary.fields) == ["t/a", "u/a", "t/b"]
    assert summary.batches == 80
    for key, parts in rows.items():
        assert_matches(summary.fields[key], np.concatenate(parts), FLOAT32_BOUNDS, key)


def test_bad_fields_raise_naming_them_and_keep_what_was_gathered() -> None:
    stats = LiveStatistics()
    x = torch.arange(6.0).reshape(3, 2)
    stats(batch({"x": x}))
    before = stats.summary().fields["t/x"]
    with pytest.raises(TypeError, match=r"field 't/z': live statistics need a real dtype, got torch.complex64"):
        stats(batch({"x": x, "z": torch.zeros(3, dtype=torch.complex64)}, 1))
    with pytest.raises(ValueError, match=r"field 't/x': per-world shape \(3,\) differs from \(2,\) seen before"):
        stats(batch({"x": torch.zeros(3, 3)}, 2))
    with pytest.raises(ValueError, match=r"field 't/m': on meta, the batch's other fields on cpu"):
        stats(batch({"x": x, "m": torch.zeros(3, device="meta")}, 3))
    after = stats.summary().fields["t/x"]
    for name in ("mean", "std", "min", "max"):
        np.testing.assert_array_equal(getattr(after, name), getattr(before, name))
    assert after.count == before.count == 3
    stats(batch({"x": x + 6}, 4))  # still reducing
    assert_matches(stats.summary().fields["t/x"], np.concatenate([x.numpy(), x.numpy() + 6]).astype(np.float64),
                   FLOAT32_BOUNDS)


def test_fields_that_require_grad_are_reduced_without_a_graph() -> None:
    stats = LiveStatistics()
    x = torch.randn(4, 3, requires_grad=True)
    stats(batch({"x": x}))
    got = stats.summary().fields["t/x"]
    assert_matches(got, x.detach().double().numpy(), FLOAT32_BOUNDS)


@MODES
def test_half_bfloat16_and_integer_fields_over_ten_thousand_steps(kernel: str) -> None:
    # Means far from zero with small spreads, in every dtype reduced through a float32 or
    # float64 copy; 10,000 batches go through about 150 windows and merges.
    steps, worlds = 10_000, 8
    rng = np.random.default_rng(7)

    def normal(mean: float, std: float, *shape: int) -> np.ndarray:
        return rng.standard_normal((steps, worlds, *shape)) * std + mean

    data = {
        "f16": torch.from_numpy(normal(1000.0, 3.0, 2)).half(),
        "bf16": torch.from_numpy(normal(-500.0, 10.0)).bfloat16(),
        "f32": torch.from_numpy(normal(2e4, 1e-2, 3)).float(),
        "u8": torch.from_numpy(rng.integers(200, 256, (steps, worlds), dtype=np.uint8)),
        "i8": torch.from_numpy(rng.integers(-128, -100, (steps, worlds, 2), dtype=np.int8)),
        "i16": torch.from_numpy(rng.integers(30_000, 30_100, (steps, worlds), dtype=np.int16)),
        "i32": torch.from_numpy(rng.integers(2**31 - 1000, 2**31 - 1, (steps, worlds), dtype=np.int32)),
        "i64": torch.from_numpy(rng.integers(10**15, 10**15 + 7, (steps, worlds), dtype=np.int64)),
    }
    stats = LiveStatistics(kernel=kernel)
    for step in range(steps):
        stats(batch({name: t[step] for name, t in data.items()}, step))
    summary = stats.summary()
    for name, t in data.items():
        bounds = FLOAT64_BOUNDS if name in ("i32", "i64") else FLOAT32_BOUNDS
        assert_matches(summary.fields[f"t/{name}"], t.double().numpy().reshape(steps * worlds, *t.shape[2:]),
                       bounds, name)


@pytest.mark.parametrize("block", [None, 1024])
def test_batches_of_several_blocks_with_large_means_match_numpy(block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    # 2500 rows a batch: one block, or (blocks of 1024 rows) blocks of 1024, 1024 and 452 rows
    # (not a multiple of 16), about one shift per window of blocks; a float16 and an int32
    # field take the converting path.
    if block is not None:
        monkeypatch.setattr(live_stats, "_BLOCK_ROWS", block)
    steps, worlds = 120, 2500
    gen = torch.Generator().manual_seed(9)
    stats = LiveStatistics()
    rows: dict[str, list[np.ndarray]] = {"t/x": [], "t/h": [], "t/i": []}
    for step in range(steps):
        x = torch.randn(worlds, 3, generator=gen) * torch.tensor([0.5, 1e-2, 1.0]) + torch.tensor([3e4, -7.0, step])
        fields = {"x": x, "h": (torch.randn(worlds, generator=gen) + 300).half(),
                  "i": torch.randint(10**9, 10**9 + 50, (worlds, 2), generator=gen, dtype=torch.int32)}
        stats(batch(fields, step))
        for name, t in fields.items():
            rows[f"t/{name}"].append(t.double().numpy())
    summary = stats.summary()
    for key, parts in rows.items():
        assert_matches(summary.fields[key], np.concatenate(parts), FLOAT64_BOUNDS if key == "t/i" else FLOAT32_BOUNDS,
                       key)


def test_reading_mid_window_keeps_every_row_once() -> None:
    # summary() merges a partly filled window; the rows before and after are each counted once,
    # and reading changes nothing of what later reads give beyond rounding.
    gen = torch.Generator().manual_seed(11)
    data = [torch.randn(300, 2, generator=gen) * 0.1 + 50 for _ in range(90)]
    read, unread = LiveStatistics(), LiveStatistics()
    for step, x in enumerate(data):
        read(batch({"x": x}, step))
        unread(batch({"x": x}, step))
        if step in (0, 4, 37, 63, 64):
            rows = torch.cat(data[:step + 1]).double().numpy()
            assert_matches(read.summary().fields["t/x"], rows, FLOAT32_BOUNDS, str(step))
    rows = torch.cat(data).double().numpy()
    assert_matches(read.summary().fields["t/x"], rows, FLOAT32_BOUNDS)
    assert_matches(unread.summary().fields["t/x"], rows, FLOAT32_BOUNDS)
