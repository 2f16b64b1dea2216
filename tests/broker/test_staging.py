"""The staging ring copies every tensor's bits exactly, whatever its dtype or strides."""

from __future__ import annotations

import threading

import pytest
import torch

from broker.staging import StagingRing

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.float8_e4m3fn]


def _staged_bytes(ring: StagingRing, tensors: list[torch.Tensor]) -> list[bytes]:
    slot = ring.acquire(True, 1.0)
    assert slot is not None
    layout, event = ring.stage(slot, tensors)
    assert event is None
    out = [bytes(slot.frame(off, nb)) for off, nb in layout]
    ring.release(slot, None)
    return out


def _bits(t: torch.Tensor) -> bytes:
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stage_copies_bits_of_every_dtype(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (5, 3, 2 * 8), dtype=torch.uint8, generator=g)
    t = raw.view(dtype) if dtype != torch.bool else raw > 127
    ring = StagingRing(2, threading.Condition())
    assert _staged_bytes(ring, [t]) == [_bits(t)]


def test_stage_handles_strided_empty_zero_d_and_grad_tensors() -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    tensors = [base[:, ::3], base.t(), torch.zeros(0, 4), torch.tensor(7, dtype=torch.int64),
               torch.ones(3, requires_grad=True), base[1:4].to(torch.bfloat16)[:, 1::2],
               base[2],  # contiguous, at an offset into its storage
               torch.arange(5.0)._neg_view()]  # a lazily negated view: its values, not its bits
    ring = StagingRing(1, threading.Condition())
    for _ in range(2):  # the second pass reuses the cached plan
        assert _staged_bytes(ring, tensors) == [_bits(t.resolve_neg()) for t in tensors]
        base.add_(1)


def test_overwriting_the_source_after_staging_changes_nothing_staged() -> None:
    t = torch.arange(8, dtype=torch.float32)
    ring = StagingRing(1, threading.Condition())
    slot = ring.acquire(True, 1.0)
    assert slot is not None
    layout, _ = ring.stage(slot, [t])
    t.fill_(-1)
    assert bytes(slot.frame(*layout[0])) == _bits(torch.arange(8, dtype=torch.float32))
