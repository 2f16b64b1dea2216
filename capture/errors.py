"""The capture package's error vocabulary."""

from __future__ import annotations

import broker

__all__ = [
    "CaptureError",
    "RecorderClosedError",
    "SchemaError",
    "SelectorError",
    "TermError",
    "VariationError",
]


class CaptureError(Exception):
    """Root of every error raised by the capture package."""


class SelectorError(CaptureError, ValueError):
    """A world selector was out of range, duplicated, of the wrong dtype or length."""


class SchemaError(CaptureError, broker.SchemaError):
    """A batch's fields differ from the schema its topic established with its first batch.

    Also a :class:`broker.SchemaError` (and so a ``ValueError``): ``except broker.SchemaError``
    catches the recorder's schema errors as well as retention's and the daemon's."""


class TermError(CaptureError, ValueError):
    """A recorder term returned something that is not a mapping of batched tensors."""


class RecorderClosedError(CaptureError, RuntimeError):
    """The recorder was closed and records nothing more."""


class VariationError(CaptureError, ValueError):
    """A variation's configuration or one of its draws was invalid (bad bounds, choices,
    labels or design, a duplicate key, a draw whose size does not match its worlds, a late
    build draw, a runtime draw in the middle of an episode, an exhausted design, a re-seed
    after draws)."""
