"""The worldtap end-to-end demo: randomized CartPole worlds, stored, then analysed.

``worldtap-demo [--out runs] [--worlds 64] [--episodes 2000]``

1. starts the storage daemon (``worldtap-store``) as a separate process, writing to
   ``OUT/demo.zarr`` (its log in ``OUT/daemon.log``);
2. steps gymnasium's ``CartPoleVectorEnv`` (every world in numpy) through
   :class:`capture.gymnasium.RecordingVectorEnv`, with a noisy balancing policy, until the
   requested number of episodes has ended. At each world's reset, before the first step of its
   new episode, :class:`capture.cartpole.CartPoleRandomizer` draws the pole's half length, the
   pole's and the cart's mass and the push force from ``capture.variations`` samplers and
   writes them into that world's physics; a fifth factor, the cart's paint, is drawn and
   recorded but changes nothing (a factor known to have no effect). The parameters every world
   actually stepped with are recorded too, beside each transition (``step/physics/<name>``),
   so anyone can check the stored variation samples against what the simulation used. Live
   statistics and episode retention are attached in the process; a progress bar shows episodes, steps/s and the ETA;
3. publishes everything over ZeroMQ to the daemon, closes the run and waits for the daemon to
   commit it and exit;
4. runs the sensitivity analysis (``worldtap-sensitivity``) on the store and prints the indices
   table and where the store, the plot and the tables are.

Ctrl-C stops stepping at the next step: the run is closed as interrupted, the daemon commits
every complete episode and exits, and the demo exits with 130 without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["PLACEBO", "main", "variations"]

PLACEBO = "paint"
"""The factor the demo draws and records but never applies: it cannot change any outcome."""

_INTERRUPTED = 130


def variations() -> dict[str, Any]:
    """The demo's factors: CartPole parameter (or :data:`PLACEBO`) -> ``Variation``.

    Seeds are left to the recorder (derived from the run seed and each key)."""
    from capture.variations import ChoiceCfg, LogUniformCfg, UniformCfg, Variation, VariationCfg

    return {
        "length": Variation("length", VariationCfg(sampler=UniformCfg(0.15, 1.5))),
        "masspole": Variation("masspole", VariationCfg(sampler=LogUniformCfg(0.02, 1.0))),
        "masscart": Variation("masscart", VariationCfg(sampler=UniformCfg(0.5, 2.0))),
        "force_mag": Variation("force_mag", VariationCfg(sampler=UniformCfg(4.0, 16.0))),
        PLACEBO: Variation(PLACEBO, VariationCfg(sampler=ChoiceCfg(["red", "green", "blue"]))),
    }


class _Policy:
    """A noisy balancing policy: push toward the pole's lean, at random a quarter of the time."""

    def __init__(self, num_worlds: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n = num_worlds

    def __call__(self, obs: np.ndarray) -> np.ndarray:
        lean = obs[:, 2] + 0.5 * obs[:, 3]
        greedy = (lean > 0).astype(np.int64)
        noise = self.rng.random(self.n) < 0.25
        return np.where(noise, 1 - greedy, greedy)


def _start_daemon(store: Path, endpoint: str, log: Path) -> subprocess.Popen[bytes]:
    """The daemon, in its own session: a terminal's Ctrl-C reaches the demo only, which then
    closes the run so the daemon commits it and exits by itself."""
    cmd = [sys.executable, "-m", "storage", str(store), "--bind", endpoint, "--exit-after-runs", "1",
           "--status-interval", "2"]
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(publisher: Any, daemon: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    """Wait until the daemon has joined the publisher (or died, or ``timeout`` passed)."""
    from broker import SubscriberTimeoutError

    deadline = time.monotonic() + timeout
    while True:
        try:
            publisher.wait_for_subscribers(1, timeout=0.5)
            return
        except SubscriberTimeoutError:
            if daemon.poll() is not None:
                raise RuntimeError(f"the storage daemon exited with {daemon.returncode} before it "
                                   f"was ready: {_tail(log)}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the storage daemon did not join within {timeout:.0f} s: "
                                   f"{_tail(log)}") from None


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " | ".join(text[-lines:]) if text else "(empty log)"


def _finish_daemon(daemon: subprocess.Popen[bytes], timeout: float) -> int:
    """The daemon's exit code once it has committed and exited; told to stop (SIGTERM: it
    commits every complete episode) if it outlives ``timeout``, killed only as a last resort."""
    try:
        return daemon.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        daemon.terminate()
    try:
        return daemon.wait(timeout=30.0)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait()
        return -9


class _Progress:
    """Episodes ended, steps/s and ETA: a rich progress bar on a terminal, a line every few
    seconds otherwise."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.start = time.monotonic()
        self._last_line = self.start
        self._bar: Any = None
        if enabled and sys.stderr.isatty():
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._bar = Progress(TextColumn("episodes"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]:>7.0f} steps/s"), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), transient=False)
            self._task = self._bar.add_task("episodes", total=total, rate=0.0)
            self._bar.start()

    def update(self, episodes: int, steps: int) -> None:
        now = time.monotonic()
        rate = steps / max(now - self.start, 1e-9)
        if self._bar is not None:
            self._bar.update(self._task, completed=min(episodes, self.total), rate=rate)
        elif self.enabled and now - self._last_line >= 5.0 and episodes:
            self._last_line = now
            eta = (self.total - episodes) / (episodes / (now - self.start))
            print(f"worldtap-demo: {episodes}/{self.total} episodes, {rate:.0f} steps/s, "
                  f"ETA {max(eta, 0):.0f} s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="worldtap-demo", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", default="runs", help="output folder (default: %(default)s)")
    p.add_argument("--store", default=None, help="Zarr store to write (default: OUT/demo.zarr)")
    p.add_argument("--worlds", type=int, default=64, help="parallel CartPole worlds (default: %(default)s)")
    p.add_argument("--episodes", type=int, default=2000,
                   help="stop once this many episodes have ended (default: %(default)s)")
    p.add_argument("--max-steps", type=int, default=200,
                   help="time limit of an episode in steps; reaching it is a success (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="run seed (default: %(default)s)")
    p.add_argument("--endpoint", default=None,
                   help="where the daemon binds (default: an ipc:// socket in a temporary folder)")
    p.add_argument("--resamples", type=int, default=100,
                   help="bootstrap resamples of the sensitivity analysis (default: %(default)s)")
    p.add_argument("--no-analysis", action="store_true", help="skip the sensitivity analysis")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    for name in ("worlds", "episodes", "max_steps", "resamples"):
        if getattr(args, name) < 1:
            print(f"worldtap-demo: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = Path(args.store) if args.store else out / "demo.zarr"
    log = out / "daemon.log"
    from broker.cli_args import signals_set

    stop = threading.Event()  # set by the first SIGINT/SIGTERM; a second raises KeyboardInterrupt
    with tempfile.TemporaryDirectory(prefix="worldtap-demo-") as tmp, signals_set(stop, interrupt_again=True):
        endpoint = args.endpoint or f"ipc://{tmp}/store.sock"
        try:
            result = _record(args, store, endpoint, log, stop)
        except KeyboardInterrupt:
            print("worldtap-demo: stopped at once (second Ctrl-C); the daemon commits what it "
                  "holds", file=sys.stderr)
            return _INTERRUPTED
        except RuntimeError as exc:
            print(f"worldtap-demo: {exc}", file=sys.stderr)
            return 1
    if result is None:
        return 1
    run, interrupted = result
    if interrupted:
        print("worldtap-demo: interrupted; the run is stored as interrupted with every complete "
              "episode", file=sys.stderr)
    code = _report(store, run)
    if code == 0 and not args.no_analysis and not interrupted:
        code = _analyse(store, run, out, args.resamples)
    return _INTERRUPTED if interrupted else code


def _record(args: argparse.Namespace, store: Path, endpoint: str, log: Path,
            stop: threading.Event) -> tuple[str, bool] | None:
    """Run the simulation into the daemon; returns (run, interrupted), or None on failure."""
    import gymnasium as gym

    from broker import Broker, ZmqPublisher
    from capture import Recorder
    from capture.cartpole import CartPoleRandomizer, physics
    from capture.gymnasium import RecordingVectorEnv
    from capture.variations import VariationRecorder
    from consumers import LiveStatistics, Retention

    daemon = _start_daemon(store, endpoint, log)
    publisher = ZmqPublisher(endpoint, bind=False)
    env: Any = None
    wrapped: Any = None
    interrupted = False
    progress = _Progress(args.episodes, not args.quiet)
    try:
        _wait_ready(publisher, daemon, log, timeout=60.0)
        broker = Broker()
        stats = LiveStatistics()
        stats.attach(broker)
        retention = Retention()  # every world's current episode, in batched buffers
        retention.attach(broker)
        broker.subscribe("", publisher)
        rec = Recorder(args.worlds, "cpu", broker, seed=args.seed,
                       metadata={"env": "CartPoleVectorEnv", "policy": "noisy-balance",
                                 "max_episode_steps": args.max_steps, "placebo": PLACEBO})
        factors = variations()
        VariationRecorder(rec, keep_records=False).attach(factors.values())
        env = gym.make_vec("CartPole-v1", num_envs=args.worlds, vectorization_mode="vector_entry_point",
                           max_episode_steps=args.max_steps)
        physical = {k: v for k, v in factors.items() if k != PLACEBO}
        randomize = CartPoleRandomizer(env, physical)
        placebo = factors[PLACEBO]
        wrapped = RecordingVectorEnv(
            env, rec,
            on_reset=[randomize, lambda worlds: placebo.sample(int(worlds.numel()), worlds)],
            # What every world stepped with, beside each transition (step/physics/<name>).
            step_fields=lambda: {"physics": {k: v for k, v in physics(env).items() if k in physical}})
        policy = _Policy(args.worlds, args.seed)
        obs, _ = wrapped.reset(seed=args.seed)
        progress.start = time.monotonic()
        ended = steps = 0
        while ended < args.episodes and not stop.is_set():
            obs, _, terminated, truncated, _ = wrapped.step(policy(obs))
            ended += int(np.count_nonzero(terminated | truncated))
            steps += 1
            progress.update(ended, steps * args.worlds)
        interrupted = stop.is_set()
        progress.close()
        rec.close(interrupted=interrupted)  # RunEnd; the store marks an interrupted run so
        wrapped.close()
        run = rec.run
        summary = stats.summary()
        print(f"run {run}: {args.worlds} worlds, {steps} steps, {ended} episodes ended "
              f"(success rate {summary.success_rate:.2f}) in {time.monotonic() - progress.start:.1f} s")
        publisher.close()  # delivers everything published; the daemon confirms the run's end
    except BaseException:
        progress.close()
        if wrapped is not None:
            wrapped.env.close()
        with contextlib.suppress(Exception):  # already failing: the daemon keeps its commits
            publisher.close(timeout=2.0)
        daemon.terminate()  # it commits every complete episode and exits
        _finish_daemon(daemon, timeout=30.0)
        raise
    code = _finish_daemon(daemon, timeout=120.0)
    print(f"daemon: {_tail(log, 1)}")
    if code != 0:
        print(f"worldtap-demo: the storage daemon exited with {code} (log: {log})", file=sys.stderr)
        return None
    return run, interrupted


def _report(store: Path, run: str) -> int:
    from .reader import RunStore

    reader = RunStore(str(store))
    info = reader.info(run)
    episodes = reader.episodes(run)
    n = len(episodes)
    ok = int(episodes["success"].sum()) if n else 0
    mean = float(episodes["length"].mean()) if n else float("nan")
    print(f"store {store}: run {run} ({info['status']}) holds {n} episodes, {ok} succeeded, "
          f"mean length {mean:.1f}")
    still = info.get("open_at_end")
    if still:
        print(f"  {still} episodes still in progress when the run ended were not stored (incomplete)")
    return 0


def _analyse(store: Path, run: str, out: Path, resamples: int) -> int:
    from consumers.sensitivity.cli import main as sensitivity

    return sensitivity(["--store", str(store), "--run", run, "--out", str(out / "sensitivity" / run),
                        "--resamples", str(resamples)])


if __name__ == "__main__":
    sys.exit(main())
