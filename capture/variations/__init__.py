"""capture.variations: seeded samplers, named variations, and their recorder.

Samplers draw on their own seeded ``torch.Generator`` and notify listeners of every draw;
a :class:`Variation` owns a sampler and keeps its listeners across ``apply_cfg``; a
:class:`VariationRecorder` publishes each draw as a ``broker.VariationSample`` tied to the
episode of each world and keeps an in-memory record.
"""

from ..errors import VariationError
from .config import Bounds, ChoiceCfg, LogUniformCfg, NormalCfg, SamplerCfg, UniformCfg
from .recorder import VariationRecorder
from .records import EpisodeSample, VariationDraw, VariationRecord, VariationSummary
from .samplers import (
    ChoiceSampler,
    LogUniformSampler,
    NormalSampler,
    SampleListener,
    Sampler,
    UniformSampler,
)
from .variation import Variation, VariationCfg

__all__ = [
    "Bounds",
    "ChoiceCfg",
    "ChoiceSampler",
    "EpisodeSample",
    "LogUniformCfg",
    "LogUniformSampler",
    "NormalCfg",
    "NormalSampler",
    "SampleListener",
    "Sampler",
    "SamplerCfg",
    "UniformCfg",
    "UniformSampler",
    "Variation",
    "VariationCfg",
    "VariationDraw",
    "VariationError",
    "VariationRecord",
    "VariationRecorder",
    "VariationSummary",
]
