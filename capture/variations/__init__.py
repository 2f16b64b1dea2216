"""capture.variations: seeded samplers, named variations, and their recorder.

Samplers draw on their own seeded ``torch.Generator`` (seeds derived from the run seed and
the variation key unless given) or take rows of a given design, and notify listeners of every
draw;
a :class:`Variation` owns a sampler and keeps its listeners across ``apply_cfg``; a
:class:`VariationRecorder` publishes each draw as a ``broker.VariationSample`` tied to the
episode of each world and keeps an in-memory record.
"""

from ..errors import VariationError
from .config import (
    Bounds,
    ChoiceCfg,
    DesignCfg,
    LogUniformCfg,
    NormalCfg,
    SamplerCfg,
    UniformCfg,
)
from .recorder import VariationRecorder
from .records import EpisodeSample, VariationDraw, VariationRecord, VariationSummary
from .samplers import (
    ChoiceSampler,
    DesignSampler,
    LogUniformSampler,
    NormalSampler,
    SampleListener,
    Sampler,
    UniformSampler,
)
from .seeds import derive_seed
from .variation import Variation, VariationCfg

__all__ = [
    "Bounds",
    "ChoiceCfg",
    "ChoiceSampler",
    "DesignCfg",
    "DesignSampler",
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
    "derive_seed",
]
