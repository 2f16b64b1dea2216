"""Suite-wide fixtures: a strict broker, CUDA gating."""

from __future__ import annotations

import pytest
import torch

from broker import Broker


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def broker() -> Broker:
    """A strict broker: consumer failures are re-raised into the test."""
    with Broker(strict=True) as b:
        yield b  # type: ignore[misc]

