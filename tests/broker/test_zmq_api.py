"""The broker package's public surface, its error vocabulary, and the translation of pyzmq and
msgpack errors into it."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
import zmq

import broker
from broker import (
    BrokerClosedError,
    BrokerError,
    SecurityError,
    SendTimeoutError,
    Subscriber,
    SubscriberTimeoutError,
    TransportError,
    WireFormatError,
    ZmqPublisher,
    decode,
)
from broker.errors import translate_zmq_errors


def test_exported_surface() -> None:
    assert set(broker.__all__) == {
        "BUILD", "DEFAULT_ENDPOINT", "PROTOCOL_VERSION", "RUNTIME", "TOPIC_EPISODE_END", "TOPIC_RUN_END",
        "TOPIC_RUN_START", "BFloat16Bits", "Batch", "Broker", "BrokerClosedError", "BrokerError", "BrokerStatistics",
        "Consumer", "ConsumerError", "CurveClient", "CurveServer", "EpisodeEnd", "FieldSpec", "Gap",
        "KeyPair", "Message", "MessageOf", "NumpyMessage", "Phase", "Policy", "PublisherStatistics", "RunEnd", "RunStart",
        "SchemaError", "SecurityError", "SendTimeoutError", "Subscriber", "SubscriberStatistics",
        "SubscriberTimeoutError", "Subscription", "TopicSchema", "TransportError", "VariationSample",
        "WireFormatError", "ZmqPublisher", "batch_topic", "decode", "encode", "load_keypair",
        "load_public_keys", "variation_topic", "write_keypair",
    }
    assert len(broker.__all__) == len(set(broker.__all__))
    assert all(hasattr(broker, name) for name in broker.__all__)


@pytest.mark.parametrize(("error", "builtin"), [
    (WireFormatError, ValueError), (TransportError, ConnectionError), (SendTimeoutError, TimeoutError),
    (SubscriberTimeoutError, TimeoutError), (SecurityError, ValueError),
])
def test_errors_inherit_root_and_builtin(error: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(error, BrokerError)
    assert issubclass(error, builtin)


def test_gap_and_statistics_are_frozen() -> None:
    gap = broker.Gap("r", "batch/a", 3, 7)
    assert gap.missing == 4
    assert gap.publisher == ""
    with pytest.raises(AttributeError):
        gap.expected = 1  # type: ignore[misc]


@pytest.mark.parametrize(("make", "match"), [
    (lambda: ZmqPublisher("nonsense://x"), r"bind 'nonsense://x' failed: Protocol not supported"),
    (lambda: ZmqPublisher("tcp://127.0.0.1:notaport"), r"bind 'tcp://127.0.0.1:notaport' failed"),
    (lambda: Subscriber("tcp://"), r"connect 'tcp://' failed: Invalid argument"),
    (lambda: Subscriber("ipc:///nonexistent-dir/x.ipc", bind=True), r"bind 'ipc:///nonexistent-dir/x.ipc' failed"),
])
def test_pyzmq_errors_become_transport_errors(make: Callable[[], Any], match: str) -> None:
    with pytest.raises(TransportError, match=match) as info:
        make()
    assert isinstance(info.value.__cause__, zmq.ZMQError)


def test_address_in_use_is_a_transport_error() -> None:
    first = ZmqPublisher("tcp://127.0.0.1:*")
    try:
        with pytest.raises(TransportError, match=r"bind 'tcp://127.0.0.1:\d+' failed: Address already in use"):
            ZmqPublisher(first.endpoints[0])
    finally:
        first.close()


def test_translate_leaves_again_to_the_caller() -> None:
    with pytest.raises(zmq.Again), translate_zmq_errors("send"):
        raise zmq.Again()
    with pytest.raises(TransportError, match=r"send failed: .* \(errno \d+\)"), translate_zmq_errors("send"):
        raise zmq.ZMQError(zmq.ETERM)


def test_msgpack_errors_become_wire_format_errors() -> None:
    with pytest.raises(WireFormatError, match="header is not valid msgpack") as info:
        decode([b"batch/a", b"\x92\x01"])  # an array announced with 2 items, holding 1
    assert isinstance(info.value.__cause__, ValueError | msgpack.UnpackException)
    with pytest.raises(WireFormatError, match="header is not valid msgpack") as info:
        decode([b"batch/a", msgpack.packb({"v": 1}) + b"\x00"])  # trailing bytes
    assert isinstance(info.value.__cause__, msgpack.ExtraData)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"policy": "lossy"}, ValueError, "policy: expected 'block' or 'drop', got 'lossy'"),
    ({"send_timeout": 0}, ValueError, "send_timeout: expected a positive number of seconds, got 0"),
    ({"slots": 0}, ValueError, "slots: expected a positive int, got 0"),
    ({"topics": "batch/"}, TypeError, "topics: expected a sequence of str prefixes, got 'batch/'"),
])
def test_publisher_arguments_are_checked(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        ZmqPublisher("tcp://127.0.0.1:*", **kwargs)


def test_subscriber_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="max_header_size: expected a positive int, got 0"):
        Subscriber("tcp://127.0.0.1:1", max_header_size=0)


@pytest.mark.parametrize("bad", ["", "x" * 65, "a/b", "run end", "é", 7])
def test_subscriber_ids_are_checked(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"id: expected None or 1 to 64 characters of \[A-Za-z0-9_.-\], got "):
        Subscriber("tcp://127.0.0.1:1", id=bad)


def test_a_subscriber_keeps_the_id_it_is_given() -> None:
    with Subscriber("tcp://127.0.0.1:1", id="store-1.a_B", confirm_run_ends=False) as sub:
        assert sub.id == "store-1.a_B"
        assert sub.confirm_run_ends is False
    with Subscriber("tcp://127.0.0.1:1") as sub:
        assert re.fullmatch(r"[0-9a-f]{16}", sub.id)
        assert sub.confirm_run_ends is True
        sub.confirm_run_end("never-ended")  # unknown run: nothing to confirm
    with pytest.raises(BrokerClosedError, match=r"confirm_run_end\('r'\) after close\(\)"):
        sub.confirm_run_end("r")
