from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from broker import Batch, Broker, EpisodeEnd, FieldSpec, Message, RunEnd, RunStart
from capture import (
    FunctionTerm,
    Recorder,
    RecorderClosedError,
    SchemaError,
    SelectorError,
    TermError,
)

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


class Collect:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __call__(self, message: Message) -> None:
        self.messages.append(message)

    def of(self, kind: type) -> list:  # type: ignore[type-arg]
        return [m for m in self.messages if isinstance(m, kind)]


class StateTerm:
    """A term with every hook, reading a simulator-owned buffer."""

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state

    def pre_step(self) -> dict[str, object]:
        return {"obs": {"state": self.state}, "flag": self.state[:, 0] > 0}

    def post_step(self) -> dict[str, object]:
        return {"obs": {"state": self.state}, "flag": self.state[:, 0] > 0}

    def pre_reset(self, worlds: torch.Tensor) -> dict[str, object]:
        return {"obs": {"state": self.state[worlds]}, "flag": self.state[worlds, 0] > 0}

    def post_reset(self, worlds: torch.Tensor) -> dict[str, object]:
        return {"obs": {"state": self.state[worlds] + 1}, "flag": self.state[worlds, 0] > 0}


@pytest.fixture
def collect(broker: Broker) -> Collect:
    c = Collect()
    broker.subscribe("", c)
    return c


@pytest.mark.parametrize("device", DEVICES)
def test_lifecycle_publishes_batches_episode_ends_and_run_bounds(
    broker: Broker, collect: Collect, device: str
) -> None:
    state = torch.arange(12.0, device=device).reshape(4, 3)
    rec = Recorder(4, device, broker, run="r1", metadata={"task": "cartpole"})
    rec.add_term("s", StateTerm(state))
    rec.record_pre_step()
    rec.record_post_step()
    rec.record_pre_step()
    rec.record_post_step()
    rec.record_pre_reset((1, 3), success=torch.tensor([True, False], device=device), truncated=True)
    rec.record_post_reset((1, 3))
    rec.close()
    kinds = [(type(m).__name__, getattr(m, "hook", None)) for m in collect.messages]
    assert kinds == [
        ("RunStart", None), ("Batch", "pre_step"), ("Batch", "post_step"), ("Batch", "pre_step"),
        ("Batch", "post_step"), ("Batch", "pre_reset"), ("EpisodeEnd", None),
        ("Batch", "post_reset"), ("RunEnd", None),
    ]
    seqs = [m.seq for m in collect.messages]
    assert seqs == list(range(len(seqs)))
    assert all(m.run == "r1" for m in collect.messages)
    start = collect.of(RunStart)[0]
    assert (start.num_worlds, start.metadata["task"]) == (4, "cartpole")
    assert torch.device(start.device).type == device
    post = [b for b in collect.of(Batch) if b.hook == "post_step"]
    assert [b.step for b in post] == [0, 1]
    assert set(post[0].fields) == {"obs/state", "flag"}
    assert post[0].fields["obs/state"] is state  # borrowed, not copied
    end = collect.of(EpisodeEnd)[0]
    assert end.worlds.tolist() == [1, 3]
    assert end.episodes.tolist() == [0, 0]
    assert end.success.tolist() == [True, False]
    assert end.terminated.tolist() == [False, False]
    assert end.truncated.tolist() == [True, True]
    assert end.length.tolist() == [2, 2]
    final, initial = (b for b in collect.of(Batch) if b.hook in ("pre_reset", "post_reset"))
    assert final.episodes.tolist() == [0, 0]
    assert initial.episodes.tolist() == [1, 1]
    assert torch.equal(initial.fields["obs/state"], state[[1, 3]] + 1)
    assert rec.episode_index.tolist() == [0, 1, 0, 1]
    assert rec.episode_length.tolist() == [2, 0, 2, 0]
    end_msg = collect.of(RunEnd)[0]
    assert end_msg.schema["batch/s"]["obs/state"] == FieldSpec("float32", (3,))
    assert end_msg.schema["batch/s"]["flag"] == FieldSpec("bool", ())


def test_tuple_ids_reset_the_right_worlds(broker: Broker, collect: Collect) -> None:
    """The regression seen in the systems we replace: tuple ids indexed as dimensions."""
    rec = Recorder(3, "cpu", broker)
    rec.record_pre_reset((0, 1), success=torch.tensor([True, True, False]))
    end = collect.of(EpisodeEnd)[0]
    assert end.worlds.tolist() == [0, 1]
    assert end.success.tolist() == [True, True]
    assert rec.episode_index.tolist() == [1, 1, 0]
    rec.record_pre_reset(torch.tensor([False, True, True]))
    assert rec.episode_index.tolist() == [1, 2, 1]


def test_empty_selections_are_no_ops(broker: Broker, collect: Collect) -> None:
    rec = Recorder(3, "cpu", broker)
    rec.add_term("s", StateTerm(torch.zeros(3, 2)))
    assert rec.record_pre_reset(()).numel() == 0
    assert rec.record_post_reset([]).numel() == 0
    rec.record_pre_reset(torch.zeros(3, dtype=torch.bool))
    assert collect.messages == []
    assert rec.episode_index.tolist() == [0, 0, 0]


def test_bad_selectors_raise_before_anything_is_published(broker: Broker, collect: Collect) -> None:
    rec = Recorder(3, "cpu", broker)
    with pytest.raises(SelectorError, match=r"worlds: expected world indices in \[0, 3\), got \[3\]"):
        rec.record_pre_reset((0, 3))
    with pytest.raises(SelectorError, match=r"worlds: expected distinct world indices"):
        rec.record_post_reset([1, 1])
    assert collect.messages == []


def test_flag_validation(broker: Broker) -> None:
    rec = Recorder(3, "cpu", broker)
    with pytest.raises(ValueError, match=r"success: expected a bool, or a bool tensor of shape \(2,\) or \(3,\), got dtype torch.int64 shape \(2,\)"):
        rec.record_pre_reset((0, 1), success=torch.tensor([1, 0]))
    with pytest.raises(ValueError, match=r"terminated: .* got dtype torch.bool shape \(4,\)"):
        rec.record_pre_reset((0, 1), terminated=torch.ones(4, dtype=torch.bool))


def test_full_length_flags_are_selected_by_world(broker: Broker, collect: Collect) -> None:
    rec = Recorder(4, "cpu", broker)
    rec.record_pre_reset([3, 0], success=torch.tensor([True, False, False, False]))
    assert collect.of(EpisodeEnd)[0].success.tolist() == [False, True]


def test_schema_is_fixed_by_the_first_batch(broker: Broker) -> None:
    out: dict[str, object] = {"x": torch.zeros(2, 3)}
    rec = Recorder(2, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: out))
    rec.record_post_step()
    out["x"] = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(SchemaError, match=r"topic 'batch/t' field 'x': expected float32 per-world shape \(3,\), got float64 per-world shape \(3,\)"):
        rec.record_post_step()
    out["x"] = torch.zeros(2, 4)
    with pytest.raises(SchemaError, match=r"expected float32 per-world shape \(3,\), got float32 per-world shape \(4,\)"):
        rec.record_post_step()
    out["x"] = torch.zeros(2, 3)
    out["y"] = torch.zeros(2)
    with pytest.raises(SchemaError, match=r"topic 'batch/t': expected fields \['x'\], got \['x', 'y'\]"):
        rec.record_post_step()


def test_term_output_is_validated(broker: Broker) -> None:
    out: object = {"x": torch.zeros(3, 1)}
    rec = Recorder(2, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: out))
    with pytest.raises(TermError, match=r"topic 'batch/t' field 'x': expected a leading worlds dimension of 2, got shape \(3, 1\)"):
        rec.record_post_step()
    out = {"x": [1, 2]}
    with pytest.raises(TermError, match=r"term 't': field 'x': expected a tensor, got list"):
        rec.record_post_step()
    out = torch.zeros(2)
    with pytest.raises(TermError, match=r"term 't': expected a mapping of field name to tensor, got Tensor"):
        rec.record_post_step()
    out = {"": torch.zeros(2)}
    with pytest.raises(TermError, match=r"field names must be non-empty strings, got ''"):
        rec.record_post_step()
    out = {"x": torch.tensor(1.0)}
    with pytest.raises(TermError, match=r"expected a leading worlds dimension of 2, got shape \(\)"):
        rec.record_post_step()


def test_terms_returning_none_publish_nothing(broker: Broker, collect: Collect) -> None:
    rec = Recorder(2, "cpu", broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: None))
    rec.record_post_step()
    assert collect.of(Batch) == []
    assert rec.step == 1


def test_add_term_validation() -> None:
    rec = Recorder(2)
    rec.add_term("a", FunctionTerm(post_step=lambda: None))
    with pytest.raises(ValueError, match="a term named 'a' is already registered"):
        rec.add_term("a", FunctionTerm(post_step=lambda: None))
    with pytest.raises(ValueError, match="name: expected a non-empty term name without whitespace, got 'a b'"):
        rec.add_term("a b", FunctionTerm(post_step=lambda: None))
    with pytest.raises(TypeError, match="term 'c': expected at least one of the hooks"):
        rec.add_term("c", object())
    with pytest.raises(ValueError, match="FunctionTerm: expected at least one of"):
        FunctionTerm()
    with pytest.raises(ValueError, match="num_worlds: expected a positive int, got 0"):
        Recorder(0)


def test_closed_recorder_refuses(broker: Broker, collect: Collect) -> None:
    with Recorder(2, "cpu", broker, run="x") as rec:
        rec.record_post_step()
    rec.close()
    assert [type(m).__name__ for m in collect.messages] == ["RunStart", "RunEnd"]
    with pytest.raises(RecorderClosedError, match="recorder of run 'x' is closed"):
        rec.record_pre_reset(0)


def test_run_bounds_carry_seed_wall_time_and_declarations(broker: Broker, collect: Collect) -> None:
    """Catches a run without its seed, its wall-clock start/end, or a declaration made after
    RunStart missing from RunEnd."""
    before = time.time()
    rec = Recorder(2, broker=broker, run="r", seed=2**64 - 1)
    rec.declare_variation("mass", {"kind": "uniform", "phase": "build", "shape": [], "seed": 1,
                                   "low": 0.0, "high": 1.0})
    rec.start()
    late: dict[str, Any] = {"kind": "choice", "phase": "runtime", "shape": [], "seed": 2, "labels": ["a"],
            "weights": None}
    rec.declare_variation("object", late)
    late["labels"].append("b")  # the recorder keeps its own copy
    rec.close()
    after = time.time()
    (start,), (end,) = collect.of(RunStart), collect.of(RunEnd)
    assert start.seed == end.seed == 2**64 - 1
    assert before <= start.wall_time <= end.wall_time <= after
    assert list(start.variations) == ["mass"]
    assert list(end.variations) == ["mass", "object"]
    assert end.variations["object"]["labels"] == ["a"]
    got = rec.variations
    got["mass"]["low"] = 5.0  # a deep copy
    assert rec.variations["mass"]["low"] == 0.0
    assert Recorder(1).seed == 0


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0, None])
def test_bad_run_seed(seed: object) -> None:
    with pytest.raises(ValueError, match=r"seed: expected an int in \[0, 2\*\*64\), got"):
        Recorder(2, seed=seed)  # type: ignore[arg-type]


def test_bad_declarations(broker: Broker) -> None:
    rec = Recorder(2, broker=broker)
    with pytest.raises(ValueError, match=r"key: expected a non-empty variation key without "
                                         r"whitespace, got 'a b'"):
        rec.declare_variation("a b", {})
    with pytest.raises(ValueError, match=r"declaration of 'k': expected a mapping with str keys, "
                                         r"got \[1\]"):
        rec.declare_variation("k", [1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected a mapping with str keys, got \{1: 2\}"):
        rec.declare_variation("k", {1: 2})  # type: ignore[dict-item]
    rec.close()
    with pytest.raises(RecorderClosedError):
        rec.declare_variation("k", {})


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_of_some_worlds_publishes_their_rows_and_advances_their_lengths_only(
        device: str, broker: Broker, collect: Collect) -> None:
    """Catches: a vectorized env's reset-inside-a-step (gymnasium NEXT_STEP) recorded as a
    transition of the world's episode (rows of worlds that did not step published, or their
    episode length counting the step)."""
    state = torch.arange(12, dtype=torch.float32, device=device).reshape(4, 3)
    rec = Recorder(4, device, broker)
    rec.add_term("t", FunctionTerm(post_step=lambda: {"x": state}))
    rec.record_post_step(worlds=[2, 0])
    rec.record_post_step()
    (first, second) = collect.of(Batch)
    assert first.worlds.tolist() == [2, 0]
    assert first.step == 0
    assert torch.equal(first.fields["x"].cpu(), state.cpu()[[2, 0]])
    assert second.worlds.tolist() == [0, 1, 2, 3]
    assert second.step == 1
    assert rec.episode_length.tolist() == [2, 1, 2, 1]
    assert rec.step == 2
    rec.record_post_step(worlds=[])
    assert rec.step == 3
    assert len(collect.of(Batch)) == 2
    assert rec.episode_length.tolist() == [2, 1, 2, 1]


def test_close_marks_an_interrupted_run(broker: Broker, collect: Collect) -> None:
    """Catches: a run stopped by Ctrl-C or an error stored as ``complete``."""
    Recorder(2, "cpu", broker).close()
    Recorder(2, "cpu", broker).close(interrupted=True)
    with pytest.raises(KeyboardInterrupt), Recorder(2, "cpu", broker):
        raise KeyboardInterrupt
    with Recorder(2, "cpu", broker):
        pass
    assert [m.interrupted for m in collect.of(RunEnd)] == [False, True, True, False]
    with pytest.raises(TypeError, match="interrupted"):
        Recorder(2, "cpu", broker).close(interrupted="yes")  # type: ignore[arg-type]
