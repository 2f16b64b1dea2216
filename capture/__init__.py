"""worldtap.capture: the producer side (recorder, terms, selectors, variations)."""

from .errors import (
    CaptureError,
    RecorderClosedError,
    SchemaError,
    SelectorError,
    TermError,
    VariationError,
)
from .recorder import Recorder
from .selectors import WorldSelector, normalize_worlds
from .terms import FieldTree, FunctionTerm, Term, flatten_fields

__all__ = [
    "CaptureError",
    "FieldTree",
    "FunctionTerm",
    "Recorder",
    "RecorderClosedError",
    "SchemaError",
    "SelectorError",
    "Term",
    "TermError",
    "VariationError",
    "WorldSelector",
    "flatten_fields",
    "normalize_worlds",
]
