"""The in-process broker: synchronous, zero-copy, topic-prefix pub/sub."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType

from .errors import BrokerClosedError, ConsumerError
from .messages import Message

__all__ = ["Broker", "BrokerStatistics", "Consumer", "Subscription"]

_log = logging.getLogger("worldtap.broker")

Consumer = Callable[[Message], object]
"""Anything callable with one message. Its return value is ignored."""


def _consumer_name(consumer: Consumer) -> str:
    name = getattr(consumer, "name", None)
    if isinstance(name, str) and name:
        return name
    qualname = getattr(consumer, "__qualname__", None)
    return qualname if isinstance(qualname, str) else type(consumer).__qualname__


@dataclass(frozen=True, slots=True)
class BrokerStatistics:
    """A snapshot of a broker's counters.

    Attributes:
        published: Messages passed to ``publish``.
        deliveries: Successful consumer calls.
        consumer_errors: Consumer calls that raised, in total.
        errors_by_consumer: Consumer name -> calls of it that raised.
        subscriptions: Active subscriptions.
        closed: Whether ``close()`` was called.
    """

    published: int
    deliveries: int
    consumer_errors: int
    errors_by_consumer: Mapping[str, int]
    subscriptions: int
    closed: bool


class Subscription:
    """A consumer attached to a topic prefix. ``cancel()`` (or leaving a ``with``) detaches it."""

    __slots__ = ("_broker", "active", "consumer", "name", "prefix")

    def __init__(self, broker: Broker, prefix: str, consumer: Consumer, name: str) -> None:
        self._broker = broker
        self.prefix = prefix
        self.consumer = consumer
        self.name = name
        self.active = True

    def cancel(self) -> None:
        """Stop delivering to this consumer. Idempotent."""
        if self.active:
            self.active = False
            self._broker._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cancel()

    def __repr__(self) -> str:
        return f"Subscription(prefix={self.prefix!r}, consumer={self.name!r}, active={self.active})"


class Broker:
    """Synchronous in-process pub/sub keyed by topic prefix.

    ``publish`` calls every consumer whose prefix matches the message's topic, in subscription
    order, in the publishing thread, and passes the message itself: no copy, no queue. The
    tensors inside are borrowed for the duration of the call; a consumer that keeps anything
    copies it, because the publisher may overwrite its buffers as soon as ``publish`` returns.

    A consumer that raises does not stop delivery to the others: the failure is logged with
    the consumer's name and counted in ``statistics()``; with ``strict=True`` it is re-raised
    as :class:`ConsumerError` after every other consumer has received the message.

    Args:
        strict: Re-raise consumer failures (the test suite runs strict).
    """

    def __init__(self, *, strict: bool = False) -> None:
        self.strict = strict
        self._subs: list[Subscription] = []
        self._routes: dict[str, tuple[Subscription, ...]] = {}
        self._lock = threading.Lock()
        self._published = 0
        self._deliveries = 0
        self._errors: dict[str, int] = {}
        self._closed = False

    def subscribe(self, topic_prefix: str, consumer: Consumer, *, name: str | None = None) -> Subscription:
        """Deliver every message whose topic starts with ``topic_prefix`` (``""``: all) to
        ``consumer``.

        Raises:
            BrokerClosedError: The broker was closed.
            TypeError: ``consumer`` is not callable or ``topic_prefix`` is not a str.
        """
        if not isinstance(topic_prefix, str):
            raise TypeError(f"topic_prefix: expected a str, got {topic_prefix!r}")
        if not callable(consumer):
            raise TypeError(f"consumer: expected a callable taking one message, got {consumer!r}")
        sub = Subscription(self, topic_prefix, consumer, name or _consumer_name(consumer))
        with self._lock:
            if self._closed:
                raise BrokerClosedError("subscribe() on a closed broker")
            self._subs.append(sub)
            self._routes.clear()
        return sub

    def _remove(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            self._routes.clear()

    def _route(self, topic: str) -> tuple[Subscription, ...]:
        route = self._routes.get(topic)
        if route is None:
            with self._lock:
                route = tuple(s for s in self._subs if topic.startswith(s.prefix))
                self._routes[topic] = route
        return route

    def publish(self, message: Message) -> None:
        """Deliver ``message`` synchronously to every matching consumer.

        Raises:
            BrokerClosedError: The broker was closed.
            ConsumerError: In strict mode, the first consumer failure (after delivery to all).
        """
        if self._closed:
            raise BrokerClosedError(f"publish() on a closed broker (topic {message.topic!r})")
        self._published += 1
        first: ConsumerError | None = None
        for sub in self._route(message.topic):
            if not sub.active:
                continue
            try:
                sub.consumer(message)
            except Exception as exc:
                self._errors[sub.name] = self._errors.get(sub.name, 0) + 1
                _log.exception("consumer %r raised on topic %r", sub.name, message.topic)
                if first is None:
                    first = ConsumerError(sub.name, message.topic, exc)
                    first.__cause__ = exc
            else:
                self._deliveries += 1
        if first is not None and self.strict:
            raise first

    def statistics(self) -> BrokerStatistics:
        """A frozen snapshot of the counters."""
        errors = dict(self._errors)
        return BrokerStatistics(
            published=self._published,
            deliveries=self._deliveries,
            consumer_errors=sum(errors.values()),
            errors_by_consumer=MappingProxyType(errors),
            subscriptions=len(self._subs),
            closed=self._closed,
        )

    def close(self) -> None:
        """Detach every consumer and refuse further publishes. Consumers that hold resources
        (publishers, files) are closed by their owners, not by the broker. Idempotent."""
        with self._lock:
            self._closed = True
            for sub in self._subs:
                sub.active = False
            self._subs.clear()
            self._routes.clear()

    def __enter__(self) -> Broker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
