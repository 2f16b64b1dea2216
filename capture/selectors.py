"""World selectors: every accepted way of naming a set of worlds, normalized once.

Accepted forms: ``None`` (all worlds), an int, a sequence (list or tuple) of ints, ``range``,
``slice``, a 1-D integer tensor or numpy array, a 1-D boolean mask of length ``num_worlds``.
Everything becomes a 1-D int64 index tensor on the recorder's device, in the order given.
Anything else (an index out of ``[0, num_worlds)``, a duplicate, a non-integer dtype, a mask
of another length, a slice with a zero step or non-int bounds) raises :class:`SelectorError`
(a ``ValueError``) naming the argument, what was expected and what was received.
"""

from __future__ import annotations

import itertools
import numbers
from collections import Counter
from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import torch

from .errors import SelectorError

__all__ = ["WorldSelector", "normalize_worlds"]

WorldSelector: TypeAlias = (
    int | Sequence[int] | range | slice | torch.Tensor | np.ndarray | None
)


def _describe(values: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(v) for v in values[:limit])
    return f"[{shown}{', ...' if len(values) > limit else ''}]"


def _check_indices(index: list[int], num_worlds: int, name: str) -> None:
    bad = [i for i in index if i < 0 or i >= num_worlds]
    if bad:
        raise SelectorError(
            f"{name}: expected world indices in [0, {num_worlds}), got {_describe(bad)} "
            f"out of range"
        )
    if len(set(index)) != len(index):
        dups = sorted(i for i, count in Counter(index).items() if count > 1)
        raise SelectorError(f"{name}: expected distinct world indices, got duplicates {_describe(dups)}")


def _check_range(rng: range, num_worlds: int, name: str) -> None:
    """Check a range's bounds without materializing it (``range(10**12)`` is one argument)."""
    if not rng or (min(rng[0], rng[-1]) >= 0 and max(rng[0], rng[-1]) < num_worlds):
        return
    # A range is monotonic: its out-of-range values are a prefix and/or a suffix, so the first
    # few of them are found within num_worlds + 9 steps.
    bad = list(itertools.islice((i for i in rng if i < 0 or i >= num_worlds), 9))
    raise SelectorError(f"{name}: expected world indices in [0, {num_worlds}), got {_describe(bad)} out of range")


def normalize_worlds(
    selector: WorldSelector,
    num_worlds: int,
    device: torch.device | str = "cpu",
    *,
    name: str = "worlds",
    all_worlds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Normalize ``selector`` into a 1-D int64 index tensor on ``device``.

    Args:
        selector: One of the accepted forms (module docstring).
        num_worlds: Number of worlds; indices must lie in ``[0, num_worlds)``.
        device: Device of the returned tensor.
        name: The argument's name, used in error messages.
        all_worlds: Cached ``arange(num_worlds)`` to return for ``None``.

    Returns:
        The index tensor; empty when the selection is empty.

    Raises:
        SelectorError: (a ``ValueError``) out of range, duplicates, wrong dtype, wrong mask
            length, or a form that is not accepted; the message names ``name``.
    """
    device = torch.device(device)
    if selector is None:
        if all_worlds is not None:
            return all_worlds
        return torch.arange(num_worlds, device=device, dtype=torch.int64)
    if isinstance(selector, bool | np.bool_):
        raise SelectorError(f"{name}: expected world indices or a boolean mask, got the bool {selector!r}")
    if isinstance(selector, numbers.Integral):
        value = int(selector)
        _check_indices([value], num_worlds, name)
        return torch.tensor([value], device=device, dtype=torch.int64)
    if isinstance(selector, slice):
        try:
            selector = range(*selector.indices(num_worlds))
        except (TypeError, ValueError):
            raise SelectorError(
                f"{name}: expected a slice of int bounds and a non-zero int step, got {selector!r}"
            ) from None
    if isinstance(selector, range):
        _check_range(selector, num_worlds, name)
        return torch.tensor(selector, device=device, dtype=torch.int64)
    if isinstance(selector, np.ndarray):
        if selector.dtype.kind not in "biu":
            raise SelectorError(f"{name}: expected an integer or bool array, got dtype {selector.dtype}")
        # Native byte order (torch refuses the other one), contiguous (torch needs strides >= 0).
        selector = torch.from_numpy(np.ascontiguousarray(selector, dtype=selector.dtype.newbyteorder("=")))
    if isinstance(selector, torch.Tensor):
        return _normalize_tensor(selector, num_worlds, device, name)
    if isinstance(selector, Sequence) and not isinstance(selector, str | bytes):
        items = list(selector)
        wrong = [v for v in items if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral)]
        if wrong:
            raise SelectorError(
                f"{name}: expected a sequence of int world indices, got element {wrong[0]!r} "
                f"of type {type(wrong[0]).__name__}"
            )
        index = [int(v) for v in items]
        _check_indices(index, num_worlds, name)
        return torch.tensor(index, device=device, dtype=torch.int64)
    raise SelectorError(
        f"{name}: expected None, an int, a sequence of ints, a range, a slice, an integer tensor "
        f"or a boolean mask, got {type(selector).__name__} {selector!r}"
    )


def _normalize_tensor(t: torch.Tensor, num_worlds: int, device: torch.device, name: str) -> torch.Tensor:
    if t.dtype == torch.bool:
        if t.dim() != 1 or t.shape[0] != num_worlds:
            raise SelectorError(
                f"{name}: expected a boolean mask of shape ({num_worlds},), got shape {tuple(t.shape)}"
            )
        return t.to(device).nonzero().flatten()
    if t.is_floating_point() or t.is_complex():
        raise SelectorError(f"{name}: expected an integer or bool tensor, got dtype {t.dtype}")
    if t.dim() == 0:
        t = t.reshape(1)
    if t.dim() != 1:
        raise SelectorError(f"{name}: expected a 1-D index tensor, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        return torch.empty(0, device=device, dtype=torch.int64)
    # One host read of the index to validate it; selectors are named at resets, not per step.
    _check_indices(t.tolist(), num_worlds, name)
    return t.to(device=device, dtype=torch.int64)
