"""CUDA staging: pinned host slots, a side stream and an event (needs a GPU; skipped without)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from broker import Batch, Subscriber, ZmqPublisher

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_batches_arrive_intact_while_the_simulation_overwrites_them(
        make_pub: Callable[..., ZmqPublisher], make_sub: Callable[..., Subscriber]) -> None:
    pub = make_pub("tcp://127.0.0.1:*", slots=4)
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    device = torch.device("cuda", torch.cuda.current_device())
    worlds = torch.arange(4096, device=device)
    episodes = torch.zeros(4096, dtype=torch.int64, device=device)
    state = torch.empty(4096, 37, device=device)
    big = torch.empty(4096, 4096, device=device)
    for i in range(20):
        state.fill_(float(i))
        pub(Batch("run", i, i, "batch/obs", worlds, episodes, {"state": state, "done": state[:, 0] > 5}))
        big.normal_()  # queue work so the copy is still pending...
        state.fill_(-1.0)  # ...when the simulation overwrites the source on its stream
    for i in range(20):
        item = sub.recv(timeout=10)
        assert isinstance(item, Batch)
        assert item.seq == i
        assert item.fields["state"].device.type == "cpu"
        assert bool((item.fields["state"] == float(i)).all())
        assert bool((item.fields["done"] == (i > 5)).all())
    assert pub._ring.slots[0].buffer is not None
    assert pub._ring.slots[0].buffer.is_pinned()
