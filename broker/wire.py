"""The wire codec: every message kind to and from a ZeroMQ multipart ``[topic, header, data...]``.

Layout (protocol version 2; version 1 is still decoded):

- ``topic``: the message's topic, UTF-8 (``batch/<term>``, ``episode/end``, ``variation/<key>``,
  ``run/start``, ``run/end``). Subscribers filter on its prefix inside ZeroMQ.
- ``header``: one msgpack map (no ext types, no pickle) with, in this order, ``v`` (protocol
  version), ``kind``, ``run``, ``seq``, ``step``, ``pub`` (publisher id), ``n`` (wire number of the
  message within its ``(pub, run, topic)`` stream), ``tensors`` (the message's own tensors as
  ``[name, dtype, shape, position]``), then the kind's own keys (``fields`` for batches, in
  the same four-item form; ``outcomes`` for episode ends, in that form too: each outcome's
  tensor follows the six flag and count tensors; ``key``/``phase``/``labels`` for variations;
  ``num_worlds``/``device``/``schema``/``metadata``/``variations``/``seed``/``wall_time`` for run
  messages, plus ``interrupted`` and ``streams`` on ``run/end``). Every key of a kind is always written: a missing
  one is malformed, never read as a default.
- Version 2, ``data``: one frame holding every tensor of the message (messages of kinds with
  tensors; run messages have no data frame), raw little-endian bytes in C order (``bfloat16``
  as its raw 16 bits, ``bool`` as one byte 0 or 1). The tensor at position 0 starts at byte 0
  and each next one at the first multiple of :data:`ALIGN` (64) at or after the end of the
  one before; the frame ends where the last tensor with any bytes ends. Padding bytes carry
  nothing. One frame instead of one per tensor: ZeroMQ's cost is per frame, and at a few
  hundred worlds it dominated.
- Version 1, ``frame_i``: one frame per tensor instead, tensor ``i`` (its position) in frame
  ``2 + i``. Publishers write it for messages whose staged tensors are not laid out as version
  2 needs (a reset batch of fewer worlds than its staging plan has room for), and decoders
  read both, so receivers must be upgraded before publishers.

Decoding validates everything and raises :class:`WireFormatError` with a stable ``reason``, and
nothing else, for any received bytes: every header value is type-checked before it is used, and
every shape (tensor or run-schema field) is bounded before anything is allocated, with a zero
dimension counted as 1, so no size computed from a decoded shape can overflow. A decoded message
keeps the structural contract of :mod:`broker.messages` (1-D int64 ``worlds`` and ``episodes`` of
one length, that length leading every other tensor, bool tensors holding only 0 and 1, ...);
its *values* (world indices, episode numbers) are for the receiver to check against its run.
Encoding refuses (reason ``"encode"``) what decoding would reject, from the header and the
tensors' dtypes and shapes, once per message shape (:class:`HeaderTemplate`), never reading a
tensor's values.
Decoded tensors are CPU tensors built over the received frames without a copy (a read-only
buffer such as ``bytes`` is copied once, because torch tensors must be writable); they belong to
the receiver (a version 2 message's tensors are disjoint views of its one data frame). With
``arrays="numpy"`` they are numpy arrays over the frames instead (read-only
over a read-only buffer; bfloat16 as :class:`broker.BFloat16Bits`), and decoding never imports
torch: this module imports it only to encode or to decode to torch.
"""

from __future__ import annotations

import collections
import math
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Generic, Literal, overload

import msgpack
import numpy as np

from ._assemble import DTYPES, MAX_BYTES, MAX_DIMS, NUMPY_DTYPES, LazyMapping, assemble, shape_error, shown
from ._assemble import fail as _fail
from ._assemble import is_count as _is_count
from .errors import WireFormatError
from .messages import (
    TOPIC_EPISODE_END,
    TOPIC_RUN_END,
    TOPIC_RUN_START,
    A,
    Batch,
    EpisodeEnd,
    Message,
    MessageOf,
    NumpyMessage,
    RunEnd,
    RunStart,
    VariationSample,
)
from .schema import BFloat16Bits, is_tensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "ALIGN",
    "DEFAULT_MAX_HEADER_SIZE",
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DTYPES",
    "MAX_DIMS",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "REASONS",
    "SUBSCRIBER_ACK",
    "SUBSCRIBER_HELLO",
    "Decoded",
    "HeaderCache",
    "HeaderTemplate",
    "decode",
    "decode_envelope",
    "encode",
    "encode_header",
    "message_tensors",
    "packed_layout",
    "template_key",
    "tensor_spec",
]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("broker.wire: the wire format is little-endian; big-endian hosts are unsupported")

PROTOCOL_VERSION: Final = 2
"""The version this codec writes (see the module docstring)."""
PROTOCOL_VERSIONS: Final = (1, 2)
"""The versions it reads."""
ALIGN: Final = 64
"""Alignment (bytes) of each tensor inside a version 2 data frame."""
DEFAULT_MAX_HEADER_SIZE: Final = 1 << 20
"""Largest accepted header (bytes); a RunStart schema of thousands of fields fits easily."""
DEFAULT_MAX_MESSAGE_SIZE: Final = 1 << 31
"""Largest accepted frame and whole message (bytes); also the receiving socket's MAXMSGSIZE, and
the most bytes any decoded shape may span (run-schema fields included, zero dimensions counted
as 1)."""
_NAMES: Final = LazyMapping(lambda: {dtype: name for name, dtype in DTYPES.items()})
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
TensorSpec = tuple[str, str, tuple[int, ...], int]
"""``(name, dtype name, shape, frame index)`` of one decoded tensor."""


@dataclass(frozen=True, slots=True)
class Decoded(Generic[A]):
    """A decoded message and its envelope (who numbered it, and how).

    Attributes:
        message: The message; its tensors (torch tensors, or numpy arrays for
            ``Decoded[np.ndarray]``) belong to the receiver.
        publisher: Id of the publisher that numbered it (``""`` when encoded standalone).
        number: Position of the message in its ``(publisher, run, topic)`` stream.
        streams: On ``run/end`` only: topic -> number of messages the publisher numbered on it
            in this run (lets receivers detect losses at the tail of a stream).
    """

    message: MessageOf[A]
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
    if not is_tensor(tensor):
        raise _fail("encode", f"topic {topic!r} tensor {name!r}: expected a torch.Tensor, got {tensor!r}")
    dtype = _NAMES.get(tensor.dtype)
    if dtype is None:
        raise _fail("dtype", f"topic {topic!r} tensor {name!r}: dtype {tensor.dtype} is not on the "
                             f"wire whitelist {sorted(DTYPES)}")
    return name, dtype, tuple(tensor.shape)


def _entries(specs: Sequence[Spec], first: int) -> list[list[Any]]:
    return [[name, dtype, list(shape), first + i] for i, (name, dtype, shape) in enumerate(specs)]


def packed_layout(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where a version 2 data frame holds tensors of ``sizes`` bytes (in position order): each
    one's offset, and the frame's length (the end of the last tensor with any bytes)."""
    offsets = []
    offset = end = 0
    for size in sizes:
        offsets.append(offset)
        if size:
            end = offset + size
        offset += -(-size // ALIGN) * ALIGN
    return offsets, end


def _head(message: Message, own: Sequence[Spec], fields: Sequence[Spec], publisher: str, number: int,
          streams: Mapping[str, int] | None, version: int = PROTOCOL_VERSION) -> tuple[str, dict[str, Any]]:
    """The kind of ``message`` and its header as a map, in wire order (see :func:`encode_header`)."""
    kind = _KINDS.get(type(message))
    if kind is None:
        raise _fail("encode", f"message: expected one of {[k.__name__ for k in _KINDS]}, got {message!r}")
    _packed_version(version)
    head: dict[str, Any] = {"v": version, "kind": kind, "run": message.run,
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
    return kind, head


def encode_header(
    message: Message,
    own: Sequence[Spec],
    fields: Sequence[Spec],
    *,
    publisher: str = "",
    number: int = 0,
    streams: Mapping[str, int] | None = None,
    version: int = PROTOCOL_VERSION,
) -> bytes:
    """The msgpack header of ``message`` whose tensors have the given specs (position order: own
    tensors, then fields: a batch's fields or an episode end's outcomes), in protocol ``version``.

    Receivers decode strictly, so what every receiver would refuse is refused here, where the
    caller sees it, rather than lost there: a run message is decoded whole; any other message
    is checked from its header and its tensors' specs as a receiver checks it (the tensors'
    values are not read), so a batch field without one row per world, worlds that are not 1-D
    int64, an episode end's column of another length, ... raise here.

    Raises:
        WireFormatError: (reason ``"encode"``) a value msgpack cannot carry, e.g. metadata, or
            a message that receivers would reject (see above; also metadata map keys other
            than str or bytes, a schema dtype off the whitelist).
    """
    kind, head = _head(message, own, fields, publisher, number, streams, version)
    try:
        header: bytes = msgpack.packb(head, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError, msgpack.PackException) as exc:
        raise _fail("encode", f"topic {message.topic!r}: header cannot be encoded with msgpack: "
                              f"{exc}") from exc
    try:
        if kind in ("run_start", "run_end"):  # two messages a run: the cost does not matter
            decode_envelope([message.topic.encode(), header], max_header_size=len(header),
                            max_message_size=MAX_BYTES)
        else:
            _check_as_received(message.topic, header)
    except WireFormatError as exc:
        raise _fail("encode", f"topic {message.topic!r}: receivers would reject this message "
                              f"({exc.reason}): {exc}") from exc
    return header


def _check_as_received(topic: str, header: bytes) -> None:
    """Raise the :class:`WireFormatError` a receiver would raise on a message of this header
    (not a run message), from the header alone: every check of :func:`decode` but those of
    the tensors' bytes, on stand-in arrays of the header's dtypes and shapes that hold no
    memory (a bool tensor's values, which only its bytes tell, are not checked)."""
    head = _unpack(topic, memoryview(header))
    kind = _check_head(topic, head)
    own_specs = _specs(topic, head, "tensors", MAX_BYTES)
    named_key = _NAMED.get(kind)
    field_specs = _specs(topic, head, named_key, MAX_BYTES) if named_key is not None else []
    _layout(topic, kind, head["v"], own_specs, field_specs)

    def stand_in(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        array = np.broadcast_to(np.zeros((), NUMPY_DTYPES[dtype]), shape)
        return array.view(BFloat16Bits) if dtype == "bfloat16" else array

    own = {name: stand_in(dtype, shape) for name, dtype, shape, _ in own_specs}
    fields = {name: stand_in(dtype, shape) for name, dtype, shape, _ in field_specs}
    if len(fields) != len(field_specs):
        raise _fail("schema", f"topic {topic!r}: duplicate {_NAMED[kind]} names "
                              f"{shown([s[0] for s in field_specs])}")
    assemble(topic, kind, head, own, fields, MAX_BYTES)


_VARYING: Final = ("run", "seq", "step", "pub", "n")
"""Header keys whose values change from one message of a shape to the next (adjacent, in wire
order): a :class:`HeaderTemplate` packs them per message."""
_NUMBERS: Final = -1
_ROWS: Final = -2
_VERSION: Final = -3
"""Places in a template's chunks for the packed :data:`_VARYING` values, the row count and the
protocol version."""
_PACKED_VERSIONS: Final[dict[int, bytes]] = {v: msgpack.packb(v) for v in PROTOCOL_VERSIONS}


def _packed_version(version: int) -> bytes:
    """``version`` packed with msgpack.

    Raises:
        WireFormatError: (reason ``"encode"``) a version this codec does not write.
    """
    packed = _PACKED_VERSIONS.get(version)
    if packed is None:
        raise _fail("encode", f"protocol version {version!r}: expected one of {list(PROTOCOL_VERSIONS)}")
    return packed


class HeaderTemplate:
    """The header of every message of one shape, encoded once: per message only the values of
    :data:`_VARYING` (and the row count) are packed and joined with the cached bytes, giving byte
    for byte what :func:`encode_header` writes (same map, same key order, same msgpack widths).

    Messages share a template when they have the same kind, topic, kind constants (a batch's
    hook; a variation's key, phase and labels), tensor names, dtypes and shapes, except that
    when every tensor has a leading dimension and they all agree (the worlds of a batch), that
    dimension is per message too (see :func:`template_key`).

    Args:
        message: A message of the shape (not a run message).
        own: Specs of its own tensors; ``fields``: of its named tensors (see :func:`encode_header`).
        rows: The leading dimension shared by every tensor (per message), or ``None``: the
            shapes are fixed.

    Raises:
        WireFormatError: (reason ``"encode"``) a constant msgpack cannot carry.
    """

    __slots__ = ("_chunks", "_numbers", "_rows", "_topic", "_version")

    def __init__(self, message: Message, own: Sequence[Spec], fields: Sequence[Spec], rows: int | None) -> None:
        self._topic = message.topic
        kind, head = _head(message, own, fields, "", 0, None)
        if kind in ("run_start", "run_end"):
            raise _fail("encode", f"topic {message.topic!r}: run messages have no header template")
        # Refuses what receivers would (see encode_header): a message of this template differs
        # from this one only in its varying values, checked per message, and in a leading
        # dimension its tensors share, which no check of a receiver tells from this one's.
        encode_header(message, own, fields)
        packer = msgpack.Packer(use_bin_type=True, strict_types=False)
        chunks: list[bytes | int] = [packer.pack_map_header(len(head))]
        try:
            for key, value in head.items():
                if key in _VARYING[1:]:
                    continue
                chunks.append(packer.pack(key))
                if key == "v":
                    chunks.append(_VERSION)
                elif key == "run":
                    chunks.append(_NUMBERS)
                elif key in ("tensors", _NAMED.get(kind)) and rows is not None:
                    chunks.append(packer.pack_array_header(len(value)))
                    for name, dtype, shape, frame in value:
                        chunks += [packer.pack_array_header(4), packer.pack(name), packer.pack(dtype),
                                   packer.pack_array_header(len(shape)), _ROWS,
                                   *(packer.pack(d) for d in shape[1:]), packer.pack(frame)]
                else:
                    chunks.append(packer.pack(value))
        except (TypeError, ValueError, OverflowError, msgpack.PackException) as exc:
            raise _fail("encode", f"topic {message.topic!r}: header cannot be encoded with msgpack: "
                                  f"{exc}") from exc
        merged: list[bytes | int] = []
        for chunk in chunks:
            if isinstance(chunk, bytes) and merged and isinstance(merged[-1], bytes):
                merged[-1] += chunk
            else:
                merged.append(chunk)
        self._numbers = merged.index(_NUMBERS)
        self._version = merged.index(_VERSION)
        self._rows = [i for i, chunk in enumerate(merged) if chunk == _ROWS]
        self._chunks: list[bytes] = [c if isinstance(c, bytes) else b"" for c in merged]

    def header(self, run: str, seq: int, step: int, publisher: str, number: int, rows: int | None,
               version: int = PROTOCOL_VERSION) -> bytes:
        """The header of a message of this shape with these values (``rows``: its leading
        dimension, ignored when the template's shapes are fixed), in protocol ``version``.

        Raises:
            WireFormatError: (reason ``"encode"``) a value msgpack cannot carry (an int of 2**64
                or more or below -2**63, an object msgpack does not know).
        """
        if not (isinstance(run, str) and _is_count(seq) and _is_count(step)):  # as receivers check them
            raise _fail("encode", f"topic {self._topic!r}: receivers would reject this message (header): "
                                  f"run must be a str and seq and step ints in [0, 2**63), got "
                                  f"{shown(run)}, {shown(seq)} and {shown(step)}")
        parts = self._chunks.copy()
        parts[self._version] = _packed_version(version)
        try:
            # A list of up to 15 items packs as a one-byte header and then the items exactly as
            # they are packed inside the header map.
            parts[self._numbers] = msgpack.packb([run, "seq", seq, "step", step, "pub", publisher, "n", number],
                                                 use_bin_type=True, strict_types=False)[1:]
            if self._rows:
                packed = msgpack.packb(rows, use_bin_type=True, strict_types=False)
                for i in self._rows:
                    parts[i] = packed
        except (TypeError, ValueError, OverflowError, msgpack.PackException) as exc:
            raise _fail("encode", f"topic {self._topic!r}: header cannot be encoded with msgpack: "
                                  f"{exc}") from exc
        return b"".join(parts)


def template_key(message: Message, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[Any, ...] | None:
    """What a message must share with another for the same header bytes but for the varying
    values: type, topic, kind constants (a batch's hook; a variation's key, phase and labels),
    and each tensor's name, type, dtype and shape. ``None`` for a run message, or one whose
    tensors have no dtype or shape (the encoder then reports what is wrong).

    Args:
        message: The message.
        tensors: Its own tensors, then its named ones (:func:`message_tensors`).
    """
    if isinstance(message, Batch):
        constants: Any = message.hook
    elif isinstance(message, EpisodeEnd):
        constants = None
    elif isinstance(message, VariationSample):
        labels = message.labels
        try:
            constants = (message.key, message.phase, None if labels is None else tuple(labels))
        except TypeError:  # labels that are no sequence
            return None
    else:
        return None
    try:
        return (type(message), message.topic, constants, tuple([(n, type(t), t.dtype, t.shape) for n, t in tensors]))
    except AttributeError:  # not a tensor
        return None


def _shared(key: tuple[Any, ...]) -> tuple[tuple[Any, ...], int | None]:
    """The :class:`HeaderTemplate` key of messages like the one of ``key`` (a
    :func:`template_key`) whatever their leading dimension, when every tensor has one and they
    all agree, and that dimension (else ``key`` itself and ``None``)."""
    items = key[3]
    shapes = [shape for _, _, _, shape in items]
    first = shapes[0][0] if shapes and len(shapes[0]) else None
    if first is None or not all(len(s) and s[0] == first for s in shapes):
        return key, None
    return (*key[:3], tuple([(n, ty, dt, s[1:]) for (n, ty, dt, _), s in zip(items, shapes, strict=True)]),
            "rows"), first


def _cacheable(key: tuple[Any, ...]) -> bool:
    """Whether the topic, names and constants in a template key are exact ``str`` (or ``None``),
    so that equal keys mean equal header bytes (``1 == True == 1.0`` would not)."""
    constants = key[2]
    if isinstance(constants, tuple):  # a variation's key, phase and labels
        name, phase, labels = constants
        constants = (name, phase, *(labels or ()))
    else:
        constants = () if constants is None else (constants,)
    return all(type(v) is str for v in (key[1], *(item[0] for item in key[3]), *constants))


class HeaderCache:
    """The :class:`HeaderTemplate` of each message shape one publisher sends (least recently
    used out), shared by messages that differ only in their leading (worlds) dimension; run
    messages (two a run) are encoded in full.

    Args:
        size: Most templates kept (and most exact shapes remembered).

    Attributes:
        built: Templates built so far: a message shape seen for the first time (or again after
            its template was evicted).
    """

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.built = 0
        self._templates: collections.OrderedDict[Any, HeaderTemplate] = collections.OrderedDict()
        # exact key -> its template and leading dimension: most messages repeat an exact shape
        self._exact: collections.OrderedDict[Any, tuple[HeaderTemplate, int | None]] = collections.OrderedDict()
        self._recent: tuple[HeaderTemplate, int | None] | None = None

    def header(
        self,
        message: Message,
        own: Sequence[tuple[str, torch.Tensor]],
        fields: Sequence[tuple[str, torch.Tensor]],
        *,
        publisher: str,
        number: int,
        streams: Mapping[str, int] | None = None,
        version: int = PROTOCOL_VERSION,
    ) -> bytes:
        """The header :func:`encode_header` writes for ``message`` (own tensors and named
        tensors as :func:`message_tensors` returns them) in protocol ``version``.

        Raises:
            WireFormatError: The message cannot be encoded (see :func:`encode_header`).
        """
        key = template_key(message, [*own, *fields])
        found = None if key is None else self._exact.get(key)
        if found is None:
            found = self._lookup(message, own, fields, key)
            if found is None:
                topic = message.topic
                return encode_header(message, [tensor_spec(topic, n, t) for n, t in own],
                                     [tensor_spec(topic, n, t) for n, t in fields], publisher=publisher,
                                     number=number, streams=streams, version=version)
        elif found is not self._recent:  # a repeated shape is already the most recent
            self._exact.move_to_end(key)
            self._recent = found
        template, rows = found
        return template.header(message.run, message.seq, message.step, publisher, number, rows, version)

    def _lookup(self, message: Message, own: Sequence[tuple[str, torch.Tensor]],
                fields: Sequence[tuple[str, torch.Tensor]],
                key: tuple[Any, ...] | None) -> tuple[HeaderTemplate, int | None] | None:
        """The template of a shape not seen exactly before (built if needed, and remembered when
        its key is exact), or ``None`` for messages encoded in full."""
        if key is None:
            return None
        shared, rows = _shared(key)
        template = self._templates.get(shared)
        if template is None:
            topic = message.topic
            template = HeaderTemplate(message, [tensor_spec(topic, n, t) for n, t in own],
                                      [tensor_spec(topic, n, t) for n, t in fields], rows)
            self.built += 1
            if not _cacheable(key):
                return template, rows
            self._templates[shared] = template
            if len(self._templates) > self.size:
                self._templates.popitem(last=False)
        else:
            self._templates.move_to_end(shared)
        self._exact[key] = self._recent = found = (template, rows)
        if len(self._exact) > self.size:
            self._exact.popitem(last=False)
        return found

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
    import torch

    host = tensor.detach().to("cpu").contiguous()
    return host.reshape(-1).view(torch.uint8).numpy().data


def encode(
    message: Message,
    *,
    publisher: str = "",
    number: int = 0,
    streams: Mapping[str, int] | None = None,
    version: int = PROTOCOL_VERSION,
) -> list[bytes | memoryview]:
    """The frames of ``message`` in protocol ``version``: ``[topic, header, data]`` (version 2;
    ``[topic, header]`` for a run message) or ``[topic, header, frame_0, ...]`` (version 1).

    Version 2 copies the tensors into the one data frame. Version 1's frames of contiguous CPU
    tensors are views of the message's tensors (borrowed: send them before the tensors change);
    other tensors are copied to contiguous host memory.

    Raises:
        WireFormatError: The message cannot be encoded (dtype off the whitelist, metadata
            msgpack cannot carry, a version this codec does not write).
    """
    own, fields = message_tensors(message)
    own_specs = [tensor_spec(message.topic, n, t) for n, t in own]
    field_specs = [tensor_spec(message.topic, n, t) for n, t in fields]
    header = encode_header(message, own_specs, field_specs, publisher=publisher, number=number,
                           streams=streams, version=version)
    frames = [_frame(t) for _, t in own + fields]
    if version == 1:
        return [message.topic.encode(), header, *frames]
    if not frames:
        return [message.topic.encode(), header]
    offsets, end = packed_layout([f.nbytes for f in frames])
    data = bytearray(end)
    for frame, offset in zip(frames, offsets, strict=True):
        data[offset:offset + frame.nbytes] = frame
    return [message.topic.encode(), header, memoryview(data)]


# -- decoding -------------------------------------------------------------------------------


Arrays = Literal["torch", "numpy"]
"""What the decoder builds a message's tensors as."""


@overload
def decode(frames: Sequence[Any], *, max_header_size: int = ..., max_message_size: int = ...,
           arrays: Literal["torch"] = ...) -> Message: ...


@overload
def decode(frames: Sequence[Any], *, max_header_size: int = ..., max_message_size: int = ...,
           arrays: Literal["numpy"]) -> NumpyMessage: ...


def decode(
    frames: Sequence[Any],
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    arrays: Arrays = "torch",
) -> Message | NumpyMessage:
    """Decode ``[topic, header, frames...]`` (``bytes``, ``memoryview`` or ``zmq.Frame``).

    Args:
        frames: The received frames. Tensors are built over writable frames without a copy and
            then own them; read-only frames (``bytes``) are copied once.
        max_header_size: Largest accepted header in bytes (bounds msgpack's work and memory).
        max_message_size: Largest accepted message in bytes, and the most bytes any shape in it
            may span with each zero dimension counted as 1 (never more than 2**62), so that a
            zero-row tensor cannot declare dimensions whose products overflow downstream.
        arrays: ``"torch"``: the message's tensors are torch tensors. ``"numpy"``: numpy arrays
            over the frames, never copied (except a tiny frame that is not aligned for its
            dtype), read-only when a frame is; bfloat16 as :class:`broker.BFloat16Bits` (its
            16 bits); torch is not imported.

    Raises:
        WireFormatError: Anything about the message is invalid; ``reason`` (one of
            :data:`REASONS`) says what. Nothing else is raised for any received bytes.
        ValueError: ``arrays`` is neither ``"torch"`` nor ``"numpy"``.
    """
    return decode_envelope(frames, max_header_size=max_header_size, max_message_size=max_message_size,
                           arrays=arrays).message


@overload
def decode_envelope(frames: Sequence[Any], *, max_header_size: int = ..., max_message_size: int = ...,
                    arrays: Literal["torch"] = ...) -> Decoded[torch.Tensor]: ...


@overload
def decode_envelope(frames: Sequence[Any], *, max_header_size: int = ..., max_message_size: int = ...,
                    arrays: Literal["numpy"]) -> Decoded[np.ndarray]: ...


def decode_envelope(
    frames: Sequence[Any],
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
    arrays: Arrays = "torch",
) -> Decoded[torch.Tensor] | Decoded[np.ndarray]:
    """Like :func:`decode`, and also return the publisher's numbering of the message."""
    if arrays == "torch":
        return _decode(frames, max_header_size, max_message_size, _tensor, copy=True)
    if arrays == "numpy":
        return _decode(frames, max_header_size, max_message_size, _array, copy=False)
    raise ValueError(f"arrays: expected 'torch' or 'numpy', got {arrays!r}")


def _decode(frames: Sequence[Any], max_header_size: int, max_message_size: int,
            build: Callable[[str, str, str, tuple[int, ...], np.ndarray], A], copy: bool) -> Decoded[A]:
    """:func:`decode_envelope` with ``build`` making each tensor from its checked spec and its
    bytes (a uint8 array of exactly the spec's size, over the received frame, or over a copy
    of a read-only frame with ``copy``: torch cannot own read-only memory)."""
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
    key = (kind, head["v"], id(own_specs), id(field_specs))
    known = _layouts.get(key)
    if known is not None and known[0] is own_specs and known[1] is field_specs:
        # these very spec lists (cached by _specs) passed every check below that depends on
        # the header alone: only the frames are checked again
        items, end = known[2], known[3]
    else:
        items, end = _layout(topic, kind, head["v"], own_specs, field_specs)
        known = None
    if head["v"] == 1:
        _count_frames(topic, payload, len(items), "tensor frames")
        raws = []
        for _, name, dtype, shape, f, nb in items:
            if payload[f].nbytes != nb:
                raise _fail("shape", f"topic {topic!r} tensor {name!r}: shape {list(shape)} of {dtype} "
                                     f"needs {nb} bytes, frame has {payload[f].nbytes}")
            raws.append(_bytes(payload[f], copy))
    elif items:
        _count_frames(topic, payload, 1, "data frame (protocol 2)")
        data = payload[0]
        if data.nbytes != end:
            raise _fail("shape", f"topic {topic!r}: the data frame has {data.nbytes} bytes, its "
                                 f"{len(items)} tensors need {end} (protocol 2: each at a "
                                 f"{ALIGN}-byte aligned offset)")
        # one array over the frame, sliced per tensor (the layout gave each its exact size)
        base = _bytes(data, copy)
        raws = [base[o:o + nb] for _, _, _, _, o, nb in items]
    else:
        _count_frames(topic, payload, 0, "data frames (protocol 2)")
        raws = []
    own: dict[str, A] = {}
    fields: dict[str, A] = {}
    for (is_own, name, dtype, shape, _, _), raw in zip(items, raws, strict=True):
        (own if is_own else fields)[name] = build(topic, name, dtype, shape, raw)
    if len(fields) != len(field_specs):
        raise _fail("schema", f"topic {topic!r}: duplicate {_NAMED[kind]} names "
                              f"{shown([s[0] for s in field_specs])}")
    decoded = _finish(topic, kind, head, own, fields, limit)
    if known is None:  # every check passed: later messages of this layout skip the header-only ones
        if len(_layouts) >= _SPEC_CACHE_SIZE:
            _layouts.clear()
        _layouts[key] = (own_specs, field_specs, items, end)
    return decoded


Item = tuple[bool, str, str, tuple[int, ...], int, int]
"""One tensor of a checked layout: own (not named), name, dtype, shape, and where its bytes
are: protocol 1, its frame index; protocol 2, its offset in the data frame; then its size."""


def _layout(topic: str, kind: str, version: int, own_specs: list[TensorSpec],
            field_specs: list[TensorSpec]) -> tuple[list[Item], int]:
    """Each tensor of a message's header, checked against everything the header alone decides
    (own tensor names, positions), and where its bytes are; with the length of the protocol 2
    data frame (0 for protocol 1)."""
    if [s[0] for s in own_specs] != list(_OWN[kind]):
        raise _fail("schema", f"topic {topic!r}: expected tensors {list(_OWN[kind])} for kind "
                              f"{kind!r}, got {[s[0] for s in own_specs]}")
    specs = own_specs + field_specs
    positions = [s[3] for s in specs]
    if sorted(positions) != list(range(len(specs))):
        raise _fail("header", f"topic {topic!r}: frame indices {positions} are not "
                              f"each of 0..{len(specs) - 1} once")
    sizes = [0] * len(specs)
    for _, dtype, shape, f in specs:  # shapes are bounded: no product overflows
        sizes[f] = math.prod(shape) * NUMPY_DTYPES[dtype].itemsize
    if version == 1:
        return [(i < len(own_specs), name, dtype, shape, f, sizes[f])
                for i, (name, dtype, shape, f) in enumerate(specs)], 0
    offsets, end = packed_layout(sizes)
    return [(i < len(own_specs), name, dtype, shape, offsets[f], sizes[f])
            for i, (name, dtype, shape, f) in enumerate(specs)], end


def _count_frames(topic: str, payload: Sequence[Any], expected: int, what: str) -> None:
    if len(payload) != expected:
        reason = "missing frames" if len(payload) < expected else "extra frames"
        raise _fail(reason, f"topic {topic!r}: header describes {expected} {what}, got "
                            f"{len(payload)}")


def _finish(topic: str, kind: str, head: dict[str, Any], own: dict[str, A], fields: dict[str, A],
            limit: int) -> Decoded[A]:
    """The decoded message from its checked header and tensors."""
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
    if type(version) is not int or version not in PROTOCOL_VERSIONS:  # not True, not 1.0
        raise _fail("version", f"topic {topic!r}: unsupported protocol version {shown(version)} "
                               f"(this codec reads versions {', '.join(map(str, PROTOCOL_VERSIONS))})")
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


_SPEC_CACHE_SIZE: Final = 256
_spec_cache: collections.OrderedDict[tuple[str, int, bytes], list[TensorSpec]] = collections.OrderedDict()
_spec_lock: Final = threading.Lock()
"""Checked specs of recently seen header entries, keyed on the header key, the size limit and
the entries packed again with msgpack (which, unlike ``==``, tells ``true`` from ``1`` and
``1.0``): only entries that passed :func:`_check_specs` under that limit are cached."""


_layouts: dict[tuple[str, int, int, int], tuple[list[TensorSpec], list[TensorSpec], list[Item], int]] = {}
"""Kind, protocol version and the identities of two spec lists from :func:`_specs`'s cache ->
those lists (kept alive, so their identities stay theirs), the :data:`Item` of each tensor and the
data frame's length: the layouts of messages that passed every check of :func:`_decode`."""


def _specs(topic: str, head: dict[str, Any], key: str, limit: int) -> list[TensorSpec]:
    """The checked ``(name, dtype, shape, frame index)`` of header key ``key``'s entries, from
    the cache when the same entries were checked under the same limit before (borrowed: never
    mutate the result)."""
    entries = head.get(key)
    try:
        cache_key = (key, limit, msgpack.packb(entries, use_bin_type=True))
    except (TypeError, ValueError, OverflowError, msgpack.PackException):  # pragma: no cover
        return _check_specs(topic, key, entries, limit)
    with _spec_lock:
        specs = _spec_cache.get(cache_key)
        if specs is not None:
            _spec_cache.move_to_end(cache_key)
            return specs
    specs = _check_specs(topic, key, entries, limit)
    with _spec_lock:
        _spec_cache[cache_key] = specs
        if len(_spec_cache) > _SPEC_CACHE_SIZE:
            _spec_cache.popitem(last=False)
    return specs


def _check_specs(topic: str, key: str, entries: Any, limit: int) -> list[TensorSpec]:
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


def _bytes(view: memoryview, copy: bool) -> np.ndarray:
    """A uint8 array over ``view`` (which it keeps alive); over a copy when ``view`` is
    read-only and ``copy``."""
    return np.frombuffer(bytearray(view) if copy and view.readonly else view, dtype=np.uint8)


def _view(topic: str, name: str, dtype_name: str, shape: tuple[int, ...], raw: np.ndarray,
          dtype: np.dtype[Any]) -> np.ndarray:
    """``raw`` (a tensor's bytes, of the size its spec needs) as an array of ``dtype`` (numpy's
    for ``dtype_name``, or its bits) and ``shape``.

    Raises:
        WireFormatError: (``"value"``) a bool tensor holds bytes other than 0 and 1.
    """
    if not raw.size:
        return np.empty(shape, dtype)
    if dtype_name == "bool" and int(raw.max()) > 1:
        raise _fail("value", f"topic {topic!r} tensor {name!r}: bool frame holds bytes other than 0 and 1")
    array = raw.view(dtype).reshape(shape)
    if not array.flags.aligned:  # tiny frames may sit unaligned inside the message
        array = array.copy()
    return array


def _array(topic: str, name: str, dtype_name: str, shape: tuple[int, ...], raw: np.ndarray) -> np.ndarray:
    """A numpy array over ``raw`` (see :func:`decode`)."""
    array = _view(topic, name, dtype_name, shape, raw, NUMPY_DTYPES[dtype_name])
    return array.view(BFloat16Bits) if dtype_name == "bfloat16" else array


def _tensor(topic: str, name: str, dtype_name: str, shape: tuple[int, ...], raw: np.ndarray) -> torch.Tensor:
    """A torch tensor over ``raw`` (writable: a read-only frame was copied)."""
    import torch

    if not raw.size:
        return torch.empty(shape, dtype=DTYPES[dtype_name])
    # One torch call per tensor (two for bfloat16): each releases the GIL, and taking it back
    # from the daemon's writer threads can cost up to a switch interval.
    tensor = torch.from_numpy(_view(topic, name, dtype_name, shape, raw, _NUMPY[dtype_name]))
    return tensor if dtype_name != "bfloat16" else tensor.view(DTYPES[dtype_name])
