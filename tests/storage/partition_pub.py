"""Publisher process of the partition tests: several runs of the storage tests' ``Sim``, stepped
together on one ``ZmqPublisher`` that connects to a worldtap-proxy's frontend.

``python partition_pub.py FRONTEND --run RUN:SEED ... --subscribers N --start FILE --steps S
[--gate FILE --steps2 M]``: waits for ``N`` subscribers behind the proxy (prints ``joined``),
for ``--start`` to exist, steps every run ``S`` times (one step of each in turn), then (with
``--gate``: prints ``gate``, waits for the file and for ``N`` subscribers again) ``M`` more,
ends every run and closes, which returns once every daemon behind the proxy has confirmed
every run's end (prints ``closed``). Deterministic: ``Sim(Broker(), 6, run=RUN, seed=SEED)``
stepped ``S + M`` times replays a run.
"""

from __future__ import annotations

import argparse
import time

from storage_sim import Sim, wait_for_file

from broker import Broker, ZmqPublisher


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("frontend")
    p.add_argument("--run", action="append", required=True, metavar="RUN:SEED")
    p.add_argument("--subscribers", type=int, required=True)
    p.add_argument("--start", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--gate", default=None)
    p.add_argument("--steps2", type=int, default=0)
    args = p.parse_args()
    broker = Broker()
    pub = ZmqPublisher(args.frontend, bind=False, send_timeout=30.0)
    broker.subscribe("", pub)
    pub.wait_for_subscribers(args.subscribers, timeout=60.0)
    print("joined", flush=True)
    wait_for_file(args.start, "partition_pub")
    sims = [Sim(broker, 6, run=run, seed=int(seed))
            for run, seed in (spec.rsplit(":", 1) for spec in args.run)]

    def steps(n: int) -> None:
        for _ in range(n):
            for sim in sims:
                sim.step(1)
            if args.delay:
                time.sleep(args.delay)

    steps(args.steps)
    if args.gate is not None:
        print("gate", flush=True)
        wait_for_file(args.gate, "partition_pub")
        pub.wait_for_subscribers(args.subscribers, timeout=60.0)
        steps(args.steps2)
    for sim in sims:
        sim.close()
    pub.close(timeout=30.0)
    print(f"closed {pub.statistics()}", flush=True)


if __name__ == "__main__":
    main()
