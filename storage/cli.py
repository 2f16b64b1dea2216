"""``worldtap-store``: the storage daemon's command line (also ``python -m storage``).

Subcommands (``worldtap-store --help`` lists them, ``worldtap-store CMD --help`` explains one):

- ``serve`` (the default: ``worldtap-store [STORE] --connect tcp://127.0.0.1:5555`` is
  ``worldtap-store serve ...``) subscribes to publishers and writes their runs into STORE;
  SIGINT and SIGTERM commit every complete episode and exit 0.
- the subcommands of :data:`SUBCOMMANDS`, each in its own module.

Exit codes (every error is one line on stderr, without a traceback): 0 done; 1 an unexpected
error (its traceback at ``--log-level DEBUG``); 2 usage error (a bad option value, a missing
ipc folder, a key file that cannot be loaded); 3 the store is locked, is not a run store, or
cannot be opened or written (a read-only folder, a file, a filesystem extra not installed,
no credentials); 4 a run failed to write (the daemon served the other runs; the failed ones
stay at their last commit); 5 an endpoint cannot be bound or connected (the port is in use),
or, for ``status``, no daemon answered in time; 6 the CURVE handshake with a ``--connect``
endpoint kept failing for ``--handshake-grace`` seconds (the daemon's key is not on the
publisher's allow-list, the wrong ``--curve-server`` key, or CURVE on one side only): the
daemon commits what it holds and exits (a bound daemon logs such failures and serves on).
7 (``verify``, ``repair``) the store is damaged: ``verify`` found a problem, or ``repair``
could not repair a run.
A store write that fails while serving (disk full) fails that run only: it keeps its last
commit, and the exit code is 4.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

from broker.allocator import apply_malloc_choice
from broker.cli_args import OneLineParser, add_malloc_argument, check_endpoint, parse_size, positive_int, seconds

from ._format import ALL_RUNS, Partition
from .daemon import StoreDaemon
from .errors import StorageError, StoreDamagedError
from .lock import FencedStore, StoreLease, StoreLock
from .status import StatusReporter, StatusServer, format_status, status_document

__all__ = ["build_parser", "main", "parse_size", "store_locks", "subscriber_id"]

_log = logging.getLogger("worldtap.storage")

_SERVE_HELP = "Persist worldtap runs received over ZeroMQ into a Zarr run store."
_CHECK_INTERVAL = 0.05  # seconds between answers to status requests and handshake checks

#: Subcommands that live in their own modules: name -> module. Each module defines ``HELP``
#: (one line), ``add_arguments(parser)`` and ``run(args) -> int`` (the exit code), and imports
#: nothing heavy at module level (building the parser imports every one of them).
SUBCOMMANDS: dict[str, str] = {
    "info": "storage.info",
    "export": "storage.export",
    "episodes": "storage.query",
    "verify": "storage.verify",
    "repair": "storage.repair",
    "status": "storage.status_cli",
}


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``worldtap-store serve`` (the daemon's options)."""
    p = OneLineParser(prog="worldtap-store serve", description=_SERVE_HELP)
    _serve_arguments(p)
    return p


def build_main_parser() -> argparse.ArgumentParser:
    """The parser of ``worldtap-store``: one subparser per subcommand."""
    import importlib

    p = OneLineParser(
        prog="worldtap-store",
        description="worldtap's run store: the storage daemon and the tools that read, check and "
                    "export what it stored. Without a subcommand, the arguments are serve's.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    _serve_arguments(sub.add_parser("serve", help=_SERVE_HELP, description=_SERVE_HELP))
    for name, module in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, help=mod.HELP, description=mod.HELP))
    return p


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", nargs="?", default="worldtap.zarr",
                   help="local directory (default ./worldtap.zarr) or zarr/fsspec URL")
    p.add_argument("--connect", action="append", default=[], metavar="ENDPOINT", type=check_endpoint,
                   help="publisher endpoint to connect to (repeatable; default "
                        "tcp://127.0.0.1:5555)")
    p.add_argument("--bind", action="append", default=[], metavar="ENDPOINT", type=check_endpoint,
                   help="endpoint to bind, for publishers that connect (repeatable)")
    p.add_argument("--export", choices=("all", "succeeded", "split", "none"), default="all",
                   help="which episodes to store; split puts failed ones in --failed-store")
    p.add_argument("--failed-store", default=None, help="store for failed episodes (split mode; "
                   "default: STORE with _failed before its suffix)")
    p.add_argument("--compression", choices=("lz4", "zstd", "none"), default="lz4",
                   help="chunk compression (default lz4, fast)")
    p.add_argument("--chunk-size", type=parse_size, default=2**20, metavar="SIZE",
                   help="uncompressed bytes per data chunk (default 1MiB)")
    p.add_argument("--memory-budget", type=parse_size, default=2**30, metavar="SIZE",
                   help="memory for buffered episodes (default 1GiB)")
    p.add_argument("--fsync", action="store_true",
                   help="sync data and index to disk before each commit (power-loss safe)")
    p.add_argument("--commit-interval", type=seconds(zero=True), default=0.5, metavar="SECONDS",
                   help="seconds between index commits while a run is busy, at least (default "
                        "0.5); a run whose commits take long commits no sooner than 4 times its "
                        "last commit's duration after it")
    p.add_argument("--status-interval", type=seconds(zero=False), default=5.0, metavar="SECONDS",
                   help="seconds between status lines, and the interval of the write rates "
                        "(default 5)")
    p.add_argument("--status", default=None, metavar="ENDPOINT", type=check_endpoint,
                   help="answer status requests (worldtap-store status ENDPOINT) on this "
                        "endpoint, e.g. tcp://127.0.0.1:5557; plain text: loopback, ipc:// or a "
                        "trusted network only")
    p.add_argument("--handshake-grace", type=seconds(zero=True), default=10.0, metavar="SECONDS",
                   help="exit (code 6) once the CURVE handshake with a --connect endpoint has "
                        "failed for this long without succeeding (default 10; each failure is "
                        "logged at once; with --bind, failures are logged, never fatal)")
    p.add_argument("--max-runs", type=positive_int, default=64, metavar="N",
                   help="runs held in memory at once (default 64); the least recently active "
                        "is retired to admit another")
    p.add_argument("--idle-timeout", type=seconds(zero=False), default=600.0, metavar="SECONDS",
                   help="retire a run after this long without a message (default 600; it "
                        "resumes if its messages come back)")
    p.add_argument("--max-message-size", type=parse_size, default=2**31 - 1, metavar="SIZE")
    p.add_argument("--io-threads", type=positive_int, default=os.cpu_count() or 2, metavar="N",
                   help="threads that compress and write chunks (default: the CPU count; more "
                        "only add switching between threads)")
    p.add_argument("--hwm", type=positive_int, default=8, metavar="N",
                   help="ZeroMQ receive high-water mark: messages queued before the publisher "
                        "is slowed down (memory outside the budget: N x message size)")
    p.add_argument("--curve-keys", default=None, metavar="FILE",
                   help="CURVE: this daemon's key pair (a .key_secret file from worldtap-keys); "
                        "its public key must be on the publishers' allow-list")
    p.add_argument("--curve-server", default=None, metavar="FILE",
                   help="CURVE: the publishers' public key (.key file); needs --curve-keys")
    p.add_argument("--lease-ttl", type=seconds(zero=False), default=30.0, metavar="SECONDS",
                   help="stores that are not local directories: seconds the daemon's lease on "
                        "the store lasts unrenewed (a resume after a crash waits this long)")
    p.add_argument("--exit-after-runs", type=positive_int, default=None, metavar="N",
                   help="exit once N runs have ended")
    p.add_argument("--partition", type=_partition, default=ALL_RUNS, metavar="K/N",
                   help="store only the runs of partition K of N (0 <= K < N; a hash of the run "
                        "id): N daemons, one per partition, write one store together "
                        "(default 0/1: every run)")
    add_malloc_argument(p)
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _partition(text: str) -> Partition:
    try:
        return Partition.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the daemon until SIGINT/SIGTERM (or ``--exit-after-runs``); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    main_parser = build_main_parser()
    commands = {"serve", *SUBCOMMANDS}
    if not argv or (argv[0] not in commands and argv[0] not in ("-h", "--help")):
        argv = ["serve", *argv]
    args = main_parser.parse_args(argv)
    if args.command != "serve":
        import importlib

        return int(importlib.import_module(SUBCOMMANDS[args.command]).run(args))
    parser = build_parser()
    if (args.curve_keys is None) != (args.curve_server is None):
        parser.error("--curve-keys and --curve-server go together")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s worldtap-store %(levelname)s %(message)s")
    from broker import SecurityError

    try:
        args.curve = _curve(args)
    except SecurityError as exc:
        print(f"worldtap-store: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    from broker import TransportError
    from broker.cli_args import signals_set

    with signals_set(stop):  # set until the error, if any, is said
        try:
            return _serve(args, stop)
        except _HandshakeFailed as exc:
            print(f"worldtap-store: {exc}", file=sys.stderr)
            return 6
        except TransportError as exc:
            print(f"worldtap-store: {exc}", file=sys.stderr)
            return 5
        except StoreDamagedError as exc:
            print(f"worldtap-store: {exc}", file=sys.stderr)
            return 3
        except (StorageError, OSError) as exc:  # locked, not a run store, disk full, read-only
            print(f"worldtap-store: {exc}", file=sys.stderr)
            return 3
        except Exception as exc:  # one line for the operator; the traceback at --log-level DEBUG
            _log.debug("unexpected error", exc_info=exc)
            print(f"worldtap-store: error: {exc!r}", file=sys.stderr)
            return 1


def _serve(args: argparse.Namespace, stop: threading.Event) -> int:
    import zarr

    from broker import Subscriber, TransportError  # the ZeroMQ transport, imported late

    from .daemon import failed_store_location

    zarr.config.set({"threading.max_workers": args.io_threads})  # this process is ours to tune
    # The receiving thread releases the GIL for every large copy; with Python's default 5 ms
    # switch interval, taking it back from the writer's threads costs up to 5 ms each time.
    sys.setswitchinterval(0.001)
    malloc = apply_malloc_choice(args.malloc)  # said in the ready line; stderr stays one line on errors
    for location in (args.store, args.failed_store):
        if str(location).startswith("memory://"):
            _log.warning("store %r is held in this process's memory: it vanishes when the daemon "
                         "exits", location)

    with ExitStack() as stack:
        with _opening(args.store):
            locks = store_locks(args)
            for lock in locks:  # before opening: resuming modifies the store
                stack.enter_context(lock)
            leases = [lock for lock in locks if isinstance(lock, StoreLease)]
            store, failed_store = _fenced(args, locks)
        bind = bool(args.bind)
        endpoints = args.bind if bind else (args.connect or ["tcp://127.0.0.1:5555"])
        # A stable id (the store's): a daemon restarted on the same store is the same
        # subscriber to publishers, which send it again every RunEnd it had not confirmed.
        # RunEnds are confirmed only once the run's last commit is durable (on_run_end).
        sub: Subscriber[Any] = Subscriber(endpoints, topics=("",), bind=bind, curve=args.curve,
                                          max_message_size=args.max_message_size, hwm=args.hwm,
                                          id=subscriber_id(args.store, args.partition),
                                          confirm_run_ends=False, arrays="numpy")
        stack.callback(sub.close)
        with _opening(args.store):
            daemon = StoreDaemon(store, export=args.export, failed_store=failed_store,
                                 compression=args.compression, chunk_bytes=args.chunk_size,
                                 memory_budget=args.memory_budget, fsync=args.fsync,
                                 commit_interval=args.commit_interval, max_runs=args.max_runs,
                                 idle_timeout=args.idle_timeout, on_run_end=sub.confirm_run_end,
                                 partition=args.partition)
        stack.callback(daemon.close)

        def transport() -> dict[str, Any]:
            st = sub.statistics()
            return {"bad_messages": st.bad_messages, "gaps": st.gaps,
                    "bad_reasons": st.bad_reasons, "publishers": st.publishers,
                    "received": st.received, "handshake_failures": st.handshake_failures,
                    "failing_endpoints": st.failing_endpoints}

        status = stack.enter_context(StatusReporter(daemon.statistics, transport,
                                                    interval=args.status_interval))
        server = None
        if args.status is not None:
            about = {"store": str(args.store), "export": args.export,
                     "failed_store": None if args.export != "split" else str(
                         args.failed_store or failed_store_location(args.store)),
                     "partition": str(args.partition), "bind": bind,
                     "endpoints": list(sub.endpoints), "pid": os.getpid()}
            try:
                server = stack.enter_context(StatusServer(args.status, lambda: status_document(
                    daemon.statistics(), transport(), status.rates,
                    memory_budget=args.memory_budget, about=about)))
            except TransportError as exc:
                raise TransportError(f"--status: {exc}") from exc
        handshakes = _Handshakes(None if bind else args.handshake_grace)
        next_check = 0.0
        part = "" if args.partition.whole else f" partition={args.partition}"
        print(f"worldtap-store ready: store={args.store!r}{part} export={args.export} "
              f"{'bind' if bind else 'connect'}={','.join(endpoints)}"
              f"{'' if server is None else f' status={server.endpoint}'} malloc={malloc}", file=sys.stderr,
              flush=True)
        while not stop.is_set():
            if any(lease.lost.is_set() for lease in leases):
                # Another daemon holds the store now: stop at once, as a crash would (the
                # commit protocol keeps what was committed), never writing over its commits.
                print("worldtap-store: lost the store's lease to another daemon; stopping "
                      "without a final commit", file=sys.stderr, flush=True)
                os._exit(3)
            item = sub.recv(timeout=0.1)
            if item is None:
                daemon.tick()
            else:
                daemon.handle(item)
            status.poll()
            now = time.monotonic()
            if now >= next_check:  # a few times a second: never a cost per message
                next_check = now + _CHECK_INTERVAL
                if server is not None:
                    server.poll()
                handshakes.check(sub.statistics().failing_endpoints)
            if args.exit_after_runs is not None and daemon.runs_ended >= args.exit_after_runs:
                break
        daemon.close()
        final = status.snapshot()
        st, ds = sub.statistics(), daemon.statistics()
        print(f"worldtap-store done: {format_status(final)} messages={st.received} "
              f"written={ds.bytes_written / 1e6:.1f}MB "
              f"avg={ds.bytes_written / 1e6 / max(ds.uptime_s, 1e-9):.1f}MB/s "
              f"open_at_end={ds.episodes_open_at_end} failed_runs={ds.runs_failed}"
              f"{'' if args.partition.whole else f' other_partition={ds.other_partition}'}",
              file=sys.stderr, flush=True)
        if ds.runs_failed:
            print(f"worldtap-store: {ds.runs_failed} run(s) failed to write and stopped at their "
                  f"last commit (see the log above)", file=sys.stderr, flush=True)
            return 4
    return 0


class _HandshakeFailed(Exception):
    """The CURVE handshake with a publisher kept failing (``worldtap-store`` exits with 6)."""


class _Handshakes:
    """Failed CURVE handshakes of the daemon's subscriber: each endpoint that starts failing is
    logged at once; one that keeps failing for ``grace`` seconds ends the daemon (``None``:
    never, for a bound daemon, which one misconfigured publisher must not stop)."""

    def __init__(self, grace: float | None) -> None:
        self.grace = grace
        self._since: dict[str, float] = {}  # endpoint -> when its handshakes started failing

    def check(self, failing: Mapping[str, str]) -> None:
        """Note the endpoints whose latest handshake failed (endpoint -> likely cause).

        Raises:
            _HandshakeFailed: One has been failing for ``grace`` seconds.
        """
        if not failing and not self._since:
            return
        now = time.monotonic()
        for endpoint in [e for e in self._since if e not in failing]:
            del self._since[endpoint]
        for endpoint, cause in failing.items():
            if endpoint not in self._since:
                self._since[endpoint] = now
                _log.warning("the CURVE handshake with %s failed: %s%s", endpoint, cause,
                             "" if self.grace is None else
                             f" (exiting in {self.grace:g} s unless it succeeds)")
            if self.grace is not None and now - self._since[endpoint] >= self.grace:
                raise _HandshakeFailed(f"the CURVE handshake with {endpoint} failed: {cause}")


@contextmanager
def _opening(store: str) -> Iterator[None]:
    """Make an error of opening ``store`` a :class:`StorageError` that names it (exit code 3).

    Raises:
        StorageError: The store cannot be opened or written (a read-only folder, no credentials,
            a filesystem that is not installed).
    """
    from broker import BrokerError

    try:
        yield
    except (StorageError, BrokerError):
        raise
    except Exception as exc:
        raise StorageError(f"store {store!r} cannot be opened or written: "
                           f"{type(exc).__name__}: {exc}") from exc


def _curve(args: argparse.Namespace) -> Any:
    """The subscriber's CURVE client settings, or ``None`` for plain text.

    Raises:
        broker.SecurityError: A key file is missing or malformed.
    """
    if args.curve_keys is None:
        return None
    from broker import CurveClient, load_keypair
    from broker.security import load_public_key

    return CurveClient(load_keypair(args.curve_keys), load_public_key(args.curve_server))


def subscriber_id(store: str, partition: Partition = ALL_RUNS) -> str:
    """The daemon's subscriber id for ``store`` and ``partition``: the same for every daemon
    of that partition of that store (so a restarted daemon is sent the ``RunEnd`` s it had not
    confirmed), different for the other partitions' daemons."""
    import hashlib

    from ._format import local_path

    path = local_path(store)
    where = str(path.resolve()) if path is not None else str(store)
    sid = "store-" + hashlib.sha256(where.encode()).hexdigest()[:16]
    return sid if partition.whole else f"{sid}-p{partition.index}of{partition.count}"


def _fenced(args: argparse.Namespace, locks: list[StoreLock | StoreLease]) -> tuple[Any, Any]:
    """The daemon's store and failed store, each behind its lease when it has one (a daemon
    whose lease lapsed writes nothing more: :class:`storage.FencedStore`)."""
    from ._format import open_store
    from .daemon import failed_store_location

    if args.export == "none":
        return args.store, args.failed_store
    locations = [args.store, args.failed_store or failed_store_location(args.store)]
    out: list[Any] = [args.store, locations[1] if args.export == "split" else None]
    for i, lock in enumerate(locks):
        if isinstance(lock, StoreLease):
            out[i] = FencedStore(open_store(locations[i], fsync=args.fsync), lock)
    return out[0], out[1]


def store_locks(args: argparse.Namespace) -> list[StoreLock | StoreLease]:
    """The locks the daemon takes before opening its stores: a ``flock`` per local directory,
    a lease object beside the store for any other URL (see :mod:`storage.lock`)."""
    from ._format import local_path
    from .daemon import failed_store_location

    if args.export == "none":
        return []
    stores = [args.store]
    if args.export == "split":
        stores.append(args.failed_store or failed_store_location(args.store))
    locks: list[StoreLock | StoreLease] = []
    for store in stores:
        path = local_path(store)
        locks.append(StoreLock(path, args.partition) if path is not None else
                     StoreLease(str(store), ttl=args.lease_ttl, partition=args.partition))
    return locks
