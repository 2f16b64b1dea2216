"""worldtap.capture: the producer side (recorder, terms, selectors, variations, gymnasium; Isaac
Lab's recorder manager in :mod:`capture.isaaclab`, imported on its own)."""

from .cartpole import CartPoleRandomizer
from .errors import (
    CaptureError,
    RecorderClosedError,
    SchemaError,
    SelectorError,
    TermError,
    VariationError,
)
from .gymnasium import RecordingVectorEnv
from .recorder import Recorder
from .selectors import CheckMode, WorldsCheck, WorldSelector, normalize_worlds
from .terms import FieldTree, FunctionTerm, Term, flatten_fields

__all__ = [
    "CaptureError",
    "CartPoleRandomizer",
    "CheckMode",
    "FieldTree",
    "FunctionTerm",
    "Recorder",
    "RecorderClosedError",
    "RecordingVectorEnv",
    "SchemaError",
    "SelectorError",
    "Term",
    "TermError",
    "VariationError",
    "WorldSelector",
    "WorldsCheck",
    "flatten_fields",
    "normalize_worlds",
]
