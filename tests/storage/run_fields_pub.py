"""Publisher process of the run-fields test in ``test_daemon.py``: publishes
``test_run_fields._publish_run`` (declarations, seed, wall times, changing episode outcomes) on
a bound ``ZmqPublisher``. Prints its endpoint, waits for ``--subscribers``, publishes, closes."""

from __future__ import annotations

import argparse
import sys

from test_run_fields import Run, _publish_run

from broker import Broker, ZmqPublisher


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--subscribers", type=int, default=1)
    args = p.parse_args()
    broker = Broker()
    pub = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20.0)
    try:
        broker.subscribe("", pub)
        print(pub.endpoints[0], flush=True)
        pub.wait_for_subscribers(args.subscribers, timeout=30.0)
        _publish_run(Run(broker))
    finally:
        pub.close()
    print(f"published {pub.statistics()}", flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
