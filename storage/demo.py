"""The worldtap demo: gymnasium CartPole worlds recorded through the broker.

``worldtap-demo [--worlds 64] [--steps 400]`` steps a vector of real gymnasium CartPole worlds
with a noisy balancing policy, records observations, actions and rewards every step through a
:class:`capture.Recorder`, and feeds a live statistics consumer and batched retention.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["CartPoleWorlds", "main"]


class CartPoleWorlds:
    """Real gymnasium CartPole worlds stepped together, exposed as batched torch tensors.

    Buffers (``obs``, ``action``, ``reward``, ``terminated``, ``truncated``) are simulator-owned
    and overwritten in place every step, as a GPU simulator's would be.
    """

    def __init__(self, num_worlds: int, *, seed: int = 0, max_steps: int = 200) -> None:
        import gymnasium as gym  # optional dependency, imported lazily

        self.num_worlds = num_worlds
        self.envs: Any = gym.make_vec(
            "CartPole-v1", num_envs=num_worlds, vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.DISABLED},
            max_episode_steps=max_steps,
        )
        self.rng = np.random.default_rng(seed)
        obs, _ = self.envs.reset(seed=seed)
        self.obs = torch.from_numpy(np.ascontiguousarray(obs))
        self.action = torch.zeros(num_worlds, dtype=torch.int64)
        self.reward = torch.zeros(num_worlds)
        self.terminated = torch.zeros(num_worlds, dtype=torch.bool)
        self.truncated = torch.zeros(num_worlds, dtype=torch.bool)

    def act(self) -> None:
        """A noisy balancing policy: push toward the pole's lean, sometimes at random."""
        lean = self.obs[:, 2] + 0.5 * self.obs[:, 3]
        greedy = (lean > 0).to(torch.int64)
        noise = torch.from_numpy(self.rng.random(self.num_worlds) < 0.1)
        self.action.copy_(torch.where(noise, 1 - greedy, greedy))

    def step(self) -> torch.Tensor:
        """Step every world; returns the mask of worlds whose episode ended."""
        obs, reward, terminated, truncated, _ = self.envs.step(self.action.numpy())
        self.obs.copy_(torch.from_numpy(obs))
        self.reward.copy_(torch.from_numpy(np.asarray(reward, dtype=np.float32)))
        self.terminated.copy_(torch.from_numpy(terminated))
        self.truncated.copy_(torch.from_numpy(truncated))
        return self.terminated | self.truncated

    def set_pole_length(self, worlds: Sequence[int], half_length: Sequence[float]) -> None:
        """Domain randomization hook: set each world's (half) pole length."""
        for w, length in zip(worlds, half_length, strict=True):
            env: Any = self.envs.envs[w].unwrapped
            env.length = float(length)
            env.polemass_length = env.masspole * env.length

    def reset(self, done: torch.Tensor) -> None:
        obs, _ = self.envs.reset(options={"reset_mask": done.numpy()})
        self.obs.copy_(torch.from_numpy(obs))

    def close(self) -> None:
        self.envs.close()


def main(argv: Sequence[str] | None = None) -> int:
    from broker import Broker
    from capture import FunctionTerm, Recorder
    from consumers import FinishedEpisode, LiveStatistics, Retention

    parser = argparse.ArgumentParser(prog="worldtap-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, default=64, help="parallel CartPole worlds")
    parser.add_argument("--steps", type=int, default=400, help="simulation steps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    sim = CartPoleWorlds(args.worlds, seed=args.seed)
    broker = Broker()
    stats = LiveStatistics()
    stats.attach(broker)
    finished: list[FinishedEpisode] = []
    retention = Retention(sink=finished.append)
    retention.attach(broker)
    rec = Recorder(args.worlds, "cpu", broker, metadata={"env": "CartPole-v1", "seed": args.seed})
    rec.add_term("policy", FunctionTerm(pre_step=lambda: {"obs": sim.obs, "action": sim.action}))
    rec.add_term("transition", FunctionTerm(post_step=lambda: {
        "obs": sim.obs, "reward": sim.reward, "terminated": sim.terminated, "truncated": sim.truncated}))
    rec.add_term("initial", FunctionTerm(post_reset=lambda w: {"obs": sim.obs[w]}))
    rec.record_post_reset()
    for _ in range(args.steps):
        sim.act()
        rec.record_pre_step()
        done = sim.step()
        rec.record_post_step()
        if bool(done.any()):
            rec.record_pre_reset(done, success=sim.truncated[done], terminated=sim.terminated[done],
                                 truncated=sim.truncated[done])
            sim.reset(done)
            rec.record_post_reset(done)
    rec.close()
    sim.close()

    summary = stats.summary()
    print(f"run {rec.run}: {args.worlds} worlds x {args.steps} steps, "
          f"{summary.batches} batches, {broker.statistics().published} messages")
    print(f"episodes finished: {summary.episodes}, success rate {summary.success_rate:.2f}, "
          f"mean length {summary.mean_length:.1f}")
    obs = summary.fields["transition/obs"]
    print("obs mean", np.array2string(obs.mean, precision=3), "std", np.array2string(obs.std, precision=3))
    if finished:
        ep = finished[0]
        shapes = {f"{t}/{f}": tuple(v.shape) for t, fs in ep.data.items() for f, v in fs.items()}
        print(f"first retained episode: world {ep.world} episode {ep.episode} "
              f"length {ep.length} success {ep.success}: {shapes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
