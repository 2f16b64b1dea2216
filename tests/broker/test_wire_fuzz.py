"""Fuzzing the wire decoder with structured mutations of real messages.

Real messages of every kind are encoded, their msgpack header is unpacked and mutated as a tree
(any value at any path replaced by a value of another type, keys dropped and added, list items
removed, duplicated, swapped or copied from elsewhere, numbers nudged to the edges of their
range), re-packed, and the frames are mutated too (truncated, extended, swapped, dropped, added,
bytes flipped, bool bytes set to 2..255). :func:`broker.wire.decode_envelope` must then either
return a message that keeps the structural contract of ``broker/messages.py`` (checked byte for
byte against the frames its header names), or raise :class:`WireFormatError` with a reason from
``broker.wire.REASONS``; nothing else may escape. Decoded to numpy (``arrays="numpy"``, the storage
daemon's decoder), the same bytes must give the same error, or the same message as numpy arrays
over the same bytes.

The normal suite runs a few hundred cases. A larger campaign:

    WORLDTAP_FUZZ_EXAMPLES=100000 python -m pytest tests/broker/test_wire_fuzz.py -q -o timeout=0

(``-o timeout=0`` lifts the suite's per-test timeout, which a campaign of minutes exceeds). To count every escape instead of stopping at
the first, run the module: ``python tests/broker/test_wire_fuzz.py 100000 [first seed]``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import random
import sys
import traceback
from collections.abc import Mapping
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import (
    Batch,
    BFloat16Bits,
    EpisodeEnd,
    FieldSpec,
    RunEnd,
    RunStart,
    VariationSample,
    WireFormatError,
    encode,
)
from broker.messages import RESERVED_OUTCOMES
from broker.wire import (
    DEFAULT_MAX_MESSAGE_SIZE,
    DTYPES,
    MAX_DIMS,
    REASONS,
    Decoded,
    decode_envelope,
    message_tensors,
    tensor_spec,
)

EXAMPLES = int(os.environ.get("WORLDTAP_FUZZ_EXAMPLES", "300"))
HOOKS = ("pre_step", "post_step", "pre_reset", "post_reset")


def _real_messages() -> dict[str, list[bytes]]:
    """Frames of real messages of every kind, by name."""
    g = torch.Generator().manual_seed(7)
    w = torch.tensor([0, 3, 5])
    e = torch.tensor([2, 0, 1])
    batch = Batch("run-1", 4, 9, "batch/obs", w, e, {
        "pos": torch.randn(3, 4, generator=g),
        "done": torch.tensor([True, False, True]),
        "img": torch.randint(0, 255, (3, 2, 2), dtype=torch.uint8, generator=g),
        "half": torch.randn(3, 2, generator=g).to(torch.bfloat16),
        "count": torch.tensor([7, -1, 2**40]),
        "mask": torch.rand(3, 2, generator=g) > 0.5,
        "none": torch.zeros(3, 0, dtype=torch.float16),
    }, "pre_reset")
    empty = Batch("run-1", 5, 9, "batch/obs", torch.zeros(0, dtype=torch.int64),
                  torch.zeros(0, dtype=torch.int64), {"pos": torch.zeros(0, 4)})
    end = EpisodeEnd("run-1", 6, 10, w, e, torch.tensor([True, False, False]),
                     torch.tensor([False, True, False]), torch.tensor([False, False, True]),
                     torch.tensor([5, 12, 1]),
                     outcomes={"return": torch.tensor([1.5, -2.0, 0.0]), "hits": torch.tensor([3, 0, 1]),
                               "half": torch.tensor([0.5, 1.0, 2.0], dtype=torch.bfloat16)})
    labelled = VariationSample("run-1", 1, 0, "color", "runtime", w, e, torch.tensor([1, 0, 2]),
                               ("red", 2, 1.5, True))
    plain = VariationSample("run-1", 2, 0, "mass", "build", w, e, torch.randn(3, 2, generator=g))
    schema = {"batch/obs": {"pos": FieldSpec("float32", (4,)), "done": FieldSpec("bool", ()),
                            "img": FieldSpec("uint8", (2, 2)), "half": FieldSpec("bfloat16", (2,))},
              "batch/act": {"a": FieldSpec("int64", (0, 3))}}
    metadata = {"task": "lift", "seed": 3, "nested": {"a": [1, 2.5, None, True, b"\x00"], "b": {"c": "d"}}}
    variations = {
        "mass": {"kind": "log_uniform", "phase": "runtime", "shape": [], "seed": 11, "low": 0.1, "high": 10.0},
        "pos": {"kind": "normal", "phase": "build", "shape": [2], "seed": -4, "mean": [0.0, 1], "std": [1.0, 2.0],
                "low": None, "high": None},
        "color": {"kind": "choice", "phase": "runtime", "shape": [], "seed": 2**40, "labels": ["red", 2, 1.5, True],
                  "weights": None},
        "grid": {"kind": "design", "phase": "build", "shape": [3], "seed": 0, "low": [0, 0, 0], "high": [1, 2, 3],
                 "note": {"from": "sobol"}},
    }
    start = RunStart("run-1", 0, 0, 8, "cuda:0", schema, metadata, variations=variations, seed=5,
                     wall_time=1_700_000_000.25)
    stop = RunEnd("run-1", 7, 11, 8, "cpu", schema, metadata, variations=variations, seed=None, wall_time=0,
                  interrupted=True)
    envelopes: dict[str, tuple[Any, int, dict[str, int] | None]] = {
        "batch": (batch, 3, None), "empty batch": (empty, 4, None), "episode end": (end, 0, None),
        "labelled variation": (labelled, 1, None), "variation": (plain, 0, None),
        "run start": (start, 0, None), "run end": (stop, 0, {"batch/obs": 5, "episode/end": 1})}
    real = {}
    for name, (m, n, streams) in envelopes.items():  # protocol 2 (what publishers send), and 1
        real[name] = [bytes(f) for f in encode(m, publisher="pub-a", number=n, streams=streams)]
        real[f"{name} (v1)"] = [bytes(f) for f in encode(m, publisher="pub-a", number=n, streams=streams, version=1)]
    return real


REAL = _real_messages()

# -- mutations ------------------------------------------------------------------------------

KNOWN_STRINGS = [*DTYPES, "complex64", "object", "batch", "episode_end", "variation", "run_start",
                 "run_end", *HOOKS, "build", "runtime", "worlds", "episodes", "success", "terminated",
                 "truncated", "length", "value", "pos", "done", "batch/obs", "episode/end", "dtype",
                 "shape", "", "x", "uniform", "log_uniform", "normal", "choice", "design", "return"]
KNOWN_KEYS = ["v", "kind", "run", "seq", "step", "pub", "n", "tensors", "fields", "hook", "key",
              "phase", "labels", "num_worlds", "device", "schema", "metadata", "streams", "dtype",
              "shape", "extra", "outcomes", "variations", "seed", "wall_time", "interrupted", "low", "high", "mean",
              "std", "labels", "weights"]
EDGE_INTS = [0, 1, 2, 3, -1, -2, 2**31, 2**32, 2**53, 2**62, 2**63 - 1, 2**64 - 1, -(2**63)]


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A value of any type msgpack can carry, biased towards edges."""
    choice = rng.randrange(14 if depth < 2 else 9)
    if choice == 0:
        return None
    if choice == 1:
        return rng.choice([True, False])
    if choice == 2:
        return rng.choice(EDGE_INTS)
    if choice == 3:
        return rng.choice([0.0, -0.0, 1.0, 1.5, -2.0, math.inf, -math.inf, math.nan, 1e308])
    if choice == 4:
        return rng.choice(KNOWN_STRINGS)
    if choice == 5:
        return rng.choice(["a" * 10_000, "\u00e9\u4e2d", "../x", "batch/", "variation/"])
    if choice == 6:
        return rng.choice([b"", b"\x00\xff", b"int64"])
    if choice == 7:
        return rng.choice([msgpack.ExtType(5, b"x"), msgpack.Timestamp(1, 2)])
    if choice == 8:
        return rng.randrange(-1000, 1000)
    if choice == 9:  # a shape-like list
        return [rng.choice([*EDGE_INTS, math.inf, -1, 0, 4]) for _ in range(rng.randrange(5))]
    if choice == 10:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if choice == 11:
        return {rng.choice(KNOWN_KEYS): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if choice == 12:  # a schema entry, right or nearly
        return {"dtype": rng.choice([*DTYPES, "complex64", 3, None, ["float32"]]),
                "shape": rng.choice([[], [2], [0, 2**62, 4], [math.inf], [-1], "2", [2**40, 2**40], None])}
    return [rng.choice(KNOWN_STRINGS), rng.choice([*DTYPES, "object", 1]),
            rng.choice([[3], [3, 2], [0], [], [2**62], [3, -1], None]), rng.randrange(-1, 10)]


Path = tuple[Any, ...]


def _paths(node: Any, prefix: Path = ()) -> list[Path]:
    out = []
    if isinstance(node, dict):
        items: Any = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return out
    for key, child in items:
        out.append((*prefix, key))
        out.extend(_paths(child, (*prefix, key)))
    return out


def _get(node: Any, path: Path) -> Any:
    for key in path:
        node = node[key]
    return node


def _containers(head: dict[str, Any]) -> list[Path]:
    return [()] + [p for p in _paths(head) if isinstance(_get(head, p), dict | list)]


def _mutate_header(rng: random.Random, head: dict[str, Any]) -> None:
    paths = _paths(head)
    op = rng.randrange(7)
    if op == 0 and paths:  # replace any value by a value of any type
        path = rng.choice(paths)
        _get(head, path[:-1])[path[-1]] = _value(rng)
    elif op == 1 and paths:  # nudge a number to the edges of its range
        ints = [p for p in paths if isinstance(_get(head, p), int)]
        if ints:
            path = rng.choice(ints)
            old = _get(head, path)
            new = rng.choice([old + 1, old - 1, -old, 0, *EDGE_INTS])
            _get(head, path[:-1])[path[-1]] = new if -(2**63) <= new < 2**64 else 0
    elif op == 2 and paths:  # drop a key or list item
        path = rng.choice(paths)
        del _get(head, path[:-1])[path[-1]]
    elif op == 3:  # add a key or list item
        node = _get(head, rng.choice(_containers(head)))
        if isinstance(node, dict):
            node[rng.choice([*KNOWN_KEYS, "zz"])] = _value(rng)
        else:
            node.insert(rng.randrange(len(node) + 1), _value(rng))
    elif op == 4 and len(paths) > 1:  # copy a value from elsewhere (duplicate names, swapped shapes)
        src, dst = rng.choice(paths), rng.choice(paths)
        if dst[:len(src)] != src:  # not into itself
            _get(head, dst[:-1])[dst[-1]] = copy.deepcopy(_get(head, src))
    elif op == 5:  # duplicate, remove or swap items of a list
        lists = [p for p in _containers(head) if isinstance(_get(head, p), list) and _get(head, p)]
        if lists:
            node = _get(head, rng.choice(lists))
            i, j = rng.randrange(len(node)), rng.randrange(len(node))
            action = rng.randrange(3)
            if action == 0:
                node.insert(j, copy.deepcopy(node[i]))
            elif action == 1:
                node[i], node[j] = node[j], node[i]
            else:
                node.clear()
    elif op == 6:  # change a tensor entry's dtype, shape or frame index
        entries = [e for k in ("tensors", "fields", "outcomes") if isinstance(head.get(k), list)
                   for e in head[k] if isinstance(e, list) and len(e) == 4]
        if entries:
            entry = rng.choice(entries)
            slot = rng.randrange(1, 4)
            if slot == 1:
                entry[1] = rng.choice(list(DTYPES))
            elif slot == 2:
                entry[2] = rng.choice([[], [3], [3, 1], [0], [0, 2**62, 4], [2**31, 0], [3, 2, 2, 1],
                                       [2**62, 2**62], [1] * 40, [3, 2**64 - 1]])
            else:
                entry[3] = rng.choice([0, 1, 2, 9, 2**63 - 1])


def _mutate_frames(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = list(frames)
    op = rng.randrange(8)
    payload = range(2, len(frames))
    if op == 0 and payload:  # truncate
        i = rng.choice(payload)
        frames[i] = frames[i][:rng.randrange(len(frames[i]) + 1)]
    elif op == 1 and payload:  # extend
        i = rng.choice(payload)
        frames[i] += bytes(rng.randrange(256) for _ in range(rng.choice([1, 2, 8, 16])))
    elif op == 2 and len(payload) > 1:  # swap two tensor frames
        i, j = rng.sample(payload, 2)
        frames[i], frames[j] = frames[j], frames[i]
    elif op == 3 and frames:  # drop a frame (topic and header included)
        del frames[rng.randrange(len(frames))]
    elif op == 4:  # add a frame
        frames.insert(rng.randrange(len(frames) + 1), bytes(rng.randrange(256) for _ in range(rng.randrange(17))))
    elif op == 5 and payload:  # flip a byte of a tensor frame (into 2..255: bad bools)
        i = rng.choice(payload)
        if frames[i]:
            raw = bytearray(frames[i])
            raw[rng.randrange(len(raw))] = rng.randrange(2, 256)
            frames[i] = bytes(raw)
    elif op == 6 and frames:  # another topic
        frames[0] = rng.choice([b"batch/obs", b"batch/", b"episode/end", b"run/start", b"run/end",
                                b"variation/mass", b"", b"\xff", b"batch/\xc3"])
    elif op == 7 and len(frames) > 1 and frames[1]:  # raw header byte
        raw = bytearray(frames[1])
        raw[rng.randrange(len(raw))] = rng.randrange(256)
        frames[1] = bytes(raw)
    return frames


def mutated(seed: int) -> list[bytes]:
    """The frames of one real message after 1-3 structured mutations chosen by ``seed``."""
    rng = random.Random(seed)
    frames = list(list(REAL.values())[rng.randrange(len(REAL))])
    for _ in range(rng.choice([1, 1, 2, 3])):
        if rng.random() < 0.7 and len(frames) > 1:
            try:
                head = msgpack.unpackb(frames[1], raw=False, strict_map_key=False, timestamp=0)
            except (ValueError, TypeError, msgpack.UnpackException):  # a raw byte flip broke it
                frames = _mutate_frames(rng, frames)
                continue
            if isinstance(head, dict):
                _mutate_header(rng, head)
                frames[1] = msgpack.packb(head, use_bin_type=True)
                continue
        frames = _mutate_frames(rng, frames)
    return frames


# -- the contract ---------------------------------------------------------------------------


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _vector(t: object, dtype: torch.dtype, n: int | None = None) -> int:
    assert isinstance(t, torch.Tensor)
    assert t.dtype == dtype
    assert t.dim() == 1
    assert n is None or t.shape[0] == n
    return int(t.shape[0])


def _tensor_ok(t: object, n: int | None) -> None:
    assert isinstance(t, torch.Tensor)
    assert t.dtype in DTYPES.values()
    assert t.device.type == "cpu"
    assert t.is_contiguous()
    if n is not None:
        assert t.dim() >= 1
        assert t.shape[0] == n
    assert t.numel() * t.element_size() <= DEFAULT_MAX_MESSAGE_SIZE
    if t.dtype == torch.bool and t.numel():
        assert int(t.view(torch.uint8).max()) <= 1, "bool byte not 0/1"  # poisons torch ops
    t.clone().sum()  # usable by ordinary torch code


def _metadata_ok(value: Any, depth: int = 0) -> None:
    assert depth <= 64
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str | bytes)
            _metadata_ok(v, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _metadata_ok(v, depth + 1)
    else:
        assert value is None or type(value) in (bool, int, float, str, bytes)


def _numbers_ok(value: Any) -> bool:
    if isinstance(value, list):
        return all(_numbers_ok(v) for v in value)
    return type(value) in (int, float)


def _declaration_ok(key: Any, decl: Any) -> None:
    """What ``broker/messages.py`` promises about a variation declaration."""
    assert isinstance(key, str), f"declaration key {key!r}"
    assert key, "empty declaration key"
    assert isinstance(decl, dict)
    assert decl["kind"] in ("uniform", "log_uniform", "normal", "choice", "design"), f"kind {decl['kind']!r}"
    assert decl["phase"] in ("build", "runtime"), f"phase {decl['phase']!r}"
    assert type(decl["shape"]) is list
    assert len(decl["shape"]) <= MAX_DIMS
    assert all(_count(d) for d in decl["shape"]), f"declaration shape {decl['shape']!r}"
    assert type(decl["seed"]) is int, f"declaration seed {decl['seed']!r}"
    for name in ("low", "high", "mean", "std", "weights"):
        assert decl.get(name) is None or _numbers_ok(decl[name]), f"declaration {name} {decl[name]!r}"
    labels = decl.get("labels")
    assert labels is None or (type(labels) is list and all(type(x) in (str, int, float, bool) for x in labels))
    _metadata_ok(decl)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _header(frames: list[bytes]) -> dict[str, Any]:
    head = msgpack.unpackb(frames[1], raw=False, timestamp=0)
    assert isinstance(head, dict)
    return head


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (NaN equals NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def check_contract(decoded: Decoded, frames: list[bytes]) -> None:
    """Everything ``broker/messages.py`` promises about a decoded message, and every tensor equal
    byte for byte to the frame its header names."""
    m = decoded.message
    assert isinstance(decoded.publisher, str)
    assert _count(decoded.number)
    assert isinstance(decoded.streams, Mapping)
    assert all(isinstance(k, str) and _count(v) for k, v in decoded.streams.items())
    assert isinstance(m.run, str)
    assert _count(m.seq)
    assert _count(m.step)
    assert isinstance(m.topic, str)
    head = _header(frames)
    assert frames[0] == m.topic.encode()
    for key, value in (("run", m.run), ("seq", m.seq), ("step", m.step), ("pub", decoded.publisher),
                       ("n", decoded.number)):
        assert _same(head[key], value), key
    if isinstance(m, RunStart | RunEnd):
        assert m.topic == ("run/start" if isinstance(m, RunStart) else "run/end")
        assert _count(m.num_worlds)
        assert isinstance(m.device, str)
        assert isinstance(m.schema, Mapping)
        for topic, specs in m.schema.items():
            assert isinstance(topic, str)
            assert isinstance(specs, Mapping)
            for name, spec in specs.items():
                assert isinstance(name, str)
                assert isinstance(spec, FieldSpec)
                assert spec.dtype in DTYPES
                assert isinstance(spec.shape, tuple)
                assert len(spec.shape) <= MAX_DIMS
                assert all(_count(d) for d in spec.shape)
                # one world's row must fit a message, so no size derived from it overflows
                span = math.prod(max(d, 1) for d in spec.shape) * DTYPES[spec.dtype].itemsize
                assert span <= DEFAULT_MAX_MESSAGE_SIZE, f"schema field {name!r} spans {span} bytes"
        assert isinstance(m.metadata, dict)
        _metadata_ok(m.metadata)
        assert len(frames) == 2
        if isinstance(m, RunStart):
            assert not decoded.streams
        # what the header said, not a coercion of it (no "2" or 2.0 or True taken for a 2)
        assert _same(head["schema"], {t: {f: s.to_dict() for f, s in fs.items()} for t, fs in m.schema.items()}), \
            "schema differs from the header's"
        assert _same(head["metadata"], m.metadata), "metadata differs from the header's"
        assert _same(head["streams"] if isinstance(m, RunEnd) else {}, dict(decoded.streams)), "streams differ"
        assert _same(head["variations"], m.variations), "variations differ from the header's"
        for key, decl in m.variations.items():
            _declaration_ok(key, decl)
        assert m.seed is None or (type(m.seed) is int and -(2**63) <= m.seed < 2**64)
        assert type(m.wall_time) is float
        assert math.isfinite(m.wall_time)
        assert m.wall_time >= 0
        assert _same(head["wall_time"], m.wall_time), "wall_time differs from the header's"
        if isinstance(m, RunEnd):
            assert _same(head["interrupted"], m.interrupted), "interrupted differs from the header's"
        return
    n = _vector(m.worlds, torch.int64)
    _vector(m.episodes, torch.int64, n)
    tensors: dict[str, torch.Tensor] = {"worlds": m.worlds, "episodes": m.episodes}
    if isinstance(m, Batch):
        assert m.topic.startswith("batch/")
        assert len(m.topic) > len("batch/")
        assert m.hook in HOOKS
        assert isinstance(m.fields, dict)
        for name, t in m.fields.items():
            assert isinstance(name, str)
            _tensor_ok(t, n)
        fields = m.fields
    elif isinstance(m, EpisodeEnd):
        assert m.topic == "episode/end"
        for flag in (m.success, m.terminated, m.truncated):
            _vector(flag, torch.bool, n)
            _tensor_ok(flag, n)
        _vector(m.length, torch.int64, n)
        tensors |= {"success": m.success, "terminated": m.terminated, "truncated": m.truncated,
                    "length": m.length}
        assert isinstance(m.outcomes, dict)
        for name, t in m.outcomes.items():
            assert isinstance(name, str), f"outcome name {name!r}"
            assert name, "empty outcome name"
            assert name not in RESERVED_OUTCOMES, f"outcome named as an episode column: {name!r}"
            _vector(t, t.dtype, n)
            _tensor_ok(t, n)
        fields = m.outcomes
    else:
        assert isinstance(m, VariationSample)
        assert isinstance(m.key, str)
        assert m.phase in ("build", "runtime")
        _tensor_ok(m.value, n)
        assert m.labels is None or (isinstance(m.labels, tuple)
                                    and all(type(x) in (str, int, float, bool) for x in m.labels))
        tensors["value"] = m.value
        fields = {}
    for t in tensors.values():
        _tensor_ok(t, None)
    if isinstance(m, VariationSample):
        assert _same(head["labels"], None if m.labels is None else list(m.labels))
    named_key = "fields" if isinstance(m, Batch) else "outcomes" if isinstance(m, EpisodeEnd) else None
    entries = head["tensors"] + (head[named_key] if named_key is not None else [])
    located = _located(head["v"], entries, frames)
    own = {e[0]: located[i] for i, e in enumerate(head["tensors"])}
    assert set(own) == set(tensors)
    for name, raw in own.items():
        assert _bytes_of(tensors[name]) == raw, name
    named = {e[0]: located[len(own) + i] for i, e in enumerate(entries[len(own):])}
    assert set(named) == set(fields)
    for name, raw in named.items():
        assert _bytes_of(fields[name]) == raw, name


def _located(version: int, entries: list[list[Any]], frames: list[bytes]) -> list[bytes]:
    """The bytes of each header entry's tensor as the protocol places them (written from the
    protocol's definition, not the codec's code): version 1, frame ``2 + position``; version 2,
    in the one data frame, at offsets of the positions in order, each the first multiple of 64
    at or after the end of the one before."""
    if version == 1:
        assert len(frames) == 2 + len(entries)
        return [frames[2 + e[3]] for e in entries]
    assert version == 2
    assert len(frames) == 3
    sizes = {e[3]: math.prod(e[2]) * DTYPES[e[1]].itemsize for e in entries}
    assert sorted(sizes) == list(range(len(entries)))
    offsets, offset, end = {}, 0, 0
    for position in range(len(entries)):
        offsets[position] = offset
        if sizes[position]:
            end = offset + sizes[position]
        offset += math.ceil(sizes[position] / 64) * 64
    assert len(frames[2]) == end
    return [frames[2][offsets[e[3]]:offsets[e[3]] + sizes[e[3]]] for e in entries]


def decode_checked(frames: list[bytes]) -> None:
    """Decode ``frames``: a message that keeps the contract, or the codec's own error."""
    try:
        decoded = decode_envelope(frames)
    except WireFormatError as exc:
        error = exc
    else:
        check_contract(decoded, frames)
        return
    assert error.reason in REASONS
    assert str(error)


def _torch_of(a: object) -> torch.Tensor:
    """A numpy-decoded array as the torch tensor it stands for (a copy), after checking what the
    numpy decoder promises: a C-contiguous, aligned, native numpy array of the whitelist, with
    bfloat16 as :class:`BFloat16Bits` and nothing else as ``uint16``."""
    assert isinstance(a, np.ndarray)
    assert type(a) is (BFloat16Bits if a.dtype == np.uint16 else np.ndarray), f"{type(a).__name__} of {a.dtype}"
    assert a.flags.c_contiguous
    assert a.ctypes.data % a.dtype.itemsize == 0 or not a.size
    t = torch.from_numpy(np.array(a.view(np.ndarray)))
    return t.view(torch.bfloat16) if isinstance(a, BFloat16Bits) else t


def _as_torch(decoded: Decoded[np.ndarray]) -> Decoded:
    """``decoded`` with every array replaced by :func:`_torch_of` it."""
    m = decoded.message
    if isinstance(m, Batch):
        message: Any = dataclasses.replace(m, worlds=_torch_of(m.worlds), episodes=_torch_of(m.episodes),
                                           fields={k: _torch_of(v) for k, v in m.fields.items()})
    elif isinstance(m, EpisodeEnd):
        message = dataclasses.replace(
            m, **{k: _torch_of(getattr(m, k)) for k in ("worlds", "episodes", "success", "terminated",
                                                        "truncated", "length")},
            outcomes={k: _torch_of(v) for k, v in m.outcomes.items()})
    elif isinstance(m, VariationSample):
        message = dataclasses.replace(m, worlds=_torch_of(m.worlds), episodes=_torch_of(m.episodes),
                                      value=_torch_of(m.value))
    else:
        message = m
    return dataclasses.replace(decoded, message=message)


def decode_checked_numpy(frames: list[bytes]) -> None:
    """Decode ``frames`` to numpy: the torch decoder's error (same reason and text), or a message
    that keeps the contract with numpy arrays over the header's frames, of the same dtypes as the
    torch decoder's tensors."""
    errors: list[WireFormatError] = []
    decoded: list[Decoded[Any]] = []
    for arrays in ("torch", "numpy"):
        try:
            decoded.append(decode_envelope(frames, arrays=arrays))
        except WireFormatError as exc:
            errors.append(exc)
    if errors:
        assert len(errors) == 2, f"only one decoder refused: {errors[0]}"
        assert errors[0].reason == errors[1].reason
        assert str(errors[0]) == str(errors[1])
        return
    expected, got = decoded[0], _as_torch(decoded[1])
    check_contract(got, frames)
    if not isinstance(got.message, RunStart | RunEnd):
        specs = [[tensor_spec("", n, t) for n, t in own + named]
                 for own, named in (message_tensors(d.message) for d in (got, expected))]
        assert specs[0] == specs[1]


# -- corpus -------------------------------------------------------------------------------

DROP = object()
"""Stands for "remove this key" in a corpus edit."""
S = ("schema", "batch/obs", "pos")
ROW = "spans more than max_message_size=2147483648 bytes"
SHAPE = "expected a list of at most 32 ints >= 0"
DTYPE = "is not on the whitelist"
ENTRY = "expected a str name and a map with exactly 'dtype' and 'shape'"

# (id, real message, path into its header, new value, reason, message pattern). Each of these
# escaped the codec before it was hardened: a TypeError, OverflowError or RuntimeError, or a
# message accepted with a coerced or unbounded value (a schema dtype of 'True', a shape of (-1,)
# or (2**64 - 1,), "12" read as (1, 2), a missing key read as a default).
ESCAPES: list[tuple[str, str, tuple[Any, ...], Any, str, str]] = [
    ("kind list", "batch", ("kind",), ["batch"], "kind", r"unknown message kind \['batch'\]"),
    ("kind map", "batch", ("kind",), {"a": 1}, "kind", r"unknown message kind \{'a': 1\}"),
    ("hook list", "batch", ("hook",), ["post_step"], "header", r"unknown hook \['post_step'\]"),
    ("hook map", "batch", ("hook",), {}, "header", r"unknown hook \{\}"),
    ("zero rows, 2**62", "empty batch", ("fields", 0, 2), [0, 2**62, 4], "shape",
     rf"tensor 'pos': shape \[0, 4611686018427387904, 4\] of float32 {ROW}"),
    ("zero rows, 2**40 squared", "empty batch", ("fields", 0, 2), [0, 2**40, 2**40], "shape", ROW),
    ("zero rows, 2**31", "empty batch", ("fields", 0, 2), [0, 2**31], "shape", ROW),
    ("schema shape inf", "run start", (*S, "shape"), [math.inf], "shape",
     rf"schema of 'batch/obs' field 'pos': invalid shape \[inf\]: {SHAPE}"),
    ("schema shape str", "run start", (*S, "shape"), "12", "shape", rf"invalid shape '12': {SHAPE}"),
    ("schema shape bool", "run start", (*S, "shape"), [True], "shape", rf"invalid shape \[True\]: {SHAPE}"),
    ("schema shape float", "run start", (*S, "shape"), [2.5], "shape", rf"invalid shape \[2.5\]: {SHAPE}"),
    ("schema shape map", "run start", (*S, "shape"), {"3": 1}, "shape", SHAPE),
    ("schema shape negative", "run end", (*S, "shape"), [4, -1], "shape", rf"invalid shape \[4, -1\]: {SHAPE}"),
    ("schema shape 2**64-1", "run start", (*S, "shape"), [2**64 - 1], "shape",
     rf"shape \[18446744073709551615\] of float32 {ROW}"),
    ("schema shape 2**62", "run end", (*S, "shape"), [2**62], "shape", ROW),
    ("schema shape zero and 2**40", "run start", (*S, "shape"), [0, 2**40], "shape", ROW),
    ("schema dtype bool", "run start", (*S, "dtype"), True, "dtype", f"field 'pos': dtype True {DTYPE}"),
    ("schema dtype list", "run start", (*S, "dtype"), ["float32"], "dtype", rf"dtype \['float32'\] {DTYPE}"),
    ("schema dtype complex", "run end", (*S, "dtype"), "complex64", "dtype", f"dtype 'complex64' {DTYPE}"),
    ("schema topic bytes", "run start", ("schema", b"batch/x"), {}, "header",
     r"schema entry b'batch/x' must map a topic name to a map of fields"),
    ("schema field bytes", "run start", ("schema", "batch/obs", b"x"), {"dtype": "float32", "shape": []},
     "header", f"field b'x': {ENTRY}"),
    ("schema extra key", "run start", (*S, "unit"), "m", "header", ENTRY),
    ("labels missing", "labelled variation", ("labels",), DROP, "header",
     "header key 'labels' must be nil or a list of str/int/float/bool, got no such key"),
    ("streams missing", "run end", ("streams",), DROP, "header",
     "header key 'streams' must map topics to counts, got None"),
    ("version float", "batch", ("v",), 1.0, "version",
     r"unsupported protocol version 1.0 \(this codec reads versions 1, 2\)"),
    ("version 2.0", "batch", ("v",), 2.0, "version", r"unsupported protocol version 2.0"),
    ("version true", "batch (v1)", ("v",), True, "version", r"unsupported protocol version True"),
    ("version 3", "batch", ("v",), 3, "version", r"unsupported protocol version 3"),
    ("version 1 of a data frame", "batch", ("v",), 1, "missing frames", "header describes 9 tensor frames, got 1"),
    ("version 2 of tensor frames", "batch (v1)", ("v",), 2, "extra frames",
     r"header describes 1 data frame \(protocol 2\), got 9"),
]

# The fields of issue 12 (declarations, the run seed, wall times, episode outcomes): each
# malformed value is refused with the codec's error, none is read as a default or coerced.
V = ("variations", "mass")
NEW_FIELDS: list[tuple[str, str, tuple[Any, ...], Any, str, str]] = [
    ("variations missing", "run start", ("variations",), DROP, "header",
     "header key 'variations' must map variation keys to declarations, got no such key"),
    ("variations list", "run end", ("variations",), [1], "header", "must map variation keys to declarations"),
    ("variation key empty", "run start", ("variations", ""), {}, "header", "expected a non-empty str key"),
    ("variation key bytes", "run start", ("variations", b"m"), {}, "header", "expected a non-empty str key"),
    ("declaration list", "run start", V, [1], "header", r"expected a declaration map with str keys, got \[1\]"),
    ("declaration bytes key", "run start", (*V, b"k"), 1, "header", "expected a declaration map with str keys"),
    ("declaration kind missing", "run start", (*V, "kind"), DROP, "header", "declaration 'kind' must be one of"),
    ("declaration kind unknown", "run end", (*V, "kind"), "sobol", "header", "got 'sobol'"),
    ("declaration phase", "run start", (*V, "phase"), "interval", "header", "declaration 'phase' must be"),
    ("declaration shape str", "run start", (*V, "shape"), "3", "header", "declaration 'shape' must be a list"),
    ("declaration shape bool", "run start", (*V, "shape"), [True], "header", "declaration 'shape'"),
    ("declaration shape negative", "run start", (*V, "shape"), [-1], "header", "declaration 'shape'"),
    ("declaration shape deep", "run start", (*V, "shape"), [1] * 33, "header", "declaration 'shape'"),
    ("declaration seed missing", "run start", (*V, "seed"), DROP, "header", "declaration 'seed' must be an int"),
    ("declaration seed float", "run start", (*V, "seed"), 1.0, "header", "declaration 'seed' must be an int, got 1.0"),
    ("declaration seed bool", "run start", (*V, "seed"), True, "header", "declaration 'seed'"),
    ("declaration low str", "run start", (*V, "low"), "0.1", "header", "declaration 'low' must be nil, a number"),
    ("declaration high bool", "run end", (*V, "high"), True, "header", "declaration 'high'"),
    ("declaration std nested str", "run start", ("variations", "pos", "std"), [1.0, ["x"]], "header",
     "declaration 'std'"),
    ("declaration labels map", "run start", ("variations", "color", "labels"), {"a": 1}, "header",
     "declaration 'labels' must be a list"),
    ("declaration labels nested", "run start", ("variations", "color", "labels"), [["red"]], "header",
     "declaration 'labels'"),
    ("declaration extra ext", "run start", ("variations", "grid", "note"), msgpack.ExtType(5, b"x"), "header",
     "ext type 5"),
    ("declaration extra timestamp", "run start", ("variations", "grid", "note"), msgpack.Timestamp(1, 0),
     "header", "not part of the protocol"),
    ("seed missing", "run start", ("seed",), DROP, "header", "header key 'seed' must be nil or an int, got no such key"),
    ("seed float", "run end", ("seed",), 5.0, "header", "header key 'seed' must be nil or an int, got 5.0"),
    ("seed str", "run start", ("seed",), "5", "header", "header key 'seed'"),
    ("seed bool", "run start", ("seed",), False, "header", "header key 'seed'"),
    ("wall_time missing", "run start", ("wall_time",), DROP, "header",
     "header key 'wall_time' must be a finite float of seconds >= 0, got no such key"),
    ("wall_time nil", "run end", ("wall_time",), None, "header", "'wall_time'"),
    ("wall_time nan", "run start", ("wall_time",), math.nan, "header", "'wall_time'"),
    ("wall_time inf", "run start", ("wall_time",), math.inf, "header", "'wall_time'"),
    ("wall_time negative", "run start", ("wall_time",), -1.0, "header", "'wall_time'"),
    ("wall_time bool", "run start", ("wall_time",), True, "header", "'wall_time'"),
    ("wall_time str", "run start", ("wall_time",), "now", "header", "'wall_time'"),
    ("wall_time int", "run start", ("wall_time",), 2**63 - 1, "header", "'wall_time' must be a finite float"),
    ("interrupted missing", "run end", ("interrupted",), DROP, "header",
     "header key 'interrupted' must be a bool, got no such key"),
    ("interrupted int", "run end", ("interrupted",), 1, "header", "header key 'interrupted' must be a bool, got 1"),
    ("interrupted nil", "run end", ("interrupted",), None, "header", "'interrupted'"),
    ("outcomes missing", "episode end", ("outcomes",), DROP, "header",
     "header key 'outcomes' must be a list, got None"),
    ("outcomes map", "episode end", ("outcomes",), {"return": 1}, "header", "header key 'outcomes' must be a list"),
    ("outcome entry short", "episode end", ("outcomes", 0), ["return", "float32", [3]], "header",
     r"outcomes entry must be \[name, dtype, shape, frame\]"),
    ("outcome dtype", "episode end", ("outcomes", 0, 1), "complex64", "dtype", "dtype 'complex64' is not on"),
    ("outcome rows", "episode end", ("outcomes", 0, 2), [1, 3], "schema",
     r"outcome 'return': expected a non-empty name and a tensor of shape \(3,\), got shape \(1, 3\)"),
    ("outcome short frame", "episode end (v1)", ("outcomes", 0, 2), [2], "shape", "needs 8 bytes, frame has 12"),
    # protocol 2: a size change inside a tensor's padding leaves the data frame's length as it
    # is; the row check still refuses it
    ("outcome short in padding", "episode end", ("outcomes", 0, 2), [2], "schema",
     r"outcome 'return': expected a non-empty name and a tensor of shape \(3,\), got shape \(2,\)"),
    ("outcome short data", "episode end", ("outcomes", 2, 2), [2], "shape",
     "the data frame has 518 bytes, its 9 tensors need 516"),
    ("outcome 2-D", "episode end", ("outcomes", 2, 2), [3, 1], "schema",
     r"outcome 'half': expected a non-empty name and a tensor of shape \(3,\), got shape \(3, 1\)"),
    ("outcome scalar", "episode end (v1)", ("outcomes", 1, 2), [], "shape", "needs 8 bytes, frame has 24"),
    ("outcome scalar data", "episode end", ("outcomes", 2, 2), [], "shape", "has 518 bytes, its 9 tensors need 514"),
    ("outcome name empty", "episode end", ("outcomes", 0, 0), "", "schema", "expected a non-empty name"),
    ("outcome name duplicate", "episode end", ("outcomes", 1, 0), "return", "schema", "duplicate outcomes names"),
    ("outcome frame reused", "episode end", ("outcomes", 0, 3), 5, "header", "are not each of"),
]

# Named by the review but already rejected with the codec's error before the hardening: pinned
# so they stay rejected (with their reason and message).
PINNED: list[tuple[str, str, tuple[Any, ...], Any, str, str]] = [
    ("schema shape nan", "run start", (*S, "shape"), [math.nan], "shape", rf"invalid shape \[nan\]: {SHAPE}"),
    ("schema entry list", "run start", S, ["float32", [4]], "header", ENTRY),
    ("schema entry missing shape", "run start", (*S, "shape"), DROP, "header", ENTRY),
    ("schema fields list", "run end", ("schema", "batch/obs"), [1], "header", "must map a topic name"),
    ("schema not a map", "run start", ("schema",), [], "header", "schema must be a map"),
    ("labels nested", "labelled variation", ("labels",), [["red"]], "header", r"got \[\['red'\]\]"),
    ("labels map", "labelled variation", ("labels",), {"a": 1}, "header", "must be nil or a list"),
    ("labels bytes", "labelled variation", ("labels",), [b"red"], "header", "must be nil or a list"),
    ("streams negative", "run end", ("streams", "batch/obs"), -1, "header", "must map topics to counts"),
    ("streams float", "run end", ("streams", "batch/obs"), 1.5, "header", "must map topics to counts"),
    ("streams list", "run end", ("streams",), [1], "header", "must map topics to counts"),
    ("num_worlds inf", "run start", ("num_worlds",), math.inf, "header", "invalid num_worlds inf"),
    ("metadata timestamp", "run start", ("metadata", "t"), msgpack.Timestamp(1, 0), "header",
     "of type Timestamp is not part of the protocol"),
    ("metadata ext", "run start", ("metadata", "t"), msgpack.ExtType(5, b"x"), "header", "ext type 5"),
    ("phase list", "labelled variation", ("phase",), ["build"], "header", r"phase \['build'\]"),
    ("worlds zero rows, 2**63-1", "empty batch", ("tensors", 0, 2), [0, 2**63 - 1], "shape", ROW),
]


def edited(name: str, path: tuple[Any, ...], value: Any) -> list[bytes]:
    """The frames of real message ``name`` with the header value at ``path`` replaced (or dropped)."""
    frames = list(REAL[name])
    head = msgpack.unpackb(frames[1], raw=False, timestamp=0)
    node = head
    for key in path[:-1]:
        node = node[key]
    if value is DROP:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    frames[1] = msgpack.packb(head, use_bin_type=True)
    return frames


@pytest.mark.parametrize(("name", "path", "value", "reason", "match"),
                         [c[1:] for c in ESCAPES + PINNED + NEW_FIELDS],
                         ids=[c[0] for c in ESCAPES + PINNED + NEW_FIELDS])
def test_corpus_is_rejected_with_reason(name: str, path: tuple[Any, ...], value: Any, reason: str,
                                        match: str) -> None:
    with pytest.raises(WireFormatError, match=match) as info:
        decode_envelope(edited(name, path, value))
    assert info.value.reason == reason
    assert reason in REASONS


def test_error_messages_stay_short() -> None:
    """A received value is quoted, not dumped: a 10 kB kind makes a message of a few hundred bytes."""
    with pytest.raises(WireFormatError, match=r"unknown message kind 'aaa.*\.\.\. \(10002 characters\)") as info:
        decode_envelope(edited("batch", ("kind",), "a" * 10_000))
    assert len(str(info.value)) < 500


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(REAL))
def test_real_messages_keep_the_contract(name: str) -> None:
    """The unmutated messages decode, and the checker accepts them (so it is not vacuous)."""
    frames = REAL[name]
    check_contract(decode_envelope(frames), frames)
    decode_checked_numpy(frames)


@pytest.mark.parametrize(("name", "path", "value", "reason", "match"),
                         [c[1:] for c in ESCAPES + PINNED + NEW_FIELDS],
                         ids=[c[0] for c in ESCAPES + PINNED + NEW_FIELDS])
def test_corpus_is_rejected_with_reason_when_decoding_to_numpy(name: str, path: tuple[Any, ...], value: Any,
                                                              reason: str, match: str) -> None:
    with pytest.raises(WireFormatError, match=match) as info:
        decode_envelope(edited(name, path, value), arrays="numpy")
    assert info.value.reason == reason


def test_numpy_checker_catches_broken_decodes() -> None:
    """The numpy contract checker can fail: a bfloat16 field read as plain uint16 bits, or as a
    float16, is caught."""
    frames = REAL["batch"]
    good = decode_envelope(frames, arrays="numpy")
    batch = good.message
    assert isinstance(batch, Batch)
    assert isinstance(batch.fields["half"], BFloat16Bits)
    check_contract(_as_torch(good), frames)
    for wrong in (batch.fields["half"].view(np.ndarray), batch.fields["half"].view(np.float16)):
        broken = dataclasses.replace(good, message=dataclasses.replace(batch, fields={**batch.fields, "half": wrong}))
        with pytest.raises(AssertionError):
            check_contract(_as_torch(broken), frames)


def test_checker_catches_broken_decodes() -> None:
    """The contract checker can fail: it catches the decoder bugs it exists for."""
    frames = REAL["batch"]
    good = decode_envelope(frames)
    batch = good.message
    assert isinstance(batch, Batch)
    swapped = dataclasses.replace(batch, worlds=batch.episodes, episodes=batch.worlds)
    with pytest.raises(AssertionError, match="worlds"):  # a tensor built over the wrong frame
        check_contract(dataclasses.replace(good, message=swapped), frames)
    poisoned = batch.fields["done"].clone()
    poisoned.view(torch.uint8)[0] = 2
    with pytest.raises(AssertionError, match="bool byte not 0/1"):  # a bool that is not 0 or 1
        check_contract(dataclasses.replace(good, message=dataclasses.replace(
            batch, fields={**batch.fields, "done": poisoned})), frames)
    start_frames = REAL["run start"]
    start = decode_envelope(start_frames)
    assert isinstance(start.message, RunStart)
    huge = {"batch/obs": {"pos": FieldSpec("float32", (2**62,))}}
    with pytest.raises(AssertionError, match="schema field 'pos' spans 18446744073709551616 bytes"):  # an unbounded schema shape
        check_contract(dataclasses.replace(start, message=dataclasses.replace(start.message, schema=huge)),
                       start_frames)
    with pytest.raises(AssertionError, match="metadata differs from the header's"):  # a coerced value ("2" taken for 2)
        check_contract(dataclasses.replace(start, message=dataclasses.replace(start.message, metadata={
            **start.message.metadata, "seed": "3"})), start_frames)


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_structured_mutations_never_escape(seed: int) -> None:
    decode_checked(mutated(seed))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_structured_mutations_decode_to_numpy_as_to_torch(seed: int) -> None:
    decode_checked_numpy(mutated(seed))


# -- campaign -------------------------------------------------------------------------------


def campaign(count: int, first: int = 0) -> dict[str, tuple[int, int, str]]:
    """Escapes among ``count`` mutated messages: where raised -> (times, first seed, message)."""
    escapes: dict[str, tuple[int, int, str]] = {}
    for seed in range(first, first + count):
        try:
            decode_checked(mutated(seed))
            decode_checked_numpy(mutated(seed))
        except Exception as exc:  # counting every escape is the point
            where = traceback.extract_tb(exc.__traceback__)[-1]
            key = f"{type(exc).__name__} at {os.path.basename(where.filename)}:{where.lineno} ({where.name})"
            times, example, text = escapes.get(key, (0, seed, str(exc)[:160]))
            escapes[key] = (times + 1, example, text)
    return escapes


if __name__ == "__main__":
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000
    start = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    found = campaign(total, start)
    for what, (times, example, text) in sorted(found.items(), key=lambda kv: -kv[1][0]):
        print(f"{times:7d}  {what}  seed {example}: {text!r}")
    print(f"{sum(t for t, _, _ in found.values())} escapes in {total} cases (seeds {start}..{start + total - 1})")
