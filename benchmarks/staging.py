"""Staging benchmark: what publishing costs the simulation, and how fast a slot is filled.

``python -m benchmarks.staging [--json] [--device cuda] [--worlds 4096] [--camera 64]``

Two payloads: the seed payload and a camera term (``worlds x camera x camera x 3`` uint8, 50 MB
at 4096 worlds and 64 px). For each, the publisher's staging ring stages the message the way
``ZmqPublisher`` does (a slot, the copy, the sender's wait on the slot's event):

- ``stage_ms``: host time of the staging call in the simulation thread;
- ``stream_ms`` (CUDA): time the staging occupies the simulation's current stream (CUDA timing
  events around the call: the device-to-device copy into the slot; the device-to-host copy
  runs on the side stream);
- ``staging_gbps``: payload bytes over the time from the call until the slot's bytes are on
  the host (the sender's event wait returned);
- ``copy_gbps``: the plain copy of the same bytes the staging is measured against, side by
  side: on CUDA a device-to-pinned-host copy of one contiguous tensor, on the CPU a memcpy;
- ``staging_vs_copy``: ``staging_gbps / copy_gbps``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from broker.staging import StagingRing

from . import _timing
from ._payload import make_payload, payload_bytes


def _payloads(worlds: int, device: torch.device, camera: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator(device=device).manual_seed(seed)
    image = torch.randint(0, 256, (worlds, camera, camera, 3), dtype=torch.uint8, device=device, generator=gen)
    return {"seed": make_payload(worlds, device, seed=seed), f"camera{camera}": {"rgb": image}}


def _time_staging(ring: StagingRing, tensors: list[torch.Tensor], device: torch.device,
                  repeats: int) -> dict[str, Any]:
    cuda = device.type == "cuda"
    stage_ms: list[float] = []
    stream_ms: list[float] = []
    total_ms: list[float] = []
    for _ in range(repeats):
        _timing.sync(device)
        slot = ring.acquire(True, 10.0)
        assert slot is not None
        if cuda:
            before = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            after = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            before.record(torch.cuda.current_stream(device))
        start = time.perf_counter()
        _, event = ring.stage(slot, tensors)
        staged = time.perf_counter()
        if cuda:
            after.record(torch.cuda.current_stream(device))
        if event is not None:
            event.synchronize()
        done = time.perf_counter()
        ring.release(slot, None)
        stage_ms.append((staged - start) * 1e3)
        total_ms.append((done - start) * 1e3)
        if cuda:
            after.synchronize()
            stream_ms.append(before.elapsed_time(after))
    out: dict[str, Any] = {"stage_ms": _timing.stats(stage_ms), "total_ms": _timing.stats(total_ms)}
    if cuda:
        out["stream_ms"] = _timing.stats(stream_ms)
    return out


def _staged_bytes_equal(ring: StagingRing, tensors: list[torch.Tensor]) -> bool:
    """Whether a slot holds, once its event is done, exactly the bytes of ``tensors``."""
    slot = ring.acquire(True, 10.0)
    assert slot is not None
    layout, event = ring.stage(slot, tensors)
    if event is not None:
        event.synchronize()
    try:
        assert slot.buffer is not None
        return all(bytes(slot.buffer[offset:offset + nbytes].numpy())
                   == bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
                   for t, (offset, nbytes) in zip(tensors, layout, strict=True))
    finally:
        ring.release(slot, None)


def _time_copy(flat: torch.Tensor, repeats: int) -> list[float]:
    """Milliseconds of a plain copy of ``flat`` to the host (pinned when it is on a device)."""
    target = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=flat.is_cuda)
    out = []
    for _ in range(repeats):
        _timing.sync(flat.device)
        start = time.perf_counter()
        target.copy_(flat, non_blocking=flat.is_cuda)
        _timing.sync(flat.device)
        out.append((time.perf_counter() - start) * 1e3)
    return out


def run_case(worlds: int, device: torch.device, camera: int, repeats: int, rounds: int,
             seed: int) -> list[dict[str, Any]]:
    rows = []
    for name, payload in _payloads(worlds, device, camera, seed).items():
        tensors = list(payload.values())
        nbytes = payload_bytes(payload)
        flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
        ring = StagingRing(2, threading.Condition())
        _time_staging(ring, tensors, device, 3)  # warm-up: plans, buffers, streams
        byte_equal = _staged_bytes_equal(ring, tensors)
        _time_copy(flat, 3)
        staging: list[dict[str, Any]] = []
        copies: list[float] = []
        for _ in range(rounds):  # interleaved, so both see the same machine
            staging.append(_time_staging(ring, tensors, device, repeats))
            copies += _time_copy(flat, repeats)

        def merged(key: str, staging: list[dict[str, Any]] = staging) -> dict[str, Any]:
            return _timing.stats([v for s in staging for v in s[key]["samples"]])

        row: dict[str, Any] = {"worlds": worlds, "payload": name, "bytes": nbytes, "byte_equal": byte_equal,
                               "stage_ms": merged("stage_ms"), "total_ms": merged("total_ms"),
                               "copy_ms": _timing.stats(copies)}
        if device.type == "cuda":
            row["stream_ms"] = merged("stream_ms")
        row["staging_gbps"] = nbytes / (row["total_ms"]["median"] * 1e6)
        row["copy_gbps"] = nbytes / (statistics.median(copies) * 1e6)
        row["staging_vs_copy"] = row["staging_gbps"] / row["copy_gbps"]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = _timing.base_parser("staging: publish cost and staging bandwidth")
    parser.add_argument("--worlds", type=int, nargs="+", default=[4096])
    parser.add_argument("--camera", type=int, default=64, help="camera term: pixels per side (uint8 RGB)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(1)
    with torch.no_grad():
        rows = [r for w in args.worlds for r in run_case(w, device, args.camera, args.repeats, args.rounds, args.seed)]
    doc = {"benchmark": "staging", "device": str(device), "cases": rows, "machine": _timing.machine(),
           "versions": _timing.versions()}
    if device.type == "cuda":
        doc["gpu"] = torch.cuda.get_device_name(device)
    if args.json:
        _timing.print_json(doc)
    else:
        cuda = device.type == "cuda"
        head = ["worlds", "payload", "MB", "byte_equal", "stage_ms", *(["stream_ms"] if cuda else []), "total_ms",
                "staging GB/s", "copy GB/s", "staging/copy"]
        table = [[r["worlds"], r["payload"], r["bytes"] / 1e6, r["byte_equal"], r["stage_ms"]["median"],
                  *([r["stream_ms"]["median"]] if cuda else []), r["total_ms"]["median"],
                  r["staging_gbps"], r["copy_gbps"], r["staging_vs_copy"]] for r in rows]
        print(_timing.table(head, table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
