"""worldtap.consumers: things that consume the stream (retention, live statistics, analysis)."""

from .errors import ConsumersError, RetentionError
from .live_stats import FieldStatistics, LiveStatistics, LiveSummary
from .retention import FinishedEpisode, Retention, RetentionStatistics

__all__ = [
    "ConsumersError",
    "FieldStatistics",
    "FinishedEpisode",
    "LiveStatistics",
    "LiveSummary",
    "Retention",
    "RetentionError",
    "RetentionStatistics",
]
