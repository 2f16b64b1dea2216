"""``python -m storage``: the storage daemon (same as ``worldtap-store``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
