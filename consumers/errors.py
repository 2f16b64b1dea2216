"""The consumers package's error vocabulary."""

from __future__ import annotations

__all__ = ["ConsumersError", "RetentionError"]


class ConsumersError(Exception):
    """Root of every error raised by the consumers package."""


class RetentionError(ConsumersError, ValueError):
    """A batch does not fit the retention buffers (unknown worlds, changed schema, ...)."""
