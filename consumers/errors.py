"""The consumers package's error vocabulary."""

from __future__ import annotations

__all__ = ["ConsumersError", "RetentionError", "SampleTableError"]


class ConsumersError(Exception):
    """Root of every error raised by the consumers package."""


class RetentionError(ConsumersError, ValueError):
    """A batch does not fit the retention buffers (unknown worlds, changed schema, ...)."""


class SampleTableError(ConsumersError, ValueError):
    """A variation sample does not fit the table (value/worlds mismatch, changed shape, ...)."""
