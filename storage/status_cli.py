"""``worldtap-store status ENDPOINT``: the status of a running storage daemon, asked over its
status socket (``worldtap-store serve --status ENDPOINT``).

Prints a readable table (rich's, when it is installed), or the JSON document with ``--json``;
``--watch SECONDS`` asks again every SECONDS until Ctrl-C. Exit codes: 0 answered; 5 no daemon
answered within ``--timeout`` (one line on stderr); 3 the answer is not a status document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping
from typing import Any

from broker.cli_args import check_endpoint, seconds

__all__ = ["HELP", "add_arguments", "render", "rows", "run"]

HELP = "show the status of a running daemon (serve --status ENDPOINT)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``worldtap-store status``."""
    p.add_argument("endpoint", type=check_endpoint,
                   help="the daemon's status endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--json", action="store_true", help="print the JSON document")
    p.add_argument("--watch", type=seconds(zero=False), default=None, metavar="SECONDS",
                   help="ask again every SECONDS until Ctrl-C")
    p.add_argument("--timeout", type=seconds(zero=False), default=5.0, metavar="S",
                   help="seconds to wait for the answer (default 5)")


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def rows(doc: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The status document as (name, value) rows, in reading order."""
    runs, eps, rate, mem, sub = (doc.get(k, {}) for k in
                                 ("runs", "episodes", "rate", "memory", "subscriber"))
    rejected = doc.get("rejected", {})
    out = [
        ("store", str(doc.get("store"))),
        ("endpoints", f"{'bind' if doc.get('bind') else 'connect'} "
                      f"{', '.join(doc.get('endpoints', []))}"),
        ("publishers heard", str(sub.get("publishers", 0))),
        ("uptime", f"{doc.get('uptime_s', 0):.0f} s"),
        ("runs", f"{runs.get('active', 0)} active, {runs.get('ended', 0)} ended, "
                 f"{runs.get('failed', 0)} failed"),
        ("episodes stored", str(eps.get("stored", 0))),
        ("episodes incomplete", str(eps.get("incomplete", 0))),
        ("lag", f"{doc.get('lag_steps', 0)} steps"),
        ("write rate", f"{rate.get('mb_per_s', 0):.1f} MB/s, {rate.get('episodes_per_s', 0):.1f} "
                       f"episodes/s (last {rate.get('interval_s', 0):.1f} s)"),
        ("written", _mb(doc.get("bytes_written", 0))),
        ("gaps", str(doc.get("gaps", 0))),
        ("bad messages", str(doc.get("bad_messages", 0))),
        ("rejected", ", ".join(f"{k}={v}" for k, v in sorted(rejected.items())) or "0"),
        ("memory", f"{_mb(mem.get('held_bytes', 0))} of {_mb(mem.get('budget_bytes', 0))}"),
    ]
    if sub.get("handshake_failures"):
        out.append(("handshakes failed", str(sub["handshake_failures"])))
    for endpoint, cause in sorted(sub.get("failing_endpoints", {}).items()):
        out.append((f"failing {endpoint}", str(cause)))
    for run, count in sorted(runs.get("episodes", {}).items()):
        out.append((f"run {run}", f"{count} episodes stored"))
    out.append(("version", str(doc.get("version"))))
    return out


def render(doc: Mapping[str, Any]) -> str:
    """The status document as plain text, one ``name: value`` line per row."""
    table = rows(doc)
    width = max(len(name) for name, _ in table)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in table)


def _show(doc: Mapping[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, sort_keys=True), flush=True)
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional
        print(render(doc), flush=True)
        return
    table = Table(title="worldtap-store status", show_header=False)
    table.add_column(justify="right", style="bold")
    table.add_column()
    for name, value in rows(doc):
        table.add_row(name, value)
    Console(file=sys.stdout).print(table)


def run(args: argparse.Namespace) -> int:
    """Ask, print, and (``--watch``) repeat; returns the exit code."""
    from broker import TransportError

    from .errors import StorageError
    from .status import StatusTimeoutError, daemon_status

    try:
        while True:
            try:
                doc = daemon_status(args.endpoint, timeout=args.timeout)
            except (StatusTimeoutError, TransportError) as exc:
                print(f"worldtap-store status: {exc}", file=sys.stderr)
                return 5
            except StorageError as exc:
                print(f"worldtap-store status: {exc}", file=sys.stderr)
                return 3
            _show(doc, args.json)
            if args.watch is None:
                return 0
            time.sleep(args.watch)  # the pace the user asked for, not a wait for another process
    except KeyboardInterrupt:
        return 0
