"""``worldtap-store repair``: cut damaged runs of a store back to their longest verified prefix
of episodes (see :mod:`storage.verify`, which does the work)."""

from __future__ import annotations

import argparse

from .verify import DAMAGED, fail, repair_store

HELP = "cut damaged runs back to their longest verified prefix of episodes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worldtap-store repair``."""
    parser.add_argument("store", help="local directory or zarr/fsspec URL of a run store")
    parser.add_argument("--run", action="append", default=None, metavar="RUN",
                        help="a run to repair (repeatable; default: every damaged run)")
    parser.add_argument("--dry-run", action="store_true", help="say what would be cut; write nothing")


def run(args: argparse.Namespace) -> int:
    """``worldtap-store repair``: 0 repaired (or nothing to do), 7 a run that could not be
    repaired (or, with ``--dry-run``, damage found), 2 an unknown run, 3 a store that is
    locked, is not a run store or cannot be written."""
    from .errors import RunNotFoundError, StorageError

    try:
        report, repairs = repair_store(args.store, args.run, dry_run=args.dry_run)
    except RunNotFoundError as exc:
        return fail("repair", 2, exc)
    except (StorageError, OSError) as exc:
        return fail("repair", 3, exc)
    for done in repairs:
        print(done)
    left = [r for r in report.runs if not r.repairable]
    for r in left:
        print(f"run {r.run!r}: cannot be repaired, its attributes (the index) are unreadable: "
              f"{r.problems[0].what}")
    if not repairs and not left:
        print("nothing to repair: every run verified")
    return DAMAGED if left or (args.dry_run and repairs) else 0

