"""The ``kernel`` fixture: LiveStatistics' reductions, one test per reduction (parametrize it
with ``indirect=True``). ``"numba-parts"`` is the numba kernel with every float batch of more
than a few rows cut into parts reduced on two threads (consumers.live_stats._PART_BYTES
lowered), so that small test batches take the path large batches take; the test fails if no
batch took it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from consumers import _kernels, live_stats


@pytest.fixture
def parts_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    """The output shape (``[parts, 4, columns]``) of each call of the kernel that reduces a
    batch in parts, as they come; skips where numba's threads are not used."""
    if _kernels.threads() < 2:
        pytest.skip(f"numba's threading layer here may not be launched from any thread "
                    f"(it is one of {sorted(_kernels.SAFE_LAYERS)} where LiveStatistics uses it)")
    calls: list[tuple[int, ...]] = []
    compiled = _kernels.moments_parts()

    def counted(fields: Any, count: int, shift: Any, starts: Any, out: Any, rows: int) -> None:
        assert len(fields) == _kernels.ARITY
        assert 0 < count <= len(fields)
        calls.append(out.shape)
        compiled(fields, count, shift, starts, out, rows)

    monkeypatch.setattr(_kernels, "_parts", counted)
    return calls


@pytest.fixture
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name: str = request.param
    if name != "numba-parts":
        yield name
        return
    calls: list[tuple[int, ...]] = request.getfixturevalue("parts_calls")
    monkeypatch.setattr(live_stats, "_PART_BYTES", 16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield "numba"
    finally:
        torch.set_num_threads(threads)
    assert calls, "no batch was reduced in parts"
    assert all(shape[0] == 2 for shape in calls), calls
