"""worldtap.broker: the in-process pub/sub and (in later modules) its ZeroMQ bridge."""

from .bus import Broker, BrokerStatistics, Consumer, Subscription
from .errors import BrokerClosedError, BrokerError, ConsumerError
from .messages import (
    BUILD,
    RUNTIME,
    TOPIC_EPISODE_END,
    TOPIC_RUN_END,
    TOPIC_RUN_START,
    Batch,
    EpisodeEnd,
    FieldSpec,
    Message,
    Phase,
    RunEnd,
    RunStart,
    VariationSample,
    batch_topic,
    variation_topic,
)

__all__ = [
    "BUILD",
    "RUNTIME",
    "TOPIC_EPISODE_END",
    "TOPIC_RUN_END",
    "TOPIC_RUN_START",
    "Batch",
    "Broker",
    "BrokerClosedError",
    "BrokerError",
    "BrokerStatistics",
    "Consumer",
    "ConsumerError",
    "EpisodeEnd",
    "FieldSpec",
    "Message",
    "Phase",
    "RunEnd",
    "RunStart",
    "Subscription",
    "VariationSample",
    "batch_topic",
    "variation_topic",
]
