"""consumers.sensitivity: which randomized parameters drive episode outcomes, with controls.

Given an (X, Y) table (:class:`consumers.SampleArrays`) and the run's variation declarations,
:func:`analyze` computes per-factor conditional outcome rates in fixed-bound bins and SALib's
given-data indices (PAWN, RBD-FAST, delta) with 95% intervals, for several outputs at once,
together with the controls that make them trustworthy: a dummy factor (the threshold below
which nothing is influential), a shuffled-outcome null, convergence on growing subsets and a
sample-sufficiency warning. :func:`write_outputs` writes CSV, JSON and PNG files;
:func:`run_live` does it all as a remote ZeroMQ subscriber. The command is
``worldtap-sensitivity`` (:mod:`consumers.sensitivity.cli`).

SALib, matplotlib and rich are imported on first use; without them a
:class:`MissingDependencyError` says ``pip install worldtap[analysis]``.
"""

from .analysis import (
    CONVERGENCE_FRACTIONS,
    CONVERGENCE_RULE,
    CONVERGENCE_WIDTH,
    DUMMY,
    INFLUENCE_RULE,
    Analysis,
    IndexRow,
    analyze,
    dummy_seed,
)
from .errors import MissingDependencyError, SensitivityError
from .factors import MIN_BIN_EPISODES, Factor, RateRow
from .live import LIVE_TOPICS, LiveResult, run_live
from .methods import DEFAULT_METHODS, METHODS
from .report import render_table, to_json, write_outputs

__all__ = [
    "CONVERGENCE_FRACTIONS",
    "CONVERGENCE_RULE",
    "CONVERGENCE_WIDTH",
    "DEFAULT_METHODS",
    "DUMMY",
    "INFLUENCE_RULE",
    "LIVE_TOPICS",
    "METHODS",
    "MIN_BIN_EPISODES",
    "Analysis",
    "Factor",
    "IndexRow",
    "LiveResult",
    "MissingDependencyError",
    "RateRow",
    "SensitivityError",
    "analyze",
    "dummy_seed",
    "render_table",
    "run_live",
    "to_json",
    "write_outputs",
]
