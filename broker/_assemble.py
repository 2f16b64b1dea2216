"""Message assembly for the wire codec: decoded header values and tensors -> a checked message.

Private to :mod:`broker.wire`. Every check raises :class:`WireFormatError` with a stable reason.
"""

from __future__ import annotations

from typing import Any, Final

import torch

from .errors import WireFormatError
from .messages import Batch, EpisodeEnd, FieldSpec, Message, RunEnd, RunStart, VariationSample

__all__ = ["assemble", "fail", "is_count"]

_HOOKS: Final = frozenset({"pre_step", "post_step", "pre_reset", "post_reset"})
_MAX_DEPTH: Final = 32


def fail(reason: str, text: str) -> WireFormatError:
    """The codec's error for ``reason`` (see ``broker.wire.REASONS``)."""
    return WireFormatError(reason, text)


def is_count(value: object) -> bool:
    """Whether ``value`` is a non-negative int that fits msgpack's uint64 range and isn't a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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
        raise fail("header", f"topic {topic!r}: metadata value of type {type(value).__name__} is "
                              f"not part of the protocol")


def _vector(topic: str, name: str, t: torch.Tensor, dtype: torch.dtype, n: int | None) -> None:
    if t.dtype != dtype or t.dim() != 1 or (n is not None and t.shape[0] != n):
        want = f"({n},)" if n is not None else "(n,)"
        raise fail("schema", f"topic {topic!r} tensor {name!r}: expected {_name(dtype)} of shape "
                              f"{want}, got {_name(t.dtype)} of shape {tuple(t.shape)}")


def _leading(topic: str, name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() == 0 or t.shape[0] != n:
        raise fail("schema", f"topic {topic!r} tensor {name!r}: expected a leading worlds dimension "
                              f"of {n}, got shape {tuple(t.shape)}")


def assemble(topic: str, kind: str, head: dict[str, Any], own: dict[str, torch.Tensor],
             fields: dict[str, torch.Tensor]) -> Message:
    """The message of ``kind`` from its checked header and tensors, after checking how they fit."""
    run, seq, step = head["run"], head["seq"], head["step"]
    if kind in ("run_start", "run_end"):
        return _build_run(topic, kind, head)
    worlds = own["worlds"]
    _vector(topic, "worlds", worlds, torch.int64, None)
    n = worlds.shape[0]
    _vector(topic, "episodes", own["episodes"], torch.int64, n)
    if kind == "batch":
        hook = head.get("hook")
        if hook not in _HOOKS:
            raise fail("header", f"topic {topic!r}: unknown hook {hook!r}, expected one of {sorted(_HOOKS)}")
        for name, t in fields.items():
            _leading(topic, name, t, n)
        return Batch(run, seq, step, topic, worlds, own["episodes"], fields, hook)
    if kind == "episode_end":
        for name in ("success", "terminated", "truncated"):
            _vector(topic, name, own[name], torch.bool, n)
        _vector(topic, "length", own["length"], torch.int64, n)
        return EpisodeEnd(run, seq, step, worlds, own["episodes"], own["success"], own["terminated"],
                          own["truncated"], own["length"], topic)
    key, phase, labels = head.get("key"), head.get("phase"), head.get("labels")
    if not isinstance(key, str) or phase not in ("build", "runtime"):
        raise fail("header", f"topic {topic!r}: invalid variation key {key!r} or phase {phase!r}")
    if labels is not None and not (isinstance(labels, list) and all(
            isinstance(x, str | int | float | bool) for x in labels)):
        raise fail("header", f"topic {topic!r}: labels must be a list of str/int/float/bool, got {labels!r}")
    _leading(topic, "value", own["value"], n)
    return VariationSample(run, seq, step, key, phase, worlds, own["episodes"], own["value"],
                           None if labels is None else tuple(labels), topic)


def _build_run(topic: str, kind: str, head: dict[str, Any]) -> Message:
    num_worlds: Any = head.get("num_worlds")
    device, schema, metadata = head.get("device"), head.get("schema"), head.get("metadata")
    if not is_count(num_worlds) or not isinstance(device, str):
        raise fail("header", f"topic {topic!r}: invalid num_worlds {num_worlds!r} or device {device!r}")
    if not isinstance(metadata, dict):
        raise fail("header", f"topic {topic!r}: metadata must be a map, got {metadata!r}")
    _check_metadata(topic, metadata)
    if not isinstance(schema, dict):
        raise fail("header", f"topic {topic!r}: schema must be a map, got {schema!r}")
    try:
        specs = {str(t): {str(f): FieldSpec.from_dict(s) for f, s in fs.items()} for t, fs in schema.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise fail("header", f"topic {topic!r}: invalid schema {schema!r}") from exc
    cls = RunStart if kind == "run_start" else RunEnd
    return cls(head["run"], head["seq"], head["step"], num_worlds, device, specs, metadata, topic)
