"""The sensitivity analysis on known answers: synthetic tables where success provably depends
on some factors (one of them non-monotonically) and not on others, the controls (dummy,
shuffled outcome, convergence, sample sufficiency), and the offline command on a store written
by the real pipeline (Recorder, variations, StoreDaemon)."""

from __future__ import annotations

import builtins
import csv
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from broker import Broker, Message, RunEnd, RunStart
from capture import Recorder
from capture.variations import (
    ChoiceCfg,
    LogUniformCfg,
    UniformCfg,
    Variation,
    VariationCfg,
    VariationRecorder,
)
from consumers import SampleArrays, SampleTable
from consumers.sensitivity import (
    DUMMY,
    MIN_BIN_EPISODES,
    MissingDependencyError,
    SensitivityError,
    analyze,
    dummy_seed,
    to_json,
)
from consumers.sensitivity.cli import main
from consumers.sensitivity.factors import conditional_rates, factors_of, wilson
from consumers.sensitivity.methods import pawn_statistic

TRUE = {"a", "c"}  # success depends on these (c non-monotonically) ...
NULL = {"color", "d", "mass", "v[0]", "v[1]"}  # ... and provably on none of these
DECLARATIONS: dict[str, dict[str, Any]] = {
    "a": {"kind": "uniform", "phase": "runtime", "shape": [], "seed": 1, "low": 0.0, "high": 1.0},
    "c": {"kind": "uniform", "phase": "runtime", "shape": [], "seed": 2, "low": 0.0, "high": 1.0},
    "color": {"kind": "choice", "phase": "runtime", "shape": [], "seed": 3,
              "labels": ["red", "green", "blue"], "weights": None},
    "d": {"kind": "uniform", "phase": "runtime", "shape": [], "seed": 4, "low": 0.0, "high": 1.0},
    "mass": {"kind": "log_uniform", "phase": "runtime", "shape": [], "seed": 5, "low": 0.1, "high": 10.0},
    "v": {"kind": "uniform", "phase": "runtime", "shape": [2], "seed": 6, "low": [-1.0, -1.0],
          "high": [1.0, 1.0]},
}
COLUMNS = ("a", "c", "color", "d", "mass", "v[0]", "v[1]")
OUTCOMES = ("success", "terminated", "truncated", "length")


def outcome(a: np.ndarray, c: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """Success iff a > 0.3 and |c - 0.5| < 0.2 (a window: no linear trend in c), flipped where
    ``noise`` < 0.05."""
    ok = (a > 0.3) & (np.abs(c - 0.5) < 0.2)
    return np.where(noise < 0.05, ~ok, ok)


def synthetic(seed: int, n: int = 1000) -> SampleArrays:
    """A table drawn straight from the declared distributions; ``length`` depends on ``a`` only."""
    rng = np.random.default_rng(seed + 1000)
    a, c, d = rng.uniform(0, 1, n), rng.uniform(0, 1, n), rng.uniform(0, 1, n)
    mass = np.exp(rng.uniform(np.log(0.1), np.log(10.0), n))
    color = rng.integers(0, 3, n).astype(np.float64)
    v = rng.uniform(-1, 1, (n, 2))
    success = outcome(a, c, rng.uniform(0, 1, n)).astype(np.float64)
    length = np.round(4 + 8 * a)
    x = np.column_stack([a, c, color, d, mass, v])
    y = np.column_stack([success, 1 - success, np.zeros(n), length])
    labels = {"color": np.array(["red", "green", "blue"], dtype=object)[color.astype(int)]}
    return SampleArrays(np.full(n, "syn"), np.arange(n), np.zeros(n, np.int64), x, y, COLUMNS,
                        OUTCOMES, labels)


def shuffled(arrays: SampleArrays, seed: int) -> SampleArrays:
    perm = np.random.default_rng(seed).permutation(arrays.y.shape[0])
    return SampleArrays(arrays.run, arrays.world, arrays.episode, arrays.x, arrays.y[perm],
                        arrays.x_columns, arrays.y_columns, arrays.labels)


# -- the statistic and the bins -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["binary", "continuous", "discrete"])
def test_vectorized_pawn_equals_salib(kind: str) -> None:
    """The bootstrap replicates use a twin of SALib's PAWN statistic: a twin that drifted from
    SALib's slides or KS distance would give intervals around another index."""
    pawn = pytest.importorskip("SALib.analyze.pawn")
    rng = np.random.default_rng(3)
    x = rng.uniform(size=(700, 4))
    x[:, 3] = np.round(x[:, 3] * 5) / 5  # ties at the quantiles
    y = {"binary": (x[:, 0] > 0.4).astype(float), "continuous": 3 * x[:, 1] + rng.normal(size=700),
         "discrete": np.round(x[:, 2] * 4)}[kind]
    problem = {"num_vars": 4, "names": list("abcd"), "bounds": [[0, 1]] * 4}
    expected = np.asarray(pawn.analyze(problem, x, y, S=10)["median"])
    np.testing.assert_allclose(pawn_statistic(x, y, [False] * 4, [0] * 4), expected, rtol=0, atol=1e-12)


def test_bins_come_from_the_declarations() -> None:
    """Bins are fixed by the declared bounds (log space for log_uniform, one per label for a
    choice, per component for a vector), never by the data's range when a declaration exists."""
    arrays = synthetic(0, 200)
    decl = dict(DECLARATIONS)
    decl["d"] = {"kind": "normal", "phase": "runtime", "shape": [], "seed": 4, "mean": 0.5,
                 "std": 0.1, "low": None, "high": None}
    decl["v"] = {**DECLARATIONS["v"], "low": [-1.0, -2.0], "high": [1.0, 2.0]}
    by_name = {f.name: f for f in factors_of(arrays, decl, bins=4)}
    assert by_name["a"].edges == (0.0, 0.25, 0.5, 0.75, 1.0)
    np.testing.assert_allclose(by_name["mass"].edges, [0.1, 0.1 * 10**0.5, 1.0, 10**0.5, 10.0])
    np.testing.assert_allclose(by_name["d"].edges, np.linspace(0.2, 0.8, 5))  # mean ± 3 std
    assert by_name["v[1]"].edges == (-2.0, -1.0, 0.0, 1.0, 2.0)
    assert by_name["color"].categorical
    assert by_name["color"].labels == ("red", "green", "blue")
    assert all(f.bounds == "declared" for f in by_name.values())
    undeclared = {f.name: f for f in factors_of(arrays, None, bins=4)}
    assert undeclared["a"].bounds == "data"
    assert undeclared["a"].low == arrays.x[:, 0].min()
    assert undeclared["a"].high == arrays.x[:, 0].max()
    assert undeclared["color"].labels == ("red", "green", "blue")  # labels from the table


def test_wilson_and_conditional_rates() -> None:
    """Rates per bin are the exact share of successes among the episodes in the bin, with
    Wilson intervals (checked against the closed form for 0/10 and 5/10)."""
    assert wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert wilson(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    arrays = synthetic(1, 400)
    factor = next(f for f in factors_of(arrays, DECLARATIONS, bins=5) if f.name == "c")
    rows = conditional_rates(factor, arrays.x[:, 1], arrays.y[:, 0], "success",
                             rng=np.random.default_rng(0), resamples=50)
    for row in rows:
        inside = (arrays.x[:, 1] >= row.low) & ((arrays.x[:, 1] < row.high) | (row.bin == 4))
        assert row.n == int(inside.sum())
        assert row.value == arrays.y[inside, 0].mean()
        assert row.ci_low <= row.value <= row.ci_high
    assert rows[2].value > 0.5 > max(rows[0].value, rows[4].value)  # the window in the middle
    means = conditional_rates(factor, arrays.x[:, 1], arrays.y[:, 3], "length",
                              rng=np.random.default_rng(0), resamples=50)
    assert {r.statistic for r in means} == {"mean"}
    assert {r.statistic for r in rows} == {"rate"}


# -- known answers and controls ---------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_known_answer_ranks_true_factors_above_the_dummy(seed: int) -> None:
    """Success depends on a and on c through a window (a correlation misses c), length on a
    only; nothing depends on color, d, mass or v. The rule (lower bound above the dummy's upper
    bound) must report exactly the true factors, per method where the method fits, across
    seeds, and nothing on shuffled outcomes."""
    arrays = synthetic(seed)
    c = arrays.x[:, 1]
    assert abs(np.corrcoef(c, arrays.y[:, 0])[0, 1]) < 0.1  # a correlation sees nothing in c
    an = analyze(arrays, DECLARATIONS, run="syn", outputs=["success", "length"], seed=seed,
                 resamples=30, fractions=(0.75,))
    assert set(an.influential("success", "pawn")) == TRUE
    assert "c" in an.influential("success", "rbd_fast")
    assert set(an.influential("success", "rbd_fast")) <= TRUE
    assert an.influential("length", "pawn") == ["a"] == an.influential("length", "rbd_fast")
    for output in an.outputs:
        for method in an.methods:
            threshold = an.threshold(output, method)
            for row in an.rows(output, method):
                if row.factor in NULL and math.isfinite(row.ci_low):
                    assert row.ci_low <= threshold, row
            assert an.influential(output, method, control="shuffled") == []
    dummy = [r for r in an.indices if r.factor == DUMMY]
    assert dummy
    assert not any(r.influential for r in dummy)
    color = an.rows("success", "rbd_fast")[COLUMNS.index("color")]
    assert color.factor == "color"
    assert math.isnan(color.index)


def test_shuffled_labels_report_nothing_influential() -> None:
    """With the outcomes shuffled across episodes no factor can matter: an analysis that still
    flags one (Isaac Lab-Arena's fitted report does) fails this control."""
    for seed in (0, 1):
        an = analyze(shuffled(synthetic(seed), 99), DECLARATIONS, outputs=["success"], seed=seed,
                     resamples=30, fractions=(0.75,))
        assert an.influential("success", "pawn") == [] == an.influential("success", "rbd_fast")


def test_dummy_is_seeded_and_recorded() -> None:
    """The dummy column is reproducible from the recorded seed, differs from the user's seed
    stream, and the outputs say how it was drawn."""
    arrays = synthetic(0, 300)
    kwargs: dict[str, Any] = {"outputs": ["success"], "methods": ["pawn"], "seed": 5, "resamples": 10,
                              "fractions": ()}
    one, two = analyze(arrays, DECLARATIONS, **kwargs), analyze(arrays, DECLARATIONS, **kwargs)
    assert [r.as_dict() for r in one.indices] == [r.as_dict() for r in two.indices]
    assert dummy_seed(5) != 5
    doc = json.loads(json.dumps(to_json(one), allow_nan=False))
    assert doc["dummy"] == {"name": DUMMY, "distribution": "uniform(0, 1)", "generator": "numpy PCG64",
                            "seed": dummy_seed(5)}
    assert "exceeds the upper bound of the dummy" in doc["rules"]["influential"]


def test_convergence_and_sufficiency() -> None:
    """Few episodes: bins below the threshold are warned about and the verdict is not
    converged; many: the ranking is stable on growing subsets and the verdict is converged."""
    small = analyze(synthetic(0, 120), DECLARATIONS, outputs=["success"], methods=["pawn"],
                    resamples=20)
    assert any(f"fewer than {MIN_BIN_EPISODES} episodes" in w for w in small.warnings)
    assert not small.converged
    big = analyze(synthetic(0, 3000), DECLARATIONS, outputs=["length"], methods=["pawn"],
                  resamples=20)
    assert not any("fewer than" in w and "'a'" in w for w in big.warnings)
    assert big.converged, big.detail
    assert {r.fraction for r in big.convergence} == {0.25, 0.5, 0.75, 1.0}
    assert big.detail["length/pawn"]["rankings"] == {"0.25": ["a"], "0.5": ["a"], "0.75": ["a"], "1": ["a"]}


def test_delta_fits_numeric_outputs_only() -> None:
    """SALib's delta runs on a numeric outcome (and finds a) and is skipped, with a note, on a
    binary one, where its density estimate degenerates."""
    arrays = synthetic(0, 250)
    an = analyze(arrays, DECLARATIONS, outputs=["success", "length"], methods=["delta"],
                 resamples=2, fractions=())
    assert all(math.isnan(r.index) for r in an.rows("success", "delta"))
    assert any("delta: not applied to a binary output" in n for n in an.notes)
    assert an.influential("length", "delta")[:1] == ["a"]


def test_bad_input_raises_one_clear_error() -> None:
    arrays = synthetic(0, 50)
    empty = SampleArrays(arrays.run[:0], arrays.world[:0], arrays.episode[:0], arrays.x[:0],
                         arrays.y[:0], COLUMNS, OUTCOMES, {})
    with pytest.raises(SensitivityError, match="holds no finished episodes"):
        analyze(empty, DECLARATIONS)
    with pytest.raises(SensitivityError, match=r"outputs: expected some of success, .*got \['reward'\]"):
        analyze(arrays, DECLARATIONS, outputs=["reward"])
    with pytest.raises(SensitivityError, match=r"methods: expected some of pawn, rbd_fast, delta"):
        analyze(arrays, DECLARATIONS, methods=["sobol"])


def test_missing_salib_names_the_extra(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    """Without SALib the analysis says, in one line, what to install."""
    real = builtins.__import__

    def no_salib(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith("SALib"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_salib)
    monkeypatch.setattr("importlib.import_module", lambda name: no_salib(name))
    with pytest.raises(MissingDependencyError, match=r"pip install worldtap\[analysis\]"):
        analyze(synthetic(0, 100), DECLARATIONS, outputs=["success"], resamples=5)


# -- the offline command on a store written by the real pipeline ---------------------------


def publish_run(broker: Broker, *, run: str = "known", seed: int = 0, worlds: int = 32,
                episodes: int = 800, close: bool = True) -> None:
    """Drive a Recorder whose worlds end episodes on their own schedule; every reset draws the
    six variations (runtime) for the worlds that reset, and success follows :func:`outcome` on
    the values actually drawn; episode length is 4 + round(8 a). ``close=False`` leaves the
    run open (no RunEnd)."""
    rec = Recorder(worlds, broker=broker, run=run)
    cfgs = {"a": UniformCfg(0.0, 1.0, seed=10 * seed + 1), "c": UniformCfg(0.0, 1.0, seed=10 * seed + 2),
            "color": ChoiceCfg(["red", "green", "blue"], seed=10 * seed + 3),
            "d": UniformCfg(0.0, 1.0, seed=10 * seed + 4),
            "mass": LogUniformCfg(0.1, 10.0, seed=10 * seed + 5),
            "v": UniformCfg([-1.0, -1.0], [1.0, 1.0], seed=10 * seed + 6)}
    variations = {k: Variation(k, VariationCfg(sampler=cfg, phase="runtime")) for k, cfg in cfgs.items()}
    VariationRecorder(rec, keep_records=False).attach(list(variations.values()))
    noise = torch.Generator().manual_seed(seed)
    values: dict[str, torch.Tensor] = {}

    def draw(idx: torch.Tensor) -> None:
        for key, var in variations.items():
            value = var.sample(len(idx), idx)
            values.setdefault(key, torch.zeros((worlds, *value.shape[1:]), dtype=value.dtype))[idx] = value

    draw(torch.arange(worlds))
    steps = torch.zeros(worlds, dtype=torch.int64)
    ended = 0
    while ended < episodes:
        rec.record_pre_step()
        rec.record_post_step()
        steps += 1
        due = (steps >= 4 + torch.round(8 * values["a"])).nonzero().flatten()
        if len(due) == 0:
            continue
        a, c = values["a"][due].double().numpy(), values["c"][due].double().numpy()
        ok = torch.from_numpy(outcome(a, c, torch.rand(len(due), generator=noise).numpy()))
        rec.record_pre_reset(due, success=ok, terminated=~ok, truncated=ok)
        rec.record_post_reset(due)
        steps[due] = 0
        ended += len(due)
        draw(due)
    if close:
        rec.close()


class Kept:
    """Broker consumer keeping the run's RunStart/RunEnd (their declarations)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __call__(self, message: Message) -> None:
        if isinstance(message, RunStart | RunEnd):
            self.messages.append(message)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SampleTable]:
    """A run store holding run ``known`` written by an in-process StoreDaemon, and the table the
    same messages built in process (read-only: shared by the tests of this module)."""
    from storage import StoreDaemon

    path = tmp_path_factory.mktemp("sensitivity") / "runs.zarr"
    with Broker(strict=True) as broker:
        daemon = StoreDaemon(path)
        try:
            broker.subscribe("", daemon)
            live = SampleTable()
            live.attach(broker)
            publish_run(broker)
        finally:
            daemon.close()
    return path, live


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as fh:
        return list(csv.DictReader(fh))


def test_offline_command_on_a_real_store(store: tuple[Path, SampleTable], tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``worldtap-sensitivity --store`` analyses exactly what was published: the table it reads
    equals the in-process table byte for byte, its indices equal an analysis of the in-process
    table, the true factors are influential and the others not, and the CSV, JSON and PNG
    files say so."""
    from storage import RunStore

    path, live = store
    stored = RunStore(path).variation_table("known").arrays()
    mine = live.arrays()
    order_a, order_b = np.lexsort((stored.episode, stored.world)), np.lexsort((mine.episode, mine.world))
    assert stored.x[order_a].tobytes() == mine.x[order_b].tobytes()
    assert stored.y[order_a][:, :4].tobytes() == mine.y[order_b][:, :4].tobytes()
    out = tmp_path / "out"
    code = main(["--store", str(path), "--out", str(out), "--outputs", "success,length",
                 "--resamples", "20", "--seed", "3", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 0
    doc = json.loads((out / "indices.json").read_text())
    assert doc["run"] == "known"
    assert doc["episodes"] == len(mine.world)
    assert set(doc["influential"]["success/pawn"]) == TRUE
    assert doc["influential"]["length/pawn"] == ["a"] == doc["influential"]["length/rbd_fast"]
    assert all(v == [] for v in doc["null_influential"].values())
    from consumers.sensitivity.cli import declarations_of

    declared = declarations_of(RunStore(path).info("known"))
    expected = analyze(stored, declared, run="known", outputs=["success", "length"], seed=3, resamples=20)
    assert doc["indices"] == json.loads(json.dumps([r.as_dict() for r in expected.indices]).replace("NaN", "null"))
    bounds = {f["name"]: f["bounds"] for f in doc["factors"]}
    if declared:  # the run carries its declarations: bins use them, never the data's range
        assert set(declared) == {"a", "c", "color", "d", "mass", "v"}
        assert {b for n, b in bounds.items() if n != DUMMY} == {"declared"}
    else:  # a store without declarations: bounds from the data, flagged in every output
        assert {b for n, b in bounds.items() if n != DUMMY} == {"data"}
        assert any("bounds=data" in w for w in doc["warnings"])
    rows = _csv(out / "indices.csv")
    assert list(rows[0]) == ["factor", "output", "method", "index", "ci_low", "ci_high", "influential",
                             "threshold", "n", "fraction", "control", "bounds"]
    main_rows = [r for r in rows if r["control"] == "none" and r["fraction"] == "1.0"]
    assert {(r["factor"], r["output"], r["method"]) for r in main_rows if r["influential"] == "True"} == {
        (f, *pair.split("/")) for pair, factors in doc["influential"].items() for f in factors}
    assert "c" in doc["influential"]["success/rbd_fast"]
    assert any(r["control"] == "shuffled" for r in rows)
    assert any(r["fraction"] == "0.5" for r in rows)
    rates = _csv(out / "rates.csv")
    assert {r["label"] for r in rates if r["factor"] == "color"} == {"red", "green", "blue"}
    for png in ("sensitivity.png", "convergence.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "indices.csv: " in printed
    assert "_dummy (dummy)" in printed


def test_offline_command_bad_input(store: tuple[Path, SampleTable], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """No such store, no such run, a store without runs: one clear line and exit 2."""
    path, _ = store
    assert main(["--store", str(tmp_path / "absent.zarr"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("worldtap-sensitivity: error: no run store at")
    assert main(["--store", str(path), "--run", "nope", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["worldtap-sensitivity: error: run 'nope' not found in store "
                   f"{str(path)!r}; runs: ['known']"]
    from storage import RunStoreWriter

    RunStoreWriter(tmp_path / "empty.zarr")
    assert main(["--store", str(tmp_path / "empty.zarr"), "--quiet"]) == 2
    assert "holds 0 runs (none); pass --run" in capsys.readouterr().err


def test_exported_surface_and_lazy_imports() -> None:
    """The package's public names, and importing it (or its command module) pulls in none of
    SALib, matplotlib or rich: ``import consumers`` stays light without the analysis extra."""
    import subprocess
    import sys

    import consumers.sensitivity as sensitivity

    assert list(sensitivity.__all__) == [
        "CONVERGENCE_FRACTIONS", "CONVERGENCE_RULE", "CONVERGENCE_WIDTH", "DEFAULT_METHODS", "DUMMY",
        "INFLUENCE_RULE", "LIVE_TOPICS", "METHODS", "MIN_BIN_EPISODES", "Analysis", "Factor", "IndexRow",
        "LiveResult", "MissingDependencyError", "RateRow", "SensitivityError", "analyze", "dummy_seed",
        "render_table", "run_live", "to_json", "write_outputs"]
    assert all(hasattr(sensitivity, name) for name in sensitivity.__all__)
    assert issubclass(SensitivityError, ValueError)
    assert issubclass(MissingDependencyError, ImportError)
    code = ("import sys, consumers.sensitivity, consumers.sensitivity.cli\n"
            "heavy = [m for m in ('SALib', 'matplotlib', 'rich') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_default_folder_keeps_any_run_id_inside_runs_sensitivity(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Bug: without ``--out`` the outputs went to ``runs/sensitivity/<run id>`` as a path, and
    the publisher chooses the run id: ``../../escaped`` wrote outside ``runs/``, an absolute id
    wrote (and overwrote) files wherever it named, in offline and in live mode. Now the id is
    one folder name under ``runs/sensitivity``."""
    from storage import StoreDaemon

    outside = tmp_path / "outside"
    runs = ["../../escaped", str(outside), "..", "plain-run_1.x"]
    with Broker(strict=True) as broker:
        daemon = StoreDaemon(tmp_path / "runs.zarr")
        try:
            broker.subscribe("", daemon)
            for i, run in enumerate(runs):
                publish_run(broker, run=run, seed=i, worlds=16, episodes=200)
        finally:
            daemon.close()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    for run in runs:
        assert main(["--store", str(tmp_path / "runs.zarr"), "--run", run, "--quiet", "--resamples", "10"]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.zarr", "work"]  # nothing outside
    assert sorted(p.name for p in work.iterdir()) == ["runs"]
    assert sorted(p.name for p in (work / "runs").iterdir()) == ["sensitivity"]
    from consumers.sensitivity.report import FILES, default_folder

    folders = [default_folder(run) for run in runs]
    assert sorted(p.name for p in (work / "runs" / "sensitivity").iterdir()) == sorted(f.name for f in folders)
    for folder in folders:
        assert folder.parent == Path("runs/sensitivity")
        assert sorted(p.name for p in (work / folder).iterdir()) == sorted(FILES)
    assert folders[-1].name == "plain-run_1.x"  # a plain id reads as itself
