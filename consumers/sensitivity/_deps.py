"""Lazy imports of the optional analysis packages (``consumers`` imports without them)."""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

__all__ = ["require"]

_PACKAGES = {"SALib": "SALib", "matplotlib": "matplotlib", "rich": "rich"}


def require(module: str) -> ModuleType:
    """Import ``module`` (e.g. ``"SALib.analyze.pawn"``) or raise one clear error.

    Raises:
        MissingDependencyError: Its package is not installed; the message says
            ``pip install worldtap[analysis]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        package = _PACKAGES.get(module.split(".")[0], module.split(".")[0])
        raise MissingDependencyError(
            f"the sensitivity analysis needs {package} ({module} failed to import: {exc}); "
            f"install it with: pip install worldtap[analysis]"
        ) from exc
