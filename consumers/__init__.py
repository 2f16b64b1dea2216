"""worldtap.consumers: things that consume the stream (retention, live statistics, analysis)."""

from .errors import ConsumersError, RetentionError, RetentionSchemaError, SampleTableError
from .live_stats import FieldStatistics, LiveStatistics, LiveSummary
from .retention import FinishedEpisode, Retention, RetentionStatistics
from .sample_table import OUTCOME_COLUMNS, SampleArrays, SampleTable

__all__ = [
    "OUTCOME_COLUMNS",
    "ConsumersError",
    "FieldStatistics",
    "FinishedEpisode",
    "LiveStatistics",
    "LiveSummary",
    "Retention",
    "RetentionError",
    "RetentionSchemaError",
    "RetentionStatistics",
    "SampleArrays",
    "SampleTable",
    "SampleTableError",
]
