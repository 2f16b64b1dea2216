"""Capture benchmark: simulation-thread cost per step with no consumer, each consumer, and all.

``python -m benchmarks.capture [--json] [--device cuda] [--worlds 4096] [--threads 1]``

One recorder term publishes the seed payload every step; each case subscribes a different set
of consumers to the broker. The cost is the time ``record_post_step`` takes in the simulation
thread, measured in randomized paired trials, next to a plain memcpy of the payload: the table
gives each case's median, its spread over the trials and its ratio to the memcpy's median.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from broker import Broker
from capture import FunctionTerm, Recorder
from consumers import LiveStatistics, Retention, _kernels

from . import _timing
from ._payload import make_payload, payload_bytes

CONSUMERS: dict[str, Callable[[], list[Any]]] = {
    "none": lambda: [],
    "live_statistics": lambda: [LiveStatistics()],  # the default kernel: numba where installed
    "live_statistics_eager": lambda: [LiveStatistics(kernel="eager")],
    "live_statistics_compiled": lambda: [LiveStatistics(kernel="compile")],
    "retention": lambda: [Retention()],
    "all": lambda: [LiveStatistics(), Retention()],
}


def _resetter(consumers: list[Any]) -> Callable[[], None]:
    def reset() -> None:
        for c in consumers:
            if isinstance(c, Retention):
                c.reset()

    return reset


def run_case(worlds: int, device: torch.device, steps: int, trials: int, seed: int) -> dict[str, Any]:
    payload = make_payload(worlds, device, seed=seed)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in payload.values()])
    target = torch.empty_like(flat)
    cases: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {}
    recorders: list[Recorder] = []
    for name, make in CONSUMERS.items():
        broker = Broker()
        consumers = make()
        for c in consumers:
            c.attach(broker)
        rec = Recorder(worlds, device, broker, run=name)
        rec.add_term("transition", FunctionTerm(post_step=lambda: payload))
        recorders.append(rec)

        cases[name] = (_resetter(consumers), rec.record_post_step)

    def memcpy() -> None:
        target.copy_(flat)

    cases["memcpy"] = (lambda: None, memcpy)
    for reset, op in cases.values():  # warm-up
        for _ in range(2):
            reset()
            for _ in range(steps):
                op()
    values, orders = _timing.paired_trials(cases, trials=trials, repeats=steps, device=device, seed=seed)
    med = {name: _timing.stats(v) for name, v in values.items()}
    base = med["memcpy"]["median"]
    return {
        "worlds": worlds,
        "payload_bytes": payload_bytes(payload),
        "step_ms": med,
        "ratio_to_memcpy": {name: m["median"] / base for name, m in med.items()},
        "order": orders,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = _timing.base_parser("capture: simulation-thread cost per step")
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with torch.no_grad():
        cases = [run_case(w, device, args.steps, args.trials, args.seed) for w in args.worlds]
    doc = {"benchmark": "capture", "device": str(device), "cases": cases,
           "live_statistics_kernel": "numba" if device.type == "cpu" and _kernels.available() else "eager",
           "machine": _timing.machine(),
           "torch": torch.__version__, "versions": _timing.versions()}
    if args.json:
        _timing.print_json(doc)
    else:
        rows = [[c["worlds"], name, m["median"], m["min"], m["max"], c["ratio_to_memcpy"][name]]
                for c in cases for name, m in c["step_ms"].items()]
        print(_timing.table(["worlds", "case", "step_ms", "min_ms", "max_ms", "x_memcpy"], rows))
        print(f"live_statistics kernel: {doc['live_statistics_kernel']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
