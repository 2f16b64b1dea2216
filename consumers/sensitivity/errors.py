"""The sensitivity package's error vocabulary (leaves of :class:`consumers.ConsumersError`)."""

from __future__ import annotations

from ..errors import ConsumersError

__all__ = ["MissingDependencyError", "SensitivityError"]


class SensitivityError(ConsumersError, ValueError):
    """The analysis cannot run on its input: no rows, no factor, an unknown output or method."""


class MissingDependencyError(SensitivityError, ImportError):
    """An optional package the analysis needs (SALib, matplotlib, rich) is not installed; the
    message names it and the extra that installs it."""
