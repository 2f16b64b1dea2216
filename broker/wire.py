"""The wire codec: every message kind to and from a ZeroMQ multipart ``[topic, header, frames...]``.

Layout (protocol version 1):

- ``topic``: the message's topic, UTF-8 (``batch/<term>``, ``episode/end``, ``variation/<key>``,
  ``run/start``, ``run/end``). Subscribers filter on its prefix inside ZeroMQ.
- ``header``: one msgpack map (no ext types, no pickle) with, in this order, ``v`` (protocol
  version), ``kind``, ``run``, ``seq``, ``step``, ``pub`` (publisher id), ``n`` (wire number of the
  message within its ``(pub, run, topic)`` stream), ``tensors`` (the message's own tensors as
  ``[name, dtype, shape, frame index]``), then the kind's own keys (``fields`` for batches, in
  the same four-item form; ``outcomes`` for episode ends, in that form too: each outcome's
  tensor follows the six flag and count tensors; ``key``/``phase``/``labels`` for variations;
  ``num_worlds``/``device``/``schema``/``metadata``/``variations``/``seed``/``wall_time`` for run
  messages, plus ``interrupted`` and ``streams`` on ``run/end``). Every key of a kind is always written: a missing
  one is malformed, never read as a default.
- ``frame_i``: raw little-endian bytes of tensor ``i`` (C order; ``bfloat16`` as its raw 16 bits,
  ``bool`` as one byte 0 or 1).

Decoding validates everything and raises :class:`WireFormatError` with a stable ``reason``, and
nothing else, for any received bytes: every header value is type-checked before it is used, and
every shape (tensor or run-schema field) is bounded before anything is allocated, with a zero
dimension counted as 1, so no size computed from a decoded shape can overflow. A decoded message
keeps the structural contract of :mod:`broker.messages` (1-D int64 ``worlds`` and ``episodes`` of
one length, that length leading every other tensor, bool tensors holding only 0 and 1, ...);
its *values* (world indices, episode numbers) are for the receiver to check against its run.
Decoded tensors are CPU tensors built over the received frames without a copy (a read-only
buffer such as ``bytes`` is copied once, because torch tensors must be writable); they belong to
the receiver.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final

import msgpack
import numpy as np
import torch

from ._assemble import DTYPES, MAX_BYTES, MAX_DIMS, assemble, shape_error, shown
from ._assemble import fail as _fail
from ._assemble import is_count as _is_count
from .errors import WireFormatError
from .messages import (
    TOPIC_EPISODE_END,
    TOPIC_RUN_END,
    TOPIC_RUN_START,
    Batch,
    EpisodeEnd,
    Message,
    RunEnd,
    RunStart,
    VariationSample,
)

__all__ = [
    "DEFAULT_MAX_HEADER_SIZE",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DTYPES",
    "MAX_DIMS",
    "PROTOCOL_VERSION",
    "REASONS",
    "SUBSCRIBER_ACK",
    "SUBSCRIBER_HELLO",
    "Decoded",
    "decode",
    "decode_envelope",
    "encode",
    "encode_header",
    "message_tensors",
    "tensor_spec",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("broker.wire: the wire format is little-endian; big-endian hosts are unsupported")

PROTOCOL_VERSION: Final = 1
DEFAULT_MAX_HEADER_SIZE: Final = 1 << 20
"""Largest accepted header (bytes); a RunStart schema of thousands of fields fits easily."""
DEFAULT_MAX_MESSAGE_SIZE: Final = 1 << 31
"""Largest accepted frame and whole message (bytes); also the receiving socket's MAXMSGSIZE, and
the most bytes any decoded shape may span (run-schema fields included, zero dimensions counted
as 1)."""
_NAMES: Final = {dtype: name for name, dtype in DTYPES.items()}
_NUMPY: Final = {name: np.dtype(name if name != "bfloat16" else "int16") for name in DTYPES}
"""Wire name -> numpy dtype to view a frame as (bfloat16, which numpy lacks: its bits)."""

REASONS: Final = frozenset({
    "encode", "missing frames", "extra frames", "too large", "topic", "header size", "header",
    "version", "kind", "dtype", "shape", "value", "schema",
})
"""Every ``WireFormatError.reason`` the codec produces."""

SUBSCRIBER_HELLO: Final = b"\xffworldtap/subscriber/"
# A subscriber acknowledges each RunEnd it received by subscribing (then unsubscribing) to
# ``SUBSCRIBER_ACK + b"<publisher id>/<run>/<subscriber id>"``: the publisher's close() waits
# for these before it disconnects, because ZeroMQ discards what a peer has not read yet when
# the connection closes.
SUBSCRIBER_ACK: Final = b"\xffworldtap/ack/"
"""Prefix of the extra subscription by which a :class:`broker.Subscriber` announces its id to a
publisher (``0xff`` never starts a UTF-8 topic, so nothing is ever delivered on it)."""

_KINDS: Final = {Batch: "batch", EpisodeEnd: "episode_end", VariationSample: "variation",
                 RunStart: "run_start", RunEnd: "run_end"}
_OWN: Final[Mapping[str, tuple[str, ...]]] = {
    "batch": ("worlds", "episodes"),
    "episode_end": ("worlds", "episodes", "success", "terminated", "truncated", "length"),
    "variation": ("worlds", "episodes", "value"),
    "run_start": (), "run_end": (),
}
_NAMED: Final[Mapping[str, str]] = {"batch": "fields", "episode_end": "outcomes"}
"""Header key of the named tensors (after the own ones) of the kinds that have them."""

Spec = tuple[str, str, tuple[int, ...]]
"""``(name, dtype name, shape)`` of one tensor on the wire."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """A decoded message and its envelope (who numbered it, and how).

    Attributes:
        message: The message; its tensors belong to the receiver.
        publisher: Id of the publisher that numbered it (``""`` when encoded standalone).
        number: Position of the message in its ``(publisher, run, topic)`` stream.
        streams: On ``run/end`` only: topic -> number of messages the publisher numbered on it
            in this run (lets receivers detect losses at the tail of a stream).
    """

    message: Message
    publisher: str
    number: int
    streams: Mapping[str, int]


def message_tensors(message: Message) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """The message's own tensors and its named tensors (a batch's fields, an episode end's
    outcomes), in frame order. Borrowed."""
    if isinstance(message, RunStart | RunEnd):
        return [], []
    own = [(name, getattr(message, name)) for name in _OWN[_KINDS[type(message)]]]
    if isinstance(message, Batch):
        named = list(message.fields.items())
    elif isinstance(message, EpisodeEnd):
        named = list(message.outcomes.items())
    else:
        named = []
    return own, named


def tensor_spec(topic: str, name: str, tensor: torch.Tensor) -> Spec:
    """``(name, dtype name, shape)`` of ``tensor``, checked against the dtype whitelist."""
    if not isinstance(tensor, torch.Tensor):
        raise _fail("encode", f"topic {topic!r} tensor {name!r}: expected a torch.Tensor, got {tensor!r}")
    dtype = _NAMES.get(tensor.dtype)
    if dtype is None:
        raise _fail("dtype", f"topic {topic!r} tensor {name!r}: dtype {tensor.dtype} is not on the "
                             f"wire whitelist {sorted(DTYPES)}")
    return name, dtype, tuple(tensor.shape)


def _entries(specs: Sequence[Spec], first: int) -> list[list[Any]]:
    return [[name, dtype, list(shape), first + i] for i, (name, dtype, shape) in enumerate(specs)]


def encode_header(
    message: Message,
    own: Sequence[Spec],
    fields: Sequence[Spec],
    *,
    publisher: str = "",
    number: int = 0,
    streams: Mapping[str, int] | None = None,
) -> bytes:
    """The msgpack header of ``message`` whose tensors have the given specs (frame order: own
    tensors, then fields: a batch's fields or an episode end's outcomes).

    Raises:
        WireFormatError: (reason ``"encode"``) a value msgpack cannot carry, e.g. metadata, or
            a run message that receivers would reject (metadata map keys other than str or
            bytes, a schema dtype off the whitelist).
    """
    kind = _KINDS.get(type(message))
    if kind is None:
        raise _fail("encode", f"message: expected one of {[k.__name__ for k in _KINDS]}, got {message!r}")
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind, "run": message.run,
                            "seq": message.seq, "step": message.step, "pub": publisher, "n": number,
                            "tensors": _entries(own, 0)}
    if isinstance(message, Batch):
        head["fields"] = _entries(fields, len(own))
        head["hook"] = message.hook
    elif isinstance(message, EpisodeEnd):
        head["outcomes"] = _entries(fields, len(own))
    elif isinstance(message, VariationSample):
        head["key"] = message.key
        head["phase"] = message.phase
        head["labels"] = None if message.labels is None else list(message.labels)
    elif isinstance(message, RunStart | RunEnd):
        head["num_worlds"] = message.num_worlds
        head["device"] = message.device
        head["schema"] = {t: {f: s.to_dict() for f, s in fs.items()} for t, fs in message.schema.items()}
        head["metadata"] = dict(message.metadata)
        head["variations"] = _plain(message.variations)
        head["seed"] = message.seed
        wall: Any = message.wall_time  # always a float on the wire (receivers take nothing else)
        head["wall_time"] = float(wall) if isinstance(wall, int | float) and not isinstance(wall, bool) else wall
        if isinstance(message, RunEnd):
            head["interrupted"] = message.interrupted
            head["streams"] = dict(streams or {})
    try:
        header: bytes = msgpack.packb(head, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError, msgpack.PackException) as exc:
        raise _fail("encode", f"topic {message.topic!r}: header cannot be encoded with msgpack: "
                              f"{exc}") from exc
    if kind in ("run_start", "run_end"):
        # Receivers decode strictly: refuse here, where the caller sees it, what every receiver
        # would refuse (metadata with int keys, a schema dtype off the whitelist, ...), rather
        # than lose the run there. Two messages a run, so the cost does not matter.
        try:
            decode_envelope([message.topic.encode(), header], max_header_size=len(header),
                            max_message_size=MAX_BYTES)
        except WireFormatError as exc:
            raise _fail("encode", f"topic {message.topic!r}: receivers would reject this message "
                                  f"({exc.reason}): {exc}") from exc
    return header


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` with every mapping a dict and every tuple a list (what msgpack packs and a
    receiver gets back); anything else as it is, for msgpack and the receivers' checks to judge."""
    if depth > 64:
        return value
    if isinstance(value, Mapping):
        return {k: _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, depth + 1) for v in value]
    return value


def _frame(tensor: torch.Tensor) -> memoryview:
    host = tensor.detach().to("cpu").contiguous()
    return host.reshape(-1).view(torch.uint8).numpy().data


def encode(
    message: Message,
    *,
    publisher: str = "",
    number: int = 0,
    streams: Mapping[str, int] | None = None,
) -> list[bytes | memoryview]:
    """``[topic, header, frame_0, ...]`` of ``message``.

    The frames of contiguous CPU tensors are views of the message's tensors (borrowed: send
    them before the tensors change); other tensors are copied to contiguous host memory.

    Raises:
        WireFormatError: The message cannot be encoded (dtype off the whitelist, metadata
            msgpack cannot carry).
    """
    own, fields = message_tensors(message)
    own_specs = [tensor_spec(message.topic, n, t) for n, t in own]
    field_specs = [tensor_spec(message.topic, n, t) for n, t in fields]
    header = encode_header(message, own_specs, field_specs, publisher=publisher, number=number,
                           streams=streams)
    return [message.topic.encode(), header, *(_frame(t) for _, t in own + fields)]


# -- decoding -------------------------------------------------------------------------------


def decode(
    frames: Sequence[Any],
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> Message:
    """Decode ``[topic, header, frames...]`` (``bytes``, ``memoryview`` or ``zmq.Frame``).

    Args:
        frames: The received frames. Tensors are built over writable frames without a copy and
            then own them; read-only frames (``bytes``) are copied once.
        max_header_size: Largest accepted header in bytes (bounds msgpack's work and memory).
        max_message_size: Largest accepted message in bytes, and the most bytes any shape in it
            may span with each zero dimension counted as 1 (never more than 2**62), so that a
            zero-row tensor cannot declare dimensions whose products overflow downstream.

    Raises:
        WireFormatError: Anything about the message is invalid; ``reason`` (one of
            :data:`REASONS`) says what. Nothing else is raised for any received bytes.
    """
    return decode_envelope(frames, max_header_size=max_header_size,
                           max_message_size=max_message_size).message


def decode_envelope(
    frames: Sequence[Any],
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
) -> Decoded:
    """Like :func:`decode`, and also return the publisher's numbering of the message."""
    if len(frames) < 2:
        raise _fail("missing frames", f"expected at least 2 frames (topic, header), got {len(frames)}")
    views = [memoryview(f).cast("B") for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_message_size:
        raise _fail("too large", f"message of {total} bytes exceeds max_message_size={max_message_size}")
    try:
        topic = bytes(views[0]).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail("topic", f"frame 0 (topic) is not UTF-8: {bytes(views[0][:64])!r}") from exc
    if views[1].nbytes > max_header_size:
        raise _fail("header size", f"topic {topic!r}: header of {views[1].nbytes} bytes exceeds "
                                   f"max_header_size={max_header_size}")
    head = _unpack(topic, views[1])
    kind = _check_head(topic, head)
    payload = views[2:]
    limit = min(max_message_size, MAX_BYTES)
    own_specs = _specs(topic, head, "tensors", limit)
    named_key = _NAMED.get(kind)
    field_specs = _specs(topic, head, named_key, limit) if named_key is not None else []
    specs = own_specs + field_specs
    if [s[0] for s in own_specs] != list(_OWN[kind]):
        raise _fail("schema", f"topic {topic!r}: expected tensors {list(_OWN[kind])} for kind "
                              f"{kind!r}, got {[s[0] for s in own_specs]}")
    if len(payload) != len(specs):
        reason = "missing frames" if len(payload) < len(specs) else "extra frames"
        raise _fail(reason, f"topic {topic!r}: header describes {len(specs)} tensor frames, got "
                            f"{len(payload)}")
    if sorted(s[3] for s in specs) != list(range(len(specs))):
        raise _fail("header", f"topic {topic!r}: frame indices {[s[3] for s in specs]} are not "
                              f"each of 0..{len(specs) - 1} once")
    tensors = {(i < len(own_specs), name): _tensor(topic, name, dtype, shape, frames[2 + f], payload[f])
               for i, (name, dtype, shape, f) in enumerate(specs)}
    own = {name: t for (is_own, name), t in tensors.items() if is_own}
    fields = {name: t for (is_own, name), t in tensors.items() if not is_own}
    if len(fields) != len(field_specs):
        raise _fail("schema", f"topic {topic!r}: duplicate {named_key} names "
                              f"{shown([s[0] for s in field_specs])}")
    message = assemble(topic, kind, head, own, fields, limit)
    streams = head.get("streams") if kind == "run_end" else {}
    if not isinstance(streams, dict) or not all(
            isinstance(k, str) and _is_count(v) for k, v in streams.items()):
        raise _fail("header", f"topic {topic!r}: header key 'streams' must map topics to counts, got "
                              f"{shown(streams)}")
    return Decoded(message, head["pub"], head["n"], MappingProxyType(streams))


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack ext type {code} is not part of the protocol")


def _unpack(topic: str, header: memoryview) -> dict[str, Any]:
    try:
        head = msgpack.unpackb(header, raw=False, strict_map_key=True, ext_hook=_no_ext,
                               timestamp=0, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise _fail("header", f"topic {topic!r}: header is not valid msgpack: {exc}") from exc
    if not isinstance(head, dict):
        raise _fail("header", f"topic {topic!r}: header must be a msgpack map, got {type(head).__name__}")
    version = head.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # not True, not 1.0
        raise _fail("version", f"topic {topic!r}: unsupported protocol version {shown(version)} "
                               f"(this codec speaks version {PROTOCOL_VERSION})")
    return head


def _check_head(topic: str, head: dict[str, Any]) -> str:
    kind = head.get("kind")
    if not isinstance(kind, str) or kind not in _OWN:  # a list or map would not even hash
        raise _fail("kind", f"topic {topic!r}: unknown message kind {shown(kind)}, expected one of "
                            f"{sorted(_OWN)}")
    for key, ok in (("run", isinstance(head.get("run"), str)), ("pub", isinstance(head.get("pub"), str)),
                    ("seq", _is_count(head.get("seq"))), ("step", _is_count(head.get("step"))),
                    ("n", _is_count(head.get("n")))):
        if not ok:
            raise _fail("header", f"topic {topic!r}: header key {key!r} is missing or invalid: "
                                  f"{shown(head.get(key))}")
    fixed = {"episode_end": TOPIC_EPISODE_END, "run_start": TOPIC_RUN_START, "run_end": TOPIC_RUN_END}
    if kind == "batch":
        good = topic.startswith("batch/") and len(topic) > len("batch/")
    elif kind == "variation":
        good = bool(topic)
    else:
        good = topic == fixed[kind]
    if not good:
        raise _fail("topic", f"topic {topic!r} does not fit message kind {kind!r}")
    return str(kind)


def _specs(topic: str, head: dict[str, Any], key: str,
           limit: int) -> list[tuple[str, str, tuple[int, ...], int]]:
    entries = head.get(key)
    if not isinstance(entries, list):
        raise _fail("header", f"topic {topic!r}: header key {key!r} must be a list, got {shown(entries)}")
    out = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str)
                and isinstance(entry[1], str) and _is_count(entry[3])):
            raise _fail("header", f"topic {topic!r}: {key} entry must be [name, dtype, shape, frame], "
                                  f"got {shown(entry)}")
        name, dtype, shape, frame = entry
        if dtype not in DTYPES:
            raise _fail("dtype", f"topic {topic!r} tensor {shown(name)}: dtype {shown(dtype)} is not on "
                                 f"the whitelist {sorted(DTYPES)}")
        problem = shape_error(shape, dtype, limit)
        if problem is not None:
            raise _fail("shape", f"topic {topic!r} tensor {shown(name)}: {problem}")
        out.append((name, dtype, tuple(shape), frame))
    return out


def _tensor(topic: str, name: str, dtype_name: str, shape: tuple[int, ...], frame: Any,
            view: memoryview) -> torch.Tensor:
    dtype = DTYPES[dtype_name]
    itemsize = dtype.itemsize
    expected = math.prod(shape) * itemsize
    if expected != view.nbytes:
        raise _fail("shape", f"topic {topic!r} tensor {name!r}: shape {list(shape)} of {dtype_name} "
                             f"needs {expected} bytes, frame has {view.nbytes}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype == torch.bool and int(np.frombuffer(view, dtype=np.uint8).max()) > 1:
        raise _fail("value", f"topic {topic!r} tensor {name!r}: bool frame holds bytes other than 0 and 1")
    source: Any = frame if not view.readonly else bytearray(view)
    # One torch call per tensor (two for bfloat16): each releases the GIL, and taking it back
    # from the daemon's writer threads can cost up to a switch interval.
    array = np.frombuffer(source, dtype=_NUMPY[dtype_name]).reshape(shape)
    if array.ctypes.data % itemsize:  # tiny frames may sit unaligned inside the message
        array = array.copy()
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)
