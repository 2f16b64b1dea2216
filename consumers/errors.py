"""The consumers package's error vocabulary."""

from __future__ import annotations

import broker

__all__ = ["ConsumersError", "RetentionError", "RetentionSchemaError", "SampleTableError"]


class ConsumersError(Exception):
    """Root of every error raised by the consumers package."""


class RetentionError(ConsumersError, ValueError):
    """A batch does not fit the retention buffers (unknown worlds, changed schema, ...) or a
    request names an unknown world or term."""


class RetentionSchemaError(RetentionError, broker.SchemaError):
    """A batch's fields differ from the schema its topic's buffers were allocated for (checked
    by name: a missing or extra field, another dtype, per-world shape or leading dimension).

    Also a :class:`broker.SchemaError`, so ``except broker.SchemaError`` catches it."""


class SampleTableError(ConsumersError, ValueError):
    """A variation sample does not fit the table (value/worlds mismatch, changed shape, ...)."""
