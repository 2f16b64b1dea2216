"""``worldtap-keys``: generate a CURVE key pair for a publisher or a subscriber.

Usage::

    worldtap-keys DIR [--name NAME] [--force]

writes ``DIR/NAME.key`` (public: give it to the other side; a publisher's allow-list is a
folder of its clients' ``.key`` files) and ``DIR/NAME.key_secret`` (secret, mode 0600: keep it
on this host). Prints both paths and the public key. Exit status 0 on success, 1 when a file
exists (without ``--force``) or cannot be written, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .errors import SecurityError
from .security import load_public_key, write_keypair

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worldtap-keys",
        description="Generate a ZeroMQ CURVE key pair (NAME.key public, NAME.key_secret secret).")
    parser.add_argument("directory", help="folder to write the key files into (created if missing)")
    parser.add_argument("--name", default="worldtap", help="base name of the key files (default: worldtap)")
    parser.add_argument("--force", action="store_true", help="overwrite existing key files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``worldtap-keys``; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        public, secret = write_keypair(args.directory, args.name, overwrite=args.force)
        key = load_public_key(public).decode("ascii")
    except (FileExistsError, SecurityError, OSError) as exc:
        print(f"worldtap-keys: error: {exc}", file=sys.stderr)
        return 1
    print(f"public key file: {public}")
    print(f"secret key file: {secret}")
    print(f"public key: {key}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
