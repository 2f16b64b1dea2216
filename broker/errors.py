"""The broker's error vocabulary: one root, leaves that also inherit the built-in they resemble."""

from __future__ import annotations

__all__ = [
    "BrokerClosedError",
    "BrokerError",
    "ConsumerError",
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
