"""Header checks and message assembly for the wire codec: decoded header values and tensors -> a
checked message.

Private to :mod:`broker.wire`. Every value read from a header is type-checked before it is used
(hashed, compared, multiplied, handed to torch or numpy), and every check raises
:class:`WireFormatError` with a stable reason, so a malformed message can never surface as a
``TypeError`` or ``OverflowError`` inside a receiver. Messages are assembled from torch tensors or
numpy arrays alike; nothing here imports torch before a torch dtype is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeVar, cast, get_args

import numpy as np

from .errors import WireFormatError
from .messages import (
    RESERVED_OUTCOMES,
    A,
    Batch,
    EpisodeEnd,
    FieldSpec,
    Hook,
    MessageOf,
    Phase,
    RunEnd,
    RunStart,
    VariationSample,
)
from .schema import Array, dtype_name

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "MAX_BYTES", "MAX_DIMS", "NUMPY_DTYPES", "LazyMapping", "assemble",
           "check_declaration", "fail", "is_count", "shape_error", "shown"]

K = TypeVar("K")
V = TypeVar("V")


class LazyMapping(Mapping[K, V]):
    """A read-only mapping that ``make`` builds on its first lookup (torch dtypes, so that torch
    is imported only when one is needed).

    Args:
        make: Builds the mapping.
        keys: Its keys, when known up front: membership, iteration and length then never build it.
    """

    def __init__(self, make: Callable[[], Mapping[K, V]], keys: Collection[K] | None = None) -> None:
        self._make = make
        self._keys = keys
        self._built: Mapping[K, V] | None = None

    def _mapping(self) -> Mapping[K, V]:
        if self._built is None:
            self._built = MappingProxyType(dict(self._make()))
        return self._built

    def __getitem__(self, key: K) -> V:
        return self._mapping()[key]

    def __contains__(self, key: object) -> bool:
        return key in (self._keys if self._keys is not None else self._mapping())

    def __iter__(self) -> Iterator[K]:
        return iter(self._keys if self._keys is not None else self._mapping())

    def __len__(self) -> int:
        return len(self._keys if self._keys is not None else self._mapping())

    def __repr__(self) -> str:
        return f"LazyMapping({dict(self._mapping())!r})"


NUMPY_DTYPES: Final[Mapping[str, np.dtype[Any]]] = MappingProxyType({
    name: np.dtype("uint16" if name == "bfloat16" else name)
    for name in ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
                 "float64")
})
"""The dtype whitelist: wire name -> the numpy dtype of its arrays (bfloat16, which numpy lacks:
its 16 bits, as ``uint16``)."""


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in NUMPY_DTYPES}


DTYPES: Final[Mapping[str, torch.dtype]] = LazyMapping(_torch_dtypes, NUMPY_DTYPES)
"""The dtype whitelist: wire name -> torch dtype (looking a dtype up imports torch)."""
MAX_DIMS: Final = 32
"""Most dimensions a shape may have (numpy's historical limit)."""
MAX_BYTES: Final = 1 << 62
"""Ceiling on the bytes a shape may span whatever ``max_message_size`` says, so that no size a
receiver derives from a decoded shape comes near int64 overflow."""

_HOOKS: Final = frozenset(get_args(Hook))
_KINDS: Final = ("uniform", "log_uniform", "normal", "choice", "design")
_NUMERIC_KEYS: Final = ("low", "high", "mean", "std", "weights")
_PHASES: Final = ("build", "runtime")
_MAX_DEPTH: Final = 32
_SHOWN: Final = 200


def fail(reason: str, text: str) -> WireFormatError:
    """The codec's error for ``reason`` (see ``broker.wire.REASONS``)."""
    return WireFormatError(reason, text)


def shown(value: object) -> str:
    """``repr(value)`` cut to a length fit for a log line (headers carry up to megabytes)."""
    text = repr(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


def is_count(value: object) -> bool:
    """Whether ``value`` is a non-negative int that fits msgpack's uint64 range and isn't a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def shape_error(shape: object, dtype: str, limit: int) -> str | None:
    """What is wrong with ``shape`` (a header value) for a tensor of whitelisted ``dtype``, or
    ``None`` when it is a list of at most :data:`MAX_DIMS` ints ``>= 0`` spanning at most ``limit``
    bytes *with every 0 counted as 1*: a zero-row tensor cannot declare dimensions that no
    non-empty tensor could carry, so every product of its dimensions stays below ``limit``."""
    if type(shape) is not list or len(shape) > MAX_DIMS:
        return f"invalid shape {shown(shape)}: expected a list of at most {MAX_DIMS} ints >= 0"
    size = NUMPY_DTYPES[dtype].itemsize
    for d in shape:
        if type(d) is not int or d < 0:  # type(), not isinstance(): True is not a dimension
            return f"invalid shape {shown(shape)}: expected a list of at most {MAX_DIMS} ints >= 0"
        size *= d or 1
        if size > limit:
            return (f"shape {shown(shape)} of {dtype} spans more than max_message_size={limit} bytes "
                    f"(each 0 counted as 1)")
    return None


def _check_metadata(topic: str, value: Any, depth: int = 0) -> None:
    if depth > _MAX_DEPTH:
        raise fail("header", f"topic {topic!r}: metadata nested deeper than {_MAX_DEPTH}")
    if isinstance(value, dict):
        for k, v in value.items():
            _check_metadata(topic, k, depth + 1)
            _check_metadata(topic, v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_metadata(topic, v, depth + 1)
    elif value is not None and not isinstance(value, bool | int | float | str | bytes):
        raise fail("header", f"topic {topic!r}: metadata value {shown(value)} of type "
                             f"{type(value).__name__} is not part of the protocol")


def _vector(topic: str, name: str, t: Array, dtype: str, n: int | None) -> None:
    if t.ndim != 1 or dtype_name(t) != dtype or (n is not None and t.shape[0] != n):
        want = f"({n},)" if n is not None else "(n,)"
        raise fail("schema", f"topic {topic!r} tensor {name!r}: expected {dtype} of shape "
                              f"{want}, got {dtype_name(t)} of shape {tuple(t.shape)}")


def _leading(topic: str, name: str, t: Array, n: int) -> None:
    if t.ndim == 0 or t.shape[0] != n:
        raise fail("schema", f"topic {topic!r} tensor {name!r}: expected a leading worlds dimension "
                              f"of {n}, got shape {tuple(t.shape)}")


def assemble(topic: str, kind: str, head: dict[str, Any], own: dict[str, A], fields: dict[str, A],
             limit: int) -> MessageOf[A]:
    """The message of ``kind`` from its checked header and tensors (torch tensors or numpy arrays,
    all of one kind), after checking how they fit.

    ``limit`` bounds the bytes of each run schema field's per-world shape (see
    :func:`shape_error`).
    """
    run, seq, step = head["run"], head["seq"], head["step"]
    if kind in ("run_start", "run_end"):
        return _build_run(topic, kind, head, limit)
    worlds = own["worlds"]
    _vector(topic, "worlds", worlds, "int64", None)
    n = int(worlds.shape[0])
    _vector(topic, "episodes", own["episodes"], "int64", n)
    if kind == "batch":
        hook = head.get("hook")
        if not isinstance(hook, str) or hook not in _HOOKS:
            raise fail("header", f"topic {topic!r}: unknown hook {shown(hook)}, expected one of {sorted(_HOOKS)}")
        for name, t in fields.items():
            _leading(topic, name, t, n)
        return Batch(run, seq, step, topic, worlds, own["episodes"], fields, cast(Hook, hook))
    if kind == "episode_end":
        for name in ("success", "terminated", "truncated"):
            _vector(topic, name, own[name], "bool", n)
        _vector(topic, "length", own["length"], "int64", n)
        for name, t in fields.items():
            if not name or t.ndim != 1 or t.shape[0] != n:
                raise fail("schema", f"topic {topic!r} outcome {shown(name)}: expected a non-empty name "
                                     f"and a tensor of shape ({n},), got shape {tuple(t.shape)}")
            if name in RESERVED_OUTCOMES:
                raise fail("schema", f"topic {topic!r} outcome {name!r}: the name of a column episode tables "
                                     f"hold already (reserved: {', '.join(sorted(RESERVED_OUTCOMES))})")
        return EpisodeEnd(run, seq, step, worlds, own["episodes"], own["success"], own["terminated"],
                          own["truncated"], own["length"], topic, outcomes=fields)
    key, phase = head.get("key"), head.get("phase")
    if not isinstance(key, str) or not isinstance(phase, str) or phase not in _PHASES:
        raise fail("header", f"topic {topic!r}: invalid variation key {shown(key)} or phase {shown(phase)}, "
                             f"expected a str and one of {list(_PHASES)}")
    labels = head.get("labels", ...)  # the encoder always writes the key: missing is malformed
    if labels is not None and not (isinstance(labels, list) and all(
            isinstance(x, str | int | float | bool) for x in labels)):
        raise fail("header", f"topic {topic!r}: header key 'labels' must be nil or a list of "
                             f"str/int/float/bool, got {'no such key' if labels is ... else shown(labels)}")
    _leading(topic, "value", own["value"], n)
    return VariationSample(run, seq, step, key, cast(Phase, phase), worlds, own["episodes"], own["value"],
                           None if labels is None else tuple(labels), topic)


def _build_run(topic: str, kind: str, head: dict[str, Any], limit: int) -> RunStart | RunEnd:
    num_worlds: Any = head.get("num_worlds")
    device, metadata = head.get("device"), head.get("metadata")
    if not is_count(num_worlds) or not isinstance(device, str):
        raise fail("header", f"topic {topic!r}: invalid num_worlds {shown(num_worlds)} or device "
                             f"{shown(device)}, expected an int >= 0 and a str")
    if not isinstance(metadata, dict):
        raise fail("header", f"topic {topic!r}: metadata must be a map, got {shown(metadata)}")
    _check_metadata(topic, metadata)
    specs = _schema(topic, head.get("schema"), limit)
    variations = head.get("variations", ...)
    if not isinstance(variations, dict):
        raise fail("header", f"topic {topic!r}: header key 'variations' must map variation keys to "
                             f"declarations, got {'no such key' if variations is ... else shown(variations)}")
    for key, decl in variations.items():
        problem = check_declaration(key, decl)
        if problem is not None:
            raise fail("header", f"topic {topic!r}: variation {shown(key)}: {problem}")
    seed, wall_time = head.get("seed", ...), head.get("wall_time", ...)
    if seed is not None and (type(seed) is not int or not -(1 << 63) <= seed < 1 << 64):
        raise fail("header", f"topic {topic!r}: header key 'seed' must be nil or an int, got "
                             f"{'no such key' if seed is ... else shown(seed)}")
    if type(wall_time) is not float or not math.isfinite(wall_time) or wall_time < 0:
        raise fail("header", f"topic {topic!r}: header key 'wall_time' must be a finite float of "
                             f"seconds >= 0, got {'no such key' if wall_time is ... else shown(wall_time)}")
    if kind == "run_start":
        return RunStart(head["run"], head["seq"], head["step"], num_worlds, device, specs, metadata, topic,
                        variations=variations, seed=seed, wall_time=wall_time)
    interrupted = head.get("interrupted", ...)
    if type(interrupted) is not bool:
        raise fail("header", f"topic {topic!r}: header key 'interrupted' must be a bool, got "
                             f"{'no such key' if interrupted is ... else shown(interrupted)}")
    return RunEnd(head["run"], head["seq"], head["step"], num_worlds, device, specs, metadata, topic,
                  variations=variations, seed=seed, wall_time=wall_time, interrupted=interrupted)


def _numbers(value: object, depth: int = 0) -> bool:
    """Whether ``value`` is a number (int or float, not bool) or a nested list of them."""
    if isinstance(value, list):
        return depth < MAX_DIMS and all(_numbers(v, depth + 1) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_declaration(key: object, decl: object) -> str | None:
    """What is wrong with a variation declaration (see ``broker.messages.RunStart``), or ``None``.

    A declaration is a map with str keys holding ``kind`` (one of ``uniform``, ``log_uniform``,
    ``normal``, ``choice``, ``design``), ``phase`` (``build`` or ``runtime``), ``shape`` (a list
    of at most :data:`MAX_DIMS` ints >= 0) and ``seed`` (an int); ``low``, ``high``, ``mean``,
    ``std`` and ``weights``, where present, are nil, a number or a (nested) list of numbers;
    ``labels``, where present, a list of str/int/float/bool; any other key a plain msgpack value
    (nil, bool, int, float, str, bytes, lists and str-keyed maps of them).
    """
    if not isinstance(key, str) or not key:
        return f"expected a non-empty str key, got {shown(key)}"
    if not isinstance(decl, dict) or not all(isinstance(k, str) for k in decl):
        return f"expected a declaration map with str keys, got {shown(decl)}"
    kind, phase, shape, seed = (decl.get(k, ...) for k in ("kind", "phase", "shape", "seed"))
    if not isinstance(kind, str) or kind not in _KINDS:
        return f"declaration 'kind' must be one of {list(_KINDS)}, got {shown(kind)}"
    if not isinstance(phase, str) or phase not in _PHASES:
        return f"declaration 'phase' must be one of {list(_PHASES)}, got {shown(phase)}"
    if type(shape) is not list or len(shape) > MAX_DIMS or not all(type(d) is int and 0 <= d < 1 << 63
                                                                  for d in shape):
        return f"declaration 'shape' must be a list of at most {MAX_DIMS} ints >= 0, got {shown(shape)}"
    if type(seed) is not int:
        return f"declaration 'seed' must be an int, got {shown(seed)}"
    for name in _NUMERIC_KEYS:
        value = decl.get(name)
        if value is not None and not _numbers(value):
            return f"declaration {name!r} must be nil, a number or a list of numbers, got {shown(value)}"
    labels = decl.get("labels")
    if labels is not None and not (isinstance(labels, list) and all(
            isinstance(x, str | int | float | bool) for x in labels)):
        return f"declaration 'labels' must be a list of str/int/float/bool, got {shown(labels)}"
    try:
        _check_metadata("", decl)
    except WireFormatError:
        return f"declaration holds a value that is not part of the protocol: {shown(decl)}"
    return None


def _schema(topic: str, schema: object, limit: int) -> dict[str, dict[str, FieldSpec]]:
    """The run schema from its header value, checked down to every field's dtype and shape."""
    if not isinstance(schema, dict):
        raise fail("header", f"topic {topic!r}: schema must be a map of topic -> field -> spec, got "
                             f"{shown(schema)}")
    out: dict[str, dict[str, FieldSpec]] = {}
    for term, fields in schema.items():
        if not isinstance(term, str) or not isinstance(fields, dict):
            raise fail("header", f"topic {topic!r}: schema entry {shown(term)} must map a topic name to a "
                                 f"map of fields, got {shown(fields)}")
        specs: dict[str, FieldSpec] = {}
        for name, spec in fields.items():
            where = f"topic {topic!r}: schema of {term!r} field {shown(name)}"
            if not isinstance(name, str) or not isinstance(spec, dict) or spec.keys() != {"dtype", "shape"}:
                raise fail("header", f"{where}: expected a str name and a map with exactly 'dtype' and "
                                     f"'shape', got {shown(spec)}")
            dtype, shape = spec["dtype"], spec["shape"]
            if not isinstance(dtype, str) or dtype not in DTYPES:
                raise fail("dtype", f"{where}: dtype {shown(dtype)} is not on the whitelist {sorted(DTYPES)}")
            problem = shape_error(shape, dtype, limit)
            if problem is not None:
                raise fail("shape", f"{where}: {problem}")
            try:  # the checks above are the codec's; whatever FieldSpec adds must not escape either
                specs[name] = FieldSpec(dtype, tuple(shape))
            except (TypeError, ValueError) as exc:
                raise fail("schema", f"{where}: {exc}") from exc
        out[term] = specs
    return out
