"""Recorder.record_pre_reset(outcomes=...): extra numeric episode outcomes in EpisodeEnd."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from broker import Broker, EpisodeEnd, Message
from capture import FunctionTerm, Recorder

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _setup(num_worlds: int = 4, device: str = "cpu") -> tuple[Recorder, list[Message]]:
    broker = Broker(strict=True)
    messages: list[Message] = []
    broker.subscribe("", messages.append)
    return Recorder(num_worlds, device, broker, run="r"), messages


def _ends(messages: list[Message]) -> list[EpisodeEnd]:
    return [m for m in messages if isinstance(m, EpisodeEnd)]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


def test_outcomes_are_published_as_float64_bytes_per_selected_world() -> None:
    """Catches outcomes dropped, misaligned with the worlds, or published in another dtype:
    every form (tensor, num_worlds tensor, numpy, list, number, 0-d, bool) is compared byte
    for byte with the float64 values of the selected worlds, in the selector's order."""
    recorder, messages = _setup()
    returns = torch.tensor([1.5, -2.25], dtype=torch.float32)  # one per selected world
    by_world = torch.tensor([10, 11, 12, 13], dtype=torch.int32)  # one per world
    recorder.record_post_step()
    recorder.record_pre_reset([3, 1], success=True, outcomes={
        "return": returns, "by_world": by_world, "np": np.array([7, 8], dtype=np.int16),
        "list": [0.1, 0.2], "number": 3, "zero_d": torch.tensor(2.5), "flag": torch.tensor([True, False]),
    })
    (end,) = _ends(messages)
    expected = {
        "return": [1.5, -2.25], "by_world": [13.0, 11.0], "np": [7.0, 8.0], "list": [0.1, 0.2],
        "number": [3.0, 3.0], "zero_d": [2.5, 2.5], "flag": [1.0, 0.0],
    }
    assert list(end.outcomes) == list(expected)
    for name, values in expected.items():
        got = end.outcomes[name]
        assert got.dtype == torch.float64
        assert got.device == recorder.device
        assert _bytes(got) == np.array(values, dtype=np.float64).tobytes(), name
    assert end.worlds.tolist() == [3, 1]
    assert end.success.tolist() == [True, True]  # the flags keep their positional meaning


def test_outcomes_are_fresh_tensors_the_caller_may_overwrite() -> None:
    """Catches the caller's buffer being published as is: a consumer that kept the message's
    tensor would see the simulator's next values."""
    recorder, messages = _setup(num_worlds=2)
    returns = torch.tensor([1.0, 2.0], dtype=torch.float64)
    recorder.record_pre_reset(None, outcomes={"return": returns})
    kept = _ends(messages)[0].outcomes["return"]
    returns.fill_(-1.0)
    assert _bytes(kept) == np.array([1.0, 2.0]).tobytes()


def test_no_outcomes_publishes_an_empty_mapping() -> None:
    recorder, messages = _setup()
    recorder.record_pre_reset([0])
    recorder.record_pre_reset([1], outcomes={})
    assert [dict(e.outcomes) for e in _ends(messages)] == [{}, {}]


@pytest.mark.parametrize(
    ("outcomes", "match"),
    [
        ({"": 1.0}, r"outcomes: expected names that are non-empty strings without '/' or "
                    r"whitespace, got ''"),
        ({"a/b": 1.0}, r"got 'a/b'"),
        ({"a b": 1.0}, r"got 'a b'"),
        ({3: 1.0}, r"got 3"),
        ({"r": torch.zeros(3)}, r"outcomes\['r'\]: expected a number, or a 1-D numeric tensor or "
                                r"array of length 2 or 4, got shape \(3,\)"),
        ({"r": torch.zeros(2, 1)}, r"got shape \(2, 1\)"),
        ({"r": torch.zeros(2, dtype=torch.complex64)}, r"got a tensor of dtype torch.complex64"),
        ({"r": ["a", "b"]}, r"outcomes\['r'\]: .*got list of dtype <U1"),
        ({"r": "ab"}, r"got str of dtype <U2"),
        ({"r": [[1.0], [1.0, 2.0]]}, r"outcomes\['r'\]: expected a number"),
        ({"r": None}, r"got NoneType of dtype object"),
        ([("r", 1.0)], r"outcomes: expected a mapping of name -> values"),
        # reserved: before, taken here and rejected by every store, which then lost the episode
        ({"success": 1.0}, r"outcomes: 'success' is reserved for a column episode tables hold already"),
        ({"r": 1.0, "length": 2.0}, r"outcomes: 'length' is reserved"),
    ],
)
def test_bad_outcomes_are_refused_and_nothing_is_recorded(outcomes: object, match: str) -> None:
    """Catches invalid outcomes reaching the stream (and the store's episode table), or a
    refused call that still ended the episode."""
    recorder, messages = _setup()
    with pytest.raises(ValueError, match=match):
        recorder.record_pre_reset([0, 2], outcomes=outcomes)  # type: ignore[arg-type]
    assert _ends(messages) == []
    assert recorder.episode_index.tolist() == [0, 0, 0, 0]


@pytest.mark.cuda
@cuda
def test_outcomes_are_published_on_the_recorders_device() -> None:
    recorder, messages = _setup(device="cuda")
    recorder.record_pre_reset([1, 2], outcomes={"return": np.array([1.0, 2.0]), "n": 4,
                                                "t": torch.tensor([3, 4], device="cuda")})
    for name, value in _ends(messages)[0].outcomes.items():
        assert value.device.type == "cuda", name
        assert value.dtype == torch.float64, name


def test_an_outcome_named_as_a_column_is_refused_and_no_episode_is_lost(tmp_path: Path) -> None:
    """Bug: ``outcomes={"success": ...}`` was published; the store daemon rejected that episode
    end (its table holds a ``success`` column already), so both worlds' episodes were never
    ended: the run stored 0 of its 4 episodes (2 incomplete) and the caller learnt nothing.
    Now the call raises and ends nothing; the caller's next end stores each episode whole."""
    from storage import RunStore, StoreDaemon

    broker = Broker(strict=True)
    daemon = StoreDaemon(tmp_path / "runs.zarr", commit_interval=0.0)
    broker.subscribe("", daemon.handle)
    recorder = Recorder(2, "cpu", broker, run="r")
    x = torch.zeros(2, 1)
    recorder.add_term("t", FunctionTerm(post_step=lambda: {"x": x}))
    for step in range(6):
        x.fill_(step)
        recorder.record_post_step()
        if step == 2:
            with pytest.raises(ValueError, match="'success' is reserved"):
                recorder.record_pre_reset([0, 1], success=True, outcomes={"success": [1.0, 0.0]})
            recorder.record_pre_reset([0, 1], success=True, outcomes={"score": [1.0, 0.0]})
    recorder.record_pre_reset([0, 1])
    recorder.close()
    assert dict(daemon.statistics().rejected) == {}
    daemon.close()
    store = RunStore(tmp_path / "runs.zarr")
    rows = store.episodes("r").rows()
    assert [(r["world"], r["index"], r["length"], r["success"]) for r in rows] == [
        (0, 0, 3, True), (1, 0, 3, True), (0, 1, 3, False), (1, 1, 3, False)]
    for r in rows:
        want = np.arange(3, 6) if r["index"] else np.arange(3)
        np.testing.assert_array_equal(store.episode("r", r["world"], r["index"])["t/x"].ravel(),
                                      want.astype(np.float32))
