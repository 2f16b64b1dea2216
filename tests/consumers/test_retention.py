from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import pytest
import torch

import broker
from broker import Batch, Broker, EpisodeEnd, Message
from capture import FunctionTerm, Recorder
from consumers import FinishedEpisode, Retention, RetentionError, RetentionSchemaError
from consumers._buffers import PerWorldBuffer, SharedAxisBuffer

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


class Reference:
    """A straightforward per-world reference: Python lists of copied rows."""

    def __init__(self, num_worlds: int) -> None:
        self.current: dict[int, dict[str, dict[str, list[torch.Tensor]]]] = {
            w: defaultdict(lambda: defaultdict(list)) for w in range(num_worlds)
        }
        self.finished: list[tuple[int, int, dict[str, dict[str, list[torch.Tensor]]]]] = []

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            for row, w in enumerate(message.worlds.tolist()):
                for name, t in message.fields.items():
                    self.current[w][message.term][name].append(t[row].clone().cpu())
        elif isinstance(message, EpisodeEnd):
            for w, ep in zip(message.worlds.tolist(), message.episodes.tolist(), strict=True):
                self.finished.append((w, ep, self.current[w]))
                self.current[w] = defaultdict(lambda: defaultdict(list))

    @staticmethod
    def stacked(data: dict[str, dict[str, list[torch.Tensor]]]) -> dict[str, dict[str, torch.Tensor]]:
        return {term: {f: torch.stack(rows) for f, rows in fields.items()} for term, fields in data.items() if fields}


def assert_same(actual: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]) -> None:
    actual = {t: f for t, f in actual.items() if any(v.shape[0] for v in f.values())}
    assert actual.keys() == expected.keys()
    for term, fields in expected.items():
        assert actual[term].keys() == fields.keys(), term
        for name, exp in fields.items():
            got = actual[term][name].cpu()
            assert got.dtype == exp.dtype, (term, name)
            assert got.shape == exp.shape, (term, name)
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8)), (term, name)


def simulate(device: str, *, seed: int, steps: int, num_worlds: int, capacity: int,
             sink: bool = True) -> tuple[Retention, Reference, list[FinishedEpisode], Broker]:
    rng = random.Random(seed)
    broker = Broker(strict=True)
    finished: list[FinishedEpisode] = []
    retention = Retention(initial_capacity=capacity, sink=finished.append if sink else None)
    reference = Reference(num_worlds)
    retention.attach(broker)
    broker.subscribe("", reference)
    # Simulator-owned buffers, overwritten in place every step.
    state = torch.zeros(num_worlds, 4, device=device)
    action = torch.zeros(num_worlds, 2, dtype=torch.float16, device=device)
    done = torch.zeros(num_worlds, dtype=torch.bool, device=device)
    counter = torch.zeros(num_worlds, 2, dtype=torch.int32, device=device)
    rec = Recorder(num_worlds, device, broker, run="sim")
    rec.add_term("step", FunctionTerm(post_step=lambda: {"obs": {"state": state}, "action": action, "done": done}))
    rec.add_term("pre", FunctionTerm(pre_step=lambda: {"counter": counter}))
    rec.add_term("initial", FunctionTerm(post_reset=lambda w: {"state": state[w]}))
    rec.add_term("final", FunctionTerm(pre_reset=lambda w: {"state": state[w], "counter": counter[w]}))
    rec.record_post_reset()
    for step in range(steps):
        rec.record_pre_step()
        state.copy_(torch.randn(num_worlds, 4, device=device))
        action.copy_(torch.randn(num_worlds, 2, device=device).half())
        done.copy_(torch.rand(num_worlds, device=device) < 0.3)
        counter += 1
        rec.record_post_step()
        resets = [w for w in range(num_worlds) if rng.random() < 0.15]
        rng.shuffle(resets)
        if resets:
            success = torch.tensor([rng.random() < 0.5 for _ in resets], device=device)
            rec.record_pre_reset(tuple(resets), success=success, terminated=True)
            state[resets] = -1.0  # the simulator resets its buffers right away
            counter[resets] = 0
            rec.record_post_reset(resets)
        if step % 7 == 3:  # a partial batch on a step topic (some worlds only)
            worlds = sorted(rng.sample(range(num_worlds), 2))
            broker.publish(Batch("sim", rec.next_seq(), rec.step, "batch/step", torch.tensor(worlds, device=device),
                                 rec.episodes_of(torch.tensor(worlds, device=device)),
                                 {"obs/state": state[worlds] * 10, "action": action[worlds], "done": done[worlds]}))
    return retention, reference, finished, broker


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_snapshots_equal_a_straightforward_reference(device: str, seed: int) -> None:
    retention, reference, finished, _ = simulate(device, seed=seed, steps=60, num_worlds=7, capacity=2)
    # Every finished episode handed to the sink equals the reference, in order.
    expected = [(w, ep, Reference.stacked(d)) for w, ep, d in reference.finished]
    expected = [e for e in expected if e[2]]
    assert [(f.world, f.episode) for f in finished] == [(w, ep) for w, ep, _ in expected]
    for got, (_, _, exp) in zip(finished, expected, strict=True):
        assert got.run == "sim"
        assert got.terminated
        assert_same(got.data, exp)
    # Every current episode too.
    for w in range(7):
        assert_same(retention.episode(w), Reference.stacked(reference.current[w]))
    stats = retention.statistics()
    assert stats.grows > 0  # capacity 2 forced growth in mid-episode
    assert stats.episodes_sunk == len(finished)


def test_sink_gets_the_outcome_flags() -> None:
    broker = Broker(strict=True)
    got: list[FinishedEpisode] = []
    retention = Retention(sink=got.append)
    retention.attach(broker)
    x = torch.zeros(3, 1)
    rec = Recorder(3, "cpu", broker, run="flags")
    rec.add_term("t", FunctionTerm(post_step=lambda: {"x": x}))
    for _ in range(4):
        rec.record_post_step()
    rec.record_pre_reset([2, 0], success=torch.tensor([True, False]), truncated=torch.tensor([False, True]))
    assert [(e.world, e.episode, e.success, e.terminated, e.truncated, e.length) for e in got] == [
        (2, 0, True, False, False, 4), (0, 0, False, False, True, 4)]
    assert got[0].data["t"]["x"].shape == (4, 1)


def test_ownership_mutating_sources_after_publish_changes_nothing_kept() -> None:
    broker = Broker(strict=True)
    retention = Retention(initial_capacity=1)
    retention.attach(broker)
    src = torch.arange(6.0).reshape(3, 2)
    rec = Recorder(3, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"x": src}, post_reset=lambda w: {"x": src[w]}))
    rec.record_post_step()
    snapshot = retention.episode(1)["t"]["x"].clone()
    src.fill_(99.0)
    rec.record_post_step()
    src.fill_(-5.0)
    ep = retention.episode(1)["t"]["x"]
    assert ep.tolist() == [[2.0, 3.0], [99.0, 99.0]]
    assert torch.equal(ep[:1], snapshot)
    # A snapshot is owned: later appends and resets do not change it.
    rec.record_post_step()
    rec.record_pre_reset(1)
    assert ep.tolist() == [[2.0, 3.0], [99.0, 99.0]]


def test_reuse_after_reset_leaves_no_stale_rows() -> None:
    broker = Broker(strict=True)
    retention = Retention(initial_capacity=4)
    retention.attach(broker)
    x = torch.zeros(2, 1)
    rec = Recorder(2, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"x": x}))
    for i in range(3):
        x.fill_(i)
        rec.record_post_step()
    rec.record_pre_reset(0)
    assert retention.episode(0)["t"]["x"].shape == (0, 1)
    x.fill_(7)
    rec.record_post_step()
    assert retention.episode(0)["t"]["x"].flatten().tolist() == [7.0]
    assert retention.episode(1)["t"]["x"].flatten().tolist() == [0.0, 1.0, 2.0, 7.0]
    assert retention.capacity == {"batch/t": 4}
    for _ in range(20):  # world 0 keeps resetting: its rows are reused, world 1 keeps growing
        rec.record_post_step()
        rec.record_pre_reset(0)
    assert retention.episode(1)["t"]["x"].shape == (24, 1)


@pytest.mark.parametrize("sink", [False, True])
def test_without_a_sink_no_snapshot_is_built(monkeypatch: pytest.MonkeyPatch, sink: bool) -> None:
    """Finished episodes are only snapshotted for a sink: count every buffer read."""
    reads = {"n": 0}
    for cls in (SharedAxisBuffer, PerWorldBuffer):
        def counted(self: object, world: int, _read: Any = cls.read) -> dict[str, torch.Tensor]:
            reads["n"] += 1
            return _read(self, world)  # type: ignore[no-any-return]
        monkeypatch.setattr(cls, "read", counted)
    _, reference, finished, _ = simulate("cpu", seed=3, steps=20, num_worlds=4, capacity=4, sink=sink)
    assert reference.finished, "no episode ended: the test would prove nothing"
    if sink:
        assert reads["n"] > 0  # the counter sees the snapshot path
        assert finished
    else:
        assert (reads["n"], finished) == (0, [])


def test_reset_only_topics_keep_their_own_counters() -> None:
    broker = Broker(strict=True)
    retention = Retention(initial_capacity=1)
    retention.attach(broker)
    state = torch.arange(4.0).reshape(4, 1)
    rec = Recorder(4, "cpu", broker)
    rec.add_term("initial", FunctionTerm(post_reset=lambda w: {"s": state[w]}))
    rec.add_term("step", FunctionTerm(post_step=lambda: {"s": state}))
    rec.record_post_reset()
    for _ in range(5):  # world 3 resets every step; the others never
        rec.record_post_step()
        rec.record_pre_reset(3)
        rec.record_post_reset(3)
    assert retention.episode(0)["initial"]["s"].flatten().tolist() == [0.0]
    assert retention.episode(3)["initial"]["s"].flatten().tolist() == [3.0]
    assert retention.episode(3)["step"]["s"].shape == (0, 1)
    # Five resets of world 3 reused its row: capacity only grew for world 0 keeping its row.
    assert retention.capacity["batch/initial"] == 2


def test_bad_input_is_rejected_with_a_clear_error() -> None:
    retention = Retention()
    w = torch.arange(2)
    with pytest.raises(RetentionError, match="the number of worlds is unknown"):
        retention(Batch("r", 0, 0, "batch/t", w, w, {"x": torch.zeros(2)}))
    retention = Retention(num_worlds=2)
    with pytest.raises(RetentionSchemaError, match=r"topic 'batch/t' field 'x': expected a leading worlds dimension of 2, got shape \(3,\)"):
        retention(Batch("r", 0, 0, "batch/t", w, w, {"x": torch.zeros(3)}))
    assert retention.capacity == {}  # a first batch that did not fit fixes no schema
    retention(Batch("r", 0, 0, "batch/t", w, w, {"x": torch.zeros(2)}))
    with pytest.raises(RetentionSchemaError, match=r"topic 'batch/t' field 'x': expected float32 per-world shape \(\), got int64 per-world shape \(\)"):
        retention(Batch("r", 1, 0, "batch/t", w, w, {"x": torch.zeros(2, dtype=torch.int64)}))
    with pytest.raises(RetentionSchemaError, match=r"expected fields \['x'\], got \['y'\] \(missing \['x'\], extra \['y'\]\)"):
        retention(Batch("r", 1, 0, "batch/t", w, w, {"y": torch.zeros(2)}))
    with pytest.raises(RetentionSchemaError, match=r"field 'x': expected a leading worlds dimension of 1, got shape \(2,\)"):
        retention(Batch("r", 1, 0, "batch/t", w[:1], w[:1], {"x": torch.zeros(2)}))  # broadcast before
    with pytest.raises(RetentionError, match=r"topic 'batch/t': expected worlds as a 1-D integer index of at most 2 worlds, got dtype torch.float32 shape \(2,\)"):
        retention(Batch("r", 1, 0, "batch/t", w.float(), w, {"x": torch.zeros(2)}))
    with pytest.raises(RetentionError, match=r"at most 2 worlds, got dtype torch.int64 shape \(3,\)"):
        retention(Batch("r", 1, 0, "batch/t", torch.arange(3), w, {"x": torch.zeros(3)}))
    with pytest.raises(RetentionError, match=r"world: expected an index in \[0, 2\), got 5"):
        retention.episode(5)
    with pytest.raises(RetentionError, match=r"term: expected one of \['t'\], got 'u'"):
        retention.episode_length(0, "u")
    with pytest.raises(ValueError, match="initial_capacity: expected a positive int, got 0"):
        Retention(initial_capacity=0)
    with pytest.raises(ValueError, match=r"growth: expected a factor > 1, got 1\.0"):
        Retention(growth=1.0)
    assert retention.statistics().batches == 1  # nothing rejected was counted


@pytest.mark.parametrize("hook", ["post_step", "post_reset"])
def test_a_world_outside_the_run_is_refused_and_changes_nothing(hook: str) -> None:
    """A batch or an episode end naming a world outside the run (as a malformed message a
    remote subscriber decoded would) is refused with a RetentionError, and every world's
    retained episode is what it was. Bug caught: an EpisodeEnd for world -1 ended world 2's
    episode (torch's negative index), its rows lost; a batch for it raised torch's IndexError."""
    retention = Retention(num_worlds=3)
    w = torch.arange(3)

    def batch(worlds: torch.Tensor, value: float) -> Batch:
        return Batch("r", 0, 0, "batch/t", worlds, torch.zeros_like(worlds),
                     {"x": torch.full((len(worlds),), value)}, hook)  # type: ignore[arg-type]

    retention(batch(w, 1.0))
    retention(batch(w, 2.0))
    before = {world: retention.episode(world)["t"]["x"].tolist() for world in range(3)}
    for bad in ([-1], [0, 3], [2**40]):
        worlds = torch.tensor(bad)
        n = len(bad)
        with pytest.raises(RetentionError, match=r"topic 'episode/end': expected world indices in \[0, 3\)"):
            retention(EpisodeEnd("r", 1, 0, worlds, torch.zeros(n, dtype=torch.int64),
                                 torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool),
                                 torch.zeros(n, dtype=torch.bool), torch.full((n,), 2)))
        with pytest.raises(RetentionError, match=rf"topic 'batch/t': expected world indices in \[0, 3\), "
                                                 rf"got {min(bad)}..{max(bad)}"):
            retention(batch(worlds, 9.0))
    assert {world: retention.episode(world)["t"]["x"].tolist() for world in range(3)} == before
    assert retention.statistics().batches == 2


def test_schema_errors_are_broker_schema_errors() -> None:
    """One vocabulary across packages: ``except broker.SchemaError`` catches retention's."""
    assert issubclass(RetentionSchemaError, RetentionError)
    assert issubclass(RetentionSchemaError, broker.SchemaError)
    retention = Retention(num_worlds=1)
    w = torch.zeros(1, dtype=torch.int64)
    retention(Batch("r", 0, 0, "batch/t", w, w, {"x": torch.zeros(1)}))
    with pytest.raises(broker.SchemaError, match=r"topic 'batch/t': expected fields \['x'\], got \['x', 'y'\]"):
        retention(Batch("r", 1, 0, "batch/t", w, w, {"x": torch.zeros(1), "y": torch.zeros(1)}))


def _rows(step: int, worlds: list[int], width: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rows no other (step, world, field) shares: ``step * 1000 + world * 10 + salt``."""
    base = torch.tensor([step * 1000 + w * 10 + salt for w in worlds], dtype=torch.float64)
    return base[:, None].repeat(1, width).to(dtype) if width else base.to(dtype)


@pytest.mark.parametrize(
    ("spec_a", "spec_b"),
    [
        ((3, torch.float32), (3, torch.float32)),  # same dtype and shape: silently swapped before
        ((2, torch.float32), (2, torch.int64)),  # same shape, other dtype: silently converted before
        ((1, torch.float64), (4, torch.float64)),  # other shapes: broadcast (or refused) before
    ],
)
@pytest.mark.parametrize("partial_first", [False, True])
def test_fields_are_copied_by_name_whatever_their_order(
    spec_a: tuple[int, torch.dtype], spec_b: tuple[int, torch.dtype], partial_first: bool
) -> None:
    """Issue 18: a topic's fields in another dict order land in their own buffers, by name."""
    n = 3
    retention = Retention(num_worlds=n, initial_capacity=2)
    everyone = list(range(n))
    expected: dict[int, dict[str, list[torch.Tensor]]] = {w: {"a": [], "b": []} for w in everyone}
    for step in range(5):
        worlds = [2, 0] if partial_first and step == 0 else everyone
        a = _rows(step, worlds, spec_a[0], spec_a[1], salt=1)
        b = _rows(step, worlds, spec_b[0], spec_b[1], salt=2)
        fields = {"a": a, "b": b} if step % 2 == 0 else {"b": b, "a": a}
        idx = torch.tensor(worlds)
        retention(Batch("r", step, step, "batch/t", idx, torch.zeros(len(worlds), dtype=torch.int64), fields))
        for row, w in enumerate(worlds):
            expected[w]["a"].append(a[row].clone())
            expected[w]["b"].append(b[row].clone())
        a.fill_(-7)  # the publisher owns its tensors again
        b.fill_(-7)
    for w in everyone:
        assert_same(retention.episode(w), {"t": {f: torch.stack(rows) for f, rows in expected[w].items()}})


def test_a_worlds_buffer_refilled_in_place_is_never_trusted() -> None:
    """Issue 19: a publisher reusing one worlds buffer (identity first, a permutation later)
    gets every row written to the world the buffer names at that batch."""
    n = 4
    retention = Retention(num_worlds=n, initial_capacity=2)
    worlds = torch.arange(n)  # ONE buffer, refilled in place before each batch
    orders = [[0, 1, 2, 3], [3, 1, 0, 2], [0, 1, 2, 3], [1, 0, 3, 2], [2, 3, 1, 0]]
    expected: dict[int, list[torch.Tensor]] = {w: [] for w in range(n)}
    for step, order in enumerate(orders):
        worlds.copy_(torch.tensor(order))
        x = _rows(step, order, 2, torch.float32, salt=0)
        retention(Batch("r", step, step, "batch/t", worlds, torch.zeros(n, dtype=torch.int64), {"x": x}))
        for row, w in enumerate(order):
            expected[w].append(x[row].clone())
    worlds.fill_(0)  # and scribbled on after the last publish
    for w in range(n):
        assert_same(retention.episode(w), {"t": {"x": torch.stack(expected[w])}})
        assert retention.episode_length(w, "t") == len(orders)
