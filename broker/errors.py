"""The broker's error vocabulary: one root, leaves that also inherit the built-in they resemble.

Errors of the libraries underneath (pyzmq, msgpack) never escape the package: they are
translated at the boundary with :func:`translate_zmq_errors` (``raise Ours(...) from exc``), so a
caller only needs ``except BrokerError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import zmq

__all__ = [
    "BrokerClosedError",
    "BrokerError",
    "ConsumerError",
    "SchemaError",
    "SecurityError",
    "SendTimeoutError",
    "SubscriberTimeoutError",
    "TransportError",
    "WireFormatError",
    "translate_zmq_errors",
]


class BrokerError(Exception):
    """Root of every error raised by the broker package."""


class BrokerClosedError(BrokerError, RuntimeError):
    """The broker (or a channel of it) was closed by us and takes no more messages."""


class ConsumerError(BrokerError, RuntimeError):
    """A consumer raised while a message was delivered to it (re-raised in strict mode).

    Attributes:
        consumer: The consumer's name.
        topic: The topic of the message being delivered.
    """

    def __init__(self, consumer: str, topic: str, cause: BaseException) -> None:
        super().__init__(f"consumer {consumer!r} raised on topic {topic!r}: {cause!r}")
        self.consumer = consumer
        self.topic = topic


class WireFormatError(BrokerError, ValueError):
    """A message could not be encoded, or received bytes are not a valid message.

    Attributes:
        reason: A short, stable code of what was wrong (``"dtype"``, ``"shape"``,
            ``"version"``, ...; see :data:`broker.wire.REASONS`). Receivers count bad
            messages by it.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class TransportError(BrokerError, ConnectionError):
    """The ZeroMQ transport failed: an endpoint could not be bound or connected, or a socket
    broke. The original pyzmq error is the ``__cause__``."""


class SendTimeoutError(BrokerError, TimeoutError):
    """A lossless publisher could not hand a message to its subscribers within its
    ``send_timeout`` (a subscriber is too slow or gone). The message was not delivered."""


class SubscriberTimeoutError(BrokerError, TimeoutError):
    """``wait_for_subscribers`` gave up before the expected subscribers had joined."""


class SecurityError(BrokerError, ValueError):
    """A CURVE key or key file is missing or malformed."""


@contextmanager
def translate_zmq_errors(what: str) -> Iterator[None]:
    """Re-raise pyzmq errors raised inside the block as :class:`TransportError`.

    ``what`` names the operation and endpoint for the message, e.g. ``"bind 'tcp://...'"``.
    ``zmq.Again`` is left alone: callers decide whether it means a drop or a timeout.
    """
    try:
        yield
    except zmq.Again:
        raise
    except zmq.ZMQError as exc:
        raise TransportError(f"{what} failed: {exc} (errno {exc.errno})") from exc


class SchemaError(BrokerError, ValueError):
    """Fields do not match their topic's schema (:class:`broker.TopicSchema`): a missing or
    extra field name, another dtype or per-world shape, or a leading dimension that is not the
    number of worlds in the message."""
