"""The seed payload every benchmark uses: four float32 fields and three bool fields."""

from __future__ import annotations

import torch

__all__ = ["BOOL_FIELDS", "FLOAT_FIELDS", "make_payload", "payload_bytes"]

FLOAT_FIELDS = (("state", 37), ("next_state", 37), ("control", 19), ("contacts", 72))
BOOL_FIELDS = ("terminated", "truncated", "valid")


def make_payload(worlds: int, device: torch.device | str = "cpu", *, seed: int = 0) -> dict[str, torch.Tensor]:
    """One step's payload for ``worlds`` worlds (random floats, random bools)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = {name: torch.randn(worlds, width, generator=gen).to(device) for name, width in FLOAT_FIELDS}
    out.update({name: (torch.rand(worlds, generator=gen) < 0.5).to(device) for name in BOOL_FIELDS})
    return out


def payload_bytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())
