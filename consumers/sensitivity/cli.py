"""``worldtap-sensitivity``: which randomized parameters drive each episode outcome.

Offline::

    worldtap-sensitivity --store runs/demo.zarr [--run RUN]

Live, as a remote subscriber of a publisher (or proxy) at ENDPOINT::

    worldtap-sensitivity --connect tcp://127.0.0.1:5555 [--every 200] [--daemon-status ENDPOINT]

Both write ``indices.csv``, ``indices.json``, ``rates.csv``, ``sensitivity.png`` and
``convergence.png`` under ``--out`` (default ``./runs/sensitivity/<run>``) and print the
indices table. Live, ``--daemon-status`` adds the storage daemon's lag, write rate, gaps and
rejections (asked of its status socket, ``worldtap-store serve --status``, in the background)
to each report. A factor is marked influential only when the lower bound of its index's 95%
interval exceeds the upper bound of the dummy factor's (an independent uniform column the tool
draws). Exit status: 0 on success (also after Ctrl-C in live mode, once the outputs are
written), 2 on bad input (no such store or run, an empty table), 1 when a needed package is
missing.

Live, SIGINT (Ctrl-C) and SIGTERM end the subscription between two messages (within a tenth of
a second), and the analysis of what arrived is written; another signal while it is being
written stops the command at once (exit 130). The handlers are installed whatever the command
inherited: started by a script in the background, a process inherits SIGINT ignored.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .analysis import CONVERGENCE_RULE, INFLUENCE_RULE, Analysis, analyze
from .errors import MissingDependencyError, SensitivityError
from .methods import DEFAULT_METHODS, METHODS

__all__ = ["declarations_of", "describe_daemon", "main"]

_PROG = "worldtap-sensitivity"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=_PROG, description="Sensitivity of episode outcomes to the randomized variations "
        "of a run, offline from a run store or live from a publisher.",
        epilog=f"Rules: {INFLUENCE_RULE}. {CONVERGENCE_RULE}.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--store", metavar="PATH", help="a run store (offline)")
    src.add_argument("--connect", metavar="ENDPOINT", action="append",
                     help="a publisher or proxy endpoint to subscribe to (live); repeatable")
    p.add_argument("--run", help="run id (offline: required when the store holds several runs; "
                   "live: default the first run heard from)")
    p.add_argument("--out", metavar="DIR", help="output folder (default ./runs/sensitivity/<run>, the run id "
                   "percent-encoded as one folder name)")
    p.add_argument("--outputs", help="comma-separated outcome columns (default: every one that varies, "
                   "terminated and truncated excepted)")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default %(default)s; delta is slow)")
    p.add_argument("--seed", type=int, default=0, help="seeds the dummy, the null and the bootstraps")
    p.add_argument("--resamples", type=int, default=100, help="bootstrap resamples (default %(default)s)")
    p.add_argument("--bins", type=int, default=10, help="bins per ordered factor (default %(default)s)")
    p.add_argument("--every", type=int, default=200,
                   help="live: recompute after this many new episodes (default %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--daemon-status", metavar="ENDPOINT",
                   help="live: a storage daemon's status endpoint (worldtap-store serve --status); "
                        "its lag, write rate, gaps and rejections are shown with each report")
    return p


class _DaemonWatch:
    """Asks a storage daemon for its status every ``interval`` seconds on a background thread,
    so the live loop never waits for it; :meth:`line` is the latest answer, in words."""

    def __init__(self, endpoint: str, interval: float = 2.0) -> None:
        self.endpoint, self.interval = endpoint, interval
        self._line = f"daemon {endpoint}: no answer yet"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worldtap-sensitivity-daemon",
                                        daemon=True)

    def _run(self) -> None:
        from storage import StorageError, daemon_status

        while not self._stop.is_set():
            try:
                self._line = describe_daemon(self.endpoint, daemon_status(
                    self.endpoint, timeout=self.interval))
            except (StorageError, OSError) as exc:  # no daemon there (yet): say so, keep asking
                self._line = f"daemon {self.endpoint}: {exc}"
            self._stop.wait(self.interval)

    def line(self) -> str:
        """The daemon's latest status, in one line."""
        return self._line

    def __enter__(self) -> _DaemonWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.interval + 1.0)


def describe_daemon(endpoint: str, status: Mapping[str, Any]) -> str:
    """One line of a storage daemon's status document (:func:`storage.daemon_status`)."""
    rate = status.get("rate", {})
    rejected = status.get("rejected", {})
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()))
    return (f"daemon {endpoint}: lag {status.get('lag_steps', 0)} steps, "
            f"{rate.get('mb_per_s', 0.0):.1f} MB/s, {rate.get('episodes_per_s', 0.0):.1f} "
            f"episodes/s, {status.get('episodes', {}).get('stored', 0)} episodes stored, "
            f"gaps {status.get('gaps', 0)}, rejected {sum(rejected.values())}"
            f"{f' ({reasons})' if reasons else ''}")


def _split(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [t.strip() for t in text.split(",") if t.strip()]


def declarations_of(info: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The variation declarations in a run's ``RunStore.info()`` (entries that carry a
    ``kind``; anything else, e.g. a store without declarations, gives none)."""
    raw = info.get("variations")
    if not isinstance(raw, Mapping):
        return {}
    return {str(k): dict(v) for k, v in raw.items() if isinstance(v, Mapping) and "kind" in v}


class _Out:
    """Terminal output: the rich table on stdout, status lines on stderr."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet

    def status(self, line: str) -> None:
        if not self.quiet:
            print(f"{_PROG}: {line}", file=sys.stderr, flush=True)

    def table(self, analysis: Analysis, *, provisional: bool | None = None) -> None:
        from ._deps import require
        from .report import render_table

        console = require("rich.console").Console(file=sys.stdout, width=160)
        console.print(render_table(analysis, provisional=provisional))

    def summary(self, analysis: Analysis, paths: Mapping[str, Path]) -> None:
        for w in analysis.warnings:
            print(f"warning: {w}", file=sys.stdout)
        print(f"verdict: {'converged' if analysis.converged else 'NOT converged (provisional)'}; "
              f"{INFLUENCE_RULE}", file=sys.stdout)
        for name, path in paths.items():
            print(f"{name}: {path}", file=sys.stdout)
        sys.stdout.flush()


def _offline(args: argparse.Namespace, out: _Out) -> int:
    from storage import RunStore, StorageError

    try:
        store = RunStore(args.store)
        runs = store.runs()
        if args.run is None:
            if len(runs) != 1:
                raise SensitivityError(f"store {args.store!r} holds {len(runs)} runs "
                                       f"({', '.join(runs) or 'none'}); pass --run")
            run = runs[0]
        else:
            run = args.run
        info = store.info(run)
        declarations = declarations_of(info)
        out.status(f"reading run {run!r} from {args.store} (status {info.get('status')!r})")
        arrays = store.variation_table(run).arrays()
    except StorageError as exc:
        raise SensitivityError(str(exc)) from exc
    if not declarations:
        out.status("the run carries no variation declarations; bins use the data's range")
    if arrays.x.shape[0] == 0:
        raise SensitivityError(f"run {run!r} in {args.store!r} holds no committed episodes")
    analysis = analyze(arrays, declarations, run=run, outputs=_split(args.outputs),
                       methods=_split(args.methods) or [], seed=args.seed,
                       resamples=args.resamples, bins=args.bins, progress=out.status)
    from .report import default_folder, write_outputs

    folder = Path(args.out) if args.out else default_folder(run)
    out.status(f"writing {folder}")
    paths = write_outputs(analysis, folder)
    out.table(analysis)
    out.summary(analysis, paths)
    return 0


def _live(args: argparse.Namespace, out: _Out) -> int:
    from contextlib import nullcontext

    from broker.cli_args import signals_set

    from .live import run_live

    watch = _DaemonWatch(args.daemon_status) if args.daemon_status else None

    display: Any = None
    if sys.stdout.isatty():  # one table updated in place; else each result printed in turn
        from ._deps import require
        from .report import render_table

        display = require("rich.live").Live(auto_refresh=False)

    def on_result(analysis: Analysis) -> None:
        if watch is not None:
            out.status(watch.line())
        if display is None:
            out.table(analysis)
            return
        display.update(render_table(analysis), refresh=True)

    stop = threading.Event()
    kwargs: dict[str, Any] = {
        "out": args.out, "run": args.run, "every": args.every, "outputs": _split(args.outputs),
        "methods": _split(args.methods) or [], "seed": args.seed, "resamples": args.resamples,
        "bins": args.bins, "on_result": on_result, "on_status": out.status, "stop": stop}
    # SIGINT and SIGTERM end the loop between two messages; another one during the final
    # analysis stops the command (in the main thread: only it may install handlers)
    with watch if watch is not None else nullcontext(), signals_set(stop, interrupt_again=True):
        if display is None:
            result = run_live(args.connect, **kwargs)
        else:
            with display:
                result = run_live(args.connect, **kwargs)
    if result.analysis is None:
        print(f"{_PROG}: no finished episodes arrived"
              f"{' before Ctrl-C' if result.interrupted else ''}; nothing written", file=sys.stderr)
        return 0 if result.interrupted else 2
    out.summary(result.analysis, result.paths)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``worldtap-sensitivity``; returns the exit status."""
    args = _parser().parse_args(argv)
    out = _Out(args.quiet)
    try:
        if args.resamples < 2 or args.bins < 1 or args.every < 1:
            raise SensitivityError(f"--resamples >= 2, --bins >= 1 and --every >= 1 expected, got "
                                   f"{args.resamples}, {args.bins}, {args.every}")
        if args.daemon_status and not args.connect:
            raise SensitivityError("--daemon-status goes with --connect (live mode)")
        return _live(args, out) if args.connect else _offline(args, out)
    except MissingDependencyError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1
    except SensitivityError as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line for whatever else (a transport error, a bad path)
        from broker import BrokerError

        if isinstance(exc, BrokerError | OSError):
            print(f"{_PROG}: error: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
