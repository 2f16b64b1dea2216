"""The decoder's cache of checked tensor specs: a cache hit never lets through what the checks
refuse, and the cache stays bounded."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
import torch

from broker import Batch, WireFormatError, wire


def _batch(worlds: int = 4, width: int = 3, version: int = 1) -> list[bytes]:
    """A batch in protocol ``version`` (1 unless asked: most checks here are per tensor frame)."""
    fields = {"obs": torch.arange(worlds * width, dtype=torch.float32).reshape(worlds, width),
              "done": torch.arange(worlds) % 2 == 0}
    message = Batch("run", 1, 2, "batch/obs", torch.arange(worlds), torch.zeros(worlds, dtype=torch.int64),
                    fields)
    return [bytes(f) for f in wire.encode(message, publisher="p", number=5, version=version)]


def _header(frames: list[bytes], **changes: object) -> list[bytes]:
    head = msgpack.unpackb(frames[1])
    head.update(changes)
    return [frames[0], msgpack.packb(head, use_bin_type=True), *frames[2:]]


def _decode(frames: list[bytes]) -> Batch:
    message = wire.decode(frames, arrays="torch")
    assert isinstance(message, Batch)
    return message


@pytest.mark.parametrize("arrays", ["torch", "numpy"])
def test_cached_header_decodes_the_same_values(arrays: wire.Arrays) -> None:
    """A second message of the same shape (a cache hit) decodes to its own frames' values."""
    frames = _batch()
    wire.decode(frames, arrays=arrays)
    other = list(frames)
    other[4] = bytes(reversed(frames[4]))  # obs values changed, header unchanged
    message = wire.decode(other, arrays=arrays)
    assert isinstance(message, Batch)
    np.testing.assert_array_equal(np.asarray(message.fields["obs"]).reshape(-1),
                                  np.frombuffer(other[4], dtype=np.float32))
    np.testing.assert_array_equal(np.asarray(message.fields["done"]), np.frombuffer(other[5], dtype=np.bool_))


@pytest.mark.parametrize("arrays", ["torch", "numpy"])
def test_cached_protocol_2_header_decodes_the_same_values(arrays: wire.Arrays) -> None:
    """Protocol 2: a second message of the same shape decodes to its own data frame's values,
    at the offsets its shapes give (obs at 128: after worlds and episodes, 32 bytes each, padded
    to 64; done at 192)."""
    frames = _batch(version=2)
    wire.decode(frames, arrays=arrays)
    data = bytearray(frames[2])
    data[128:128 + 48] = bytes(reversed(data[128:128 + 48]))  # obs values changed, header unchanged
    data[192:196] = b"\x00\x01\x01\x00"
    message = wire.decode([*frames[:2], bytes(data)], arrays=arrays)
    assert isinstance(message, Batch)
    np.testing.assert_array_equal(np.asarray(message.fields["obs"]).reshape(-1),
                                  np.frombuffer(data[128:128 + 48], dtype=np.float32))
    assert np.asarray(message.fields["done"]).tolist() == [False, True, True, False]


def test_protocol_2_cache_hit_still_checks_its_data_frame() -> None:
    """Protocol 2, a cached layout: a data frame a byte short or long, a bool byte of 2, no data
    frame or two: each refused as on the first decode."""
    frames = _batch(version=2)
    _decode(frames)
    _decode(frames)
    data = frames[2]
    assert len(data) == 192 + 4
    for wrong in (data[:-1], data + b"\x00"):
        with pytest.raises(WireFormatError, match=f"the data frame has {len(wrong)} bytes, its 4 tensors need 196") as info:
            _decode([*frames[:2], wrong])
        assert info.value.reason == "shape"
    with pytest.raises(WireFormatError) as info:
        _decode([*frames[:2], data[:192] + b"\x02" + data[193:]])
    assert info.value.reason == "value"
    with pytest.raises(WireFormatError) as info:
        _decode(frames[:2])
    assert info.value.reason == "missing frames"
    with pytest.raises(WireFormatError) as info:
        _decode([*frames, b""])
    assert info.value.reason == "extra frames"
    assert _decode(frames).fields["obs"].shape == (4, 3)


def test_cache_hit_still_checks_frames() -> None:
    """Same header bytes as a decoded message, but a frame of the wrong size or a bool byte of 2:
    refused as the uncached decoder refuses it."""
    frames = _batch()
    _decode(frames)
    short = [*frames[:4], frames[4][:-4], frames[5]]
    with pytest.raises(WireFormatError, match="needs 48 bytes, frame has 44") as info:
        _decode(short)
    assert info.value.reason == "shape"
    bad_bool = [*frames[:5], b"\x02" + frames[5][1:]]
    with pytest.raises(WireFormatError) as info:
        _decode(bad_bool)
    assert info.value.reason == "value"
    with pytest.raises(WireFormatError) as info:
        _decode(frames[:-1])
    assert info.value.reason == "missing frames"


@pytest.mark.parametrize(("key", "name", "change", "reason"), [
    ("fields", "obs", lambda e: e.__setitem__(2, [4, True]), "shape"),  # == [4, 1], not to the decoder
    ("fields", "obs", lambda e: e.__setitem__(2, [4, 1.0]), "shape"),  # likewise
    ("tensors", "episodes", lambda e: e.__setitem__(3, True), "header"),  # frame index 1 -> True
    ("fields", "obs", lambda e: e.__setitem__(1, "float64"), "shape"),  # its frame no longer fits
    ("fields", "obs", lambda e: e.__setitem__(1, "complex64"), "dtype"),
])
def test_mutated_specs_after_a_cache_hit_are_refused(key: str, name: str, change: Callable[[list[Any]], None],
                                                     reason: str) -> None:
    """Entries equal to cached ones under ``==`` (and hashing alike) but not on the wire are
    checked afresh."""
    frames = _batch(width=1)
    _decode(frames)
    _decode(frames)  # now a cache hit
    entries = msgpack.unpackb(frames[1])[key]
    change(next(e for e in entries if e[0] == name))
    with pytest.raises(WireFormatError) as info:
        _decode(_header(frames, **{key: entries}))
    assert info.value.reason == reason


def test_cache_respects_the_size_limit() -> None:
    """Specs checked under a large max_message_size are not reused under a smaller one: an empty
    message whose declared shape spans more than the smaller limit is still refused."""
    empty = _header(_batch(), fields=[["obs", "float32", [0, 1 << 20], 2], ["done", "bool", [0], 3]],
                    tensors=[["worlds", "int64", [0], 0], ["episodes", "int64", [0], 1]])
    empty = [empty[0], empty[1], b"", b"", b"", b""]
    message = _decode(empty)  # default limit: fine, and now cached
    assert tuple(message.fields["obs"].shape) == (0, 1 << 20)
    with pytest.raises(WireFormatError, match="spans more than") as info:
        wire.decode(empty, max_message_size=1 << 20)
    assert info.value.reason == "shape"


def test_cache_stays_bounded() -> None:
    """Hundreds of distinct shapes: the cache holds at most its bound, the newest ones."""
    for width in range(1, 2 * wire._SPEC_CACHE_SIZE):
        message = _decode(_batch(width=width))
        assert tuple(message.fields["obs"].shape) == (4, width)
    assert len(wire._spec_cache) <= wire._SPEC_CACHE_SIZE
    newest = msgpack.packb(msgpack.unpackb(_batch(width=2 * wire._SPEC_CACHE_SIZE - 1)[1])["fields"],
                           use_bin_type=True)
    assert any(key[2] == newest for key in wire._spec_cache)


def test_a_cached_layout_still_counts_frames() -> None:
    """After a hit on the layout cache (same spec lists), a message with a frame too few or too
    many is refused as on the first decode."""
    frames = _batch()
    _decode(frames)
    _decode(frames)  # the layout is cached now
    with pytest.raises(WireFormatError) as info:
        _decode(frames[:-1])
    assert info.value.reason == "missing frames"
    with pytest.raises(WireFormatError) as info:
        _decode([*frames, frames[-1]])
    assert info.value.reason == "extra frames"
    assert len(_decode(frames).fields) == 2


@pytest.mark.parametrize(("changes", "reason"), [
    ({"fields": [["obs", "float32", [4, 3], 2], ["obs", "bool", [4], 3]]}, "schema"),  # duplicate names
    ({"tensors": [["episodes", "int64", [4], 0], ["worlds", "int64", [4], 1]]}, "schema"),  # own order
    ({"fields": [["obs", "float32", [4, 3], 2], ["done", "bool", [4], 2]]}, "header"),  # a frame twice
])
def test_headers_refused_for_their_layout_are_refused_every_time(changes: dict[str, Any], reason: str) -> None:
    """A layout that fails a header-only check is never cached: the same header is refused
    again (its spec lists are cached, as the specs alone are sound)."""
    bad = _header(_batch(), **changes)
    for _ in range(3):
        with pytest.raises(WireFormatError) as info:
            _decode(bad)
        assert info.value.reason == reason
