"""Test helper of the read tests (bulk reads, queries, datasets): small stores written through
the daemon in process, and what was published into them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
from storage_sim import Sim, owned

from broker import Batch, Broker, EpisodeEnd, Message, VariationSample
from storage import StoreDaemon

COLORS = ("red", "green", "blue")


def record(run: str, seed: int, steps: int, *, worlds: int = 6, reset_p: float = 0.08) -> tuple[Sim, list[Message]]:
    """A Sim run (terms obs, final, init; variations mass, friction) with more to read:

    - ``obs/h``: a bfloat16 copy of ``obs/state``;
    - variations ``pole`` (build, a vector of 2 per world) and ``color`` (build, categorical,
      labels :data:`COLORS`);
    - an episode outcome named ``return`` (a Python keyword), ``10 * world + index``.
    """
    got: list[Message] = []
    broker = Broker(strict=True)
    broker.subscribe("", lambda m: got.append(owned(m)))
    sim = Sim(broker, worlds, run=run, seed=seed, reset_p=reset_p)
    everyone = torch.arange(worlds)
    gen = torch.Generator().manual_seed(seed + 100)
    for key, value, labels in (
            ("pole", torch.rand(worlds, 2, generator=gen, dtype=torch.float64), None),
            ("color", torch.randint(0, len(COLORS), (worlds,), generator=gen), COLORS)):
        sim.rec.publish(VariationSample(run, sim.rec.next_seq(), sim.rec.step, key, "build", everyone,
                                        sim.rec.episodes_of(everyone), value, labels))
    sim.step(steps)
    sim.close()
    out: list[Message] = []
    for m in got:
        if isinstance(m, Batch) and m.term == "obs":
            m = dataclasses.replace(m, fields={**m.fields, "h": m.fields["state"].to(torch.bfloat16)})
        elif isinstance(m, EpisodeEnd):
            m = dataclasses.replace(m, outcomes={"return": (10 * m.worlds + m.episodes).to(torch.float64)})
        out.append(m)
    return sim, out


def expected(sim: Sim, key: tuple[int, int]) -> dict[str, np.ndarray]:
    """What episode ``key`` of ``sim`` published, field by field (``obs/h`` as float32)."""
    want = sim.arrays(key)
    if "obs/state" in want:
        want["obs/h"] = torch.from_numpy(want["obs/state"]).to(torch.bfloat16).to(torch.float32).numpy()
    return want


def write(store: Any, *runs: tuple[str, int, int], **daemon_kw: Any) -> dict[str, Sim]:
    """Record runs ``(run, seed, steps)`` and store them through a daemon in process; small
    chunks and memory budget by default, so episodes span chunks and are stored in
    fragments."""
    daemon_kw = {"commit_interval": 0.0, "memory_budget": 16 << 10, "chunk_bytes": 256, **daemon_kw}
    daemon = StoreDaemon(store, **daemon_kw)
    sims = {}
    try:
        for run, seed, steps in runs:
            sim, messages = record(run, seed, steps)
            for m in messages:
                daemon.handle(m)
            sims[run] = sim
    finally:
        daemon.close()
    stats = daemon.statistics()
    assert sum(stats.rejected.values()) == 0, stats.rejected
    assert stats.runs_failed == 0
    return sims


def two_runs(path: Path | Any) -> dict[str, Sim]:
    """The store most read tests use: runs ``run-a`` and ``run-b``."""
    return write(path, ("run-a", 0, 100), ("run-b", 1, 60))


def assert_same(got: dict[str, Any], want: dict[str, np.ndarray], where: object = "") -> None:
    """Same keys; each value of the same dtype, shape and bytes (tensors compared as numpy)."""
    assert set(got) == set(want), (where, sorted(got), sorted(want))
    for name, value in want.items():
        g = got[name].numpy() if isinstance(got[name], torch.Tensor) else got[name]
        assert g.dtype == value.dtype, (where, name, g.dtype, value.dtype)
        assert g.shape == value.shape, (where, name, g.shape, value.shape)
        assert g.tobytes() == value.tobytes(), (where, name)
