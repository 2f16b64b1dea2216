from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from broker import Batch, Broker, EpisodeEnd, Message
from capture import FunctionTerm, Recorder
from consumers import FinishedEpisode, Retention, RetentionError

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


def test_without_a_sink_no_snapshot_is_built() -> None:
    _, _, finished, _ = simulate("cpu", seed=3, steps=20, num_worlds=4, capacity=4, sink=False)
    assert finished == []


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
    retention(Batch("r", 0, 0, "batch/t", w, w, {"x": torch.zeros(2)}))
    with pytest.raises(RetentionError, match=r"topic 'batch/t' field 'x': expected torch.float32 per-world shape \(\), got torch.int64"):
        retention(Batch("r", 1, 0, "batch/t", w, w, {"x": torch.zeros(2, dtype=torch.int64)}))
    with pytest.raises(RetentionError, match=r"expected fields \['x'\], got \['y'\]"):
        retention(Batch("r", 1, 0, "batch/t", w, w, {"y": torch.zeros(2)}))
    with pytest.raises(RetentionError, match=r"world: expected an index in \[0, 2\), got 5"):
        retention.episode(5)
    with pytest.raises(ValueError, match="initial_capacity: expected a positive int, got 0"):
        Retention(initial_capacity=0)
    with pytest.raises(ValueError, match=r"growth: expected a factor > 1, got 1\.0"):
        Retention(growth=1.0)
