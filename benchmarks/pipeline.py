"""Pipeline benchmark: publisher process -> storage daemon process -> Zarr store (local disk or S3).

``python -m benchmarks.pipeline [--json] [--seconds 30] [--worlds 4096] [--store local|s3]``

Measured in one run: the raw pyzmq ceiling (payload frames between two processes, nothing
decoded), the raw zarr-python ceiling (``Array.append`` of 64 MB blocks of the payload to every
field's array concurrently, with the daemon's codecs, chunks and I/O threads) and, for
reference, the daemon's own writer alone (the same blocks through its chunk-writing threads:
the storage path with no transport in front), each as the median of randomized trials taken
half before and half after the end-to-end
pipeline (the Recorder publishing the seed payload through ZmqPublisher, the daemon writing
it) sustained for ``--seconds``. Reported: end-to-end GB/s and steps/s, the daemon's peak RSS
(VmHWM), and a lossless check that reads every stored row back and compares it byte for byte
with what was published. Budgets: end-to-end >= 70% of the slower raw ceiling (pyzmq,
zarr-python); peak RSS <= the memory budget + 300 MB.

``--publishers N``: N publisher processes, each its own run, connect to a ``worldtap-proxy``
process that the daemon connects to (publishers -> proxy -> daemon); end-to-end GB/s counts
every publisher's bytes, and every run is checked byte for byte against what its publisher
published. Without it, one publisher that binds and a daemon that connects to it.

Write amplification (local store): ``field_bytes_received`` are the raw bytes of field data
the daemon received (every published step), ``field_bytes`` those of the rows it stored (the
complete episodes; episodes still open at the end are dropped); ``bytes_written`` are the
bytes the daemon process handed to the filesystem (``wchar`` of ``/proc/<pid>/io``: chunk
files, metadata, the lock; a rewrite counted each time); ``store_bytes`` is the encoded size of
the final store (its files). ``amplification`` = ``bytes_written / field_bytes`` (against the
raw data stored: budget <= 1.2 in ``all`` mode) and ``amplification_vs_store`` =
``bytes_written / store_bytes`` (1.0: every byte of the final store written once, nothing
rewritten). Use runs long enough for most episodes to end (``--episode-length``).

Where the cores go (Linux): ``cpu_seconds_per_gb`` of the publisher process while it
publishes, of the daemon process over its life, their sum (``e2e``) and, for each
storage-only ceiling, of this process while it writes. ``cpu_bound_of_writer_ceiling`` is the
writer's CPU per GB over the pipeline's: the fraction of the writer ceiling the pipeline can
reach with the cores as busy as the writer alone kept them (``e2e_cores_busy`` says how busy
the pipeline kept them). On a machine with few cores it bounds ``fraction_of_writer_ceiling``:
the publisher's and the receiver's work take cores the writer alone had to itself.

``--writer-paths``: the storage-only ceilings to measure beside raw zarr-python's append:
``writer`` (the daemon's columns on its chunk threads), ``public`` (the same columns through
zarr's public ``Array.__setitem__``), ``zarrs`` (that path with the ``zarrs`` Rust codec
pipeline, ``pip install zarrs``), ``sharded`` (that path on sharded arrays, shards of 16
chunks). ``--daemon-writer public|zarrs`` runs the daemon itself on zarr's public path, or
on it with the zarrs pipeline (default: the daemon's own choice, its chunk threads here).

``--scalar-fields N``: the payload gains N float32 scalar fields and N/6 bool ones (a term
of many narrow columns, each its own array: the daemon's per-field and per-chunk-file work).

``--malloc keep|system``: the daemon's allocator setting (``worldtap-store --malloc``, default
``keep``: freed memory kept for the next messages, see ``broker.allocator``); this process,
which measures the receiving and storage-only ceilings, takes the same setting, so the
ratios compare like with like. The publishers keep glibc's defaults (a simulation's process
is its own).

``--store s3``: the same pipeline into an S3 API on loopback (moto in server mode, started
here; needs ``moto[server]`` and s3fs), with the same byte-for-byte check of every row read
back from S3; the amplification is not measured there (the bytes go out on a socket).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from broker.allocator import apply_malloc_choice
from broker.cli_args import add_malloc_argument

from ._payload import make_payload, payload_bytes
from ._timing import base_parser, machine, print_json, stats, table, versions

POOL = 8  # distinct payload steps, cycled; row identity comes from the stamps below
RUN = "bench"
TERM = "seed"


SCALARS = 0
"""``--scalar-fields``: float32 scalar fields added to the seed payload (and a bool scalar
field per six), for a term of many narrow columns; set by :func:`main` in every process."""


def _pool(worlds: int) -> dict[str, np.ndarray]:
    steps = [make_payload(worlds, seed=k) for k in range(POOL)]
    pool = {name: np.stack([s[name].numpy() for s in steps]) for name in steps[0]}
    gen = np.random.default_rng(worlds)
    pool.update({f"scalar{i:03d}": gen.standard_normal((POOL, worlds), dtype=np.float32)
                 for i in range(SCALARS)})
    pool.update({f"flag{i:03d}": gen.random((POOL, worlds)) < 0.5 for i in range(SCALARS // 6)})
    return pool


def _row_bytes(pool: dict[str, np.ndarray]) -> int:
    return sum(int(v[0, 0].nbytes) for v in pool.values())


def _stamped(pool: dict[str, np.ndarray], step: int, worlds: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """The payload of ``step``: the pool entry, with state[:, 0] = step and state[:, 1] = world."""
    k = step % POOL
    out = {name: v[k] if worlds is None else v[k, worlds] for name, v in pool.items()}
    out["state"] = out["state"].copy()  # only the stamped field is copied
    n = out["state"].shape[0]
    out["state"][:, 0] = np.float32(step)
    out["state"][:, 1] = (np.arange(n) if worlds is None else worlds).astype(np.float32)
    return out


# -- child roles --------------------------------------------------------------------------

def _publisher(args: Any) -> None:
    from broker import Broker, ZmqPublisher
    from capture.recorder import Recorder
    from capture.terms import FunctionTerm

    pool = _pool(args.worlds)
    rng = np.random.default_rng(args.seed)
    lo, hi = max(1, args.episode_length // 2), max(2, 3 * args.episode_length // 2)
    broker = Broker()
    if args.connect is not None:  # to a proxy's frontend
        pub = ZmqPublisher(args.connect, bind=False, policy="block", send_timeout=120.0)
    else:
        endpoint = "tcp://127.0.0.1:*" if args.transport == "tcp" else f"ipc://{args.ends}.ipc"
        pub = ZmqPublisher(endpoint, bind=True, policy="block", send_timeout=120.0)
    broker.subscribe("", pub)
    print(pub.endpoints[0], flush=True)
    pub.wait_for_subscribers(1, timeout=60.0)
    rec = Recorder(args.worlds, broker=broker, run=args.run)
    current: dict[str, torch.Tensor] = {}
    rec.add_term(TERM, FunctionTerm(post_step=lambda: current))
    remaining = rng.integers(lo, hi, args.worlds)
    ends: list[np.ndarray] = []
    steps = 0
    t0, cpu0 = time.time(), time.process_time()
    while time.time() - t0 < args.seconds:
        current.clear()
        current.update({k: torch.from_numpy(v) for k, v in _stamped(pool, rec.step).items()})
        rec.record_post_step()
        steps += 1
        remaining -= 1
        done = np.flatnonzero(remaining == 0)
        if len(done):
            success = torch.from_numpy(rng.random(len(done)) < 0.5)
            idx = torch.from_numpy(done)
            ends.append(np.stack([done, rec.episodes_of(idx).numpy(),
                                  rec.episode_length.numpy()[done], success.numpy()], axis=1))
            rec.record_pre_reset(idx, success=success, truncated=~success)
            remaining[done] = rng.integers(lo, hi, len(done))
    t_published, cpu = time.time(), time.process_time() - cpu0
    rec.close()
    pub.close(timeout=120.0)
    np.save(args.ends, np.concatenate(ends) if ends else np.zeros((0, 4), np.int64))
    print(json.dumps({"t0": t0, "t_published": t_published, "t_closed": time.time(),
                      "cpu_seconds": cpu, "steps": steps, "bytes": steps * payload_bytes(
                          {k: torch.from_numpy(v[0]) for k, v in pool.items()})}), flush=True)


def _zmq_sender(args: Any) -> None:
    import zmq

    pool = _pool(args.worlds)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.XPUB)
    sock.setsockopt(zmq.XPUB_NODROP, 1)
    sock.setsockopt(zmq.SNDHWM, 64)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    sock.recv()  # the subscription: no slow joiner
    frames: list[list[bytes | memoryview]] = [
        [b"batch/seed", b"h" * 200, *(memoryview(v[k]) for v in pool.values())] for k in range(POOL)]
    t0, i = time.monotonic(), 0
    while time.monotonic() - t0 < args.seconds:
        sock.send_multipart(frames[i % POOL], copy=False)
        i += 1
    sock.send_multipart([b"batch/end", b""])
    sock.close(linger=-1)
    ctx.term()


# -- ceilings -----------------------------------------------------------------------------

def _zmq_ceiling(worlds: int, seconds: float) -> float:
    import zmq

    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.pipeline", "--role", "zmq-sender",
                             "--worlds", str(worlds), "--seconds", str(seconds),
                             "--scalar-fields", str(SCALARS)],
                            stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().strip()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 64)
        sock.setsockopt(zmq.SUBSCRIBE, b"batch/")
        sock.connect(endpoint)
        total, t0 = 0, None
        while True:
            frames = sock.recv_multipart(copy=False)
            if frames[0].bytes == b"batch/end":
                break
            if t0 is None:
                t0 = time.monotonic()
            else:
                total += sum(len(f) for f in frames[2:])
        sock.close(linger=0)
        proc.wait(60)
        return total / max(time.monotonic() - (t0 or 0.0), 1e-9) / 1e9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.term()


WRITER_PATHS = {"writer", "public", "zarrs", "sharded"}
"""The storage-only ceilings ``--writer-paths`` may name."""

ZARRS = "zarrs.ZarrsCodecPipeline"
"""zarr's ``codec_pipeline.path`` that selects the zarrs Rust pipeline."""


def _zarr_ceiling(worlds: int, seconds: float, root: Path, args: Any, *,
                  path: str = "append") -> tuple[float, float]:
    """Append 64 MB blocks of the payload to every field's array for ``seconds``; GB/s and
    the CPU seconds this process spent per GB (every thread: codecs, I/O, Python).

    ``path="append"``: raw zarr-python, ``AsyncArray.append`` of each field concurrently.
    ``path="writer"``: the daemon's own writer (:func:`storage._columns.write_columns`), the
    storage path alone with no transport or assembly in front of it. ``"public"``,
    ``"zarrs"``, ``"sharded"``: the same writer through zarr's public API, with the zarrs codec
    pipeline, on arrays of 16-chunk shards."""
    import zarr
    from zarr.core.sync import sync

    from storage import _zarr_io
    from storage._columns import Column, write_columns
    from storage._format import APPEND_CONFIG, CHUNK_KEYS, codecs

    def append_all(pairs: list[tuple[Any, np.ndarray]]) -> None:
        """zarr-python's own append of every field at once, in one event-loop round trip."""
        async def run() -> None:
            await asyncio.gather(*(arr.async_array.append(values) for arr, values in pairs))

        sync(run())

    zarr.config.set({"threading.max_workers": os.cpu_count() or 2})  # as the daemon's default
    pool = _pool(worlds)
    piece_rows = max(1, min(64 << 20, args.memory_budget // 16) // _row_bytes(pool))
    block = {k: np.concatenate([v[i % POOL] for i in range(-(-piece_rows // worlds))])[:piece_rows]
             for k, v in pool.items()}
    folder = Path(tempfile.mkdtemp(dir=root))
    pipeline = {"codec_pipeline.path": ZARRS} if path == "zarrs" else {}
    try:
        group = zarr.open_group(zarr.storage.LocalStore(folder), mode="w")
        arrays = {}
        with zarr.config.set(pipeline):  # arrays keep the pipeline they were made with
            for name, value in block.items():
                row = max(1, value.dtype.itemsize * int(np.prod(value.shape[1:])))
                chunk = max(1, args.chunk_size // row)
                arrays[name] = group.create_array(name, shape=(0, *value.shape[1:]), dtype=value.dtype,
                                                  chunks=(chunk, *value.shape[1:]),
                                                  shards=(16 * chunk, *value.shape[1:]) if path == "sharded"
                                                  else None,
                                                  compressors=codecs(args.compression),
                                                  chunk_key_encoding=CHUNK_KEYS,  # type: ignore[arg-type]
                                                  ).with_config(APPEND_CONFIG)  # as the daemon's
        pairs = [(arrays[name], value) for name, value in block.items()]
        _zarr_io.sync_path(path == "writer")
        try:
            columns = [(Column(array, 0), value) for array, value in pairs] if path != "append" else []
        finally:
            _zarr_io.sync_path(True)
        nbytes = sum(v.nbytes for v in block.values())
        total, t0, cpu0 = 0, time.monotonic(), time.process_time()
        while time.monotonic() - t0 < seconds:  # every field at once, as concurrent as it gets
            if path == "append":
                append_all(pairs)
            else:
                write_columns(columns, flush=False)
            total += nbytes
        cpu = time.process_time() - cpu0
        return total / (time.monotonic() - t0) / 1e9, cpu / (total / 1e9)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- the pipeline -------------------------------------------------------------------------

def _daemon(args: Any) -> int:
    """The storage daemon (``worldtap-store`` with ``--daemon-args``, on ``--daemon-writer``'s
    path), then the bytes this process handed to the filesystem (``wchar`` of
    ``/proc/self/io``) into ``--ends``."""
    import zarr

    from storage import _zarr_io
    from storage.cli import main as store_main

    _zarr_io.sync_path(args.daemon_writer == "default")
    if args.daemon_writer == "zarrs":
        zarr.config.set({"codec_pipeline.path": ZARRS})
    try:
        return store_main(json.loads(args.daemon_args))
    finally:
        io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
        Path(args.ends).write_text(json.dumps({"wchar": int(io["wchar"])}))


def _daemon_command(args: Any, store: str, endpoint: str, runs: int, io_file: Path) -> list[str]:
    daemon_args = [store, "--connect", endpoint, "--exit-after-runs", str(runs),
                   "--memory-budget", str(args.memory_budget), "--compression", args.compression,
                   "--chunk-size", str(args.chunk_size), "--status-interval", "5", "--log-level", "WARNING",
                   "--malloc", args.malloc]
    return [sys.executable, "-m", "benchmarks.pipeline", "--role", "daemon", "--ends", str(io_file),
            "--daemon-writer", args.daemon_writer, "--daemon-args", json.dumps(daemon_args)]


def _env(args: Any) -> dict[str, str]:
    """The child processes' environment: this checkout on the path."""
    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def _store_bytes(store: str) -> int:
    """Encoded bytes of every object of ``store`` (a directory or an S3 URL)."""
    if store.startswith("s3://"):
        import s3fs

        return int(s3fs.S3FileSystem().du(store))
    return sum(p.stat().st_size for p in Path(store).rglob("*") if p.is_file())


def _s3_endpoint(root: Path) -> Any:
    """A moto S3 server on loopback, with this process's (and its children's) AWS settings
    pointed at it and a bucket made; returns the server (``stop()`` it)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    nowhere = str(root / "no-aws-config")
    os.environ.update({"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_CONFIG_FILE": nowhere, "AWS_SHARED_CREDENTIALS_FILE": nowhere})
    import s3fs

    s3fs.S3FileSystem().mkdir("worldtap-bench")
    return server


def _written(io_file: Path, store: str, received: int, rows: int, worlds: int) -> dict[str, Any]:
    """The write-amplification figures (see the module docstring) of a store whose runs hold
    ``rows`` rows; ``None`` where not measured."""
    pool = _pool(worlds)
    field_bytes = rows * _row_bytes(pool)
    stored = _store_bytes(store)
    written = json.loads(io_file.read_text())["wchar"] if not store.startswith("s3://") else None
    return {"field_bytes_received": received, "field_bytes": field_bytes, "store_bytes": stored,
            "bytes_written": written,
            "amplification": None if written is None or not field_bytes else written / field_bytes,
            "amplification_vs_store": None if written is None else written / stored}

def _cpu_and_faults(pid: int) -> tuple[float, int] | None:
    """CPU time (user and system, every thread) and minor page faults of process ``pid`` so
    far, or ``None`` once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])  # utime, stime; minflt


def _vm_hwm(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _pipeline(args: Any, root: Path, store: str) -> dict[str, Any]:
    ends, io_file = root / "ends.npy", root / "io.json"
    env = _env(args)
    pub = subprocess.Popen([sys.executable, "-m", "benchmarks.pipeline", "--role", "publisher",
                            "--worlds", str(args.worlds), "--seconds", str(args.seconds),
                            "--episode-length", str(args.episode_length), "--ends", str(ends),
                            "--transport", args.transport, "--scalar-fields", str(SCALARS)],
                           stdout=subprocess.PIPE, text=True, env=env)
    daemon = None
    try:
        assert pub.stdout is not None
        endpoint = pub.stdout.readline().strip()
        daemon = subprocess.Popen(_daemon_command(args, store, endpoint, 1, io_file),
                                  stderr=subprocess.PIPE, text=True, env=env)
        peak, daemon_cpu, daemon_faults = 0, 0.0, 0
        while daemon.poll() is None:
            peak = max(peak, _vm_hwm(daemon.pid))
            daemon_cpu, daemon_faults = _cpu_and_faults(daemon.pid) or (daemon_cpu, daemon_faults)  # the last reading
            time.sleep(0.1)
        t_stored = time.time()
        assert daemon.stderr is not None
        daemon_log = daemon.stderr.read()
        summary = json.loads(pub.stdout.readline())
        pub.wait(120)
        if daemon.returncode != 0:
            raise RuntimeError(f"daemon exited {daemon.returncode}: {daemon_log[-2000:]}")
    finally:
        for proc in (pub, daemon):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = t_stored - summary["t0"]
    check = _verify(store, np.load(ends), args.worlds)
    return {"steps": summary["steps"], "bytes": summary["bytes"], "e2e_seconds": seconds,
            "publish_seconds": summary["t_published"] - summary["t0"],
            "gb_per_s": summary["bytes"] / seconds / 1e9, "steps_per_s": summary["steps"] / seconds,
            # where the cores go, per published step: the publisher process (the stand-in
            # simulation making each step's payload, the recorder, staging, ZeroMQ) while it
            # publishes, and the daemon process over its whole life (start-up included)
            "publisher_cpu_ms_per_step": 1e3 * summary["cpu_seconds"] / max(summary["steps"], 1),
            "daemon_cpu_ms_per_step": 1e3 * daemon_cpu / max(summary["steps"], 1),
            # pages the daemon faulted in over its life (start-up included), per step: an
            # allocator returning freed memory to the system and faulting it in again shows
            # here (see --malloc)
            "daemon_page_faults_per_step": daemon_faults / max(summary["steps"], 1),
            "publisher_cpu_seconds": summary["cpu_seconds"], "daemon_cpu_seconds": daemon_cpu,
            "daemon_peak_rss_bytes": peak, "daemon_log_tail": daemon_log[-500:], **check,
            **_written(io_file, store, summary["bytes"], check["rows_checked"], args.worlds)}


def _proxied(args: Any, root: Path, store: str) -> dict[str, Any]:
    """``--publishers N`` publisher processes -> worldtap-proxy process -> daemon process."""
    io_file = root / "io.json"
    env = _env(args)
    sides = ["tcp://127.0.0.1:*" if args.transport == "tcp" else f"ipc://{root}/{side}.ipc"
             for side in ("front", "back")]
    procs: list[subprocess.Popen[str]] = []
    try:
        proxy = subprocess.Popen([sys.executable, "-m", "broker.proxy", "--frontend", sides[0],
                                  "--backend", sides[1], "--status-interval", "3600", "--log-level", "WARNING"],
                                 stderr=subprocess.PIPE, text=True, env=env)
        procs.append(proxy)
        assert proxy.stderr is not None
        ready = proxy.stderr.readline()
        if "worldtap-proxy ready:" not in ready:
            proxy.kill()
            raise RuntimeError(f"the proxy did not start: {ready}{proxy.stderr.read()[-2000:]}")
        front, back = (part.split("=", 1)[1] for part in ready.split()[-2:])
        daemon = subprocess.Popen(_daemon_command(args, store, back, args.publishers, io_file),
                                  stderr=subprocess.PIPE, text=True, env=env)
        procs.append(daemon)
        runs = {f"{RUN}-{k}": root / f"ends-{k}.npy" for k in range(args.publishers)}
        pubs = [subprocess.Popen([sys.executable, "-m", "benchmarks.pipeline", "--role", "publisher",
                                  "--worlds", str(args.worlds), "--seconds", str(args.seconds),
                                  "--episode-length", str(args.episode_length), "--ends", str(ends),
                                  "--connect", front, "--run", run, "--seed", str(args.seed + k),
                                  "--scalar-fields", str(SCALARS)],
                                 stdout=subprocess.PIPE, text=True, env=env)
                for k, (run, ends) in enumerate(runs.items())]
        procs += pubs
        peak = 0
        while daemon.poll() is None:
            peak = max(peak, _vm_hwm(daemon.pid))
            time.sleep(0.1)
        t_stored = time.time()
        assert daemon.stderr is not None
        daemon_log = daemon.stderr.read()
        summaries = []
        for pub in pubs:
            assert pub.stdout is not None
            pub.stdout.readline()  # its endpoint
            summaries.append(json.loads(pub.stdout.readline()))
            pub.wait(120)
        if daemon.returncode != 0:
            raise RuntimeError(f"daemon exited {daemon.returncode}: {daemon_log[-2000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = t_stored - min(s["t0"] for s in summaries)
    total = sum(s["bytes"] for s in summaries)
    steps = sum(s["steps"] for s in summaries)
    checks = {run: _verify(store, np.load(ends), args.worlds, run) for run, ends in runs.items()}
    from storage import RunStore

    reader = RunStore(store)
    complete = all(reader.info(run)["status"] == "complete" for run in runs)
    return {"publishers": args.publishers, "steps": steps, "bytes": total, "e2e_seconds": seconds,
            "publish_seconds": max(s["t_published"] for s in summaries) - min(s["t0"] for s in summaries),
            "gb_per_s": total / seconds / 1e9, "steps_per_s": steps / seconds,
            "daemon_peak_rss_bytes": peak, "daemon_log_tail": daemon_log[-500:],
            "byte_equal": all(c["byte_equal"] for c in checks.values()), "runs_complete": complete,
            "episodes_published": sum(c["episodes_published"] for c in checks.values()),
            "episodes_stored": sum(c["episodes_stored"] for c in checks.values()),
            "rows_checked": sum(c["rows_checked"] for c in checks.values()), "runs": checks,
            **_written(io_file, store, total, sum(c["rows_checked"] for c in checks.values()),
                       args.worlds)}


def _verify(store: str, ends: np.ndarray, worlds: int, run: str = RUN) -> dict[str, Any]:
    """Read every stored row of ``run`` back and compare it with the published payload, byte
    for byte."""
    import zarr

    from storage import RunStore
    from storage._format import open_store

    reader = RunStore(store)
    eps = reader.episodes(run)
    published = {tuple(int(x) for x in e[:2]) for e in ends}
    stored = set(zip(eps["world"].tolist(), eps["index"].tolist(), strict=True))
    ok = stored == published and len(eps) == len(ends)
    order = {(int(w), int(i)): (int(n), bool(s)) for w, i, n, s in ends}
    ok &= all(order[(w, i)] == (n, s) for w, i, n, s in zip(
        eps["world"].tolist(), eps["index"].tolist(), eps["length"].tolist(),
        eps["success"].tolist(), strict=True))
    if not len(eps):  # no episode ended (a short run): nothing stored to read back
        return {"byte_equal": bool(ok), "episodes_published": len(ends), "episodes_stored": 0,
                "rows_checked": 0}
    root = zarr.open_group(open_store(store, read_only=True), mode="r")
    base = f"runs/{run}"

    def array(path: str) -> zarr.Array[Any]:
        node = root[f"{base}/{path}"]
        assert isinstance(node, zarr.Array), path
        return node

    def column(path: str, rows: int) -> np.ndarray:
        return np.asarray(array(path)[:rows])

    meta = reader.info(run)["committed"]
    n_seg, n_ep = meta["segments"], meta["episodes"]
    seg = {c: column(f"segments/{c}", n_seg) for c in ("episode", "offset", "rows")}
    end_step = column("episodes/end_step", n_ep)
    length = column("episodes/length", n_ep)
    world_of = column("episodes/world", n_ep)
    within = np.zeros(n_seg, np.int64)  # rows of the same episode before each segment
    order_idx = np.lexsort((np.arange(n_seg), seg["episode"]))
    cums = np.cumsum(seg["rows"][order_idx]) - seg["rows"][order_idx]
    first = np.r_[True, seg["episode"][order_idx][1:] != seg["episode"][order_idx][:-1]]
    base_cum = np.maximum.accumulate(np.where(first, cums, 0))
    within[order_idx] = cums - base_cum
    total = int(meta["rows"][TERM])
    row_world = np.full(total, -1, np.int64)
    row_step = np.full(total, -1, np.int64)
    for e, o, r, w0 in zip(seg["episode"].tolist(), seg["offset"].tolist(), seg["rows"].tolist(),
                           within.tolist(), strict=True):
        row_world[o:o + r] = world_of[e]
        start = end_step[e] - length[e] + w0
        row_step[o:o + r] = np.arange(start, start + r)
    pool = _pool(worlds)
    arrays = {name: array(f"data/{TERM}/{name}") for name in pool}
    steps_arr = array(f"data/{TERM}/_step")
    rows_checked, piece = 0, 1 << 16
    for a in range(0, total, piece):
        b = min(total, a + piece)
        valid = row_world[a:b] >= 0
        w, s = row_world[a:b][valid], row_step[a:b][valid]
        ok &= bool(np.array_equal(np.asarray(steps_arr[a:b])[valid], s))
        for name, arr in arrays.items():
            want = pool[name][s % POOL, w]
            if name == "state":
                want[:, 0], want[:, 1] = s.astype(np.float32), w.astype(np.float32)
            ok &= np.asarray(arr[a:b])[valid].tobytes() == want.tobytes()
        rows_checked += int(valid.sum())
    ok &= rows_checked == int(eps["length"].sum())
    rng = np.random.default_rng(0)  # and a sample through the reader API, whole episodes
    for i in rng.choice(len(eps), size=min(20, len(eps)), replace=False).tolist():
        world, idx, n, end = (int(eps[c][i]) for c in ("world", "index", "length", "end_step"))
        got = reader.episode(run, world, idx)
        steps = np.arange(end - n, end)
        for name in pool:
            want = np.stack([_stamped(pool, step, np.array([world]))[name][0] for step in steps.tolist()]) \
                if n else np.zeros((0, *pool[name].shape[2:]), pool[name].dtype)
            ok &= got[f"{TERM}/{name}"].tobytes() == want.tobytes()
    return {"byte_equal": bool(ok), "episodes_published": len(ends), "episodes_stored": len(eps),
            "rows_checked": rows_checked}


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "pipeline")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--worlds", type=int, default=4096)
    parser.add_argument("--episode-length", type=int, default=200, help="mean steps per episode")
    parser.add_argument("--memory-budget", type=int, default=1 << 30)
    parser.add_argument("--compression", default="lz4", choices=("lz4", "zstd", "none"))
    parser.add_argument("--chunk-size", type=int, default=1 << 20)
    parser.add_argument("--trials", type=int, default=4,
                        help="trials of each ceiling (half before the pipeline, half after)")
    parser.add_argument("--dir", default=None, help="where the stores go (default: a temp dir)")
    parser.add_argument("--role", default=None, help=argparse_hidden())
    parser.add_argument("--ends", default=None, help=argparse_hidden())
    parser.add_argument("--transport", default="tcp", choices=("tcp", "ipc"),
                        help="publisher -> daemon transport (tcp loopback, or a unix socket)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--scalar-fields", type=int, default=0, metavar="N",
                        help="add N float32 scalar fields (and N/6 bool ones) to the seed payload: "
                             "a term of many narrow columns")
    parser.add_argument("--publishers", type=int, default=None, metavar="N",
                        help="N publisher processes through a worldtap-proxy process (default: one "
                             "publisher, no proxy)")
    parser.add_argument("--connect", default=None, help=argparse_hidden())
    parser.add_argument("--run", default=RUN, help=argparse_hidden())
    parser.add_argument("--daemon-args", default=None, help=argparse_hidden())
    parser.add_argument("--store", default="local", choices=("local", "s3"),
                        help="where the daemon writes: a local directory, or S3 on loopback (moto)")
    parser.add_argument("--writer-paths", default="writer",
                        help="comma-separated storage-only ceilings beside zarr's append: writer, "
                             "public, zarrs, sharded (see above)")
    parser.add_argument("--daemon-writer", default="default", choices=("default", "public", "zarrs"),
                        help="the daemon's chunk path: its own choice, zarr's public API, or that "
                             "with the zarrs codec pipeline (pip install zarrs)")
    add_malloc_argument(parser, help="the daemon's --malloc, and this process's for the ceilings (see above)")
    args = parser.parse_args()
    global SCALARS
    if args.scalar_fields < 0:
        parser.error(f"--scalar-fields: expected a count >= 0, got {args.scalar_fields}")
    SCALARS = args.scalar_fields
    if args.publishers is not None and args.publishers < 1:
        parser.error(f"--publishers: expected a positive integer, got {args.publishers}")
    paths = args.writer_paths.split(",")
    if not set(paths) <= WRITER_PATHS or "writer" not in paths:
        parser.error(f"--writer-paths: expected 'writer' and any of {sorted(WRITER_PATHS)}, got "
                     f"{args.writer_paths!r}")
    if args.role == "publisher":
        return _publisher(args)
    if args.role == "zmq-sender":
        return _zmq_sender(args)
    if args.role == "daemon":
        sys.exit(_daemon(args))
    apply_malloc_choice(args.malloc)  # as the daemon does (see above)
    root = Path(tempfile.mkdtemp(prefix="worldtap-pipeline-", dir=args.dir))
    server = _s3_endpoint(root) if args.store == "s3" else None
    store = "s3://worldtap-bench/bench.zarr" if server is not None else str(root / "bench.zarr")
    try:
        ceiling_s = max(0.3, min(5.0, args.seconds / 6))
        samples: dict[str, list[float]] = {"zmq": [], "zarr": [], **{p: [] for p in paths}}
        cpu_samples: dict[str, list[float]] = {name: [] for name in samples if name != "zmq"}
        rng = random.Random(args.seed)

        def measure_ceilings(trials: int) -> None:
            for _ in range(trials):
                order = list(samples)
                rng.shuffle(order)
                for name in order:
                    if name == "zmq":
                        samples[name].append(_zmq_ceiling(args.worlds, ceiling_s))
                        continue
                    gb_s, cpu = _zarr_ceiling(args.worlds, ceiling_s, root, args,
                                              path="append" if name == "zarr" else name)
                    samples[name].append(gb_s)
                    cpu_samples[name].append(cpu)

        # Half the ceiling trials before the pipeline and half after: a shared machine's
        # speed drifts, and the ratio should compare like with like.
        measure_ceilings(-(-args.trials // 2))
        result = _pipeline(args, root, store) if args.publishers is None else _proxied(args, root, store)
        measure_ceilings(args.trials // 2)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    ceilings = {name: stats(v) for name, v in samples.items()}
    slower = min(ceilings["zmq"]["median"], ceilings["zarr"]["median"])
    budget_rss = args.memory_budget + 300 * 10**6
    one = _pool(1)  # (the payload's fields, one world)
    case = {"worlds": args.worlds, "seconds": args.seconds, "store": args.store,
            "fields": len(one), "row_bytes": _row_bytes(one),
            "daemon_writer": args.daemon_writer, "malloc": args.malloc, **result, **_cpu(result, cpu_samples),
            "ceiling_gb_per_s": ceilings, "slower_ceiling_gb_per_s": slower,
            "fraction_of_slower_ceiling": result["gb_per_s"] / slower,
            "fraction_of_writer_ceiling": result["gb_per_s"] / ceilings["writer"]["median"],
            "within_throughput_budget": result["gb_per_s"] >= 0.7 * slower,
            "memory_budget_bytes": args.memory_budget,
            "within_rss_budget": result["daemon_peak_rss_bytes"] <= budget_rss}
    if args.json:
        print_json({"benchmark": "pipeline", "machine": machine(), "versions": versions(),
                    "cases": [case]})
        return
    others = [p for p in paths if p != "writer"]
    headers = ["store", "daemon writer", "worlds", "fields", "steps/s", "e2e GB/s", "zmq GB/s", "zarr GB/s", "fraction",
               "writer GB/s", "of writer", *(f"{p} GB/s" for p in others), "stored field GB", "written GB",
               "store GB", "amplif.", "vs store", "peak RSS MB", "byte-equal", "pub CPU ms/step",
               "daemon CPU ms/step", "daemon faults/step", "CPU s/GB e2e", "CPU s/GB writer", "CPU bound of writer",
               "cores busy e2e"]
    row = [args.store, args.daemon_writer, args.worlds, case["fields"], result["steps_per_s"], result["gb_per_s"],
           ceilings["zmq"]["median"], ceilings["zarr"]["median"],
           case["fraction_of_slower_ceiling"], ceilings["writer"]["median"],
           case["fraction_of_writer_ceiling"], *(ceilings[p]["median"] for p in others),
           result["field_bytes"] / 1e9, "-" if result["bytes_written"] is None else result["bytes_written"] / 1e9,
           result["store_bytes"] / 1e9, "-" if result["amplification"] is None else result["amplification"],
           "-" if result["amplification_vs_store"] is None else result["amplification_vs_store"],
           result["daemon_peak_rss_bytes"] / 1e6, result["byte_equal"],
           result.get("publisher_cpu_ms_per_step", "-"), result.get("daemon_cpu_ms_per_step", "-"),
           result.get("daemon_page_faults_per_step", "-"),
           case.get("cpu_seconds_per_gb", {}).get("e2e", "-"), case.get("cpu_seconds_per_gb", {}).get("writer", "-"),
           case.get("cpu_bound_of_writer_ceiling", "-"), case.get("e2e_cores_busy", "-")]
    if args.publishers is not None:
        headers, row = ["publishers", *headers, "complete"], [args.publishers, *row, result["runs_complete"]]
    print(table(headers, [row]))



def _cpu(result: dict[str, Any], cpu_samples: dict[str, list[float]]) -> dict[str, Any]:
    """Where the cores went, per GB published: the end-to-end pipeline (its publisher while it
    published, the daemon over its life) against each storage-only ceiling (this process while
    it wrote). With the cores equally busy, the pipeline can reach at most the writer's CPU per
    GB over its own of the writer ceiling (``cpu_bound_of_writer_ceiling``): on a machine with
    few cores the publisher's and the receiver's work shares the cores the writer alone had."""
    if "daemon_cpu_seconds" not in result:  # --publishers: the proxy's and publishers' cores are not counted
        return {}
    gb = result["bytes"] / 1e9
    pub, daemon = result["publisher_cpu_seconds"] / gb, result["daemon_cpu_seconds"] / gb
    per_gb = {"publisher": pub, "daemon": daemon, "e2e": pub + daemon,
              **{name: stats(v)["median"] for name, v in cpu_samples.items()}}
    return {"cpu_seconds_per_gb": per_gb,
            "cpu_bound_of_writer_ceiling": per_gb["writer"] / per_gb["e2e"],
            "e2e_cores_busy": (result["publisher_cpu_seconds"] + result["daemon_cpu_seconds"]) /
            result["e2e_seconds"]}


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
