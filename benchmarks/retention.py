"""Retention benchmark: per-world list recorder vs batched retention vs a plain memcpy.

``python -m benchmarks.retention [--json] [--device cuda] [--worlds 256 4096]``

Every case consumes the same sequence of payloads (the seed payload: float32 fields of widths
37, 37, 19, 72 and three bool fields), in randomized order per trial, synchronized before and
after each trial. ``floor`` copies one contiguous buffer holding the payload's bytes into the
next slot of a preallocated ``[capacity, payload_bytes]`` byte buffer, restarting at slot 0 each
trial as retention restarts its episodes, so both write fresh memory on every append.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from broker import Batch
from consumers import Retention

from . import _timing
from ._payload import make_payload, payload_bytes

TERM = "transition"


class ListRecorder:
    """The per-world recorder this field used before batched storage (a faithful reference).

    Each append clones every field's batch once, then for every world splits the key on "/",
    walks that world's nested episode dict and appends the world's row view to a Python list.
    """

    def __init__(self) -> None:
        self.episodes: dict[int, dict[str, Any]] = {}

    def add(self, key: str, fields: dict[str, torch.Tensor], worlds: Sequence[int]) -> None:
        for name, value in fields.items():
            value = value.clone()
            for row, world in enumerate(worlds):
                episode = self.episodes.setdefault(world, {})
                parts = f"{key}/{name}".split("/")
                node = episode
                for part in parts[:-1]:
                    node = node.setdefault(part, {})
                node.setdefault(parts[-1], []).append(value[row])

    def reset(self) -> None:
        self.episodes = {}

    def episode(self, world: int, key: str) -> dict[str, torch.Tensor]:
        return {name: torch.stack(rows) for name, rows in self.episodes[world][key].items()}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().cpu().view(torch.uint8).numpy().tobytes()


def run_case(worlds: int, device: torch.device, trials: int, appends: int, seed: int) -> dict[str, Any]:
    payloads = [make_payload(worlds, device, seed=seed + i) for i in range(appends)]
    nbytes = payload_bytes(payloads[0])
    flat = [torch.cat([t.reshape(-1).view(torch.uint8) for t in p.values()]) for p in payloads]
    world_ids = list(range(worlds))
    all_worlds = torch.arange(worlds, device=device)
    episodes = torch.zeros(worlds, dtype=torch.int64, device=device)

    baseline = ListRecorder()
    retention = Retention(num_worlds=worlds, initial_capacity=32)
    floor_buf = torch.empty((32, nbytes), dtype=torch.uint8, device=device)
    cursor = {"baseline": 0, "batched": 0, "floor": 0}

    def op_baseline() -> None:
        i = cursor["baseline"]
        cursor["baseline"] = i + 1
        baseline.add(TERM, payloads[i % appends], world_ids)

    def op_batched() -> None:
        i = cursor["batched"]
        cursor["batched"] = i + 1
        retention(Batch("bench", i, i, f"batch/{TERM}", all_worlds, episodes, payloads[i % appends]))

    def op_floor() -> None:
        i = cursor["floor"]
        cursor["floor"] = i + 1
        floor_buf[i % floor_buf.shape[0]].copy_(flat[i % appends])

    def resetter(name: str) -> Any:
        def reset() -> None:
            cursor[name] = 0
            if name == "baseline":
                baseline.reset()
            elif name == "batched":
                retention.reset()
        return reset

    ops = {"baseline": op_baseline, "batched": op_batched, "floor": op_floor}
    cases = {name: (resetter(name), op) for name, op in ops.items()}
    for reset, op in cases.values():  # warm-up: allocate and touch every slot of every ring
        for _ in range(2):
            reset()
            for _ in range(appends):
                op()
    values, orders = _timing.paired_trials(cases, trials=trials, repeats=appends, device=device,
                                           seed=seed)
    byte_equal = True
    for w in sorted({0, worlds // 2, worlds - 1}):
        old = baseline.episode(w, TERM)
        new = retention.episode(w)[TERM]
        byte_equal &= old.keys() == new.keys() and all(
            old[k].shape == new[k].shape and old[k].dtype == new[k].dtype
            and _bytes(old[k]) == _bytes(new[k]) for k in old
        )
    med = {name: _timing.stats(v) for name, v in values.items()}
    return {
        "worlds": worlds,
        "payload_bytes": nbytes,
        "append_ms": med,
        "speedup_vs_baseline": med["baseline"]["median"] / med["batched"]["median"],
        "ratio_to_floor": med["batched"]["median"] / med["floor"]["median"],
        "byte_equal": bool(byte_equal),
        "order": orders,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = _timing.base_parser(__doc__.splitlines()[0] if __doc__ else "retention")
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--appends", type=int, default=20)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with torch.no_grad():
        cases = [run_case(w, device, args.trials, args.appends, args.seed) for w in args.worlds]
    doc = {"benchmark": "retention", "device": str(device), "trials": args.trials,
           "appends": args.appends, "cases": cases, "machine": _timing.machine(),
           "torch": torch.__version__, "versions": _timing.versions()}
    if args.json:
        _timing.print_json(doc)
    else:
        rows = [[c["worlds"], c["payload_bytes"], c["append_ms"]["baseline"]["median"],
                 c["append_ms"]["batched"]["median"], c["append_ms"]["floor"]["median"],
                 c["speedup_vs_baseline"], c["ratio_to_floor"], c["byte_equal"]] for c in cases]
        print(_timing.table(["worlds", "payload_B", "baseline_ms", "batched_ms", "floor_ms",
                             "speedup", "x_floor", "byte_equal"], rows))
    return 0 if all(c["byte_equal"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main())
