"""The one timing helper every benchmark shares: randomized paired trials, medians, JSON."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

__all__ = ["base_parser", "machine", "paired_trials", "print_json", "stats", "sync", "table", "versions"]


def sync(device: torch.device | str) -> None:
    """Wait for every kernel queued on ``device`` (a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def stats(samples: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "samples"}`` of a list of timings."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
            "samples": list(samples)}


def paired_trials(
    cases: Mapping[str, tuple[Callable[[], None], Callable[[], None]]],
    *,
    trials: int,
    repeats: int,
    device: torch.device | str,
    seed: int = 42,
) -> tuple[dict[str, list[float]], list[list[str]]]:
    """Time every case ``trials`` times, in a random order per trial, side by side.

    Each case is ``(reset, op)``: ``reset`` runs untimed before the trial, ``op`` runs
    ``repeats`` times between two device synchronizations. Returns milliseconds per ``op`` for
    every trial of every case, and the order used in each trial.
    """
    rng = random.Random(seed)
    values: dict[str, list[float]] = {name: [] for name in cases}
    orders: list[list[str]] = []
    for _ in range(trials):
        order = list(cases)
        rng.shuffle(order)
        orders.append(order)
        for name in order:
            reset, op = cases[name]
            reset()
            gc.collect()
            sync(device)
            start = time.perf_counter()
            for _ in range(repeats):
                op()
            sync(device)
            values[name].append((time.perf_counter() - start) * 1000.0 / repeats)
    return values, orders


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "processor": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def versions() -> dict[str, str]:
    out: dict[str, str] = {"torch": torch.__version__}
    for mod in ("numpy", "zmq", "zarr", "msgpack"):
        try:
            m = __import__(mod)
            out[mod] = str(getattr(m, "__version__", getattr(m, "version", lambda: "?")))
        except ImportError:
            pass
    return out


def print_json(doc: Mapping[str, Any]) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain fixed-width text table."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1)")
    return parser
