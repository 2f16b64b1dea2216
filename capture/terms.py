"""Recorder terms: objects with optional lifecycle hooks that return batched tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

from .errors import TermError

__all__ = ["FieldTree", "FunctionTerm", "Term", "flatten_fields"]

FieldTree: TypeAlias = Mapping[str, "torch.Tensor | FieldTree"]
"""A mapping of field names to tensors, possibly nested (flattened with "/")."""

HOOKS = ("pre_step", "post_step", "pre_reset", "post_reset")


@runtime_checkable
class Term(Protocol):
    """A recorder term. Each hook is optional; define only those you need.

    - ``pre_step()`` / ``post_step()``: fields for every world (first dimension ``num_worlds``).
    - ``pre_reset(worlds)``: final fields of the worlds about to reset (first dimension
      ``len(worlds)``), recorded into the episode that is ending.
    - ``post_reset(worlds)``: initial fields of the reset worlds, recorded into their new episode.

    Each hook returns a mapping of name -> tensor (nested mappings are flattened with "/"), or
    ``None`` to record nothing this time. Every hook of one term publishes on the term's one
    topic, so they must return the same fields (one schema per topic); record different things
    at different points with different terms. The returned tensors are borrowed: the recorder does
    not copy them, and consumers copy what they keep.
    """


class FunctionTerm:
    """A term built from plain callables, e.g. ``FunctionTerm(post_step=lambda: {"obs": obs})``."""

    def __init__(
        self,
        *,
        pre_step: Callable[[], FieldTree | None] | None = None,
        post_step: Callable[[], FieldTree | None] | None = None,
        pre_reset: Callable[[torch.Tensor], FieldTree | None] | None = None,
        post_reset: Callable[[torch.Tensor], FieldTree | None] | None = None,
    ) -> None:
        hooks = {"pre_step": pre_step, "post_step": post_step, "pre_reset": pre_reset,
                 "post_reset": post_reset}
        for hook, fn in hooks.items():
            if fn is not None:
                if not callable(fn):
                    raise TypeError(f"{hook}: expected a callable, got {fn!r}")
                setattr(self, hook, fn)
        if all(fn is None for fn in hooks.values()):
            raise ValueError("FunctionTerm: expected at least one of " + ", ".join(HOOKS))


def flatten_fields(tree: Any, term: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a (nested) mapping of tensors into ``{"a/b": tensor}``.

    Raises:
        TermError: ``tree`` is not a mapping, a key is not a non-empty str without "/" at
            the ends, a leaf is not a tensor, or two leaves flatten to the same name.
    """
    if not isinstance(tree, Mapping):
        raise TermError(f"term {term!r}: expected a mapping of field name to tensor, got {type(tree).__name__}")
    out: dict[str, torch.Tensor] = {}
    for key, value in tree.items():
        if not isinstance(key, str) or not key or key.startswith("/") or key.endswith("/"):
            raise TermError(f"term {term!r}: field names must be non-empty strings, got {key!r}")
        name = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            _put(out, term, name, value)
        elif isinstance(value, Mapping):
            for leaf, tensor in flatten_fields(value, term, f"{name}/").items():
                _put(out, term, leaf, tensor)
        else:
            raise TermError(f"term {term!r}: field {name!r}: expected a tensor, got {type(value).__name__}")
    return out


def _put(out: dict[str, torch.Tensor], term: str, name: str, tensor: torch.Tensor) -> None:
    if name in out:
        # {"a/b": x, "a": {"b": y}}: one of the two would silently replace the other.
        raise TermError(f"term {term!r}: field {name!r}: named twice (a key with \"/\" and a nested "
                        "mapping flatten to the same name)")
    out[name] = tensor
