"""Header templates: a publisher encodes each message shape's header once and packs only the
numbers that change per message. The header must stay byte for byte the one the wire format
documents (one msgpack map, see ``broker/wire.py``), whatever the numbers and shapes, and decode
to the same message."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Batch, EpisodeEnd, Message, RunEnd, Subscriber, VariationSample, WireFormatError, encode
from broker.wire import PROTOCOL_VERSION, HeaderCache, decode_envelope, message_tensors

EDGES = [0, 1, 127, 128, 255, 256, 2**16 - 1, 2**16, 2**32 - 1, 2**32, 2**63 - 1]
"""Values at the edges of msgpack's int widths (fixint, uint8, uint16, uint32, uint64)."""
NUMBERS = st.one_of(st.sampled_from(EDGES), st.integers(0, 2**63 - 1))
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)


def reference_header(message: Message, publisher: str, number: int) -> bytes:
    """The header as the wire format documents it: one msgpack map, keys in order."""
    own, named = message_tensors(message)

    def entries(pairs: list[tuple[str, torch.Tensor]], first: int) -> list[list[Any]]:
        return [[name, str(t.dtype).removeprefix("torch."), list(t.shape), first + i]
                for i, (name, t) in enumerate(pairs)]

    kind = {Batch: "batch", EpisodeEnd: "episode_end", VariationSample: "variation"}[type(message)]
    head: dict[str, Any] = {"v": PROTOCOL_VERSION, "kind": kind, "run": message.run, "seq": message.seq,
                            "step": message.step, "pub": publisher, "n": number, "tensors": entries(own, 0)}
    if isinstance(message, Batch):
        head.update(fields=entries(named, len(own)), hook=message.hook)
    elif isinstance(message, EpisodeEnd):
        head["outcomes"] = entries(named, len(own))
    elif isinstance(message, VariationSample):
        head.update(key=message.key, phase=message.phase,
                    labels=None if message.labels is None else list(message.labels))
    packed: bytes = msgpack.packb(head, use_bin_type=True)
    return packed


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _tensor(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=gen, dtype=dtype)


def _message(kind: str, rows: int, seq: int, step: int, fields: list[tuple[str, torch.dtype, tuple[int, ...]]],
             gen: torch.Generator, topic: str, hook: str, labels: tuple[str, ...] | None) -> Message:
    worlds = torch.randint(0, 1 << 20, (rows,), generator=gen)
    episodes = torch.randint(0, 1 << 20, (rows,), generator=gen)
    named = {name: _tensor(gen, dtype, (rows, *trailing)) for name, dtype, trailing in fields}
    if kind == "batch":
        return Batch("run-a", seq, step, f"batch/{topic}", worlds, episodes, named, hook=hook)  # type: ignore[arg-type]
    if kind == "episode_end":
        flags = [torch.rand(rows, generator=gen) < 0.5 for _ in range(3)]
        outcomes = {f"o{name}": _tensor(gen, dtype, (rows,)) for name, dtype, _ in fields}
        return EpisodeEnd("run-a", seq, step, worlds, episodes, *flags, torch.arange(rows), outcomes=outcomes)
    value = torch.randint(0, 3, (rows,), generator=gen) if labels else _tensor(gen, fields[0][1], (rows,))
    return VariationSample("run-a", seq, step, topic, "runtime", worlds, episodes, value, labels=labels,
                           topic=f"variation/{topic}")


def _check_decoded(message: Message, header: bytes, publisher: str, number: int) -> None:
    frames = [message.topic.encode(), header, *(bytes(f) for f in encode(message)[2:])]
    decoded = decode_envelope(frames)
    got = decoded.message
    assert (decoded.publisher, decoded.number) == (publisher, number)
    assert (type(got), got.run, got.seq, got.step, got.topic) == (
        type(message), message.run, message.seq, message.step, message.topic)
    want_own, want_named = message_tensors(message)
    got_own, got_named = message_tensors(got)
    assert [n for n, _ in got_own + got_named] == [n for n, _ in want_own + want_named]
    for (name, a), (_, b) in zip(want_own + want_named, got_own + got_named, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), name
        assert _bytes(a) == _bytes(b), name


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["batch", "episode_end", "variation"]),
       topic=st.text("abcdefghij/_", min_size=1, max_size=12),
       fields=st.lists(st.tuples(NAMES, st.sampled_from(DTYPES),
                                 st.lists(st.integers(0, 3), max_size=2).map(tuple)),
                       min_size=1, max_size=5, unique_by=lambda f: f[0]),
       hook=st.sampled_from(["post_step", "pre_reset"]),
       labels=st.one_of(st.none(), st.lists(NAMES, min_size=1, max_size=3).map(tuple)),
       messages=st.lists(st.tuples(st.integers(0, 5), NUMBERS, NUMBERS, NUMBERS), min_size=1, max_size=6),
       publisher=st.sampled_from(["", "p", "0123456789abcdef"]),
       seed=st.integers(0, 2**31))
def test_template_headers_are_the_documented_bytes_and_decode_to_the_message(
        kind: str, topic: str, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], hook: str,
        labels: tuple[str, ...] | None, messages: list[tuple[int, int, int, int]], publisher: str,
        seed: int) -> None:
    """Bug it catches: a template that packs a number at the wrong width, puts a cached part out
    of order, keeps the previous message's numbers or row count, or serves one shape's header
    to another; and a cache that builds a template per row count (``built`` counts them)."""
    gen = torch.Generator().manual_seed(seed)
    cache = HeaderCache()
    for rows, seq, step, number in messages:
        message = _message(kind, rows, seq, step, fields, gen, topic, hook, labels)
        own, named = message_tensors(message)
        header = cache.header(message, own, named, publisher=publisher, number=number)
        assert header == reference_header(message, publisher, number)
        assert header == bytes(encode(message, publisher=publisher, number=number)[1])
        _check_decoded(message, header, publisher, number)
    assert cache.built == 1  # one template whatever the number of worlds


def test_shapes_without_a_shared_leading_dimension_are_refused_and_build_no_template() -> None:
    """Every tensor of a message receivers take leads with its worlds: a 0-d field, or a field
    of other rows, is refused when its template would be built (receivers would reject the
    message), and the next message of the topic is encoded as before."""
    cache = HeaderCache()
    w, e = torch.arange(3), torch.zeros(3, dtype=torch.int64)
    for named, problem in [({"scalar": torch.tensor(1.5)}, r"tensor 'scalar': expected a leading worlds "
                                                            r"dimension of 3, got shape \(\)"),
                           ({"ragged": torch.zeros(4, 2)}, r"tensor 'ragged': expected a leading worlds "
                                                            r"dimension of 3, got shape \(4, 2\)")]:
        message = Batch("r", 0, 0, "batch/odd", w, e, named)
        own, fields = message_tensors(message)
        with pytest.raises(WireFormatError, match=r"receivers would reject this message \(schema\): .*"
                                                  + problem) as info:
            cache.header(message, own, fields, publisher="p", number=0)
        assert info.value.reason == "encode"
    assert cache.built == 0
    message = Batch("r", 1, 1, "batch/odd", w, e, {"ragged": torch.zeros(3, 2)})
    own, fields = message_tensors(message)
    assert cache.header(message, own, fields, publisher="p", number=1) == reference_header(message, "p", 1)


def test_templates_tell_equal_but_differently_typed_constants_apart() -> None:
    """``1 == True == 1.0`` in Python: a cache keyed on values alone would send the header of a
    variation labelled ``[1]`` for one labelled ``[True]``."""
    cache = HeaderCache()
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    for labels in [(1,), (True,), (1.0,), ("1",), (1,), None, ()]:
        sample = VariationSample("r", 0, 0, "k", "build", w, e, torch.zeros(2, dtype=torch.int64),
                                 labels=labels, topic="variation/k")
        own, named = message_tensors(sample)
        assert cache.header(sample, own, named, publisher="p", number=3) == reference_header(sample, "p", 3)


def test_unencodable_messages_raise_as_encode_does_and_leave_the_cache_sound() -> None:
    cache = HeaderCache()
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)
    good = Batch("r", 1, 1, "batch/a", w, e, {"x": torch.zeros(2, 3)})
    own, named = message_tensors(good)
    cache.header(good, own, named, publisher="p", number=0)
    bad: list[tuple[Batch, int, str]] = [
        (Batch("r", 2**64, 1, "batch/a", w, e, {"x": torch.zeros(2, 3)}), 0, "encode"),  # too large for msgpack
        (Batch("r", 1, 1, "batch/a", w, e, {"x": torch.zeros(2, 3)}), -2**64, "encode"),
        (Batch("r", 1, 1, "batch/a", w, e, {"x": torch.zeros(2, dtype=torch.complex64)}), 0, "dtype"),
        (Batch("r", 1, 1, "batch/a", w, e, {"x": [0.0, 1.0]}), 0, "encode"),  # type: ignore[dict-item]
    ]
    for message, number, reason in bad:
        with pytest.raises(WireFormatError) as raised:
            encode(message, publisher="p", number=number)
        assert raised.value.reason == reason
        own, named = message_tensors(message)
        with pytest.raises(WireFormatError) as raised:
            cache.header(message, own, named, publisher="p", number=number)
        assert raised.value.reason == reason
    own, named = message_tensors(good)
    assert cache.header(good, own, named, publisher="p", number=9) == reference_header(good, "p", 9)


def test_the_cache_is_bounded_least_recently_used_out() -> None:
    cache = HeaderCache(size=2)
    w, e = torch.arange(2), torch.zeros(2, dtype=torch.int64)

    def send(topic: str) -> bytes:
        message = Batch("r", 1, 1, f"batch/{topic}", w, e, {"x": torch.zeros(2)})
        own, named = message_tensors(message)
        header = cache.header(message, own, named, publisher="p", number=1)
        assert header == reference_header(message, "p", 1)
        return header

    for topic in "abc":  # "c" evicts "a"
        send(topic)
    assert cache.built == 3
    send("c")
    send("b")
    assert cache.built == 3  # still cached
    send("a")  # evicted: built again
    assert cache.built == 4


def test_run_messages_are_encoded_in_full() -> None:
    cache = HeaderCache()
    end = RunEnd("r", 4, 4, 2, "cpu")
    header = cache.header(end, [], [], publisher="p", number=1, streams={"batch/a": 3})
    assert header == bytes(encode(end, publisher="p", number=1, streams={"batch/a": 3})[1])
    assert cache.built == 0


def test_batches_of_varying_worlds_arrive_byte_for_byte_over_zeromq(
        make_pub: Callable[..., Any], make_sub: Callable[..., Subscriber],
        free_endpoint: Callable[[], str]) -> None:
    """Through a real publisher and subscriber: reset batches of every size between per-step
    batches, on two topics, each received value for value under its own header."""
    pub = make_pub(free_endpoint())
    sub = make_sub(pub.endpoints[0])
    pub.wait_for_subscribers(1, timeout=10)
    gen = torch.Generator().manual_seed(7)
    sent: list[Batch] = []
    for seq, rows in enumerate([8, 3, 8, 0, 8, 5, 1, 8, 7, 8]):
        for topic in ("batch/obs", "batch/act"):
            message = Batch("run-a", seq, seq, topic, torch.randperm(8, generator=gen)[:rows],
                            torch.randint(0, 9, (rows,), generator=gen),
                            {"x": torch.randn(rows, 3, generator=gen), "done": torch.rand(rows, generator=gen) < 0.5},
                            hook="post_step" if rows == 8 else "post_reset")
            pub(message)
            sent.append(message)
    pub.flush()
    for want in sent:
        got = sub.recv(timeout=10)
        assert isinstance(got, Batch)
        assert (got.topic, got.seq, got.hook) == (want.topic, want.seq, want.hook)
        for name in ("worlds", "episodes"):
            assert _bytes(getattr(got, name)) == _bytes(getattr(want, name))
        for name, t in want.fields.items():
            assert (got.fields[name].dtype, got.fields[name].shape) == (t.dtype, t.shape)
            assert _bytes(got.fields[name]) == _bytes(t)
    assert pub._headers.built == 4  # per topic: the per-step hook and the reset hook
