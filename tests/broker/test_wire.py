"""The wire codec: byte-exact layout of every message kind, dtype round trips, and validation."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import (
    Batch,
    EpisodeEnd,
    FieldSpec,
    Message,
    RunEnd,
    RunStart,
    VariationSample,
    WireFormatError,
    decode,
    encode,
)
from broker.wire import REASONS

W = torch.tensor([0, 2])
E = torch.tensor([1, 0])

# Frames shared by the message kinds below; every integer is little-endian.
WORLDS_FRAME = b"\x00" * 8 + b"\x02" + b"\x00" * 7  # int64 [0, 2]
EPISODES_FRAME = b"\x01" + b"\x00" * 7 + b"\x00" * 8  # int64 [1, 0]


def _bytes(frames: list[bytes | memoryview]) -> list[bytes]:
    return [bytes(f) for f in frames]


def _data(*tensors: bytes) -> bytes:
    """A protocol 2 data frame, as the module docstring defines it: each tensor at the next
    multiple of 64 bytes, the frame ending with the last tensor with bytes."""
    out = b""
    for t in tensors:
        if t:
            out += b"\x00" * (-len(out) % 64) + t
    return out


def _v2(frames: list[bytes]) -> list[bytes]:
    """Protocol 1 frames as protocol 2 writes them (the version byte ``\\xa1v\\x01`` at the
    start of the header becomes 2; the tensor frames one data frame); padding compared as zeros."""
    header = frames[1].replace(b"\xa1v\x01", b"\xa1v\x02", 1)
    return [frames[0], header, _data(*frames[2:])] if len(frames) > 2 else [frames[0], header]


def _zero_padding(frames: list[bytes], message: Message) -> list[bytes]:
    """``frames`` with the padding bytes of a protocol 2 data frame zeroed (they carry nothing)."""
    if len(frames) < 3:
        return frames
    from broker.wire import message_tensors, packed_layout

    own, named = message_tensors(message)
    sizes = [t.numel() * t.element_size() for _, t in own + named]
    offsets, end = packed_layout(sizes)
    data = bytearray(end)
    for offset, size in zip(offsets, sizes, strict=True):
        data[offset:offset + size] = frames[2][offset:offset + size]
    return [*frames[:2], bytes(data)]


def _both(message: Message, **kwargs: object) -> tuple[list[bytes], list[bytes]]:
    """``message`` encoded in protocol 1 and in protocol 2 (the default)."""
    return (_bytes(encode(message, version=1, **kwargs)),  # type: ignore[arg-type]
            _zero_padding(_bytes(encode(message, **kwargs)), message))  # type: ignore[arg-type]


def test_batch_is_byte_exact() -> None:
    message = Batch("r1", 3, 7, "batch/obs", W, E, {
        "x": torch.tensor([[1.0], [2.0]]), "done": torch.tensor([True, False])})
    header = (
        b"\x8a"  # msgpack map of 10 entries, in this order:
        b"\xa1v\x01"  # "v": 1, the protocol version
        b"\xa4kind\xa5batch"  # "kind": "batch"
        b"\xa3run\xa2r1"  # "run": "r1"
        b"\xa3seq\x03"  # "seq": 3, the recorder's sequence number
        b"\xa4step\x07"  # "step": 7
        b"\xa3pub\xa1p"  # "pub": "p", the publisher id
        b"\xa1n\x02"  # "n": 2, the wire number within (pub, run, topic)
        # "tensors": [[name, dtype, shape, frame index], ...] for the message's own tensors
        b"\xa7tensors\x92\x94\xa6worlds\xa5int64\x91\x02\x00\x94\xa8episodes\xa5int64\x91\x02\x01"
        # "fields": [["x", "float32", [2, 1], 2], ["done", "bool", [2], 3]]
        b"\xa6fields\x92\x94\xa1x\xa7float32\x92\x02\x01\x02\x94\xa4done\xa4bool\x91\x02\x03"
        b"\xa4hook\xa9post_step"  # "hook": "post_step"
    )
    v1, v2 = _both(message, publisher="p", number=2)
    assert v1 == [
        b"batch/obs",  # topic: ZeroMQ filters on its prefix
        header,
        WORLDS_FRAME,  # frame 0: worlds
        EPISODES_FRAME,  # frame 1: episodes
        b"\x00\x00\x80?\x00\x00\x00@",  # frame 2: x, float32 [[1.0], [2.0]]
        b"\x01\x00",  # frame 3: done, one byte per bool
    ]
    assert v2 == [
        b"batch/obs",
        b"\x8a\xa1v\x02" + header[4:],  # the same header but for "v": 2
        # one data frame: each tensor at a multiple of 64 bytes, in position order
        WORLDS_FRAME + bytes(48) + EPISODES_FRAME + bytes(48) + b"\x00\x00\x80?\x00\x00\x00@" + bytes(56)
        + b"\x01\x00",
    ]
    for frames in (v1, v2):
        back = decode(frames)
        assert isinstance(back, Batch)
        assert back.fields["x"].tolist() == [[1.0], [2.0]]
        assert back.fields["done"].tolist() == [True, False]
        assert back.worlds.tolist() == [0, 2]


def test_episode_end_is_byte_exact() -> None:
    message = EpisodeEnd("r1", 4, 7, W, E, torch.tensor([True, False]), torch.tensor([False, False]),
                         torch.tensor([False, True]), torch.tensor([5, 9]),
                         outcomes={"return": torch.tensor([1.0, 2.0])})
    header = (
        b"\x89"  # map of 9 entries
        b"\xa1v\x01\xa4kind\xabepisode_end\xa3run\xa2r1\xa3seq\x04\xa4step\x07\xa3pub\xa1p\xa1n\x02"
        b"\xa7tensors\x96"  # 6 own tensors, frames 0..5:
        b"\x94\xa6worlds\xa5int64\x91\x02\x00\x94\xa8episodes\xa5int64\x91\x02\x01"
        b"\x94\xa7success\xa4bool\x91\x02\x02\x94\xaaterminated\xa4bool\x91\x02\x03"
        b"\x94\xa9truncated\xa4bool\x91\x02\x04\x94\xa6length\xa5int64\x91\x02\x05"
        # "outcomes": [["return", "float32", [2], 6]], in the tensors' four-item form
        b"\xa8outcomes\x91\x94\xa6return\xa7float32\x91\x02\x06"
    )
    v1, frames = _both(message, publisher="p", number=2)
    assert frames == _v2(v1)
    assert v1 == [
        b"episode/end", header, WORLDS_FRAME, EPISODES_FRAME,
        b"\x01\x00",  # success
        b"\x00\x00",  # terminated
        b"\x00\x01",  # truncated
        b"\x05" + b"\x00" * 7 + b"\x09" + b"\x00" * 7,  # length, int64 [5, 9]
        b"\x00\x00\x80?\x00\x00\x00@",  # frame 6: outcome "return", float32 [1.0, 2.0]
    ]
    back = decode(_bytes(frames))
    assert isinstance(back, EpisodeEnd)
    assert list(back.outcomes) == ["return"]
    assert back.outcomes["return"].dtype == torch.float32
    assert back.outcomes["return"].numpy().tobytes() == b"\x00\x00\x80?\x00\x00\x00@"
    plain = EpisodeEnd("r1", 4, 7, W, E, torch.tensor([True, False]), torch.tensor([False, False]),
                       torch.tensor([False, True]), torch.tensor([5, 9]))
    assert bytes(encode(plain)[1]).endswith(b"\xa8outcomes\x90")  # always written, empty here


def test_variation_sample_is_byte_exact() -> None:
    message = VariationSample("r1", 1, 0, "mass", "build", W, E,
                              torch.tensor([0.5, 1.5], dtype=torch.float16))
    header = (
        b"\x8b"  # map of 11 entries
        b"\xa1v\x01\xa4kind\xa9variation\xa3run\xa2r1\xa3seq\x01\xa4step\x00\xa3pub\xa1p\xa1n\x02"
        b"\xa7tensors\x93\x94\xa6worlds\xa5int64\x91\x02\x00\x94\xa8episodes\xa5int64\x91\x02\x01"
        b"\x94\xa5value\xa7float16\x91\x02\x02"
        b"\xa3key\xa4mass"  # "key": "mass"
        b"\xa5phase\xa5build"  # "phase": "build"
        b"\xa6labels\xc0"  # "labels": nil (not categorical)
    )
    v1, v2 = _both(message, publisher="p", number=2)
    assert v1 == [
        b"variation/mass", header, WORLDS_FRAME, EPISODES_FRAME,
        b"\x00\x38\x00\x3e",  # value, float16 [0.5, 1.5] = 0x3800, 0x3e00
    ]
    assert v2 == _v2(v1)


def test_run_start_and_end_are_byte_exact() -> None:
    decl = {"kind": "uniform", "phase": "runtime", "shape": [], "seed": 7, "low": 0.5, "high": 2}
    start = RunStart("r1", 0, 0, 2, "cpu", {"batch/obs": {"x": FieldSpec("float32", (1,))}},
                     {"task": "lift"}, variations={"mass": decl}, seed=3, wall_time=1.5)
    common = b"\xa3run\xa2r1"
    frames = encode(start, publisher="p", number=2, version=1)
    assert _v2(_bytes(frames)) == _bytes(encode(start, publisher="p", number=2))  # no data frame
    assert _bytes(frames) == [b"run/start", (
        b"\x8f\xa1v\x01\xa4kind\xa9run_start" + common + b"\xa3seq\x00\xa4step\x00\xa3pub\xa1p\xa1n\x02"
        b"\xa7tensors\x90"  # no tensor frames
        b"\xaanum_worlds\x02\xa6device\xa3cpu"
        # "schema": {"batch/obs": {"x": {"dtype": "float32", "shape": [1]}}}
        b"\xa6schema\x81\xa9batch/obs\x81\xa1x\x82\xa5dtype\xa7float32\xa5shape\x91\x01"
        b"\xa8metadata\x81\xa4task\xa4lift"  # "metadata": {"task": "lift"}
        # "variations": {"mass": {the declaration, its keys in the order given}}
        b"\xaavariations\x81\xa4mass\x86\xa4kind\xa7uniform\xa5phase\xa7runtime\xa5shape\x90"
        b"\xa4seed\x07\xa3low\xcb\x3f\xe0\x00\x00\x00\x00\x00\x00\xa4high\x02"
        b"\xa4seed\x03"  # "seed": 3, the run seed
        b"\xa9wall_time\xcb\x3f\xf8\x00\x00\x00\x00\x00\x00"  # "wall_time": 1.5, a float64
    )]
    back = decode(_bytes(frames))
    assert isinstance(back, RunStart)
    assert (back.variations, back.seed, back.wall_time) == ({"mass": decl}, 3, 1.5)
    assert type(back.wall_time) is float
    end = RunEnd("r1", 5, 8, 2, "cpu")
    assert _v2(_bytes(encode(end, publisher="p", number=2, streams={"batch/obs": 1}, version=1))) == _bytes(
        encode(end, publisher="p", number=2, streams={"batch/obs": 1}))
    assert _bytes(encode(end, publisher="p", number=2, streams={"batch/obs": 1}, version=1)) == [b"run/end", (
        b"\xde\x00\x11\xa1v\x01\xa4kind\xa7run_end" + common  # map of 17 entries
        + b"\xa3seq\x05\xa4step\x08\xa3pub\xa1p\xa1n\x02"
        b"\xa7tensors\x90\xaanum_worlds\x02\xa6device\xa3cpu\xa6schema\x80\xa8metadata\x80"
        b"\xaavariations\x80\xa4seed\xc0\xa9wall_time\xcb" + b"\x00" * 8  # defaults: {}, nil, 0.0
        + b"\xabinterrupted\xc2"  # "interrupted": false
        b"\xa7streams\x81\xa9batch/obs\x01"  # messages numbered per topic in this run
    )]
    stopped = decode(encode(RunEnd("r1", 5, 8, 2, "cpu", interrupted=True)))
    assert isinstance(stopped, RunEnd)
    assert stopped.interrupted is True


DTYPES = [torch.bool, torch.uint8, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64]


def _values(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape, dtype=dtype)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(3,), (3, 0), (3, 2, 5), (0,)], ids=str)
def test_field_round_trips_bit_exact(dtype: torch.dtype, shape: tuple[int, ...], version: int) -> None:
    n = shape[0]
    value = _values(dtype, shape)
    message = Batch("r", 1, 2, "batch/t", torch.arange(n), torch.zeros(n, dtype=torch.int64), {"v": value})
    out = decode(encode(message, version=version))
    assert isinstance(out, Batch)
    got = out.fields["v"]
    assert got.dtype == dtype
    assert got.shape == value.shape
    assert got.device.type == "cpu"
    # compare raw bits (bfloat16/float16 included; NaN-safe)
    assert got.reshape(-1).view(torch.uint8).tolist() == value.reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_zero_dim_tensor_round_trips(dtype: torch.dtype) -> None:
    from broker.wire import _bytes, _frame, _tensor  # the tensor <-> frame helpers, in isolation

    value = _values(dtype, (1,)).reshape(())
    frame = _frame(value)
    assert frame.nbytes == value.element_size()  # one item, no shape bytes
    name = str(dtype).removeprefix("torch.")
    back = _tensor("batch/t", "v", name, (), _bytes(memoryview(bytes(frame)), copy=True))
    assert back.shape == ()
    assert back.dtype == dtype
    assert back.reshape(1).view(torch.uint8).tolist() == value.reshape(1).view(torch.uint8).tolist()


def test_zero_dim_field_is_rejected_as_a_message() -> None:
    message = Batch("r", 0, 0, "batch/t", W, E, {"s": torch.tensor(3.0)})
    with pytest.raises(WireFormatError, match=r"'s': expected a leading worlds dimension of 2, got shape \(\)"):
        decode(encode(message))


def test_labels_metadata_and_hooks_round_trip() -> None:
    v = VariationSample("r", 0, 0, "color", "build", W, E, torch.tensor([1, 0]), ("red", "blue"))
    out = decode(encode(v))
    assert isinstance(out, VariationSample)
    assert out.labels == ("red", "blue")
    assert out.topic == "variation/color"
    start = RunStart("r", 0, 0, 2, "cuda:0", {"batch/a": {"x/y": FieldSpec("bfloat16", (2, 3))}},
                     {"seed": 1, "nested": {"a": [1, 2.5, None, True, b"\x00"]}})
    got = decode(encode(start))
    assert isinstance(got, RunStart)
    assert got.schema == start.schema
    assert got.metadata == start.metadata
    assert got.device == "cuda:0"
    b = Batch("r", 1, 0, "batch/a", W, E, {}, "pre_reset")
    assert decode(encode(b)).hook == "pre_reset"  # type: ignore[union-attr]


@pytest.mark.parametrize("version", [1, 2])
def test_decode_wraps_zmq_frames_without_copy(version: int) -> None:
    message = Batch("r", 0, 0, "batch/a", W, E, {"x": torch.arange(20_000, dtype=torch.float32).reshape(2, -1)})
    frames = [zmq.Frame(bytes(f)) for f in encode(message, version=version)]
    out = decode(frames)
    assert isinstance(out, Batch)
    # protocol 1: x is frame 4; protocol 2: at byte 128 of the data frame (after worlds and episodes)
    frame, offset = (frames[4], 0) if version == 1 else (frames[2], 128)
    address = np.frombuffer(frame.buffer, dtype=np.uint8).ctypes.data + offset
    assert out.fields["x"].data_ptr() == address  # the tensor lives in the received frame
    assert torch.equal(out.fields["x"], message.fields["x"])
    if version == 2:  # views of one frame, but disjoint: writing one leaves the others alone
        out.fields["x"].fill_(-1)
        assert out.worlds.tolist() == [0, 2]
        assert out.episodes.tolist() == [1, 0]


def test_encode_frames_are_views_of_the_tensors() -> None:
    x = torch.zeros(2, 4)
    frames = encode(Batch("r", 0, 0, "batch/a", W, E, {"x": x}), version=1)
    x += 1  # borrowed: the frame sees the change, so send before the tensors change
    assert bytes(frames[4]) == torch.ones(2, 4).numpy().tobytes()


def test_encode_rejects_what_the_wire_cannot_carry() -> None:
    with pytest.raises(WireFormatError, match=r"tensor 'z': dtype torch.complex64 is not on the wire whitelist"):
        encode(Batch("r", 0, 0, "batch/a", W, E, {"z": torch.zeros(2, dtype=torch.complex64)}))
    with pytest.raises(WireFormatError, match="header cannot be encoded with msgpack") as info:
        encode(RunStart("r", 0, 0, 2, "cpu", {}, {"bad": object()}))
    assert info.value.reason == "encode"
    assert isinstance(info.value.__cause__, TypeError)


def test_encode_refuses_run_messages_receivers_would_reject() -> None:
    """msgpack packs int map keys and any dtype string, but receivers reject them: refusing at
    encode time tells the caller, where a receiver could only count the run's start as bad."""
    with pytest.raises(WireFormatError, match=r"topic 'run/start': receivers would reject this message "
                                              r"\(header\): .*int is not allowed for map key") as info:
        encode(RunStart("r", 0, 0, 2, "cpu", {}, {"gains": {1: 0.5}}))
    assert info.value.reason == "encode"
    with pytest.raises(WireFormatError, match=r"topic 'run/end': receivers would reject this message \(dtype\): "
                                              r".*field 'z': dtype 'complex64' is not on the whitelist"):
        encode(RunEnd("r", 0, 0, 2, "cpu", {"batch/a": {"z": FieldSpec("complex64", (2,))}}))


# -- bad input ---------------------------------------------------------------------------


def _good(version: int = 1) -> list[bytes]:
    return _bytes(encode(Batch("r", 0, 0, "batch/a", W, E, {"x": torch.ones(2, 3)}), version=version))


def _with_header(version: int = 1, **changes: object) -> list[bytes]:
    frames = _good(version)
    head = msgpack.unpackb(frames[1])
    head.update(changes)
    frames[1] = msgpack.packb(head)
    return frames


def _field(entry: list[object], version: int = 1) -> list[bytes]:
    return _with_header(version, fields=[entry])


V2_DATA = 64 + 64 + 24  # worlds, episodes (16 bytes each, padded to 64), then x: 2x3 float32


BAD: list[tuple[str, list[bytes], str, str]] = [
    ("no frames", [], "missing frames", r"expected at least 2 frames \(topic, header\), got 0"),
    ("topic only", _good()[:1], "missing frames", "got 1"),
    ("truncated", _good()[:4], "missing frames", "header describes 3 tensor frames, got 2"),
    ("extra frame", [*_good(), b"\x00"], "extra frames", "header describes 3 tensor frames, got 4"),
    ("short frame", [*_good()[:4], _good()[4][:-1]], "shape", r"shape \[2, 3\] of float32 needs 24 bytes, frame has 23"),
    ("shape mismatch", _field(["x", "float32", [2, 4], 2]), "shape", "needs 32 bytes, frame has 24"),
    ("negative dim", _field(["x", "float32", [-2, 3], 2]), "shape", r"invalid shape \[-2, 3\]"),
    ("unknown dtype", _field(["x", "complex64", [2, 3], 2]), "dtype", "dtype 'complex64' is not on the whitelist"),
    ("object dtype", _field(["x", "object", [2, 3], 2]), "dtype", "'object'"),
    ("bad entry", _field(["x", "float32"]), "header", r"must be \[name, dtype, shape, frame\]"),
    ("frame reused", _field(["x", "float32", [2, 3], 0]), "header", "are not each of 0..2 once"),
    ("wrong version", _with_header(v=3), "version", r"unsupported protocol version 3 \(this codec reads versions 1, 2\)"),
    ("version 2 without data frame", _good(2)[:2], "missing frames",
     r"header describes 1 data frame \(protocol 2\), got 0"),
    ("version 2 frame per tensor", _with_header(v=2), "extra frames", r"describes 1 data frame \(protocol 2\), got 3"),
    ("version 1 data frame", _with_header(2, v=1), "missing frames", "header describes 3 tensor frames, got 1"),
    ("version 2 extra frame", [*_good(2), b""], "extra frames", "got 2"),
    ("version 2 short data", [*_good(2)[:2], _good(2)[2][:-1]], "shape",
     rf"the data frame has {V2_DATA - 1} bytes, its 3 tensors need {V2_DATA} \(protocol 2: each at a 64-byte"),
    ("version 2 long data", [*_good(2)[:2], _good(2)[2] + b"\x00"], "shape", f"has {V2_DATA + 1} bytes"),
    ("version 2 unpadded", [*_good(2)[:2], WORLDS_FRAME + EPISODES_FRAME + bytes(24)], "shape", "has 56 bytes"),
    ("version 2 shape mismatch", _field(["x", "float32", [2, 4], 2], 2), "shape", f"need {V2_DATA + 8}"),
    ("version 2 bool byte", _field(["x", "bool", [2, 12], 2], 2), "value", "bool frame holds bytes other than 0 and 1"),
    ("version 2 position reused", _field(["x", "float32", [2, 3], 1], 2), "header", "are not each of 0..2 once"),
    ("version run data frame", [*_bytes(encode(RunEnd("r", 0, 0, 2, "cpu"))), b""], "extra frames",
     r"header describes 0 data frames \(protocol 2\), got 1"),
    ("no version", [b"batch/a", msgpack.packb({"kind": "batch"})], "version", "version None"),
    ("unknown kind", _with_header(kind="pickle"), "kind", "unknown message kind 'pickle'"),
    ("bad seq", _with_header(seq=-1), "header", "header key 'seq' is missing or invalid: -1"),
    ("bool seq", _with_header(seq=True), "header", "'seq'"),
    ("bad hook", _with_header(hook="later"), "header", "unknown hook 'later'"),
    ("not msgpack", [b"batch/a", b"\xc1"], "header", "header is not valid msgpack"),
    ("not a map", [b"batch/a", msgpack.packb([1, 2])], "header", "must be a msgpack map, got list"),
    ("ext type", [b"batch/a", msgpack.packb(msgpack.ExtType(5, b"x"))], "header", "ext type 5"),
    ("topic kind", [b"episode/x", *_good()[1:]], "topic", "does not fit message kind 'batch'"),
    ("topic utf8", [b"\xff\xfe", *_good()[1:]], "topic", "is not UTF-8"),
    ("worlds dtype", _with_header(tensors=[["worlds", "int32", [4], 0], ["episodes", "int64", [2], 1]]),
     "schema", "'worlds': expected int64"),
    ("leading dim", [*_field(["x", "float32", [3, 2], 2])], "schema", r"leading worlds dimension of 2, got shape \(3, 2\)"),
    ("bool byte", [*_field(["x", "bool", [2, 12], 2])], "value", "bool frame holds bytes other than 0 and 1"),
]


@pytest.mark.parametrize(("frames", "reason", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_raises_with_reason(frames: list[bytes], reason: str, match: str) -> None:
    with pytest.raises(WireFormatError, match=match) as info:
        decode(frames)
    assert info.value.reason == reason
    assert reason in REASONS


def test_size_limits() -> None:
    with pytest.raises(WireFormatError, match=r"header of 1\d\d bytes exceeds max_header_size=100") as info:
        decode(_good(), max_header_size=100)
    assert info.value.reason == "header size"
    with pytest.raises(WireFormatError, match="exceeds max_message_size=64") as info:
        decode(_good(), max_message_size=64)
    assert info.value.reason == "too large"


def _empty_batch(shape: tuple[int, ...]) -> list[bytes]:
    none = torch.zeros(0, dtype=torch.int64)
    return _bytes(encode(Batch("r", 0, 0, "batch/a", none, none, {"x": torch.zeros(shape)})))


def test_shapes_are_bounded_by_max_message_size() -> None:
    """A shape may span at most max_message_size bytes with each 0 counted as 1: an empty field
    cannot declare rows that no message could carry (their products overflowed downstream)."""
    assert decode(_empty_batch((0, 64)), max_message_size=256).fields["x"].shape == (0, 64)  # type: ignore[union-attr]
    with pytest.raises(WireFormatError, match=r"tensor 'x': shape \[0, 65\] of float32 spans more than "
                                              r"max_message_size=256 bytes \(each 0 counted as 1\)") as info:
        decode(_empty_batch((0, 65)), max_message_size=256)
    assert info.value.reason == "shape"
    start = RunStart("r", 0, 0, 2, "cpu", {"batch/a": {"x": FieldSpec("float32", (65,))}})
    with pytest.raises(WireFormatError, match=r"schema of 'batch/a' field 'x': shape \[65\] of float32 spans "
                                              r"more than max_message_size=256 bytes") as info:
        decode(_bytes(encode(start)), max_message_size=256)
    assert info.value.reason == "shape"
    huge = RunStart("r", 0, 0, 2, "cpu", {"batch/a": {"x": FieldSpec("float32", (2**61,))}})
    with pytest.raises(WireFormatError, match="spans more than max_message_size=4611686018427387904 bytes"):
        decode(_bytes(encode(huge)), max_message_size=2**70)  # never beyond 2**62, whatever the caller allows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_random_bytes_never_escape_as_other_errors(frames: list[bytes]) -> None:
    try:
        decode(frames)
    except WireFormatError as exc:
        reason = exc.reason
        assert reason in REASONS


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_headers_never_escape_as_other_errors(data: st.DataObject) -> None:
    frames = _good()
    header = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 4))):
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.integers(0, 255))
    try:
        out: Message = decode([frames[0], bytes(header), *frames[2:]])
    except WireFormatError as exc:
        reason = exc.reason
        assert reason in REASONS
    else:
        assert isinstance(out, Batch)


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bfloat16, torch.bool])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_frames_at_any_alignment_decode_to_aligned_tensors(dtype: torch.dtype, offset: int) -> None:
    """Small ZeroMQ messages live inside the message struct, at any byte offset."""
    from broker.wire import _NAMES, _bytes, _tensor

    want = (torch.arange(6) % 2).to(dtype).reshape(2, 3)
    raw = want.view(torch.uint8).numpy().tobytes() if dtype != torch.bool else \
        want.numpy().tobytes()
    buf = bytearray(offset) + bytearray(raw)
    view = memoryview(buf)[offset:]
    got = _tensor("batch/t", "x", _NAMES[dtype], (2, 3), _bytes(view, copy=True))
    assert got.dtype == dtype
    assert got.shape == (2, 3)
    assert got.data_ptr() % dtype.itemsize == 0
    assert torch.equal(got, want)


@settings(max_examples=60, deadline=None)
@given(dtypes=st.lists(st.sampled_from(DTYPES), max_size=4), n=st.integers(0, 5),
       seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
       wall=st.floats(0, 1e12, allow_nan=False), data=st.data())
def test_new_run_and_outcome_fields_round_trip_byte_for_byte(dtypes: list[torch.dtype], n: int, seed: int | None,
                                                             wall: float, data: st.DataObject) -> None:
    """Outcomes (any whitelisted dtype), declarations, the run seed and wall times come back as
    sent: each outcome's bytes, and the declarations equal (types included) to what was sent."""
    worlds = torch.arange(n)
    outcomes = {f"o{i}": _values(d, (n,)) for i, d in enumerate(dtypes)}
    end = EpisodeEnd("r", 3, 4, worlds, worlds, torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
                     torch.zeros(n, dtype=torch.bool), worlds, outcomes=outcomes)
    got = decode(_bytes(encode(end)))
    assert isinstance(got, EpisodeEnd)
    assert list(got.outcomes) == list(outcomes)
    for name, t in outcomes.items():
        assert got.outcomes[name].dtype == t.dtype
        assert got.outcomes[name].numpy().tobytes() == t.numpy().tobytes() if t.dtype != torch.bfloat16 else \
            got.outcomes[name].view(torch.int16).numpy().tobytes() == t.view(torch.int16).numpy().tobytes()
    number = st.one_of(st.integers(-(2**53), 2**53), st.floats(allow_nan=False, allow_infinity=False))
    decl = {"kind": data.draw(st.sampled_from(["uniform", "log_uniform", "normal", "choice", "design"])),
            "phase": data.draw(st.sampled_from(["build", "runtime"])),
            "shape": data.draw(st.lists(st.integers(0, 9), max_size=3)),
            "seed": data.draw(st.integers(-(2**63), 2**64 - 1)),
            "low": data.draw(st.one_of(st.none(), number, st.lists(number, max_size=3))),
            "labels": data.draw(st.lists(st.one_of(st.text(max_size=3), st.booleans(), st.integers(0, 9)),
                                         max_size=3))}
    for cls in (RunStart, RunEnd):
        run = cls("r", 0, 0, 2, "cpu", variations={"k": decl}, seed=seed, wall_time=wall)
        back = decode(_bytes(encode(run)))
        assert isinstance(back, cls)
        assert back.variations == {"k": decl}
        assert [type(v) for v in back.variations["k"].values()] == [type(v) for v in decl.values()]
        assert back.seed == seed
        assert type(back.seed) is type(seed)
        assert back.wall_time == wall
        assert type(back.wall_time) is float


def test_encode_refuses_declarations_receivers_would_reject() -> None:
    """A malformed declaration fails at the publisher (reason "encode", naming the key), not at
    every receiver; mapping proxies and tuples are sent as the maps and lists they stand for."""
    from types import MappingProxyType

    with pytest.raises(WireFormatError, match=r"variation 'mass': declaration 'seed' must be an int, got None") as info:
        encode(RunStart("r", 0, 0, 2, "cpu", variations={"mass": {"kind": "uniform", "phase": "build",
                                                                  "shape": [], "seed": None}}))
    assert info.value.reason == "encode"
    decl = MappingProxyType({"kind": "choice", "phase": "runtime", "shape": (), "seed": 1, "labels": ("a", "b")})
    back = decode(encode(RunEnd("r", 0, 0, 2, "cpu", variations=MappingProxyType({"c": decl}))))
    assert isinstance(back, RunEnd)
    assert back.variations == {"c": {"kind": "choice", "phase": "runtime", "shape": [], "seed": 1,
                                     "labels": ["a", "b"]}}


@pytest.mark.parametrize("name", ["success", "length", "world"])
def test_an_outcome_named_as_an_episode_column_is_rejected_and_not_encoded(name: str) -> None:
    """``RESERVED_OUTCOMES`` name the columns episode tables hold already. Before, the decoder
    took an outcome named so and the encoder sent one: each store then rejected the whole
    episode end, and the episodes it ended were never stored."""
    ones = torch.ones(2, dtype=torch.bool)
    end = EpisodeEnd("r", 0, 0, W, E, ones, ones, ~ones, torch.full((2,), 3), outcomes={"ret": torch.zeros(2)})
    frames = _bytes(encode(end))
    head = msgpack.unpackb(frames[1])
    head["outcomes"][0][0] = name
    with pytest.raises(WireFormatError, match=rf"outcome '{name}': the name of a column episode tables hold") as info:
        decode([frames[0], msgpack.packb(head), *frames[2:]])
    assert info.value.reason == "schema"
    with pytest.raises(WireFormatError, match=r"receivers would reject this message \(schema\)") as info:
        encode(dataclasses.replace(end, outcomes={name: torch.zeros(2)}))
    assert info.value.reason == "encode"
