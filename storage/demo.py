"""The worldtap end-to-end demo: randomized gymnasium CartPole worlds stored to Zarr.

``worldtap-demo [--store runs/demo.zarr] [--worlds 64] [--steps 600]`` starts the storage
daemon in another process, steps a vector of real gymnasium CartPole worlds with a noisy
balancing policy while randomizing each world's pole length and mass at every reset (and its
push force once, at build time), records observations, actions and outcomes through a
:class:`capture.Recorder`, publishes everything over ZeroMQ to the daemon, and reads the
stored episodes and the (variation, outcome) table back from the store.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
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
        noise = torch.from_numpy(self.rng.random(self.num_worlds) < 0.25)
        self.action.copy_(torch.where(noise, 1 - greedy, greedy))

    def step(self) -> torch.Tensor:
        """Step every world; returns the mask of worlds whose episode ended."""
        obs, reward, terminated, truncated, _ = self.envs.step(self.action.numpy())
        self.obs.copy_(torch.from_numpy(obs))
        self.reward.copy_(torch.from_numpy(np.asarray(reward, dtype=np.float32)))
        self.terminated.copy_(torch.from_numpy(terminated))
        self.truncated.copy_(torch.from_numpy(truncated))
        return self.terminated | self.truncated

    def set_physics(self, worlds: Sequence[int], **values: Sequence[float]) -> None:
        """Domain randomization hook: set ``half_length``, ``pole_mass`` or ``force`` per world."""
        names = {"half_length": "length", "pole_mass": "masspole", "force": "force_mag"}
        for name, per_world in values.items():
            for w, value in zip(worlds, per_world, strict=True):
                env: Any = self.envs.envs[w].unwrapped
                setattr(env, names[name], float(value))
        for w in worlds:
            env = self.envs.envs[w].unwrapped
            env.total_mass = env.masspole + env.masscart
            env.polemass_length = env.masspole * env.length

    def reset(self, done: torch.Tensor) -> None:
        obs, _ = self.envs.reset(options={"reset_mask": done.numpy()})
        self.obs.copy_(torch.from_numpy(obs))

    def close(self) -> None:
        self.envs.close()


def _variations() -> list[Any]:
    from capture.variations import LogUniformCfg, UniformCfg, Variation, VariationCfg

    return [
        Variation("half_length", VariationCfg(sampler=UniformCfg(0.2, 1.2, seed=1))),
        Variation("pole_mass", VariationCfg(sampler=LogUniformCfg(0.03, 0.5, seed=2))),
        Variation("force", VariationCfg(sampler=UniformCfg(4.0, 14.0, seed=3), phase="build")),
    ]


def _start_daemon(store: str, endpoint: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "storage", store, "--bind", endpoint, "--exit-after-runs", "1",
           "--status-interval", "2"]
    return subprocess.Popen(cmd)


def _wait(daemon: subprocess.Popen[bytes], timeout: float) -> int:
    """The daemon's exit code; it is killed (never left behind) if it outlives ``timeout``."""
    try:
        return daemon.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        return -9


def main(argv: Sequence[str] | None = None) -> int:
    from broker import Broker, ZmqPublisher
    from capture import FunctionTerm, Recorder
    from capture.variations import VariationRecorder
    from consumers import LiveStatistics

    from .reader import RunStore

    parser = argparse.ArgumentParser(prog="worldtap-demo", description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--store", default="runs/demo.zarr", help="Zarr store to write (default: %(default)s)")
    parser.add_argument("--worlds", type=int, default=64, help="parallel CartPole worlds")
    parser.add_argument("--steps", type=int, default=600, help="simulation steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--endpoint", default=None,
                        help="where the daemon binds (default: an ipc:// socket in a temporary folder)")
    args = parser.parse_args(argv)

    tmp = tempfile.TemporaryDirectory(prefix="worldtap-demo-")
    endpoint = args.endpoint or f"ipc://{tmp.name}/store.sock"
    daemon = _start_daemon(args.store, endpoint)
    sim = CartPoleWorlds(args.worlds, seed=args.seed)
    broker = Broker()
    stats = LiveStatistics()
    stats.attach(broker)
    publisher = ZmqPublisher(endpoint, bind=False)
    finished = False
    broker.subscribe("", publisher)
    try:
        publisher.wait_for_subscribers(1, timeout=60.0)
        rec = Recorder(args.worlds, "cpu", broker,
                       metadata={"env": "CartPole-v1", "seed": args.seed, "policy": "noisy-balance"})
        variations = _variations()
        VariationRecorder(rec).attach(variations)
        for v in variations:
            v.add_sample_listener(
                lambda value, worlds, key=v.name: sim.set_physics(
                    rec.select(worlds).tolist(), **{key: value.tolist()}))
        rec.add_term("policy", FunctionTerm(pre_step=lambda: {"obs": sim.obs, "action": sim.action}))
        rec.add_term("transition", FunctionTerm(post_step=lambda: {
            "obs": sim.obs, "reward": sim.reward, "terminated": sim.terminated, "truncated": sim.truncated}))
        rec.add_term("initial", FunctionTerm(post_reset=lambda w: {"obs": sim.obs[w]}))
        variations[2].sample(args.worlds)  # build time: one push force per world for the run
        variations[0].sample(args.worlds)
        variations[1].sample(args.worlds)
        sim.reset(torch.ones(args.worlds, dtype=torch.bool))
        rec.record_post_reset()
        for _ in range(args.steps):
            sim.act()
            rec.record_pre_step()
            done = sim.step()
            rec.record_post_step()
            if bool(done.any()):
                rec.record_pre_reset(done, success=sim.truncated[done], terminated=sim.terminated[done],
                                     truncated=sim.truncated[done])
                n = int(done.sum())
                variations[0].sample(n, done)  # runtime: drawn for the worlds' new episodes
                variations[1].sample(n, done)
                sim.reset(done)
                rec.record_post_reset(done)
        rec.close()
        finished = True
    finally:
        sim.close()
        try:
            publisher.close()  # delivers everything published, then closes the socket
        finally:
            if not finished:
                daemon.terminate()  # the daemon commits every complete episode and exits
            code = _wait(daemon, timeout=120.0)
            tmp.cleanup()
    if code != 0:
        print(f"worldtap-demo: the storage daemon exited with {code}", file=sys.stderr)
        return 1

    summary = stats.summary()
    sent = publisher.statistics()
    print(f"run {rec.run}: {args.worlds} worlds x {args.steps} steps; published {sent.messages} messages "
          f"({sent.bytes / 1e6:.1f} MB), {summary.episodes} episodes ended, success rate "
          f"{summary.success_rate:.2f}")
    store = RunStore(args.store)
    episodes = store.episodes(rec.run)
    print(f"store {args.store}: runs {store.runs()}; run {rec.run} holds {len(episodes)} episodes, "
          f"{int(episodes['success'].sum())} succeeded, mean length {episodes['length'].mean():.1f}")
    if len(episodes):
        world, index = int(episodes["world"][0]), int(episodes["index"][0])
        ep = store.episode(rec.run, world, index)
        print(f"episode (world {world}, index {index}): " +
              ", ".join(f"{k} {v.shape}" for k, v in ep.items() if not k.endswith(("_step", "_hook"))))
    table = store.variation_table(rec.run).arrays()
    x, y = table.x, table.y
    print(f"variation table: X {x.shape} {list(table.x_columns)}, Y {y.shape} {list(table.y_columns)}")
    success = y[:, list(table.y_columns).index("success")].astype(bool)
    for j, name in enumerate(table.x_columns):
        col = x[:, j]
        ok, bad = col[success], col[~success]
        print(f"  {name:>12}: mean {np.nanmean(col):.3f}; succeeded {np.nanmean(ok) if ok.size else float('nan'):.3f}"
              f", failed {np.nanmean(bad) if bad.size else float('nan'):.3f}")
    lost = summary.episodes - len(episodes)
    print("lossless: every ended episode is stored" if lost == 0 else f"MISSING {lost} episodes")
    return 0 if lost == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
