"""SampleTable: joining variation samples with episode outcomes into (X, Y)."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from broker import Broker, EpisodeEnd, RunEnd, RunStart, VariationSample
from capture import Recorder
from capture.variations import ChoiceCfg, UniformCfg, Variation, VariationCfg, VariationRecorder
from consumers.errors import SampleTableError
from consumers.sample_table import OUTCOME_COLUMNS, SampleTable


def _i(*v: int) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.int64)


def _b(*v: bool) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.bool)


def _sample(key: str, phase: str, worlds: torch.Tensor, episodes: torch.Tensor,
            value: torch.Tensor, labels: tuple[str, ...] | None = None,
            run: str = "r") -> VariationSample:
    return VariationSample(run, 0, 0, key, phase, worlds, episodes, value,  # type: ignore[arg-type]
                           labels)


def _end(worlds: torch.Tensor, episodes: torch.Tensor, success: torch.Tensor,
         length: torch.Tensor, run: str = "r") -> EpisodeEnd:
    n = worlds.shape[0]
    return EpisodeEnd(run, 0, 0, worlds, episodes, success, torch.zeros(n, dtype=torch.bool),
                      ~success, length)


def test_joins_wire_style_messages_into_rows() -> None:
    table = SampleTable()
    table(_sample("mass", "build", _i(0, 1, 2), _i(0, 0, 0),
                  torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])))
    table(_sample("friction", "runtime", _i(0, 1, 2), _i(0, 0, 0), torch.tensor([0.1, 0.2, 0.3])))
    table(_sample("object", "runtime", _i(0, 1, 2), _i(0, 0, 0), _i(2, 0, 1),
                  ("cube", "ball", "mug")))
    table(_end(_i(1), _i(0), _b(True), _i(5)))
    table(_sample("friction", "runtime", _i(1), _i(1), torch.tensor([0.9])))  # world 1, ep 1
    table(_end(_i(2, 1), _i(0, 1), _b(False, True), _i(7, 3)))
    table(_end(_i(1, 0), _i(2, 0), _b(False, False), _i(4, 9)))  # world 1, ep 2: no draw
    assert table.x_columns == ("friction", "mass[0]", "mass[1]", "object")
    assert table.columns == ("run", "world", "episode", "friction", "mass[0]", "mass[1]",
                             "object", "object.label", *OUTCOME_COLUMNS)
    rows = table.rows()
    assert len(table) == len(rows) == 5
    assert [(r["world"], r["episode"]) for r in rows] == [(1, 0), (2, 0), (1, 1), (1, 2), (0, 0)]
    assert rows[0] == {"run": "r", "world": 1, "episode": 0, "friction": pytest.approx(0.2),
                       "mass[0]": 2.0, "mass[1]": 20.0, "object": 0.0, "object.label": "cube",
                       "success": True, "terminated": False, "truncated": False, "length": 5}
    assert rows[2]["friction"] == pytest.approx(0.9)
    assert rows[2]["object.label"] is None  # no object draw for episode 1
    assert math.isnan(rows[2]["object"])
    assert math.isnan(rows[3]["friction"])
    assert rows[3]["mass[1]"] == 20.0  # build-time samples join every episode
    assert rows[4]["object.label"] == "mug"
    x, y = table.to_numpy()
    assert x.shape == (5, 4)
    assert y.shape == (5, 4)
    np.testing.assert_array_equal(y[:, 0], [1, 0, 1, 0, 0])
    np.testing.assert_array_equal(y[:, 3], [5, 7, 3, 4, 9])
    np.testing.assert_allclose(x[:, 1], [2, 3, 2, 2, 1])
    arrays = table.arrays()
    assert arrays.y_columns == OUTCOME_COLUMNS
    np.testing.assert_array_equal(arrays.world, [1, 2, 1, 1, 0])
    np.testing.assert_array_equal(arrays.episode, [0, 0, 1, 2, 0])
    assert arrays.labels["object"].tolist() == ["cube", "ball", None, None, "mug"]


def test_keeps_copies_of_borrowed_tensors() -> None:
    table = SampleTable()
    worlds, episodes, value = _i(0, 1), _i(0, 0), torch.tensor([0.5, 0.6])
    table(_sample("friction", "runtime", worlds, episodes, value))
    value.fill_(-1)
    episodes.fill_(3)
    success, length, ended = _b(True, False), _i(4, 5), _i(0, 1)
    end_episodes = _i(0, 0)
    table(_end(ended, end_episodes, success, length))
    success.bitwise_not_()  # the publisher reuses every buffer of the message
    for t in (length, ended, end_episodes):
        t.fill_(9)
    x, y = table.to_numpy()
    np.testing.assert_array_equal(table.arrays().world, [0, 1])
    np.testing.assert_array_equal(table.arrays().episode, [0, 0])
    np.testing.assert_allclose(x[:, 0], [0.5, 0.6])
    np.testing.assert_array_equal(y[:, 0], [1, 0])
    np.testing.assert_array_equal(y[:, 3], [4, 5])


def test_runs_are_kept_apart_and_keys_seen_late_are_missing_earlier() -> None:
    table = SampleTable()
    table(_sample("friction", "runtime", _i(0), _i(0), torch.tensor([0.5]), run="a"))
    table(_end(_i(0), _i(0), _b(True), _i(1), run="a"))
    table(_end(_i(0), _i(0), _b(True), _i(2), run="b"))  # same world id, other run
    table(_sample("mass", "build", _i(0, 5), _i(0, 0), torch.tensor([2.0, 3.0]), run="b"))
    table(_end(_i(5), _i(0), _b(False), _i(3), run="b"))
    table(RunEnd("a", 0, 0, 1, "cpu"))
    rows = table.rows()
    assert [r["run"] for r in rows] == ["a", "b", "b"]
    assert rows[0]["friction"] == 0.5
    assert math.isnan(rows[0]["mass"])
    assert math.isnan(rows[1]["friction"])
    assert math.isnan(rows[1]["mass"])
    assert rows[2]["mass"] == 3.0


def test_inconsistent_samples_are_rejected() -> None:
    table = SampleTable()
    table(_sample("mass", "build", _i(0), _i(0), torch.tensor([[1.0, 2.0]])))
    with pytest.raises(ValueError, match=r"topic 'variation/mass': expected per-world shape "
                                         r"\(2,\) \(numeric\), got \(3,\) \(numeric\)"):
        table(_sample("mass", "build", _i(0), _i(0), torch.tensor([[1.0, 2.0, 3.0]])))
    with pytest.raises(ValueError, match=r"expected value and episodes with a leading "
                                         r"dimension of 2"):
        table(_sample("friction", "runtime", _i(0, 1), _i(0, 0), torch.tensor([1.0])))
    with pytest.raises(ValueError, match=r"expected codes in \[0, 2\), got 0..5"):
        table(_sample("object", "runtime", _i(0, 1), _i(0, 0), _i(0, 5), ("a", "b")))


def test_a_world_outside_the_run_is_rejected_and_changes_nothing() -> None:
    """Bug caught: a sample for world -1 was taken for the run's last world (numpy's negative
    index), so world 2's friction became 9.9; a world index of 2**40 grew the join state to it."""
    table = SampleTable()
    table(_sample("friction", "runtime", _i(0, 1, 2), _i(0, 0, 0), torch.tensor([0.1, 0.2, 0.3])))
    with pytest.raises(SampleTableError, match=r"topic 'variation/friction': worlds: expected indices of "
                                               r"\[0, 1048576\) \(the run's RunStart was not seen\), got -1..-1"):
        table(_sample("friction", "runtime", _i(-1), _i(0), torch.tensor([9.9])))
    with pytest.raises(SampleTableError, match=r"got 1099511627776..1099511627776"):
        table(_sample("friction", "runtime", _i(2**40), _i(0), torch.tensor([9.9])))
    table(RunStart("r", 1, 0, 3, "cpu"))
    with pytest.raises(SampleTableError, match=r"worlds: expected indices of the run's 3 worlds, got 1..3"):
        table(_sample("friction", "runtime", _i(1, 3), _i(0, 0), torch.tensor([9.9, 9.9])))
    with pytest.raises(SampleTableError, match=r"topic 'episode/end': worlds: .* got -2..0"):
        table(_end(_i(0, -2), _i(0, 0), _b(True, True), _i(5, 5)))
    with pytest.raises(SampleTableError, match=r"episode/end': length: expected a 1-D real tensor of 3 values, "
                                               r"got torch.int64 of shape \(2,\)"):
        table(_end(_i(0, 1, 2), _i(0, 0, 0), _b(True, False, True), _i(5, 5)))
    table(_end(_i(0, 1, 2), _i(0, 0, 0), _b(True, False, True), _i(5, 5, 5)))
    assert table.arrays().x[:, 0].tolist() == pytest.approx([0.1, 0.2, 0.3])
    assert len(table) == 3


def test_a_rejected_sample_leaves_no_key_behind() -> None:
    """Bug caught: a categorical sample whose codes were past its labels was refused after its
    key had been registered, so the table grew a column no accepted message had."""
    table = SampleTable()
    with pytest.raises(SampleTableError, match=r"expected codes in \[0, 1\), got 0..2"):
        table(_sample("object", "runtime", _i(0, 1), _i(0, 0), _i(2, 0), ("cube",)))
    assert table.keys == ()
    table(_sample("object", "runtime", _i(0), _i(0), torch.tensor([[0, 1]]), ("cube", "ball")))  # its own shape
    assert table.keys == ("object",)


def test_values_numpy_has_no_dtype_for_are_taken_as_float32() -> None:
    """A bfloat16 variation value is joined as float32 (numpy has no bfloat16: it raised
    TypeError); a complex one is refused with a clear error."""
    table = SampleTable()
    table(_sample("mass", "build", _i(0, 1), _i(0, 0), torch.tensor([1.5, 2.25], dtype=torch.bfloat16)))
    table(_end(_i(0, 1), _i(0, 0), _b(True, False), _i(5, 5)))
    assert table.arrays().x[:, 0].tolist() == [1.5, 2.25]
    with pytest.raises(SampleTableError, match=r"expected a real value, got torch\.complex64"):
        table(_sample("mass", "build", _i(0), _i(0), torch.tensor([1j], dtype=torch.complex64)))


def test_empty_table() -> None:
    table = SampleTable()
    x, y = table.to_numpy()
    assert x.shape == (0, 0)
    assert y.shape == (0, 4)
    assert table.rows() == []
    assert table.columns == ("run", "world", "episode", *OUTCOME_COLUMNS)


def test_to_pandas() -> None:
    pytest.importorskip("pandas")
    table = SampleTable()
    table(_sample("object", "runtime", _i(0), _i(0), _i(1), ("cube", "ball")))
    table(_end(_i(0), _i(0), _b(True), _i(8)))
    frame = table.to_pandas()
    assert list(frame.columns) == list(table.columns)
    assert frame["object.label"].tolist() == ["ball"]
    assert frame["length"].tolist() == [8]


def test_joins_a_real_recorder_loop_on_a_strict_broker() -> None:
    n = 5
    broker = Broker(strict=True)
    table = SampleTable()
    table.attach(broker)
    recorder = Recorder(n, broker=broker, run="sim")
    mass = Variation("mass", VariationCfg(sampler=UniformCfg([1, 2], [2, 3], seed=1),
                                          phase="build"))
    friction = Variation("friction", VariationCfg(sampler=UniformCfg(0, 1, seed=2)))
    obj = Variation("object", VariationCfg(sampler=ChoiceCfg(["cube", "ball", "mug"], seed=3)))
    VariationRecorder(recorder).attach([mass, friction, obj])
    episode = [0] * n
    truth: dict[tuple[int, int], tuple[float, str, bool, int]] = {}
    drawn: dict[tuple[int, int], tuple[float, str]] = {}

    def draw(worlds: list[int]) -> None:
        f, o = friction.sample(len(worlds), worlds), obj.sample(len(worlds), worlds)
        for i, w in enumerate(worlds):
            drawn[(w, episode[w])] = (float(f[i]), ("cube", "ball", "mug")[int(o[i])])
        f.fill_(-1)

    build = mass.sample(n).clone()
    draw(list(range(n)))
    rng = random.Random(1)
    age, life = [0] * n, [rng.randint(1, 5) for _ in range(n)]
    for _ in range(30):
        recorder.record_post_step()
        age = [a + 1 for a in age]
        done = [w for w in range(n) if age[w] >= life[w]]
        if not done:
            continue
        success = [rng.random() < 0.5 for _ in done]
        recorder.record_pre_reset(done, success=torch.tensor(success))
        for w, s in zip(done, success, strict=True):
            truth[(w, episode[w])] = (*drawn[(w, episode[w])], s, age[w])
            episode[w] += 1
            age[w], life[w] = 0, rng.randint(1, 5)
        draw(done)
    recorder.close()
    rows = table.rows()
    assert len(rows) == len(truth) > 2 * n
    for row in rows:
        w, e = row["world"], row["episode"]
        friction_value, label, success_flag, length = truth[(w, e)]
        assert row["run"] == "sim"
        assert row["friction"] == pytest.approx(friction_value)
        assert row["object.label"] == label
        assert row["success"] is success_flag
        assert row["length"] == length
        assert row["mass[0]"] == pytest.approx(float(build[w, 0]))
        assert row["mass[1]"] == pytest.approx(float(build[w, 1]))
    assert broker.statistics().consumer_errors == 0


def _end_with(worlds: torch.Tensor, episodes: torch.Tensor, outcomes: dict[str, torch.Tensor],
              run: str = "r") -> EpisodeEnd:
    n = worlds.shape[0]
    return EpisodeEnd(run, 0, 0, worlds, episodes, torch.ones(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool),
                      torch.zeros(n, dtype=torch.bool), torch.full((n,), 4), outcomes=outcomes)


def test_outcomes_are_extra_y_columns_sorted_by_name_nan_where_missing() -> None:
    """Bug caught: EpisodeEnd.outcomes (e.g. the return) never reached the (X, Y) table, so no
    analysis could use them; an outcome one message lacks must be NaN there, not 0 or a
    neighbour's value, and the values must be owned copies."""
    table = SampleTable()
    ret = torch.tensor([1.5, -2.0])
    table(_end_with(_i(0, 1), _i(0, 0), {"return": ret}))
    ret.fill_(99)  # borrowed: the publisher reuses it
    table(_end_with(_i(2), _i(0), {"hits": torch.tensor([3], dtype=torch.int32),
                                   "return": torch.tensor([0.25], dtype=torch.float64)}))
    table(_end_with(_i(0), _i(1), {"done": torch.tensor([True])}))
    table(_end_with(_i(1), _i(1), {}))
    a = table.arrays()
    assert a.y_columns == table.y_columns == (*OUTCOME_COLUMNS, "done", "hits", "return")
    assert table.columns[-3:] == ("done", "hits", "return")
    nan = float("nan")
    want = np.array([[nan, nan, 1.5], [nan, nan, -2.0], [nan, 3.0, 0.25], [1.0, nan, nan], [nan, nan, nan]])
    assert a.y[:, len(OUTCOME_COLUMNS):].tobytes() == want.tobytes()
    assert a.y[:, :len(OUTCOME_COLUMNS)].tobytes() == np.array([[1, 0, 0, 4]] * 5, np.float64).tobytes()
    rows = table.rows()
    assert rows[0]["return"] == 1.5
    assert math.isnan(rows[0]["hits"])
    assert rows[2]["hits"] == 3.0


@pytest.mark.parametrize(("outcomes", "match"), [
    ({"success": torch.ones(2)}, "outcome name 'success' must be a non-empty str not in"),
    ({"world": torch.ones(2)}, "outcome name 'world'"),
    ({"": torch.ones(2)}, "outcome name ''"),
    ({"r": torch.ones(3)}, r"outcome 'r': expected a 1-D numeric tensor of 2 values, got torch.float32 of shape \(3,\)"),
    ({"r": torch.ones(2, 2)}, r"got torch.float32 of shape \(2, 2\)"),
    ({"r": torch.ones(2, dtype=torch.complex64)}, "torch.complex64"),
    ({"r": [1.0, 2.0]}, "got list"),
])
def test_bad_outcomes_are_rejected(outcomes: dict[str, object], match: str) -> None:
    table = SampleTable()
    with pytest.raises(ValueError, match=match):
        table(_end_with(_i(0, 1), _i(0, 0), outcomes))  # type: ignore[arg-type]
    assert len(table) == 0
    assert table.y_columns == OUTCOME_COLUMNS


def test_keeps_the_declarations_of_run_start_and_run_end() -> None:
    """Bug caught: the live table dropped the run's variation declarations, so a live analysis
    had no bounds; RunEnd's declarations replace RunStart's key by key, and runs stay apart."""
    from broker import RunStart

    broker = Broker(strict=True)
    table = SampleTable()
    table.attach(broker)
    mass = {"kind": "uniform", "phase": "build", "shape": [], "seed": 1, "low": 0.5, "high": 2.0}
    obj = {"kind": "choice", "phase": "runtime", "shape": [], "seed": 2, "labels": ["cube", "ball"], "weights": None}
    broker.publish(RunStart("a", 0, 0, 2, "cpu", variations={"mass": mass}, seed=9))
    assert table.declarations("a") == {"mass": mass}
    table.declarations("a")["mass"]["low"] = -1  # an owned copy
    assert table.declarations("a")["mass"]["low"] == 0.5
    broker.publish(RunStart("b", 0, 0, 2, "cpu", variations={"object": obj}))
    broker.publish(RunEnd("a", 1, 0, 2, "cpu", variations={"mass": {**mass, "high": 3.0}, "object": obj}))
    assert table.declarations("a") == {"mass": {**mass, "high": 3.0}, "object": obj}
    assert table.declarations("b") == {"object": obj}
    assert table.variations == {"mass": {**mass, "high": 3.0}, "object": obj}
    assert table.seed("a") == 9
    assert table.seed("b") is None
    assert table.declarations("unknown") == {}


# -- a whole stored run at once (add_run) -----------------------------------------------------

_KEYS = {"mass": ("build", (), None), "push": ("reset", (2,), None), "floor": ("reset", (), ("ice", "mud", "sand"))}


@st.composite
def stored_run(draw: st.DrawFn) -> tuple[list[tuple[int, Any]], dict[str, dict[str, Any]], dict[str, Any]]:
    """A run's messages in publication order (numbered), and the same as stored columns:
    samples of a build-time, a vector run-time and a categorical run-time key, and episode
    ends, of worlds that repeat within a message, episodes that restart (and -1), ends of
    worlds no sample reached, ends before any sample."""
    worlds = draw(st.integers(1, 6))
    w = st.integers(0, worlds + 1)  # a world past every sample's too
    messages: list[tuple[int, Any]] = []
    samples = {k: {"seq": [], "world": [], "episode": [], "value": []} for k in _KEYS}
    ends: dict[str, list[Any]] = {c: [] for c in ("seq", "world", "episode", "success", "terminated",
                                                  "truncated", "length", "return")}
    for seq in range(draw(st.integers(0, 25))):
        n = draw(st.integers(1, 4))  # a message of no rows leaves nothing in a store
        ws = draw(st.lists(w, min_size=n, max_size=n))
        eps = draw(st.lists(st.integers(-1, 3), min_size=n, max_size=n))
        what = draw(st.sampled_from([*_KEYS, "end"]))
        if what == "end":
            success = draw(st.lists(st.booleans(), min_size=n, max_size=n))
            ret = draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n))
            messages.append((seq, EpisodeEnd("r", seq, seq, _i(*ws), _i(*eps), _b(*success), _b(*[False] * n),
                                             _b(*[not s for s in success]), _i(*[3] * n),
                                             outcomes={"return": torch.tensor(ret, dtype=torch.float64)})))
            for c, v in (("seq", [seq] * n), ("world", ws), ("episode", eps), ("success", success),
                         ("terminated", [False] * n), ("truncated", [not s for s in success]),
                         ("length", [3] * n), ("return", ret)):
                ends[c] += v
            continue
        phase, shape, labels = _KEYS[what]
        if labels is not None:
            value = torch.tensor(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), dtype=torch.float32)
        else:
            value = torch.tensor(draw(st.lists(st.floats(-9, 9, width=32), min_size=n * math.prod(shape),
                                               max_size=n * math.prod(shape))), dtype=torch.float32)
        value = value.reshape(n, *shape)
        messages.append((seq, VariationSample("r", seq, seq, what, phase, _i(*ws), _i(*eps), value,  # type: ignore[arg-type]
                                              labels)))
        for c, v in (("seq", [seq] * n), ("world", ws), ("episode", eps)):
            samples[what][c] += v
        samples[what]["value"].append(value.numpy())
    stored = {k: {"seq": np.array(s["seq"], np.int64), "world": np.array(s["world"], np.int64),
                  "episode": np.array(s["episode"], np.int64),
                  "value": np.concatenate(s["value"]) if s["value"] else np.zeros((0, *_KEYS[k][1]), np.float32),
                  "phase": _KEYS[k][0], "labels": _KEYS[k][2]}
              for k, s in samples.items() if s["seq"]}
    columns = {c: np.array(v) for c, v in ends.items() if c != "return"}
    columns["outcomes"] = {"return": np.array(ends["return"], np.float64)}
    return messages, stored, columns


def _same_table(a: SampleTable, b: SampleTable) -> None:
    x, y = a.arrays(), b.arrays()
    assert x.x_columns == y.x_columns
    assert x.y_columns == y.y_columns
    for name in ("run", "world", "episode"):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
    np.testing.assert_array_equal(x.x, y.x)  # NaN where the other has NaN
    np.testing.assert_array_equal(x.y, y.y)
    assert x.labels.keys() == y.labels.keys()
    for key in x.labels:
        assert x.labels[key].tolist() == y.labels[key].tolist()


@settings(max_examples=300, deadline=None)
@given(stored_run())
def test_a_stored_run_added_at_once_joins_as_its_messages_do(
        run: tuple[list[tuple[int, Any]], dict[str, dict[str, Any]], dict[str, Any]]) -> None:
    # The join rule written twice (message by message, and at once with sorted lookups): the
    # same rows in the same order, values, NaN and labels, for any run.
    messages, samples, ends = run
    live = SampleTable()
    for _, message in messages:
        live(message)
    stored = SampleTable()
    stored.add_run("r", samples, ends)
    _same_table(stored, live)


def test_add_run_checks_what_the_messages_check() -> None:
    ends = {"seq": [1], "world": [0], "episode": [0], "success": [True], "terminated": [False],
            "truncated": [False], "length": [2]}
    table = SampleTable()
    table.add_run("r", {"k": {"seq": [0], "world": [0], "episode": [0], "value": np.zeros((1, 2)),
                              "phase": "reset", "labels": None}}, ends)
    with pytest.raises(SampleTableError, match=r"key 'k': expected per-world shape \(2,\)"):
        table.add_run("s", {"k": {"seq": [0], "world": [0], "episode": [0], "value": np.zeros(1),
                                  "phase": "reset", "labels": None}}, ends)
    with pytest.raises(SampleTableError, match=r"expected codes in \[0, 2\), got 0..2"):
        table.add_run("s", {"c": {"seq": [0, 0], "world": [0, 1], "episode": [0, 0], "value": np.array([0, 2]),
                                  "phase": "reset", "labels": ("a", "b")}}, ends)
    with pytest.raises(SampleTableError, match=r"outcome name 'length'"):
        table.add_run("s", {}, {**ends, "outcomes": {"length": np.ones(1)}})
    assert len(table) == 1  # what failed added nothing
    assert table.x_columns == ("k[0]", "k[1]")
