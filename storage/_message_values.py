"""What the storage daemon reads out of a message before it takes it: the rejection it raises
(:class:`RejectedMessage`), a message's identity, its tensors as host numpy arrays, a field's
per-world spec, a run's declared fields and an episode end's outcomes. Every check here names
what it refused; :mod:`storage.assembly` decides what a rejection does to the run."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from broker import BFloat16Bits, EpisodeEnd, FieldSpec, RunEnd, RunStart
from broker.messages import RESERVED_OUTCOMES
from broker.schema import dtype_name, is_tensor

from ._format import to_json
from ._reading import _float32
from .errors import StorageError

__all__ = ["RejectedMessage", "as_numpy", "identity", "run_fields"]


class RejectedMessage(StorageError, ValueError):
    """A well-formed message the store cannot accept (out-of-range world, schema change).

    Attributes:
        reason: A short, stable code (``"worlds"``, ``"schema"``, ``"dtype"``, ``"replay"``,
            ``"conflict"``, ``"budget"``, ``"run"``, ...) the daemon counts rejections by.
        worlds: World indices whose current episode the message touched (they become
            incomplete), ``None`` when they cannot be trusted (then every world's is).
    """

    def __init__(self, reason: str, message: str, worlds: np.ndarray | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.worlds = worlds


def identity(message: Any, step: int) -> tuple[str, str, int, str | None]:
    """What tells two messages of a run apart when they carry one sequence number: their kind,
    topic, step and (batches) hook. A replay has all four of the message it repeats."""
    topic, hook = getattr(message, "topic", None), getattr(message, "hook", None)
    return (type(message).__name__, topic if isinstance(topic, str) else repr(topic)[:80], step,
            hook if isinstance(hook, str) else None)


def _describe(ident: tuple[str, str, int, str | None]) -> str:
    kind, topic, step, hook = ident
    return f"{kind} {topic!r:.80} at step {step}" + (f", {hook}" if hook else "")


def _spelled(what: str | tuple[str, str]) -> str:
    """What an error names: a string, or ``(topic, field name)`` spelled out (only when an
    error or a new spec needs it: not for every field of every message)."""
    return what if isinstance(what, str) else f"topic {what[0]!r} field {what[1]!r}"


def as_numpy(t: Any, what: str | tuple[str, str]) -> np.ndarray:
    """A host numpy view of a message tensor or array (bfloat16 as its 16 bits, see ``LAYOUT.md``);
    ``what`` names it in errors (see :func:`_spelled`).

    Raises:
        RejectedMessage: ``t`` is neither a torch tensor nor a numpy array.
    """
    if isinstance(t, np.ndarray):
        return t.view(np.ndarray) if isinstance(t, BFloat16Bits) else t
    if not is_tensor(t):
        raise RejectedMessage("type", f"{_spelled(what)}: expected a tensor, got {type(t).__name__}")
    import torch  # (imported already: t is a tensor)

    try:
        if t.device.type != "cpu":
            t = t.cpu()
        if t.requires_grad:  # (each torch call gives up the GIL: only when needed)
            t = t.detach()
        if t.dtype == torch.bfloat16:
            bits: np.ndarray = t.view(torch.int16).numpy().view(np.uint16)
            return bits
        values: np.ndarray = t.numpy()
        return values
    except TypeError as exc:  # a dtype numpy lacks (float8, complex32, ...)
        raise RejectedMessage("dtype", f"{_spelled(what)}: dtype {t.dtype} cannot be stored") from exc
    except (ValueError, RuntimeError) as exc:  # a shape numpy cannot address, a device gone
        raise RejectedMessage("shape", f"{_spelled(what)}: a tensor of shape {list(t.shape)} cannot be "
                                       f"read: {exc}") from exc


_SPECS: dict[tuple[Any, ...], FieldSpec] = {}
_SPECS_MAX = 4096  # specs of recently seen fields (a message's fields repeat from step to step)


def _spec_of(t: Any, values: np.ndarray, what: str | tuple[str, str], limit: int) -> FieldSpec:
    """The per-world spec of ``values``, whose one world's row (every dimension counted as at
    least 1, so no zero-size dimension hides a huge one) must fit in ``limit`` bytes; ``what``
    names the values in errors (see :func:`_spelled`).

    Raises:
        RejectedMessage: (``"shape"``) one world's row is larger than ``limit``.
    """
    # What the spec depends on (``t``'s own dtype: a torch bfloat16 tensor reads as 16-bit ints)
    key = (type(t), getattr(t, "dtype", None), values.dtype, values.shape[1:], limit)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _new_spec(t, values, _spelled(what), limit)
        if len(_SPECS) >= _SPECS_MAX:
            _SPECS.clear()
        _SPECS[key] = spec
    return spec


def _new_spec(t: Any, values: np.ndarray, what: str, limit: int) -> FieldSpec:
    """:func:`_spec_of`, computed."""
    dtype = "bfloat16" if dtype_name(t) == "bfloat16" else str(values.dtype)
    shape = tuple(int(d) for d in values.shape[1:])
    span = math.prod(max(d, 1) for d in shape) * values.dtype.itemsize
    if span > limit:
        raise RejectedMessage("shape", f"{what}: one world's row of shape {list(shape)} spans {span} "
                                       f"bytes, more than the run's share of the memory budget ({limit})")
    return FieldSpec(dtype, shape)


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` with mappings as dicts, tuples as lists and numpy scalars as Python ones."""
    if depth > 64:
        raise ValueError("nested deeper than 64")
    if isinstance(value, Mapping):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


def run_fields(msg: RunStart | RunEnd) -> dict[str, Any]:
    """The variation declarations, run seed and wall time of a ``RunStart`` or ``RunEnd``, as
    stored in the run's attributes: ``{"declarations": {key: declaration}, "seed": int | None,
    "started_at" | "ended_at": unix seconds}`` (a wall time of 0, "not given", is replaced by
    the daemon's clock). Declarations are stored as they came (JSON-safe, see
    :func:`storage._format.to_json`); the wire codec checks their structure.

    Raises:
        RejectedMessage: (``"variations"``) declarations that are not a mapping of non-empty
            str keys to str-keyed mappings JSON attributes can hold; (``"header"``) a seed that
            is not an int or ``None``, a wall time that is not a finite number >= 0.
    """
    kind = type(msg).__name__
    declarations = msg.variations
    try:
        if not isinstance(declarations, Mapping) or not all(
                isinstance(k, str) and k and isinstance(d, Mapping) and all(isinstance(n, str) for n in d)
                for k, d in declarations.items()):
            raise ValueError("expected a mapping of non-empty str keys to declarations (str-keyed "
                             "mappings)")
        stored = to_json(_plain(declarations))
        json.dumps(stored, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise RejectedMessage("variations", f"run {msg.run!r}: {kind} variations cannot be stored: "
                                            f"{exc}; got {declarations!r:.120}",
                              worlds=np.zeros(0, np.int64)) from None
    seed, wall = msg.seed, msg.wall_time
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int | np.integer)):
        raise RejectedMessage("header", f"run {msg.run!r}: {kind} seed must be an int or None, got "
                                        f"{seed!r:.80}", worlds=np.zeros(0, np.int64))
    if isinstance(wall, bool) or not isinstance(wall, int | float | np.integer | np.floating) or \
            not math.isfinite(wall) or wall < 0:
        raise RejectedMessage("header", f"run {msg.run!r}: {kind} wall_time must be a finite number "
                                        f">= 0, got {wall!r:.80}", worlds=np.zeros(0, np.int64))
    when = float(wall) if wall > 0 else time.time()
    return {"declarations": stored, "seed": None if seed is None else int(seed),
            ("started_at" if isinstance(msg, RunStart) else "ended_at"): when}


def _outcomes(msg: EpisodeEnd[Any], n: int) -> dict[str, np.ndarray]:
    """The episode outcomes of ``msg`` as float64 arrays of ``n`` values each.

    Raises:
        RejectedMessage: (``"outcomes"``) not a mapping of non-empty, unreserved str names to
            1-D bool, integer or float tensors (or numpy arrays) of ``n`` values.
    """
    outcomes = msg.outcomes
    if not isinstance(outcomes, Mapping):
        raise RejectedMessage("outcomes", f"episode/end outcomes: expected a mapping, got "
                                          f"{type(outcomes).__name__}")
    out: dict[str, np.ndarray] = {}
    for name, t in outcomes.items():
        if not isinstance(name, str) or not name or name in RESERVED_OUTCOMES:
            raise RejectedMessage("outcomes", f"episode/end outcome name {name!r:.80}: expected a "
                                              f"non-empty str not in {sorted(RESERVED_OUTCOMES)}")
        if isinstance(t, np.ndarray):
            out[name] = _numpy_outcome(name, t, n)
            continue
        if not is_tensor(t):
            raise RejectedMessage("outcomes", f"episode/end outcome {name!r}: expected a 1-D bool, "
                                              f"integer or float tensor of {n} values, got {type(t).__name__}")
        import torch  # (imported already: t is a tensor)

        if t.dim() != 1 or t.shape[0] != n or t.is_complex() or \
                not (t.dtype == torch.bool or t.dtype.is_floating_point or not t.dtype.is_signed or
                     t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64)):
            raise RejectedMessage("outcomes", f"episode/end outcome {name!r}: expected a 1-D bool, "
                                              f"integer or float tensor of {n} values, got {t.dtype} of "
                                              f"shape {tuple(t.shape)}")
        try:
            out[name] = t.detach().to("cpu", torch.float64).numpy()
        except (TypeError, RuntimeError) as exc:  # a dtype without a float64 cast (quantized...)
            raise RejectedMessage("outcomes", f"episode/end outcome {name!r}: {t.dtype} cannot be "
                                              f"stored as float64: {exc}") from exc
    return out


def _numpy_outcome(name: str, values: np.ndarray, n: int) -> np.ndarray:
    """A numpy outcome (bool, integer, float or :class:`broker.BFloat16Bits`) as float64.

    Raises:
        RejectedMessage: (``"outcomes"``) it is not 1-D of ``n`` values of such a dtype.
    """
    dtype = dtype_name(values)
    if values.ndim != 1 or values.shape[0] != n or not (dtype == "bfloat16" or values.dtype.kind in "biuf"):
        raise RejectedMessage("outcomes", f"episode/end outcome {name!r}: expected a 1-D bool, integer "
                                          f"or float array of {n} values, got {dtype} of shape {values.shape}")
    return (_float32(values) if dtype == "bfloat16" else values).astype(np.float64)
