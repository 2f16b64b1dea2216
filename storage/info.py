"""``worldtap-store info``: what a store holds, per run: status, worlds, episodes (succeeded),
gaps, metadata, fields, variations, bytes stored and times; a table, or ``--json``.

The JSON document (``--json``) is ``{"store": ..., "runs": [...], "damaged": [...]}``; each
run is an object with the keys ``run``, ``status``, ``num_worlds``, ``episodes``,
``succeeded``, ``metadata``, ``fields`` (``"<term>/<field>"`` -> ``{"dtype", "shape"}``),
``variations`` (key -> ``{"kind", "phase"}``), ``bytes`` (bytes stored under the run's group,
``null`` where the store cannot list them), ``started_at``, ``ended_at``, ``duration``
(seconds, ``null`` until both are known), ``gaps`` (``{"count", "missing"}``: rows of
``gaps/`` and the sequence numbers they span), ``rejected`` (messages of the run the daemon
rejected, by reason, as of its last commit; ``{}`` for none), ``resumed``, ``repaired`` (the
attribute a repair left, or ``null``) and ``dirty``. Messages that could not be decoded at all
name no run: the daemon counts them while it runs (its status), they are not stored. ``damaged`` lists
``{"run", "error"}`` for each run whose attributes or tables cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "list a store's runs (--json: one JSON document with each run's details)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worldtap-store info``."""
    parser.add_argument("store", help="local directory or zarr/fsspec URL of a run store")
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run_sizes(reader: Any, node: str) -> int | None:
    """Bytes stored under ``runs/<node>`` of the store ``reader`` reads: the sizes of the files
    of a local directory, else of the keys the zarr store lists; ``None`` where it cannot."""
    import os

    from zarr.core.sync import sync

    from ._format import local_path

    path = local_path(reader.location)
    if path is not None:
        total = 0
        for where, _, files in os.walk(path / "runs" / node):
            total += sum(os.path.getsize(os.path.join(where, f)) for f in files)
        return total
    store = reader.root.store

    async def size() -> int:
        return sum([await store.getsize(key) async for key in store.list_prefix(f"runs/{node}/")])

    try:
        return int(sync(size()))
    except Exception:  # a store that cannot list or size its keys
        return None


def describe(reader: Any, run: str) -> dict[str, Any]:
    """The JSON-ready description of ``run`` (see the module's documentation).

    Raises:
        StorageError: The run's tables cannot be read.
    """
    from ._format import to_json

    info = reader.info(run)
    eps = reader.episodes(run)
    gaps = reader.gaps(run)
    missing = int((gaps["received"] - gaps["expected"]).clip(min=0).sum()) if len(gaps) else 0
    started, ended = info.get("started_at"), info.get("ended_at")
    return {
        "run": run, "status": info["status"], "num_worlds": int(info["num_worlds"]),
        "episodes": len(eps), "succeeded": int(eps["success"].sum()),
        "metadata": to_json(info.get("metadata", {})),
        "fields": {f"{term}/{name}": {"dtype": spec.get("dtype"), "shape": list(spec.get("shape", []))}
                   for term, fields in info["fields"].items() for name, spec in fields.items()},
        "variations": _variations(info),
        "bytes": run_sizes(reader, reader.node(run)),
        "started_at": started, "ended_at": ended,
        "duration": ended - started if started is not None and ended is not None else None,
        "gaps": {"count": len(gaps), "missing": missing},
        "rejected": {str(k): int(v) for k, v in (info.get("rejected") or {}).items()},
        "resumed": info.get("resumed", 0), "repaired": info.get("repaired"),
        "dirty": bool(info.get("dirty", False)),
    }


def _variations(info: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Variation key -> its ``kind`` (as declared; ``None`` when undeclared) and ``phase``, for
    every key declared or with stored samples, sorted."""
    from ._format import to_json

    declared, samples = to_json(info["variations"]), info["variation_samples"]
    return {key: {"kind": (declared.get(key) or {}).get("kind"),
                  "phase": (declared.get(key) or samples.get(key) or {}).get("phase")}
            for key in sorted({*declared, *samples})}


def run(args: argparse.Namespace) -> int:
    """Print the runs; returns 0, or 3 when the store cannot be opened or a run is damaged
    (after listing the sound ones), with one line on stderr for an unopenable store."""
    from .errors import StorageError
    from .reader import RunStore

    try:
        reader = RunStore(args.store)
    except StorageError as exc:
        print(f"worldtap-store: {exc}", file=sys.stderr)
        return 3
    runs, damaged = [], []
    for name in reader.runs():
        try:
            runs.append(describe(reader, name))
        except StorageError as exc:
            damaged.append({"run": name, "error": str(exc)})
    damaged += [{"run": node, "error": why} for node, why in reader.damaged().items()]
    if args.json:
        print(json.dumps({"store": str(args.store), "runs": runs, "damaged": damaged}, indent=1))
    else:
        print(f"{'run':<24} {'status':<9} {'worlds':>7} {'episodes':>9} {'succeeded':>9} {'gaps':>5} "
              f"{'rejected':>8} {'MB':>9} {'duration':>9}")
        for r in runs:
            mb = "-" if r["bytes"] is None else f"{r['bytes'] / 1e6:.1f}"
            took = "-" if r["duration"] is None else f"{r['duration']:.0f}s"
            print(f"{r['run']:<24} {r['status']:<9} {r['num_worlds']:>7} {r['episodes']:>9} "
                  f"{r['succeeded']:>9} {r['gaps']['count']:>5} {sum(r['rejected'].values()):>8} {mb:>9} "
                  f"{took:>9}")
        for d in damaged:
            print(f"{d['run']:<24} damaged: {d['error']}")
    return 3 if damaged else 0
