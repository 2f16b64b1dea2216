"""Fixtures of the storage tests (the simulation helper lives in ``storage_sim``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # make ``storage_sim`` importable
