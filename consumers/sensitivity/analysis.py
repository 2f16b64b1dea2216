"""The analysis with its controls: a dummy factor, a shuffled-outcome null, convergence on
growing subsets, and a sample-sufficiency warning.

Rules (also written into every output):

- Influential: a factor is reported influential on an output by a method only when the lower
  bound of its index's 95% interval exceeds the upper bound of the dummy factor's interval for
  the same output and method. The dummy (:data:`DUMMY`) is an independent uniform ``[0, 1)``
  column drawn by the tool (seeded by :func:`dummy_seed`), analysed like every factor:
  it cannot influence anything, so its interval is what "no influence" looks like at this
  sample size.
- Null: the indices are recomputed with the outcome shuffled (episodes permuted); the rule
  above must then report nothing influential, else the analysis is not to be trusted.
- Converged: for every output and method, the influential factors ranked by index are the
  same on the first 75% of the episodes as on all of them, and every influential factor's
  interval, and the dummy's, is narrower than :data:`CONVERGENCE_WIDTH`.
- Sufficient: every bin of every factor holds at least
  :data:`consumers.sensitivity.factors.MIN_BIN_EPISODES` episodes, else a warning.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from ..sample_table import SampleArrays
from .errors import SensitivityError
from .factors import MIN_BIN_EPISODES, Factor, RateRow, conditional_rates, factors_of, is_binary
from .methods import DEFAULT_METHODS, METHODS, compute

__all__ = [
    "CONVERGENCE_FRACTIONS",
    "CONVERGENCE_RULE",
    "CONVERGENCE_WIDTH",
    "DUMMY",
    "INFLUENCE_RULE",
    "Analysis",
    "IndexRow",
    "analyze",
    "dummy_seed",
]

DUMMY: Final = "_dummy"
CONVERGENCE_FRACTIONS: Final = (0.25, 0.5, 0.75, 1.0)
CONVERGENCE_WIDTH: Final = 0.1
INFLUENCE_RULE: Final = (
    "influential = the lower bound of the factor's 95% interval exceeds the upper bound of the "
    "dummy factor's 95% interval (same output and method); the dummy is an independent "
    "uniform column drawn by the tool"
)
CONVERGENCE_RULE: Final = (
    f"converged = for every output and method, the influential factors ranked by index are the "
    f"same on the first 75% of the episodes as on all of them, and every influential factor's "
    f"interval and the dummy's are narrower than {CONVERGENCE_WIDTH}"
)
SUFFICIENCY_RULE: Final = f"sufficient = every bin of every factor holds at least {MIN_BIN_EPISODES} episodes"
_MIN_ROWS: Final = 20
_REDUNDANT: Final = ("terminated", "truncated")  # success is usually made of them


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One index: a factor's influence on an output by a method.

    Attributes:
        index, ci_low, ci_high: The index and its 95% interval (NaN where the method does not fit).
        influential: ``ci_low`` exceeds ``threshold`` (always False for the dummy).
        threshold: The dummy's ``ci_high`` for the same output, method, subset and control.
        n: Episodes used.
        fraction: Share of the episodes used (the first ones, in the table's order).
        control: ``"none"``, or ``"shuffled"`` for the shuffled-outcome null.
        bounds: ``"declared"`` or ``"data"`` (see :mod:`consumers.sensitivity.factors`).
    """

    factor: str
    output: str
    method: str
    index: float
    ci_low: float
    ci_high: float
    influential: bool
    threshold: float
    n: int
    fraction: float = 1.0
    control: str = "none"
    bounds: str = "declared"

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True, eq=False)
class Analysis:
    """The result of :func:`analyze` (read it, or hand it to :mod:`consumers.sensitivity.report`).

    Attributes:
        run: The run analysed (``None`` when unknown).
        episodes: Rows in the table.
        outputs, methods: What was analysed.
        factors: The factors (the dummy last).
        indices: Every index on all episodes (dummy rows included).
        null: The same on the shuffled outcome.
        convergence: The indices on each growing subset (every fraction, 1.0 included).
        rates: Conditional outcome per bin of each factor.
        converged: See :data:`CONVERGENCE_RULE`; ``detail`` holds the per-output reasons.
        warnings: Sample-sufficiency and other warnings; ``notes``: what a method skipped.
    """

    run: str | None
    episodes: int
    outputs: tuple[str, ...]
    methods: tuple[str, ...]
    seed: int
    resamples: int
    factors: tuple[Factor, ...]
    indices: tuple[IndexRow, ...]
    null: tuple[IndexRow, ...]
    convergence: tuple[IndexRow, ...]
    rates: tuple[RateRow, ...]
    converged: bool
    detail: dict[str, Any] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    def rows(self, output: str, method: str, *, control: str = "none",
             fraction: float = 1.0) -> list[IndexRow]:
        """The index rows of one output and method (dummy included)."""
        source = self.null if control == "shuffled" else (
            self.indices if fraction == 1.0 else self.convergence)
        return [r for r in source if r.output == output and r.method == method
                and r.fraction == fraction]

    def influential(self, output: str, method: str, *, control: str = "none",
                    fraction: float = 1.0) -> list[str]:
        """Influential factors of ``output`` by ``method``, highest index first."""
        rows = [r for r in self.rows(output, method, control=control, fraction=fraction) if r.influential]
        return [r.factor for r in sorted(rows, key=lambda r: (-r.index, r.factor))]

    def threshold(self, output: str, method: str) -> float:
        """The dummy's upper bound for ``output`` and ``method`` (NaN if it has none)."""
        for r in self.rows(output, method):
            if r.factor == DUMMY:
                return r.ci_high
        return math.nan

    @property
    def rules(self) -> dict[str, str]:
        return {"influential": INFLUENCE_RULE, "converged": CONVERGENCE_RULE,
                "sufficient": SUFFICIENCY_RULE}


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([abs(p) for p in parts]).generate_state(1)[0])


def dummy_seed(seed: int) -> int:
    """The seed of the dummy column: ``numpy.random.default_rng(dummy_seed(seed)).uniform(0, 1,
    episodes)``; derived (not ``seed`` itself) so that it never repeats a stream the user's
    simulation drew with the same seed."""
    return _seed(seed, 0xD0117)


def _index_rows(x: np.ndarray, y: np.ndarray, factors: Sequence[Factor], output: str,
                method: str, *, seed: int, resamples: int, fraction: float, control: str,
                notes: list[str]) -> list[IndexRow]:
    categorical = [f.categorical for f in factors]
    levels = [len(f.labels) for f in factors]
    result = compute(method, x, y, categorical=categorical, levels=levels, binary=is_binary(y),
                     seed=seed, resamples=resamples)
    notes.extend(f"{output}: {note}" for note in result.notes)
    threshold = float(result.ci_high[-1])  # the dummy is the last column
    rows = []
    for j, f in enumerate(factors):
        low = float(result.ci_low[j])
        influential = (f.name != DUMMY and math.isfinite(low) and math.isfinite(threshold)
                       and low > threshold)
        rows.append(IndexRow(f.name, output, method, float(result.index[j]), low,
                             float(result.ci_high[j]), influential, threshold, int(x.shape[0]),
                             fraction, control, f.bounds))
    return rows


def _verdict(analysis_rows: Sequence[IndexRow], convergence: Sequence[IndexRow], output: str,
             method: str) -> dict[str, Any]:
    def ranked(fraction: float) -> list[str]:
        rows = [r for r in (analysis_rows if fraction == 1.0 else convergence)
                if r.output == output and r.method == method and r.fraction == fraction
                and r.influential]
        return [r.factor for r in sorted(rows, key=lambda r: (-r.index, r.factor))]

    full = [r for r in analysis_rows if r.output == output and r.method == method]
    fractions = sorted({r.fraction for r in convergence if r.output == output and r.method == method})
    rankings = {f"{f:g}": ranked(f) for f in fractions}
    widths = [r.ci_high - r.ci_low for r in full if r.influential or r.factor == DUMMY]
    width = max(widths) if widths and all(math.isfinite(w) for w in widths) else math.nan
    previous = [f for f in fractions if f < 1.0]
    stable = bool(previous) and ranked(max(previous)) == ranked(1.0)
    applicable = any(math.isfinite(r.index) for r in full)
    ok = (not applicable) or (stable and math.isfinite(width) and width < CONVERGENCE_WIDTH)
    return {"rankings": rankings, "stable": stable, "max_width": width,
            "applicable": applicable, "converged": ok}


def analyze(arrays: SampleArrays, declarations: Mapping[str, Mapping[str, Any]] | None = None, *,
            run: str | None = None, outputs: Sequence[str] | None = None,
            methods: Sequence[str] = DEFAULT_METHODS, seed: int = 0, resamples: int = 100,
            bins: int = 10, fractions: Sequence[float] = CONVERGENCE_FRACTIONS,
            progress: Callable[[str], None] | None = None) -> Analysis:
    """Sensitivity of each output in ``arrays.y`` to each factor in ``arrays.x``, with controls.

    Args:
        arrays: The (X, Y) table (e.g. ``SampleTable.arrays()`` or
            ``RunStore(path).variation_table(run).arrays()``). Rows in time order.
        declarations: Variation key -> declaration (bins and bounds); ``None``: bounds from
            the data, flagged ``bounds="data"``.
        outputs: Y columns to analyse (default: every one that varies, except ``terminated``
            and ``truncated``, which success is usually made of; name them to get them).
        methods: Any of ``pawn``, ``rbd_fast``, ``delta``.
        seed: Seeds the dummy factor, the shuffles and every bootstrap.
        resamples: Bootstrap resamples per interval.
        bins: Bins per ordered factor (conditional rates).
        fractions: Growing subsets for the convergence check (1.0 is always added).
        progress: Called with a status line before each step.

    Raises:
        SensitivityError: No rows, no factor, an unknown output or method, bad sizes.
        MissingDependencyError: SALib is not installed.
    """
    say = progress or (lambda _line: None)
    n = int(arrays.x.shape[0])
    if n == 0:
        raise SensitivityError(f"run {run!r}: the table holds no finished episodes to analyse")
    if not arrays.x_columns:
        raise SensitivityError(f"run {run!r}: the table holds no variation factors to analyse")
    bad = [m for m in methods if m not in METHODS]
    if bad or not methods:
        raise SensitivityError(f"methods: expected some of {', '.join(METHODS)}, got {list(methods)!r}")
    if resamples < 2 or bins < 1:
        raise SensitivityError(f"resamples, bins: expected >= 2 and >= 1, got {resamples!r}, {bins!r}")
    ycols = list(arrays.y_columns)
    if outputs is None:
        chosen = [c for c in ycols if c not in _REDUNDANT and np.nanmax(arrays.y[:, ycols.index(c)])
                  > np.nanmin(arrays.y[:, ycols.index(c)])]
        outputs = chosen or ycols[:1]
    unknown = [o for o in outputs if o not in ycols]
    if unknown or not outputs:
        raise SensitivityError(f"outputs: expected some of {', '.join(ycols)}, got {list(outputs)!r}")
    warnings_: list[str] = []
    notes: list[str] = []
    all_factors = factors_of(arrays, declarations, bins=bins)
    factors: list[Factor] = []
    columns: list[np.ndarray] = []
    for j, f in enumerate(all_factors):
        col = arrays.x[:, j]
        finite = col[np.isfinite(col)]
        if finite.size == 0 or np.ptp(finite) == 0:
            notes.append(f"factor {f.name!r}: constant or missing in every episode; not analysed")
            continue
        if f.bounds == "data":
            warnings_.append(f"factor {f.name!r}: no declaration with the run; bins use the "
                             f"data's range [{f.low:g}, {f.high:g}] (bounds=data)")
        outside = f.outside(finite)
        if outside:
            warnings_.append(f"factor {f.name!r}: {outside} value(s) outside the declared bounds "
                             f"[{f.low:g}, {f.high:g}]; counted in the end bins")
        factors.append(f)
        columns.append(col)
    if not factors:
        raise SensitivityError(f"run {run!r}: every factor is constant or missing; nothing to analyse")
    dummy = np.random.default_rng(dummy_seed(seed)).uniform(0.0, 1.0, n)
    factors.append(Factor(DUMMY, DUMMY, "uniform", False,
                          tuple(float(e) for e in np.linspace(0.0, 1.0, bins + 1))))
    x = np.column_stack([*columns, dummy])
    complete = np.isfinite(x).all(axis=1)
    if not complete.all():
        warnings_.append(f"{int((~complete).sum())} of {n} episodes lack a value of some factor; "
                         f"the indices use the other {int(complete.sum())}")
    for f, col in zip(factors, x.T, strict=True):
        counts = np.bincount(f.bin_of(col[complete]), minlength=len(f.edges) - 1)
        few = counts < MIN_BIN_EPISODES
        if few.any():
            warnings_.append(f"factor {f.name!r}: {int(few.sum())} of {counts.size} bins hold fewer "
                             f"than {MIN_BIN_EPISODES} episodes (fewest: {int(counts.min())}); "
                             f"more episodes are needed for reliable rates and indices")
    fractions = sorted({float(f) for f in fractions if 0 < f < 1})
    indices: list[IndexRow] = []
    null: list[IndexRow] = []
    convergence: list[IndexRow] = []
    rates: list[RateRow] = []
    rate_rng = np.random.default_rng(_seed(seed, 7))
    for o_i, output in enumerate(outputs):
        y_all = arrays.y[:, ycols.index(output)]
        use = complete & np.isfinite(y_all)
        xo, yo = x[use], y_all[use]
        for f, col in zip(factors, x.T, strict=True):
            rates += conditional_rates(f, col, y_all, output, rng=rate_rng, resamples=resamples)
        for m_i, method in enumerate(methods):
            say(f"{output}: {method} on {yo.size} episodes ({resamples} resamples)")
            indices += _index_rows(xo, yo, factors, output, method, seed=_seed(seed, o_i, m_i, 0),
                                   resamples=resamples, fraction=1.0, control="none", notes=notes)
            shuffled = np.random.default_rng(_seed(seed, o_i, m_i, 1)).permutation(yo)
            null += _index_rows(xo, shuffled, factors, output, method,
                                seed=_seed(seed, o_i, m_i, 2), resamples=resamples, fraction=1.0,
                                control="shuffled", notes=[])
            for f_i, fraction in enumerate(fractions):
                m = math.ceil(fraction * yo.size)
                if m < _MIN_ROWS:
                    continue
                convergence += _index_rows(xo[:m], yo[:m], factors, output, method,
                                           seed=_seed(seed, o_i, m_i, 3 + f_i),
                                           resamples=resamples, fraction=fraction,
                                           control="none", notes=[])
    convergence += indices
    detail = {f"{o}/{m}": _verdict(indices, convergence, o, m) for o in outputs for m in methods}
    converged = all(v["converged"] for v in detail.values())
    for label, rows in (("shuffled-outcome null", null),):
        flagged = sorted({f"{r.factor} ({r.output}, {r.method})" for r in rows if r.influential})
        if flagged:
            warnings_.append(f"{label}: the rule flags {', '.join(flagged)} on shuffled outcomes; "
                             f"treat the influential factors with caution")
    return Analysis(run, n, tuple(outputs), tuple(methods), seed, resamples, tuple(factors),
                    tuple(indices), tuple(null), tuple(convergence), tuple(rates), converged,
                    detail, tuple(warnings_), tuple(dict.fromkeys(notes)))
