"""Queries: ``RunStore.query`` joins each episode's variation values to the episode table and
filters it with a where-expression, compared here with the (X, Y) table and with numpy masks
computed by hand; the expression evaluator refuses what it does not know and never runs the
text as code; ``worldtap-store episodes`` prints the same table (its ``--json`` parsed back
and compared value for value)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procs import ENV
from read_store import COLORS, two_runs, write
from storage_sim import Sim

from broker import Broker, VariationSample
from storage import QueryError, RunNotFoundError, RunStore, StoreDaemon, Table
from storage.cli import main
from storage.query import evaluate

pytestmark = pytest.mark.timeout(120)


@dataclass(frozen=True)
class Built:
    path: Path
    sims: dict[str, Sim]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    path = tmp_path_factory.mktemp("query") / "runs.zarr"
    return Built(path, two_runs(path))


VARIATION_COLUMNS = ["color", "friction", "mass", "pole[0]", "pole[1]", "color.label"]


def test_variation_values_are_joined_per_episode(built: Built) -> None:
    """Every episode's factor values equal the (X, Y) table's row of that episode: scalars,
    a vector one column per component, a categorical one as its code and its label, NaN where
    an episode had no runtime draw. Bugs caught: values joined to the wrong episode or run,
    components swapped, labels lost."""
    reader = RunStore(built.path)
    table = reader.query()
    assert list(table.columns)[:9] == ["run", "world", "index", "length", "success", "terminated",
                                       "truncated", "end_step", "segments"]
    assert list(table.columns)[9:] == ["return", *VARIATION_COLUMNS]
    rows = {(r["run"], r["world"], r["episode"]): r for r in reader.variation_table().rows()}
    assert len(rows) == len(table) > 40
    for row in table.rows():
        want = rows[row["run"], row["world"], row["index"]]
        for column in VARIATION_COLUMNS:
            got, expect = row[column], want[column]
            assert got == expect or (isinstance(got, float) and math.isnan(got) and math.isnan(expect)), \
                (row, column)
        assert row["color.label"] == COLORS[int(row["color"])]
        assert row["return"] == 10 * row["world"] + row["index"]
    assert np.isnan(table["friction"]).any()  # first episodes: no runtime draw yet
    assert not np.isnan(table["mass"]).any()
    one = reader.query(run="run-b")
    np.testing.assert_array_equal(one["pole[1]"], table.where(table["run"] == "run-b")["pole[1]"])


EXPRESSIONS: list[tuple[str, Any]] = [
    ("not success and mass > 0.3", lambda t: ~t["success"] & (t["mass"] > 0.3)),
    ("success", lambda t: t["success"]),
    ("world in [0, 3] and 2 <= index < 6", lambda t: np.isin(t["world"], [0, 3]) & (t["index"] >= 2) & (t["index"] < 6)),
    ("world not in (1,)", lambda t: t["world"] != 1),
    ("pole[0] > 0.5 or color.label == 'red'", lambda t: (t["pole[0]"] > 0.5) | (t["color.label"] == "red")),
    ("`pole[1]` * 2 <= pole[0] + 0.1", lambda t: t["pole[1]"] * 2 <= t["pole[0]"] + 0.1),
    ("return >= 20 and run == 'run-b'", lambda t: (t["return"] >= 20) & (t["run"] == "run-b")),
    ("isnan(friction) | (friction < 0.5)", lambda t: np.isnan(t["friction"]) | (t["friction"] < 0.5)),
    ("not isnan(friction) and friction >= 0.5", lambda t: t["friction"] >= 0.5),
    ("abs(mass - 0.5) < 0.2 and length % 2 == 1", lambda t: (np.abs(t["mass"] - 0.5) < 0.2) & (t["length"] % 2 == 1)),
    ("~truncated & (color != 1)", lambda t: ~t["truncated"] & (t["color"] != 1)),
    ("-length < -10", lambda t: t["length"] > 10),
    ("length > 5", lambda t: t["length"] > 5),
    ("length >= 5", lambda t: t["length"] >= 5),
    ("length < 5", lambda t: t["length"] < 5),
    ("length <= 5", lambda t: t["length"] <= 5),
    ("length == 5", lambda t: t["length"] == 5),
    ("length != 5", lambda t: t["length"] != 5),
    ("length // 2 == 3 and length ** 2 > 40 and length / 4 < 2", lambda t: t["length"] == 7),
    ("True", lambda t: np.ones(len(t), bool)),
    ("index < 0", lambda t: np.zeros(len(t), bool)),
]


@pytest.mark.parametrize(("where", "mask"), EXPRESSIONS, ids=[e for e, _ in EXPRESSIONS])
def test_queries_match_numpy(built: Built, where: str, mask: Any) -> None:
    """Bugs caught: an operator mapped to the wrong numpy function, chained comparisons or
    ``not in`` wrong, NaN comparisons true, a keyword-named column (``return``) unreachable."""
    reader = RunStore(built.path)
    table = reader.query()
    got = reader.query(where)
    want = table.where(mask(table))
    if where.startswith("length"):
        assert 0 < len(want) < len(table)  # the boundary matters: some episodes have length 5
    assert list(got.columns) == list(want.columns)
    for column in want.columns:
        np.testing.assert_array_equal(got[column], want[column])


def test_expression_errors_are_clear_and_nothing_runs(built: Built, tmp_path: Path) -> None:
    reader = RunStore(built.path)
    marker = tmp_path / "ran"
    with pytest.raises(QueryError, match=r"unknown column 'mas' in 'mas > 1'; columns: \['run', 'world'"):
        reader.query("mas > 1")
    with pytest.raises(QueryError, match=r"unknown column 'pole\[2\]'"):
        reader.query("pole[2] > 1")
    with pytest.raises(QueryError, match="cannot parse 'mass >'"):
        reader.query("mass >")
    with pytest.raises(QueryError, match="gives float64 values, not a condition"):
        reader.query("mass + 1")
    with pytest.raises(QueryError, match="is not a condition"):
        reader.query("mass and success")
    with pytest.raises(QueryError, match="cannot be evaluated"):
        reader.query("run > 1")
    with pytest.raises(QueryError, match="expected a non-empty expression"):
        reader.query("  ")
    for text in (f"__import__('os').system('touch {marker}')", f"open('{marker}', 'w')",
                 "[x for x in run]", "success.__class__.__mro__", "mass is None", "{1: 2}"):
        with pytest.raises(QueryError):
            reader.query(text)
    assert not marker.exists()
    with pytest.raises(RunNotFoundError, match="run 'nope' not found"):
        reader.query(run="nope")
    assert isinstance(QueryError("x"), ValueError)


def test_evaluate_on_plain_columns() -> None:
    columns = {"a": np.array([1.0, np.nan, 3.0]), "b": np.array(["x", None, "y"], dtype=object)}
    np.testing.assert_array_equal(evaluate("a >= 1", columns, 3), [True, False, True])
    np.testing.assert_array_equal(evaluate("b == None", columns, 3), [False, True, False])
    np.testing.assert_array_equal(evaluate("b in ['y', 'x']", columns, 3), [True, False, True])
    np.testing.assert_array_equal(evaluate("False", columns, 3), [False, False, False])
    with pytest.raises(QueryError, match=r"gives shape \(2,\)"):
        evaluate("c > 0", {"c": np.array([1, 2])}, 3)


def test_a_variation_named_like_an_episode_column_is_prefixed(tmp_path: Path) -> None:
    """A variation key ``length`` would hide the episode length: it is joined as
    ``variation.length``."""
    store = tmp_path / "runs.zarr"
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", daemon)
    sim = Sim(broker, 3, run="r", seed=2, reset_p=0.3)
    everyone = torch.arange(3)
    sim.rec.publish(VariationSample("r", sim.rec.next_seq(), sim.rec.step, "length", "build", everyone,
                                    sim.rec.episodes_of(everyone), torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)))
    sim.step(20)
    sim.close()
    daemon.close()
    table = RunStore(store).query("variation.length > 5.5")
    assert len(table) > 0
    assert set(table["world"].tolist()) <= {1, 2}
    np.testing.assert_array_equal(table["variation.length"], np.where(table["world"] == 1, 6.0, 7.0))
    assert (table["length"] >= 1).all()


def cli(*args: Any, process: bool = False) -> subprocess.CompletedProcess[str]:
    """``worldtap-store episodes ARGS``: in this process through ``storage.cli.main`` (fast), or
    as its own process with ``process=True`` (the entry point as a user runs it)."""
    argv = ["episodes", *map(str, args)]
    if process:
        return subprocess.run([sys.executable, "-m", "storage", *argv], env=ENV,
                              capture_output=True, text=True, timeout=60, check=False)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's usage errors
            code = exit_.code if isinstance(exit_.code, int) else 2
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def as_json(table: Table, columns: list[str]) -> list[dict[str, Any]]:
    def plain(v: Any) -> Any:
        return None if isinstance(v, float) and not math.isfinite(v) else v
    return [{c: plain(row[c]) for c in columns} for row in table.rows()]


def test_cli_json_is_the_query_table(built: Built) -> None:
    """``--json`` prints one object per episode: the query's table value for value (NaN as
    null)."""
    where = "not success and mass > 0.3"
    done = cli(built.path, "--where", where, "--json", process=True)
    assert done.returncode == 0, done.stderr
    table = RunStore(built.path).query(where)
    assert len(table) > 3
    assert np.isnan(table["friction"]).any()  # some nulls
    assert [json.loads(line) for line in done.stdout.splitlines()] == as_json(table, list(table.columns))


def test_cli_columns_and_limit(built: Built) -> None:
    """``--columns`` picks and orders columns (space- or comma-separated), ``--limit`` cuts rows."""
    done = cli(built.path, "--run", "run-b", "--json", "--columns", "index,color.label", "return", "--limit", "3")
    assert done.returncode == 0, done.stderr
    table = RunStore(built.path).query(run="run-b")
    assert [json.loads(line) for line in done.stdout.splitlines()] == \
        as_json(table, ["index", "color.label", "return"])[:3]


def test_cli_text_is_an_aligned_table(built: Built) -> None:
    done = cli(built.path, "--where", "world == 2", "--columns", "run", "world", "index", "mass", "color.label")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = RunStore(built.path).query("world == 2")
    assert len(lines) == len(table) + 1
    assert lines[0].split() == ["run", "world", "index", "mass", "color.label"]
    for line, row in zip(lines[1:], table.rows(), strict=True):
        cells = line.split()
        assert cells[:3] == [row["run"], "2", str(row["index"])]
        assert float(cells[3]) == pytest.approx(row["mass"], rel=1e-5)
        assert cells[4] == row["color.label"]
    ends = {len(line.rstrip()) - len(line.rstrip().split()[-1]) for line in lines[1:]}
    assert len(ends) == 1  # the last column starts at the same place on every row


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--where", "mas > 1"], 2, "unknown column 'mas'"),
    (["--run", "nope"], 2, "run 'nope' not found"),
    (["--columns", "nope"], 2, r"no column\(s\) \['nope'\]"),
])
def test_cli_usage_errors_exit_2_with_one_line(built: Built, args: list[str], code: int, message: str) -> None:
    """A bad expression, run or column: exit 2 and one line naming it on stderr."""
    done = cli(built.path, *args)
    assert done.returncode == code
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert re.search(message, done.stderr), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_cli_a_store_that_cannot_be_opened_exits_3(tmp_path: Path) -> None:
    done = cli(tmp_path / "absent.zarr")
    assert done.returncode == 3
    assert "absent.zarr" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_store_written_in_memory_queries_the_same(tmp_path: Path) -> None:
    import zarr

    store = zarr.storage.MemoryStore()
    write(store, ("m", 4, 40))
    table = RunStore(store).query("color.label != 'red' and pole[1] < 0.9")
    full = RunStore(store).query()
    np.testing.assert_array_equal(table["index"], full.where((full["color.label"] != "red") & (full["pole[1]"] < 0.9))["index"])
