"""Test helper of the storage tests: a small simulation that remembers what it published."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from broker import Broker, Message, VariationSample
from capture.recorder import Recorder
from capture.terms import FunctionTerm


class Sim:
    """Drives a Recorder whose worlds reset at random steps, keeping a copy of every row.

    Terms: ``obs`` (post_step: state float32[W,3], flag bool, nest/x int64[W,2]), ``final``
    (pre_reset: reward float32) and ``init`` (post_reset: q float32[n,2]). Variations:
    ``mass`` (build, per world) and ``friction`` (runtime, drawn at each reset). ``terms`` and
    ``variations`` choose a subset (a smaller store for slow backends).
    """

    def __init__(self, broker: Broker, num_worlds: int = 6, *, run: str = "run-a", seed: int = 0,
                 reset_p: float = 0.08, width: int = 3, terms: tuple[str, ...] = ("obs", "final", "init"),
                 variations: tuple[str, ...] = ("mass", "friction")) -> None:
        self.broker, self.num_worlds = broker, num_worlds
        self.rec = Recorder(num_worlds, broker=broker, run=run)
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.reset_p, self.width = reset_p, width
        self.variations = variations
        self.expected: dict[tuple[int, int], dict[str, list[np.ndarray]]] = defaultdict(
            lambda: defaultdict(list))
        self.outcome: dict[tuple[int, int], bool] = {}
        hooks = {"obs": FunctionTerm(post_step=self._obs), "final": FunctionTerm(pre_reset=self._final),
                 "init": FunctionTerm(post_reset=self._init)}
        for term in terms:
            self.rec.add_term(term, hooks[term])
        self.episode = np.zeros(num_worlds, np.int64)
        self.rec.start()
        if "mass" in variations:
            self._vary("mass", "build", torch.arange(num_worlds))

    def _keep(self, worlds: torch.Tensor, fields: dict[str, torch.Tensor]) -> None:
        for i, w in enumerate(worlds.tolist()):
            for name, t in fields.items():
                self.expected[(w, int(self.episode[w]))][name].append(t[i].numpy().copy())

    def _obs(self) -> dict[str, Any]:
        w = self.num_worlds
        state = torch.randn(w, self.width, generator=self.gen)
        flag = state[:, 0] > 0
        x = torch.randint(0, 100, (w, 2), generator=self.gen)
        self._keep(torch.arange(w), {"obs/state": state, "obs/flag": flag, "obs/nest/x": x})
        return {"state": state, "flag": flag, "nest": {"x": x}}

    def _final(self, worlds: torch.Tensor) -> dict[str, torch.Tensor]:
        reward = torch.rand(len(worlds), generator=self.gen)
        self._keep(worlds, {"final/reward": reward})
        return {"reward": reward}

    def _init(self, worlds: torch.Tensor) -> dict[str, torch.Tensor]:
        q = torch.randn(len(worlds), 2, generator=self.gen)
        self._keep(worlds, {"init/q": q})
        return {"q": q}

    def _vary(self, key: str, phase: str, worlds: torch.Tensor) -> None:
        value = torch.rand(len(worlds), generator=self.gen, dtype=torch.float64)
        self.rec.publish(VariationSample(self.rec.run, self.rec.next_seq(), self.rec.step, key,
                                         phase, worlds, self.rec.episodes_of(worlds), value))  # type: ignore[arg-type]

    def step(self, n: int = 1, *, force_reset: list[int] | None = None) -> None:
        for _ in range(n):
            self.rec.record_post_step()
            done = [w for w in range(self.num_worlds) if self.rng.random() < self.reset_p]
            if force_reset is not None:
                done = sorted(set(done) | set(force_reset))
            if done:
                idx = torch.tensor(done)
                success = torch.tensor([bool(self.rng.random() < 0.5) for _ in done])
                for w, s in zip(done, success.tolist(), strict=True):
                    self.outcome[(w, int(self.episode[w]))] = s
                self.rec.record_pre_reset(idx, success=success, truncated=~success)
                self.episode[done] += 1
                self.rec.record_post_reset(idx)
                if "friction" in self.variations:
                    self._vary("friction", "runtime", idx)

    def close(self) -> None:
        self.rec.close()

    def arrays(self, key: tuple[int, int]) -> dict[str, np.ndarray]:
        return {name: np.stack(rows) for name, rows in self.expected[key].items()}


def owned(message: Message) -> Message:
    """A copy of ``message`` that owns its tensors (published tensors are borrowed)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if isinstance(value, torch.Tensor):
            value = value.clone()
        elif f.name == "fields":
            value = {k: t.clone() for k, t in value.items()}
        kw[f.name] = value
    return type(message)(**kw)


def assert_episode_equal(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        assert got[name].tobytes() == value.tobytes(), name
    for name, value in got.items():  # terms without rows in this episode read back empty
        if name not in want and not name.rsplit("/", 1)[-1].startswith("_"):
            assert len(value) == 0, name


def expected_sim(seed: int, steps: int, worlds: int) -> Sim:
    """The same simulation as ``main`` publishes, replayed in process without a transport."""
    sim = Sim(Broker(), worlds, seed=seed)
    sim.step(steps)
    return sim


def main() -> None:
    """Publisher process of the integration tests: ``python storage_sim.py --steps N ...``.

    Prints its endpoint on stdout, waits for one subscriber, publishes, closes (RunEnd).
    """
    import argparse
    import sys
    import time

    from broker import ZmqPublisher

    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", default="tcp://127.0.0.1:*")
    p.add_argument("--connect", action="store_true")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--worlds", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--gate", default=None, help="after --steps, wait for this file to exist and "
                   "for a subscriber, then publish --steps2 more steps")
    p.add_argument("--steps2", type=int, default=0)
    p.add_argument("--end-gate", default=None, help="after the run's RunEnd, wait for this file "
                   "to exist and for a subscriber, then close (which waits for its confirmation)")
    args = p.parse_args()
    broker = Broker()
    pub = ZmqPublisher(args.endpoint, bind=not args.connect, send_timeout=20.0)
    broker.subscribe("", pub)
    print(pub.endpoints[0], flush=True)
    pub.wait_for_subscribers(1, timeout=20.0)
    sim = Sim(broker, args.worlds, seed=args.seed)
    for _ in range(args.steps):
        sim.step(1)
        if args.delay:
            time.sleep(args.delay)
    if args.gate is not None:
        deadline = time.monotonic() + 60.0
        while not Path(args.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        pub.wait_for_subscribers(1, timeout=20.0)
        for _ in range(args.steps2):
            sim.step(1)
            if args.delay:
                time.sleep(args.delay)
    sim.close()
    if args.end_gate is not None:
        print("ended", flush=True)
        deadline = time.monotonic() + 60.0
        while not Path(args.end_gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        pub.wait_for_subscribers(1, timeout=20.0)
    pub.close()
    print(f"published {pub.statistics()}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()


def wait_for_file(path: str, who: str, timeout: float = 60.0) -> None:
    """Block until ``path`` exists (a test's go signal to a publisher script); exit naming
    ``who`` after ``timeout`` seconds."""
    import sys
    import time

    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            sys.exit(f"{who}: {path} did not appear within {timeout:.0f} s")
        time.sleep(0.01)

