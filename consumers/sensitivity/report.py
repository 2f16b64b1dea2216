"""Outputs of an analysis: ``indices.csv``, ``indices.json``, ``rates.csv``, ``sensitivity.png``
and ``convergence.png`` under one folder, and the terminal table (rich).

``indices.csv`` has one row per factor, output, method, subset and control, with the columns
``factor, output, method, index, ci_low, ci_high, influential, threshold, n, fraction, control,
bounds`` (``threshold`` is the dummy's upper bound; ``fraction < 1`` rows are the convergence
subsets; ``control = shuffled`` rows are the shuffled-outcome null). ``indices.json`` holds the
same rows plus the run, the rules, the dummy's seed, the verdicts and the warnings. Empty
numbers (a method that does not fit) are empty in the CSV and ``null`` in the JSON.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import urllib.parse
from dataclasses import asdict
from pathlib import Path
from typing import Any, Final

from ._deps import require
from .analysis import DUMMY, Analysis, IndexRow, dummy_seed

__all__ = ["FILES", "default_folder", "render_table", "to_json", "write_outputs"]

FILES: Final = ("indices.csv", "indices.json", "rates.csv", "sensitivity.png", "convergence.png")
_COLUMNS: Final = ("factor", "output", "method", "index", "ci_low", "ci_high", "influential",
                   "threshold", "n", "fraction", "control", "bounds")
_METHOD_COLORS: Final = {"pawn": "tab:blue", "rbd_fast": "tab:orange", "delta": "tab:green"}


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _clean(value.item())
    return value


def _all_rows(analysis: Analysis) -> list[IndexRow]:
    return [*analysis.indices, *analysis.null,
            *(r for r in analysis.convergence if r.fraction < 1.0)]


def to_json(analysis: Analysis) -> dict[str, Any]:
    """The analysis as one JSON-able document (NaN as ``None``)."""
    doc: dict[str, Any] = _clean({
        "run": analysis.run,
        "episodes": analysis.episodes,
        "outputs": list(analysis.outputs),
        "methods": list(analysis.methods),
        "seed": analysis.seed,
        "resamples": analysis.resamples,
        "rules": analysis.rules,
        "dummy": {"name": DUMMY, "distribution": "uniform(0, 1)", "generator": "numpy PCG64",
                  "seed": dummy_seed(analysis.seed)},
        "converged": analysis.converged,
        "verdicts": analysis.detail,
        "influential": {f"{o}/{m}": analysis.influential(o, m) for o in analysis.outputs
                        for m in analysis.methods},
        "null_influential": {f"{o}/{m}": analysis.influential(o, m, control="shuffled")
                             for o in analysis.outputs for m in analysis.methods},
        "factors": [{"name": f.name, "key": f.key, "kind": f.kind, "categorical": f.categorical,
                     "low": f.low, "high": f.high, "labels": list(f.labels), "bounds": f.bounds}
                    for f in analysis.factors],
        "indices": [r.as_dict() for r in analysis.indices],
        "null": [r.as_dict() for r in analysis.null],
        "convergence": [r.as_dict() for r in analysis.convergence],
        "warnings": list(analysis.warnings),
        "notes": list(analysis.notes),
    })
    return doc


def _csv_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return value


def _write_csv(path: Path, columns: tuple[str, ...] | list[str], rows: list[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow({c: _csv_value(row[c]) for c in columns})
    tmp.replace(path)


def default_folder(run: str) -> Path:
    """``runs/sensitivity/<run>``, the outputs' folder when none is given, with the run id as
    one path component that stays inside ``runs/sensitivity`` whatever the id (a publisher
    chooses it): percent-encoded (``urllib.parse.quote``; a plain id such as ``run-a`` is kept
    as it is, ``/etc`` is ``%2Fetc``), a leading ``.`` as ``%2E``, and an id longer than 120
    characters encoded cut, with a hash of the whole id."""
    name = urllib.parse.quote(run, safe="", errors="surrogatepass")
    if name.startswith("."):  # ".", ".." and hidden folders
        name = "%2E" + name[1:]
    if len(name) > 120:
        name = f"{name[:100]}~{hashlib.sha256(run.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"
    return Path("runs") / "sensitivity" / name


def write_outputs(analysis: Analysis, out: str | Path) -> dict[str, Path]:
    """Write every output file under ``out`` (created if needed); returns name -> path.

    Raises:
        MissingDependencyError: matplotlib is not installed.
        OSError: ``out`` cannot be written.
    """
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: folder / name for name in FILES}
    _write_csv(paths["indices.csv"], _COLUMNS, [r.as_dict() for r in _all_rows(analysis)])
    rate_rows = [asdict(r) for r in analysis.rates]
    rate_columns = list(rate_rows[0]) if rate_rows else ["factor", "output", "bin"]
    _write_csv(paths["rates.csv"], rate_columns, rate_rows)
    tmp = paths["indices.json"].with_name("indices.json.tmp")
    tmp.write_text(json.dumps(to_json(analysis), indent=2, allow_nan=False), encoding="utf-8")
    tmp.replace(paths["indices.json"])
    _plot(analysis, paths["sensitivity.png"])
    _plot_convergence(analysis, paths["convergence.png"])
    return paths


def _pyplot() -> Any:
    matplotlib = require("matplotlib")
    matplotlib.use("Agg", force=True)
    return require("matplotlib.pyplot")


def _plot(analysis: Analysis, path: Path) -> None:
    plt = _pyplot()
    outputs, methods = analysis.outputs, analysis.methods
    factors = [f for f in analysis.factors]
    ncols = max(len(outputs), 1)
    rate_cols = min(4, len(factors))
    rate_rows = math.ceil(len(factors) / rate_cols)
    fig = plt.figure(figsize=(max(5.0 * ncols, 4.0 * rate_cols), 4.0 + 2.8 * rate_rows), dpi=90)
    grid = fig.add_gridspec(1 + rate_rows, max(ncols, rate_cols))
    names = [f.name for f in factors]
    for o_i, output in enumerate(outputs):
        ax = fig.add_subplot(grid[0, o_i])
        for m_i, method in enumerate(methods):
            rows = {r.factor: r for r in analysis.rows(output, method)}
            color = _METHOD_COLORS.get(method, "black")
            xs, ys, lo, hi, marks = [], [], [], [], []
            for k, name in enumerate(names):
                r = rows.get(name)
                if r is None or not math.isfinite(r.index):
                    continue
                xs.append(k + (m_i - (len(methods) - 1) / 2) * 0.2)
                ys.append(r.index)
                lo.append(max(r.index - r.ci_low, 0.0) if math.isfinite(r.ci_low) else 0.0)
                hi.append(max(r.ci_high - r.index, 0.0) if math.isfinite(r.ci_high) else 0.0)
                marks.append(r.influential)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=color, capsize=3)
                for x_, y_, m_ in zip(xs, ys, marks, strict=True):
                    ax.plot(x_, y_, "o" if m_ else "x", color=color)
                threshold = analysis.threshold(output, method)
                if math.isfinite(threshold):
                    ax.axhline(threshold, color=color, linestyle="--", linewidth=1,
                               label=f"{method}: dummy upper bound")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(f"{output}: index with 95% interval (o = influential)", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    first = outputs[0]
    for k, f in enumerate(factors):
        ax = fig.add_subplot(grid[1 + k // rate_cols, k % rate_cols])
        bins = [r for r in analysis.rates if r.factor == f.name and r.output == first]
        xs = [r.center for r in bins]
        ax.plot(xs, [r.value for r in bins], "o-", color="tab:blue", markersize=3)
        ax.fill_between(xs, [r.ci_low for r in bins], [r.ci_high for r in bins], alpha=0.3,
                        color="tab:blue")
        if f.categorical:
            ax.set_xticks(xs)
            ax.set_xticklabels([str(r.label) for r in bins], fontsize=7)
        elif f.kind == "log_uniform" and f.low > 0:
            ax.set_xscale("log")
            ax.tick_params(axis="x", which="minor", labelbottom=False)
        stat = bins[0].statistic if bins else "rate"
        ax.set_title(f"{f.name}: {first} {stat} per bin ({f.bounds} bounds)", fontsize=8)
    fig.suptitle(f"run {analysis.run}: {analysis.episodes} episodes; "
                 f"{'converged' if analysis.converged else 'NOT converged (provisional)'}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _plot_convergence(analysis: Analysis, path: Path) -> None:
    plt = _pyplot()
    pairs = [(o, m) for o in analysis.outputs for m in analysis.methods]
    fig, axes = plt.subplots(1, len(pairs), figsize=(4.5 * len(pairs), 3.6), dpi=90, squeeze=False)
    for ax, (output, method) in zip(axes[0], pairs, strict=True):
        rows = [r for r in analysis.convergence if r.output == output and r.method == method]
        for f in analysis.factors:
            pts = sorted((r.fraction, r.index) for r in rows if r.factor == f.name
                         and math.isfinite(r.index))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-" if f.name != DUMMY else "k--",
                        label=f.name, markersize=3)
        verdict = analysis.detail.get(f"{output}/{method}", {})
        ax.set_title(f"{output} / {method}: {'converged' if verdict.get('converged') else 'not converged'}",
                     fontsize=9)
        ax.set_xlabel("share of episodes")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def render_table(analysis: Analysis, *, provisional: bool | None = None) -> Any:
    """A ``rich`` renderable: one row per factor and output, one column per method
    (``index [ci_low, ci_high]``, bold ``*`` when influential), the dummy's row last.

    Raises:
        MissingDependencyError: rich is not installed.
    """
    table_mod = require("rich.table")
    escape = require("rich.markup").escape
    provisional = (not analysis.converged) if provisional is None else provisional
    state = "PROVISIONAL (not converged)" if provisional else "converged"
    table = table_mod.Table(
        title=f"run {analysis.run}: sensitivity on {analysis.episodes} episodes - {state}",
        caption="* influential: its interval's lower bound exceeds the dummy's upper bound",
    )
    table.add_column("output")
    table.add_column("factor")
    for method in analysis.methods:
        table.add_column(method, justify="right")
    for output in analysis.outputs:
        by_method = {m: {r.factor: r for r in analysis.rows(output, m)} for m in analysis.methods}
        for f in analysis.factors:
            cells = []
            for m in analysis.methods:
                r = by_method[m].get(f.name)
                if r is None or not math.isfinite(r.index):
                    cells.append("n/a")
                    continue
                text = f"{r.index:.3f} [{r.ci_low:.3f}, {r.ci_high:.3f}]"
                cells.append(f"[bold]{text} *[/bold]" if r.influential else text)
            name = f"{f.name} (dummy)" if f.name == DUMMY else f.name
            table.add_row(escape(output), escape(name), *cells)
    return table
