"""Publisher process of the proxy tests: the storage tests' ``Sim`` recorded into a
``ZmqPublisher`` that connects to a worldtap-proxy's frontend.

``python proxy_sim.py FRONTEND --run RUN --seed S --steps N [--delay D] [--start FILE]
[--gate FILE --steps2 M]``: waits for one subscriber behind the proxy (prints ``joined``), for
``--start`` to exist, publishes ``N`` steps, then (with ``--gate``: prints ``gate``, waits for
the file and for a subscriber again) ``M`` more, and closes, which returns once the subscriber
behind the proxy has confirmed the run's end (prints ``closed``). Deterministic from the seed:
``Sim(Broker(), worlds, run=RUN, seed=S)`` stepped ``N + M`` times replays it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "storage"))

from storage_sim import Sim, wait_for_file

from broker import Broker, ZmqPublisher


def _steps(sim: Sim, n: int, delay: float) -> None:
    for _ in range(n):
        sim.step(1)
        if delay:
            time.sleep(delay)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("frontend")
    p.add_argument("--run", default="run-a")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worlds", type=int, default=6)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--start", default=None)
    p.add_argument("--gate", default=None)
    p.add_argument("--steps2", type=int, default=0)
    args = p.parse_args()
    broker = Broker()
    pub = ZmqPublisher(args.frontend, bind=False, send_timeout=30.0)
    broker.subscribe("", pub)
    pub.wait_for_subscribers(1, timeout=60.0)
    print("joined", flush=True)
    if args.start is not None:
        wait_for_file(args.start, "proxy_sim")
    sim = Sim(broker, args.worlds, run=args.run, seed=args.seed)
    _steps(sim, args.steps, args.delay)
    if args.gate is not None:
        print("gate", flush=True)
        wait_for_file(args.gate, "proxy_sim")
        pub.wait_for_subscribers(1, timeout=60.0)
        _steps(sim, args.steps2, args.delay)
    sim.close()
    pub.close(timeout=30.0)
    print(f"closed {pub.statistics()}", flush=True)


if __name__ == "__main__":
    main()
