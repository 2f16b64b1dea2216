"""Transport benchmark: ZmqPublisher -> Subscriber across processes against raw pyzmq PUSH/PULL.

``python -m benchmarks.transport [--json] [--worlds 256 4096] [--seconds N] [--transports ipc tcp]``

For each transport and world count, one receiver process (started once) takes, alternating
over ``--rounds`` rounds: raw PUSH/PULL of the payload's bytes (the ceiling), the copy floor
(the same, but each send first copies the payload into the next of ``--slots`` rotating
buffers: the least a publisher pays that may not keep the caller's tensors once ``publish``
returns, as worldtap's may not; it does not wait for ZeroMQ to let go of a buffer, so it is a
cost, its bytes are not checked), then the worldtap path (broker -> ZmqPublisher -> Subscriber
with full decoding). Reported: payload GB/s and messages/s at the receiver (medians over
rounds), the median of the per-round ratios to raw and to the copy floor, the
simulation-thread cost per publish against a memcpy of the payload (randomized paired trials,
staging ring not full; each timed op alone, both with one payload in flight, as in a running
simulation, and, as "idle", with nothing in flight), the CPU time each process spends per message
while streaming (all its threads: ZeroMQ's I/O thread, and the publisher's sender thread) and,
on Linux, each thread's share of it (``cpu_us_per_message_by_thread``: main, sender, ZeroMQ's
I/O threads, pyzmq's garbage collector of zero-copy frames), and a lossless check (every
sequence number received, adler32 checksums of randomized batches equal on both sides).
Budgets: >= 0.8 of raw throughput at 4096 worlds and >= 0.7 at 256 (every transport); publish
<= 2x memcpy at 4096 worlds. The copy floor's own share of raw (``copy_floor_of_raw``) says how
much of a budget the copy alone takes on the machine at hand, and ``cpu_bound_of_raw`` (raw's
CPU per message over worldtap's, both processes) the ratio worldtap can reach where the cores
are the limit. ``--malloc`` (default ``keep``) is the receiving process's allocator setting,
the same for raw and worldtap (see ``broker.allocator``); the publishing process keeps
glibc's defaults.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import threading
import time
import zlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from benchmarks._timing import base_parser, machine, paired_trials, print_json, stats, table, versions
from broker import Batch, Broker, RunEnd, RunStart, Subscriber, ZmqPublisher
from broker.allocator import apply_malloc_choice
from broker.cli_args import add_malloc_argument

WIDTHS = {"state": 37, "next_state": 37, "control": 19, "contacts": 72}
FLAGS = ("terminated", "truncated", "valid")
VERIFY = 16  # randomized batches whose checksums are compared
RATIO_MIN = {256: 0.7, 4096: 0.8}  # throughput budgets: fraction of raw pyzmq, by world count
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds() -> float:
    """CPU time of this process so far, every thread (user and system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads so far (user and system), summed by role: ``main``,
    ``sender`` (ZmqPublisher's thread), ``monitor``, ``pyzmq gc`` (pyzmq's thread that lets go
    of zero-copy frames), ``zmq io`` (ZeroMQ's I/O threads), else the thread's name. Empty
    where ``/proc`` has no per-thread times (not Linux)."""
    threads = {t.native_id: t for t in threading.enumerate()}
    main = threading.main_thread().native_id
    out: dict[str, float] = {}
    try:
        tasks = list(Path("/proc/self/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        tid = int(task.name)
        thread = threads.get(tid)
        if tid == main:
            role = "main"
        elif thread is not None:
            name = thread.name
            role = ("sender" if name.startswith("worldtap-zmq-pub") else
                    "monitor" if name.startswith("worldtap-zmq-monitor") else
                    "pyzmq gc" if type(thread).__name__ == "GarbageCollectorThread" else name)
        else:
            role = "zmq io" if comm.startswith("ZMQbg/IO") else comm
        out[role] = out.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def _thread_us(before: dict[str, float], after: dict[str, float], messages: int) -> dict[str, float]:
    """Microseconds of CPU per message of each role between two :func:`thread_cpu` readings."""
    return {role: _per_message(after[role] - before.get(role, 0.0), messages) for role in sorted(after)}


def payload(worlds: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The seed payload (as the retention benchmark): four float32 fields and three bool ones."""
    fields: dict[str, torch.Tensor] = {k: torch.randn(worlds, w) for k, w in WIDTHS.items()}
    fields.update({k: torch.rand(worlds) > 0.5 for k in FLAGS})
    return torch.arange(worlds), torch.zeros(worlds, dtype=torch.int64), fields


def _tensors(b: Batch) -> list[torch.Tensor]:
    return [b.worlds, b.episodes, *b.fields.values()]


def checksum(tensors: list[torch.Tensor]) -> int:
    value = 1
    for t in tensors:
        value = zlib.adler32(t.contiguous().reshape(-1).view(torch.uint8).numpy().data, value)
    return value


# -- receiver process ------------------------------------------------------------------------


def _recv_raw(endpoint: str, conn: Connection) -> dict[str, Any]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.connect(endpoint)
    conn.send("ready")
    count = nbytes = 0
    first = last = 0.0
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 1:
            break
        last = time.perf_counter()
        if count == 0:
            first, cpu, threads = last, cpu_seconds(), thread_cpu()
        count += 1
        nbytes += sum(len(f) for f in frames)
    cpu = cpu_seconds() - cpu
    by_thread = _thread_us(threads, thread_cpu(), count - 1)
    sock.close(linger=0)
    ctx.term()
    return {"messages": count, "bytes": nbytes, "seconds": last - first, "cpu_us": _per_message(cpu, count - 1),
            "threads_us": by_thread}


def _recv_worldtap(endpoint: str, conn: Connection) -> dict[str, Any]:
    sub = Subscriber(endpoint)
    conn.send("ready")
    seqs: set[int] = set()
    sums: dict[int, int] = {}
    count = nbytes = gaps = 0
    first = last = cpu = 0.0
    expected = -1
    streamed = 0.0
    threads: dict[str, float] = {}
    by_thread: dict[str, float] = {}
    for item in sub:
        if count and not streamed and (isinstance(item, RunEnd) or getattr(item, "topic", "") != "batch/seed"):
            # the seed stream has ended: read the CPU clocks once (a reading per message would
            # add a system call per message to worldtap's side only)
            streamed, by_thread = cpu_seconds(), _thread_us(threads, thread_cpu(), count - 1)
        if isinstance(item, RunEnd):
            expected = int(item.metadata["batches"])
            break
        if not isinstance(item, Batch):
            gaps += 1 if type(item).__name__ == "Gap" else 0
            continue
        seqs.add(item.seq)
        if item.topic == "batch/verify":
            sums[item.seq] = checksum(_tensors(item))
        elif item.topic == "batch/seed":
            last = time.perf_counter()
            if count == 0:
                first = last
                cpu = cpu_seconds()
                threads = thread_cpu()
            count += 1
            nbytes += sum(t.numel() * t.element_size() for t in _tensors(item))
    stats_ = sub.statistics()
    sub.close()
    return {"messages": count, "bytes": nbytes, "seconds": last - first,
            "cpu_us": _per_message(streamed - cpu, count - 1), "seqs": sorted(seqs),
            "expected": expected, "gaps": gaps + stats_.gaps, "bad": stats_.bad_messages, "sums": sums,
            "threads_us": by_thread}


def _worker(conn: Connection, malloc: str) -> None:
    torch.set_num_threads(1)
    apply_malloc_choice(malloc)  # both sides see the same allocator
    while (cmd := conn.recv()) is not None:
        kind, endpoint = cmd
        conn.send((_recv_raw if kind == "raw" else _recv_worldtap)(endpoint, conn))


# -- publisher side ---------------------------------------------------------------------------


def _raw(endpoint: str, worlds: int, seconds: float, conn: Connection, copies: int = 0) -> dict[str, Any]:
    """Raw PUSH of the payload's frames (the ceiling); with ``copies``, each send first copies
    the payload into the next of ``copies`` rotating buffers (the copy floor, see ``main``)."""
    w, e, fields = payload(worlds)
    sources = [t.numpy() for t in [w, e, *fields.values()]]
    frames: list[Any] = [b"batch/seed", b"h" * 200] + [a.data for a in sources]
    ring = [[a.copy() for a in sources] for _ in range(copies)]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.bind(endpoint)
    conn.send(("raw", endpoint))
    assert conn.recv() == "ready"
    end = time.perf_counter() + seconds
    sent, cpu, threads = 0, cpu_seconds(), thread_cpu()
    while time.perf_counter() < end:
        if ring:  # the bytes of a buffer still in flight may be overwritten: a cost, not a check
            buffers = ring[sent % copies]
            for dst, src in zip(buffers, sources, strict=True):
                np.copyto(dst, src)
            frames[2:] = [b.data for b in buffers]
        sock.send_multipart(frames, copy=False)
        sent += 1
    sock.send(b"")
    result: dict[str, Any] = conn.recv()  # the receiver has every message: ZeroMQ's work is done
    result["publisher_cpu_us"] = _per_message(cpu_seconds() - cpu, sent)
    result["publisher_threads_us"] = _thread_us(threads, thread_cpu(), sent)
    sock.close(linger=-1)
    ctx.term()
    return result


def _worldtap(endpoint: str, worlds: int, seconds: float, trials: int, conn: Connection,
              slots: int = 8, hwm: int = 64) -> tuple[dict[str, Any], dict[str, list[float]], bool]:
    w, e, fields = payload(worlds)
    # memcpy baseline: into one of `slots` rotating buffers, like the staging ring (a copy into
    # the same cache-hot buffer every time would flatter the baseline)
    dsts = [[t.clone() for t in [w, e, *fields.values()]] for _ in range(slots)]
    turn = iter(range(1 << 62))
    bus = Broker(strict=True)
    pub = ZmqPublisher(endpoint, send_timeout=60.0, slots=slots, hwm=hwm)
    bus.subscribe("", pub)
    conn.send(("worldtap", endpoint))
    assert conn.recv() == "ready"
    pub.wait_for_subscribers(1, timeout=30)
    seq = 0

    def publish(topic: str = "batch/seed") -> None:
        nonlocal seq
        seq += 1
        bus.publish(Batch("bench", seq, seq, topic, w, e, fields))

    bus.publish(RunStart("bench", 0, 0, worlds, "cpu"))
    end = time.perf_counter() + seconds
    cpu, threads = cpu_seconds(), thread_cpu()
    while time.perf_counter() < end:
        publish()
    pub.flush()
    streamed = seq, cpu_seconds() - cpu
    threads = _thread_us(threads, thread_cpu(), seq)

    def memcpy() -> None:
        for d, s in zip(dsts[next(turn) % slots], [w, e, *fields.values()], strict=True):
            d.copy_(s)

    def busy() -> None:  # one payload in flight: sender, ZeroMQ and receiver at work, as in a run
        pub.flush()
        publish("batch/load")

    def idle() -> None:  # nothing in flight
        pub.flush()
        time.sleep(0.005)

    # Each timed op runs alone after its reset (the ring never fills: the simulation thread
    # does not wait for the network), the memcpy under the same conditions as the publish.
    cost, _ = paired_trials({"memcpy": (busy, memcpy), "publish": (busy, lambda: publish("batch/cost")),
                             "idle_memcpy": (idle, memcpy),
                             "idle_publish": (idle, lambda: publish("batch/cost"))},
                            trials=trials, repeats=1, device="cpu")
    sums = {}
    for _ in range(VERIFY):
        for t in fields.values():
            t.copy_(torch.randn(t.shape) if t.dtype == torch.float32 else torch.rand(t.shape) > 0.5)
        publish("batch/verify")
        sums[seq] = checksum([w, e, *fields.values()])
    bus.publish(RunEnd("bench", seq + 1, seq, worlds, "cpu", {}, {"batches": seq}))
    pub.close()
    result: dict[str, Any] = conn.recv()
    lossless = (result["seqs"] == list(range(1, seq + 1)) and result["expected"] == seq
                and result["gaps"] == 0 and result["bad"] == 0
                and {int(k): v for k, v in result.pop("sums").items()} == sums)
    result["published"] = seq
    result["publisher_cpu_us"] = _per_message(streamed[1], streamed[0])
    result["publisher_threads_us"] = threads
    result["drops"] = pub.statistics().drops
    del result["seqs"]
    return result, cost, lossless


def main(argv: list[str] | None = None) -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--seconds", type=float, default=5.0,
                        help="throughput time of each side per case, split over --rounds")
    parser.add_argument("--transports", nargs="+", default=["ipc", "tcp"], choices=["ipc", "tcp"])
    parser.add_argument("--trials", type=int, default=0, help="paired cost trials (default: from --seconds)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads of the publishing process (default 1: OpenMP "
                             "workers spinning next to ZeroMQ's I/O thread distort small machines)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating raw/worldtap rounds per case (ratio: median over rounds)")
    parser.add_argument("--slots", type=int, default=8, help="ZmqPublisher staging slots")
    parser.add_argument("--hwm", type=int, default=64, help="ZmqPublisher send high-water mark")
    add_malloc_argument(parser, help="the receiving process's allocator setting, for raw and worldtap "
                                     "alike (default keep, as worldtap-store's --malloc; see broker.allocator)")
    args = parser.parse_args(argv)
    if torch.device(args.device).type != "cpu":
        parser.error("--device: transport publishes host tensors (it measures the wire); "
                     "benchmarks.staging measures the device copy")
    torch.set_num_threads(args.threads)
    trials = args.trials or max(5, int(args.seconds * 10))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_worker, args=(child, args.malloc), daemon=True)
    worker.start()
    rows, samples = [], []
    try:
        with tempfile.TemporaryDirectory(prefix="wt-bench-") as tmp:
            names = iter(range(1_000_000))

            def endpoint(transport: str) -> str:
                return f"ipc://{tmp}/{next(names)}.ipc" if transport == "ipc" else f"tcp://127.0.0.1:{_free_port()}"

            for transport in args.transports:
                for worlds in args.worlds:
                    raws, floors, ours, lossless = [], [], [], True
                    costs: dict[str, list[float]] = {}
                    share = args.seconds / args.rounds
                    for _ in range(args.rounds):  # interleaved: every side sees the same machine
                        raws.append(_raw(endpoint(transport), worlds, share, parent))
                        floors.append(_raw(endpoint(transport), worlds, share, parent, copies=args.slots))
                        result, cost, ok = _worldtap(endpoint(transport), worlds, share,
                                                     max(trials // args.rounds, 3), parent, args.slots, args.hwm)
                        ours.append(result)
                        lossless &= ok
                        for name, values in cost.items():
                            costs.setdefault(name, []).extend(values)
                    sample = _summarize(transport, worlds, raws, floors, ours, costs, lossless)
                    samples.append(sample)
                    rows.append([transport, worlds, sample["payload_kb"], sample["raw_gb_s"],
                                 sample["raw_copy_gb_s"], sample["worldtap_gb_s"], sample["throughput_ratio"],
                                 sample["copy_floor_ratio"], sample["worldtap_msg_s"],
                                 sample["publish_ms"], sample["memcpy_ms"], sample["cost_ratio"],
                                 sample["idle_cost_ratio"], _cpu(sample, "publisher"), _cpu(sample, "receiver"),
                                 sample["cpu_bound_of_raw"], lossless])
    finally:
        parent.send(None)
        worker.join(10)
    big = [s for s in samples if s["worlds"] >= 4096]
    budgeted = [s for s in samples if s["worlds"] in RATIO_MIN]
    budgets = {"throughput_ratio_min": {str(k): v for k, v in RATIO_MIN.items()}, "cost_ratio_max": 2.0,
               "throughput_ok": all(s["throughput_ratio"] >= RATIO_MIN[s["worlds"]] for s in budgeted)
               if budgeted else None,
               "cost_ok": all(s["cost_ratio"] <= 2.0 for s in big) if big else None,
               "lossless": all(s["lossless"] for s in samples)}
    ratios = {f"{s['transport']}/{s['worlds']}": s["throughput_ratio"] for s in samples}
    floor_ratios = {f"{s['transport']}/{s['worlds']}": s["copy_floor_ratio"] for s in samples}
    publish_ms = {f"{s['transport']}/{s['worlds']}": s["publish_ms"] for s in samples}
    cpu_bounds = {f"{s['transport']}/{s['worlds']}": s["cpu_bound_of_raw"] for s in samples}
    if args.json:
        print_json({"benchmark": "transport", "seconds": args.seconds, "trials": trials, "malloc": args.malloc,
                    "ratios": ratios, "copy_floor_ratios": floor_ratios, "cpu_bounds_of_raw": cpu_bounds,
                    "publish_ms": publish_ms,
                    "cases": samples, "budgets": budgets, "machine": machine(), "versions": versions()})
    else:
        print(table(["transport", "worlds", "payload kB", "raw GB/s", "raw+copy GB/s", "worldtap GB/s", "ratio",
                     "of raw+copy", "msg/s", "publish ms", "memcpy ms", "cost x", "idle cost x", "pub cpu us/msg (raw)",
                     "recv cpu us/msg (raw)", "CPU bound", "lossless"], rows))
        print("CPU us per message by thread (medians over rounds):")
        print(table(["transport", "worlds", "path", "pub main", "pub sender", "pub zmq io", "pub pyzmq gc",
                     "recv main", "recv zmq io"], [
            [s["transport"], s["worlds"], path, *(s["cpu_us_per_message_by_thread"][key][side].get(role, 0.0)
                                                  for side, role in (("publisher", "main"), ("publisher", "sender"),
                                                                     ("publisher", "zmq io"),
                                                                     ("publisher", "pyzmq gc"),
                                                                     ("receiver", "main"), ("receiver", "zmq io")))]
            for s in samples for key, path in (("raw", "raw"), ("raw_copy", "raw+copy"), ("worldtap", "worldtap"))]))
        print(f"budgets: {budgets}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(sample: dict[str, Any], side: str) -> str:
    """``"worldtap (raw)"`` CPU microseconds per message of one side, for the table."""
    ours, raw = sample["worldtap_cpu_us_per_message"][side], sample["raw_cpu_us_per_message"][side]
    return f"{ours:.0f} ({raw:.0f})"


def _per_message(seconds: float, messages: int) -> float:
    """Microseconds per message (0 when none was counted)."""
    return seconds / messages * 1e6 if messages > 0 else 0.0


def _by_role(rounds: Any) -> dict[str, float]:
    """The median over rounds of each role's CPU per message (roles missing from a round: 0)."""
    rounds = list(rounds)
    roles = sorted({role for r in rounds for role in r})
    medians = {role: statistics.median(r.get(role, 0.0) for r in rounds) for role in roles}
    return {role: us for role, us in medians.items() if us > 0}  # idle threads left out


def _summarize(transport: str, worlds: int, raws: list[dict[str, Any]], floors: list[dict[str, Any]],
               ours: list[dict[str, Any]], cost: dict[str, list[float]], lossless: bool) -> dict[str, Any]:
    def gbs(r: dict[str, Any]) -> float:
        return r["bytes"] / r["seconds"] / 1e9 if r["seconds"] > 0 else 0.0

    def mps(r: dict[str, Any]) -> float:
        return r["messages"] / r["seconds"] if r["seconds"] > 0 else 0.0

    ratios = [gbs(o) / gbs(r) if gbs(r) else 0.0 for r, o in zip(raws, ours, strict=True)]
    floor_ratios = [gbs(o) / gbs(f) if gbs(f) else 0.0 for f, o in zip(floors, ours, strict=True)]
    floor_of_raw = [gbs(f) / gbs(r) if gbs(r) else 0.0 for r, f in zip(raws, floors, strict=True)]
    publish, memcpy = stats(cost["publish"]), stats(cost["memcpy"])
    idle_publish, idle_memcpy = stats(cost["idle_publish"]), stats(cost["idle_memcpy"])
    _, _, fields = payload(1)
    per_world = 16 + sum(t.element_size() * max(t[0].numel(), 1) for t in fields.values())
    med = statistics.median
    return {
        "transport": transport, "worlds": worlds, "payload_kb": worlds * per_world / 1e3,
        "raw_gb_s": med(gbs(r) for r in raws), "raw_msg_s": med(mps(r) for r in raws),
        "worldtap_gb_s": med(gbs(o) for o in ours), "worldtap_msg_s": med(mps(o) for o in ours),
        "throughput_ratio": med(ratios), "throughput_ratios": ratios,
        "raw_copy_gb_s": med(gbs(f) for f in floors), "copy_floor_ratio": med(floor_ratios),
        "copy_floor_ratios": floor_ratios, "copy_floor_of_raw": med(floor_of_raw),
        "raw_cpu_us_per_message": {"publisher": med(r["publisher_cpu_us"] for r in raws),
                                   "receiver": med(r["cpu_us"] for r in raws)},
        "raw_copy_cpu_us_per_message": {"publisher": med(f["publisher_cpu_us"] for f in floors),
                                        "receiver": med(f["cpu_us"] for f in floors)},
        "worldtap_cpu_us_per_message": {"publisher": med(o["publisher_cpu_us"] for o in ours),
                                        "receiver": med(o["cpu_us"] for o in ours)},
        # raw's CPU per message over worldtap's, both processes: the ratio worldtap can reach
        # where the cores are the limit (a small machine) and both keep them as busy
        "cpu_bound_of_raw": med(r["publisher_cpu_us"] + r["cpu_us"] for r in raws) /
        max(med(o["publisher_cpu_us"] + o["cpu_us"] for o in ours), 1e-9),
        "cpu_us_per_message_by_thread": {side: {"publisher": _by_role(r["publisher_threads_us"] for r in runs),
                                                "receiver": _by_role(r["threads_us"] for r in runs)}
                                         for side, runs in (("raw", raws), ("raw_copy", floors), ("worldtap", ours))},
        "publish_ms": publish["median"], "memcpy_ms": memcpy["median"],
        "cost_ratio": publish["median"] / memcpy["median"] if memcpy["median"] else 0.0,
        "idle_publish_ms": idle_publish["median"], "idle_memcpy_ms": idle_memcpy["median"],
        "idle_cost_ratio": idle_publish["median"] / idle_memcpy["median"] if idle_memcpy["median"] else 0.0,
        "lossless": lossless, "raw": raws, "worldtap": ours, "publish_trials_ms": publish,
        "memcpy_trials_ms": memcpy, "idle_publish_trials_ms": idle_publish,
        "idle_memcpy_trials_ms": idle_memcpy, "raw_copy": floors,
    }


if __name__ == "__main__":
    main()
