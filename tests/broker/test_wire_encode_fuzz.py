"""The encoder refuses exactly what receivers would reject: structured mutations of real
batches, episode ends and variation samples (tensors of other ranks, rows and dtypes, header
values of other types or out of range, topics that do not fit the kind) are either refused by
:func:`broker.encode` and by a publisher's :class:`broker.wire.HeaderCache` with
``WireFormatError(reason="encode")``, or decoded by a receiver to the same message, byte for byte.

Before, the encoder sent such messages and every receiver dropped them (a daemon counted them
rejected): a publisher's caller learnt nothing of a batch whose field had one row too many.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Batch, EpisodeEnd, Message, VariationSample, WireFormatError, encode, wire
from broker.wire import HeaderCache, decode_envelope, message_tensors

EXAMPLES = int(os.environ.get("WORLDTAP_FUZZ_EXAMPLES", "400"))
"""Examples a run of the fuzz test tries (a larger campaign: ``WORLDTAP_FUZZ_EXAMPLES=20000``)."""

ROWS = 3
_BAD_NUMBERS = [-1, 2**63, True, 1.0]


def _vector(draw: st.DrawFn, dtype: torch.dtype, n: int = ROWS) -> torch.Tensor:
    """A tensor meant to be ``dtype`` of shape ``(n,)``, mutated one time in four."""
    t = torch.zeros(n, dtype=dtype)
    kind = draw(st.integers(0, 11))
    if kind == 0:
        t = t.to(draw(st.sampled_from([torch.int32, torch.float32, torch.bool, torch.int64])))
    elif kind == 1:
        t = t.reshape(1, n)
    elif kind == 2:
        t = torch.zeros(draw(st.sampled_from([0, n - 1, n + 1])), dtype=dtype)
    return t


def _field(draw: st.DrawFn, n: int = ROWS) -> torch.Tensor:
    shape = draw(st.sampled_from([(n,), (n, 2), (n, 0), (n, 2, 1), (), (n + 1, 2), (0, 2), (1,)]))
    return torch.zeros(shape, dtype=draw(st.sampled_from([torch.float32, torch.bfloat16, torch.bool, torch.uint8])))


@st.composite
def _message(draw: st.DrawFn) -> Message:
    kind = draw(st.sampled_from(["batch", "episode_end", "variation"]))
    worlds, episodes = _vector(draw, torch.int64), _vector(draw, torch.int64)
    names = st.sampled_from(["x", "y", "", "é", "success", "length"])
    message: Message
    if kind == "batch":
        fields = {draw(names): _field(draw) for _ in range(draw(st.integers(0, 3)))}
        message = Batch("r", 0, 0, draw(st.sampled_from(["batch/t", "batch/t", "batch/", "episode/end"])),
                        worlds, episodes, fields, draw(st.sampled_from(["post_step", "post_reset", "later"])))
    elif kind == "episode_end":
        outcomes = {draw(names): _vector(draw, torch.float32) for _ in range(draw(st.integers(0, 2)))}
        message = EpisodeEnd("r", 0, 0, worlds, episodes, _vector(draw, torch.bool), _vector(draw, torch.bool),
                             _vector(draw, torch.bool), _vector(draw, torch.int64), outcomes=outcomes,
                             topic=draw(st.sampled_from(["episode/end", "episode/end", "batch/t"])))
    else:
        labels: Any = draw(st.sampled_from([None, ("a", "b"), (1, 2.5, True), ((1, 2),), (None,)]))
        message = VariationSample("r", 0, 0, draw(st.sampled_from(["k", "k", ""])),
                                  draw(st.sampled_from(["build", "runtime", "later"])),
                                  worlds, episodes, _field(draw), labels,
                                  topic=draw(st.sampled_from(["variation/k", "variation/k", ""])))
    change = draw(st.integers(0, 5))
    if change == 0:
        message = dataclasses.replace(message, **{draw(st.sampled_from(["seq", "step"])):  # type: ignore[arg-type]
                                                  draw(st.sampled_from(_BAD_NUMBERS))})
    elif change == 1:
        message = dataclasses.replace(message, run=draw(st.sampled_from([7, b"r", ""])))  # type: ignore[arg-type]
    return message


def _unchecked(message: Message, version: int) -> list[bytes]:
    """The frames the encoder wrote before it checked what receivers would reject."""
    saved = getattr(wire, "_check_as_received", None)  # (an encoder without the check: as it is)
    if saved is not None:
        wire._check_as_received = lambda topic, header: None
    try:
        return [bytes(f) for f in encode(message, version=version)]
    finally:
        if saved is not None:
            wire._check_as_received = saved


def _same(a: Any, b: Any) -> bool:
    """Whether a decoded tensor holds the published one's dtype, shape and bytes."""
    a, b = a.contiguous(), b.contiguous()
    return bool(a.dtype == b.dtype and a.shape == b.shape and
                a.view(-1).view(torch.uint8).equal(b.view(-1).view(torch.uint8)))


def _outcome(call: Callable[[], Any]) -> Any:
    """What ``call`` returns, or the ``WireFormatError`` it raises."""
    try:
        return call()
    except WireFormatError as exc:
        return exc


_CACHE = HeaderCache(size=8)
"""One publisher's cache across the examples: templates built by earlier messages serve later
ones of the same shape, as they would in a run."""


@settings(max_examples=EXAMPLES, deadline=None)
@given(message=_message(), version=st.sampled_from([1, 2]))
def test_encode_refuses_exactly_what_receivers_reject(message: Message, version: int) -> None:
    received: Any = _outcome(lambda: decode_envelope(_unchecked(message, version)))
    if isinstance(received, WireFormatError):
        assert received.reason != "value"  # no mutation makes a bool tensor's bytes other than 0 and 1
    own, named = message_tensors(message)
    outcomes = [_outcome(lambda: bytes(encode(message, version=version)[1])),
                _outcome(lambda: _CACHE.header(message, own, named, publisher="", number=0, version=version))]
    for outcome in outcomes:
        if isinstance(outcome, WireFormatError):
            assert outcome.reason == "encode"
            assert "receivers would reject this message" in str(outcome) or "cannot be encoded" in str(outcome)
    if isinstance(received, WireFormatError):
        assert all(isinstance(o, WireFormatError) for o in outcomes), f"encoded what receivers reject: {received}"
        return
    assert isinstance(outcomes[0], bytes), outcomes[0]
    assert outcomes[0] == outcomes[1]
    decoded = received.message
    assert type(decoded) is type(message)
    assert decoded.topic == message.topic
    mine, theirs = (dict(message_tensors(m)[0] + message_tensors(m)[1]) for m in (message, decoded))
    assert mine.keys() == theirs.keys()
    assert all(_same(mine[k], theirs[k]) for k in mine)


@pytest.mark.parametrize("version", [1, 2])
def test_the_unmutated_messages_are_encoded_and_received(version: int) -> None:
    """The strategy's messages without mutation reach the receiver (the test above is not
    vacuous), and its mutations are refused by receivers without the encoder's check."""
    w, e = torch.arange(ROWS), torch.zeros(ROWS, dtype=torch.int64)
    good = Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(ROWS, 2)})
    assert decode_envelope([bytes(f) for f in encode(good, version=version)]).message.topic == "batch/t"
    bad = Batch("r", 0, 0, "batch/t", w, e, {"x": torch.zeros(ROWS + 1, 2)})
    with pytest.raises(WireFormatError, match="expected a leading worlds dimension of 3"):
        decode_envelope(_unchecked(bad, version))
    with pytest.raises(WireFormatError, match=r"receivers would reject this message \(schema\)"):
        encode(bad, version=version)
