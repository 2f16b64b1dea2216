"""Recorder terms: objects with optional lifecycle hooks that return batched tensors.

Two protocols are accepted: worldtap's (hooks named after the lifecycle points, returning a
mapping of fields) and Isaac Lab's recorder terms (hooks named ``record_<point>``, returning a
``(key, value)`` pair), so Isaac Lab's terms are reused unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, TypeAlias, get_args, runtime_checkable

import torch

from broker.messages import Hook

from .errors import TermError

__all__ = ["FieldTree", "FunctionTerm", "Term", "flatten_fields"]

FieldTree: TypeAlias = Mapping[str, "torch.Tensor | FieldTree"]
"""A mapping of field names to tensors, possibly nested (flattened with "/")."""

HOOKS: Final[tuple[Hook, ...]] = get_args(Hook)
"""Every lifecycle point: ``pre_step``, ``post_step``, ``pre_reset``, ``post_reset``,
``post_physics_decimation_step``."""
ISAACLAB_PREFIX: Final = "record_"
"""Isaac Lab's name of the hook of point ``p`` is ``record_<p>``."""


@runtime_checkable
class Term(Protocol):
    """A recorder term. Each hook is optional; define only those you need.

    - ``pre_step()`` / ``post_step()``: fields for every world (first dimension ``num_worlds``).
    - ``post_physics_decimation_step()``: fields for every world after each physics step of an
      environment step (Isaac Lab's decimation loop; several rows per step).
    - ``pre_reset(worlds)``: final fields of the worlds about to reset (first dimension
      ``len(worlds)``), recorded into the episode that is ending.
    - ``post_reset(worlds)``: initial fields of the reset worlds, recorded into their new episode.

    Each hook returns a mapping of name -> tensor (nested mappings are flattened with "/"), or
    ``None`` to record nothing this time. Every hook of one term publishes on the term's one
    topic, so they must return the same fields (one schema per topic); record different things
    at different points with different terms. The returned tensors are borrowed: the recorder does
    not copy them, and consumers copy what they keep.

    Isaac Lab's recorder terms are accepted as they are: hooks ``record_pre_step()``,
    ``record_post_step()``, ``record_post_physics_decimation_step()``,
    ``record_pre_reset(env_ids)``, ``record_post_reset(env_ids)`` (``env_ids`` a list of ints,
    as Isaac Lab's manager passes them), each returning ``(key, value)``: ``value`` a tensor or
    a nested dict of tensors, ``key`` a name that may hold "/" (``"obs/joint_pos"``), or
    ``(None, None)`` to record nothing. The value's fields are named as Isaac Lab's episode data
    names them (``key``, or ``key/sub/...`` for a nested dict), and each hook of such a term
    publishes on a topic of its own, ``batch/<term>/<point>`` (one schema per topic, whatever
    keys the other hooks return). Row ``i`` belongs to the ``i``-th world of the call (extra
    rows are ignored, as Isaac Lab's manager ignores them).
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
        post_physics_decimation_step: Callable[[], FieldTree | None] | None = None,
    ) -> None:
        hooks = {"pre_step": pre_step, "post_step": post_step, "pre_reset": pre_reset,
                 "post_reset": post_reset, "post_physics_decimation_step": post_physics_decimation_step}
        for hook, fn in hooks.items():
            if fn is not None:
                if not callable(fn):
                    raise TypeError(f"{hook}: expected a callable, got {fn!r}")
                setattr(self, hook, fn)
        if all(fn is None for fn in hooks.values()):
            raise ValueError("FunctionTerm: expected at least one of " + ", ".join(HOOKS))


def pair_fields(out: object, term: str, hook: Hook) -> dict[str, torch.Tensor] | None:
    """The fields of an Isaac Lab term's ``(key, value)`` result, named as Isaac Lab's episode
    data names them (``key``, or ``key/sub/...`` for a nested dict); ``None`` when ``key`` is
    ``None`` (Isaac Lab's manager records nothing then).

    Raises:
        TermError: ``out`` is not a ``(key, value)`` pair, ``key`` is not a str, ``value`` is
            ``None`` under a key, or the value is not a tensor or a nested dict of tensors.
    """
    where = f"{ISAACLAB_PREFIX}{hook}()"
    if not isinstance(out, tuple | list) or len(out) != 2:
        raise TermError(f"term {term!r}: {where} must return a (key, value) pair, got {out!r:.200}")
    key, value = out
    if key is None:
        return None
    if not isinstance(key, str):
        raise TermError(f"term {term!r}: {where} returned the key {key!r}, expected a str or None")
    if value is None:
        raise TermError(f"term {term!r}: {where} returned the key {key!r} with the value None")
    return flatten_fields({key: value}, term)


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
