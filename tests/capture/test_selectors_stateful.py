"""World selectors against a plain Python reference, driven by a hypothesis state machine.

Every accepted form (None, ints, lists and tuples, ranges, slices, integer tensors and arrays
of every integer dtype and byte order, strided arrays, boolean masks) names a list of world ids
that plain Python computes on its own (``list(range(n))[slice]``, ``[i for i, b in
enumerate(mask) if b]``, ...). The machine resets, steps and selects through a real
:class:`capture.Recorder` in random order, so a selector that resolves to the wrong worlds shows
as the wrong episode indices, lengths or published rows, byte for byte. Invalid selectors (out
of range, duplicates, wrong dtype, wrong mask length, zero slice step, ...) must raise
:class:`capture.SelectorError` naming the argument, and change nothing: no message, no episode
advanced.
"""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker import Batch, Broker, EpisodeEnd, Message
from capture import FunctionTerm, Recorder, SelectorError, normalize_worlds

INT_TORCH = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8]
INT_NUMPY = ["<i8", ">i8", "<i4", ">i4", "<i2", "|i1", "|u1", "<u2", ">u4", "<u8"]
NAMES = ["worlds", "env_ids", "w"]

Selector = Any
Case = tuple[str, Selector, list[int]]  # (form, selector, expected world ids)


def _tensor(ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(ids, dtype=dtype)


def _array(ids: list[int], dtype: str, stride: int) -> np.ndarray:
    """``ids`` as a numpy array of ``dtype``; with ``stride`` > 1 a non-contiguous view."""
    base = np.zeros(len(ids) * stride, dtype=dtype)
    base[::stride] = ids
    return base[::stride]


@st.composite
def valid(draw: st.DrawFn, n: int) -> Case:
    """An accepted selector of ``n`` worlds and the world ids plain Python says it names."""
    ids = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n))
    form = draw(st.sampled_from(["none", "int", "npint", "list", "tuple", "range", "slice", "tensor",
                                 "tensor0d", "array", "mask", "npmask"]))
    if form == "none":
        return form, None, list(range(n))
    if form in ("int", "npint", "tensor0d"):
        w = draw(st.integers(0, n - 1))
        sel = {"int": w, "npint": np.int64(w), "tensor0d": torch.tensor(w)}[form]
        return form, sel, [w]
    if form == "list":
        return form, list(ids), ids
    if form == "tuple":
        return form, tuple(ids), ids
    if form == "range":
        start = draw(st.integers(0, n - 1))
        step = draw(st.integers(1, n)) * draw(st.sampled_from([1, -1]))
        room = (n - 1 - start) // step if step > 0 else start // -step
        count = draw(st.integers(0, room + 1))
        rng = range(start, start + count * step, step)
        return form, rng, list(rng)
    if form == "slice":
        bound = st.none() | st.integers(-2 * n, 2 * n)
        steps = st.none() | st.integers(1, n + 1).flatmap(lambda s: st.sampled_from([s, -s]))
        sl = slice(draw(bound), draw(bound), draw(steps))
        return form, sl, list(range(n))[sl]
    if form == "tensor":
        dtype = draw(st.sampled_from([d for d in INT_TORCH if n <= 127 or d not in (torch.int8, torch.uint8)]))
        return form, _tensor(ids, dtype), ids
    if form == "array":
        return form, _array(ids, draw(st.sampled_from(INT_NUMPY)), draw(st.integers(1, 3))), ids
    mask = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    chosen = [i for i, b in enumerate(mask) if b]
    if form == "mask":
        return form, torch.tensor(mask, dtype=torch.bool), chosen
    return form, _array([int(b) for b in mask], "|b1", draw(st.integers(1, 2))), chosen


@st.composite
def invalid(draw: st.DrawFn, n: int) -> tuple[str, Selector, str]:
    """A refused selector of ``n`` worlds and the regex (after ``name: ``) its error must match."""
    out = draw(st.sampled_from([n, n + 1, n + 1000, 2**40, -1, -n]))
    ok = draw(st.lists(st.integers(0, n - 1), unique=True, max_size=n - 1))
    at = draw(st.integers(0, len(ok)))
    with_out = [*ok[:at], out, *ok[at:]]
    range_msg = rf"expected world indices in \[0, {n}\), got \[.*{out}.*\] out of range"
    kind = draw(st.sampled_from([
        "int_out", "list_out", "tensor_out", "array_out", "range_out", "dup_list", "dup_tensor",
        "float_tensor", "complex_tensor", "float_array", "str_array", "object_array", "float_in_list",
        "bool_in_list", "bool", "str", "float", "set", "mask_len", "mask_2d", "tensor_2d", "slice_step0",
        "slice_float"]))
    if kind == "int_out":
        return kind, out, range_msg
    if kind == "list_out":
        return kind, with_out, range_msg
    if kind == "tensor_out":
        return kind, torch.tensor(with_out), range_msg
    if kind == "array_out":
        return kind, _array(with_out, draw(st.sampled_from(["<i8", ">i8"])), draw(st.integers(1, 2))), range_msg
    if kind == "range_out":
        stop = n + draw(st.integers(1, 5))
        return kind, range(draw(st.integers(0, n - 1)), stop), rf"got \[{n}.*\] out of range"
    if kind in ("dup_list", "dup_tensor"):
        ids = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n))
        dup = draw(st.sampled_from(ids))
        ids = [*ids, dup]
        ids = draw(st.permutations(ids))
        sel = list(ids) if kind == "dup_list" else torch.tensor(ids)
        return kind, sel, rf"expected distinct world indices, got duplicates \[.*{dup}.*\]"
    if kind == "float_tensor":
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]))
        return kind, torch.tensor(ok, dtype=dtype), r"expected an integer or bool tensor, got dtype torch\."
    if kind == "complex_tensor":
        return kind, torch.tensor(ok, dtype=torch.complex64), r"expected an integer or bool tensor"
    if kind == "float_array":
        return kind, np.array(ok, dtype=draw(st.sampled_from(["<f8", ">f4", "<f2"]))), r"expected an integer or bool"
    if kind == "str_array":
        return kind, np.array([str(i) for i in ok] or ["0"]), r"expected an integer or bool array, got dtype <U"
    if kind == "object_array":
        return kind, np.array([*ok, None], dtype=object), r"expected an integer or bool array, got dtype object"
    if kind == "float_in_list":
        return kind, [*ok, 1.0], r"expected a sequence of int world indices, got element 1.0 of type float"
    if kind == "bool_in_list":
        return kind, [*ok, True], r"got element True of type bool"
    if kind == "bool":
        return kind, draw(st.sampled_from([True, False, np.bool_(True)])), r"got the bool"
    if kind == "str":
        return kind, draw(st.sampled_from(["0", "", b"\x00"])), r"expected None, an int, .* got (str|bytes)"
    if kind == "float":
        return kind, draw(st.sampled_from([0.0, 1.5, np.float64(1.0)])), r"expected None, an int, .* got float"
    if kind == "set":
        return kind, set(ok), r"expected None, an int, .* got set"
    if kind == "mask_len":
        length = draw(st.integers(0, 2 * n + 1).filter(lambda k: k != n))
        mask = draw(st.lists(st.booleans(), min_size=length, max_size=length))
        bad_mask = torch.tensor(mask, dtype=torch.bool) if draw(st.booleans()) else np.array(mask, dtype=bool)
        return kind, bad_mask, rf"expected a boolean mask of shape \({n},\), got shape \({length},\)"
    if kind == "mask_2d":
        return kind, torch.ones((1, n), dtype=torch.bool), rf"expected a boolean mask of shape \({n},\), got shape \(1, {n}\)"
    if kind == "tensor_2d":
        return kind, torch.zeros((1, 1), dtype=torch.int64), r"expected a 1-D index tensor, got shape \(1, 1\)"
    if kind == "slice_step0":
        return kind, slice(draw(st.none() | st.integers(0, n)), None, 0), r"expected a slice of int bounds and a non-zero int step"
    return kind, slice(0.5, n), r"expected a slice of int bounds and a non-zero int step"


def _scribble(selector: Selector) -> None:
    """The caller reuses its selector's storage right after the call."""
    if isinstance(selector, torch.Tensor) and selector.numel():
        selector.fill_(0 if selector.dtype == torch.bool else 1)
    elif isinstance(selector, np.ndarray) and selector.size and selector.flags.writeable:
        selector.fill(1)
    elif isinstance(selector, list) and selector:
        selector.clear()


class Copying:
    """A consumer that copies what it keeps (published tensors are borrowed)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, message: Message) -> None:
        if isinstance(message, Batch):
            self.messages.append(("batch", {"hook": message.hook, "worlds": message.worlds.tolist(),
                                            "episodes": message.episodes.tolist(),
                                            "x": message.fields["x"].clone()}))
        elif isinstance(message, EpisodeEnd):
            self.messages.append(("end", {"worlds": message.worlds.tolist(), "episodes": message.episodes.tolist(),
                                          "length": message.length.tolist(),
                                          "success": message.success.tolist()}))


class SelectorMachine(RuleBasedStateMachine):
    """A recorder of ``n`` worlds against plain per-world lists (episode index, length)."""

    def __init__(self) -> None:
        super().__init__()
        self.rec: Recorder | None = None

    @initialize(n=st.integers(1, 9))
    def start(self, n: int) -> None:
        self.n = n
        self.broker = Broker(strict=True)
        self.got = Copying()
        self.broker.subscribe("", self.got)
        # Every world's state row is distinct, so rows of the wrong worlds cannot pass.
        self.state = torch.arange(n * 2, dtype=torch.float32).reshape(n, 2) * 1.5 + 0.25
        state = self.state
        term = FunctionTerm(pre_reset=lambda w: {"x": state[w]}, post_reset=lambda w: {"x": state[w] * -1})
        self.rec = Recorder(n, "cpu", self.broker, run="sel")
        self.rec.add_term("t", term)
        self.episode = [0] * n
        self.length = [0] * n

    def teardown(self) -> None:
        if self.rec is not None:
            self.broker.close()

    def _expect_reset(self, ids: list[int], success: list[bool]) -> list[tuple[str, dict[str, Any]]]:
        if not ids:
            return []
        before = [self.episode[w] for w in ids]
        lengths = [self.length[w] for w in ids]
        for w in ids:
            self.episode[w] += 1
            self.length[w] = 0
        return [
            ("batch", {"hook": "pre_reset", "worlds": ids, "episodes": before, "x": self.state[ids]}),
            ("end", {"worlds": ids, "episodes": before, "length": lengths, "success": success}),
            ("batch", {"hook": "post_reset", "worlds": ids, "episodes": [self.episode[w] for w in ids],
                       "x": self.state[ids] * -1}),
        ]

    def _check_messages(self, expected: list[tuple[str, dict[str, Any]]]) -> None:
        got, self.got.messages = self.got.messages, []
        assert [k for k, _ in got] == [k for k, _ in expected]
        for (_, g), (_, e) in zip(got, expected, strict=True):
            assert g.keys() == e.keys()
            for key, value in e.items():
                if key == "x":
                    assert g[key].numpy().tobytes() == value.numpy().tobytes(), (g, e)
                else:
                    assert g[key] == value, (key, g, e)

    @precondition(lambda self: self.rec is not None)
    @rule(data=st.data())
    def reset(self, data: st.DataObject) -> None:
        assert self.rec is not None
        form, selector, ids = data.draw(valid(self.n), label="selector")
        by_world = data.draw(st.booleans(), label="flags for every world")
        flags = data.draw(st.lists(st.booleans(), min_size=self.n, max_size=self.n), label="flags")
        success = torch.tensor(flags if by_world else [flags[w] for w in ids], dtype=torch.bool)
        # A flag tensor of num_worlds is indexed by world, except when every world is selected:
        # then it has the selection's length too and is read in the selector's order.
        expected_flags = [flags[w] for w in ids] if len(ids) < self.n or not by_world else flags
        idx = self.rec.record_pre_reset(selector, success=success)
        assert idx.tolist() == ids, form
        idx2 = self.rec.record_post_reset(selector)
        assert idx2.tolist() == ids, form
        _scribble(selector)
        self._check_messages(self._expect_reset(ids, expected_flags))

    @precondition(lambda self: self.rec is not None)
    @rule()
    def step(self) -> None:
        assert self.rec is not None
        self.rec.record_post_step()
        self.length = [k + 1 for k in self.length]
        self._check_messages([])

    @precondition(lambda self: self.rec is not None)
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def select(self, data: st.DataObject, name: str) -> None:
        assert self.rec is not None
        form, selector, ids = data.draw(valid(self.n), label="selector")
        for out in (self.rec.select(selector, name=name), normalize_worlds(selector, self.n, name=name)):
            assert (out.dtype, out.dim(), out.device.type) == (torch.int64, 1, "cpu"), form
            assert out.tolist() == ids, form
        self._check_messages([])

    @precondition(lambda self: self.rec is not None)
    @rule(data=st.data(), name=st.sampled_from(NAMES),
          via=st.sampled_from(["select", "normalize", "pre_reset", "post_reset"]))
    def refuse(self, data: st.DataObject, name: str, via: str) -> None:
        assert self.rec is not None
        kind, selector, message = data.draw(invalid(self.n), label="invalid selector")
        calls: dict[str, Callable[[], object]] = {
            "select": lambda: self.rec.select(selector, name=name),  # type: ignore[union-attr]
            "normalize": lambda: normalize_worlds(selector, self.n, name=name),
            "pre_reset": lambda: self.rec.record_pre_reset(selector, success=True),  # type: ignore[union-attr]
            "post_reset": lambda: self.rec.record_post_reset(selector),  # type: ignore[union-attr]
        }
        shown = name if via in ("select", "normalize") else "worlds"
        with pytest.raises(SelectorError, match=rf"^{re.escape(shown)}: (.* )?{message}") as info:
            calls[via]()
        assert isinstance(info.value, ValueError), kind
        self._check_messages([])

    @precondition(lambda self: self.rec is not None)
    @invariant()
    def the_recorder_matches_the_reference(self) -> None:
        assert self.rec is not None
        assert self.rec.episode_index.tolist() == self.episode
        assert self.rec.episode_length.tolist() == self.length


SelectorMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestSelectors = SelectorMachine.TestCase


def test_a_huge_range_is_refused_without_materializing_it() -> None:
    """Bug: a range was turned into a list before its bounds were checked, so ``range(10**12)``
    for 4 worlds tried to build a list of 10**12 ints (memory error or a hang) before refusing.
    Here a range of a million out-of-range ids must be refused within a few KiB."""
    tracemalloc.start()
    try:
        with pytest.raises(SelectorError, match=r"^worlds: expected world indices in \[0, 4\), got \[4, 5, 6, 7, 8, "
                                                r"9, 10, 11, \.\.\.\] out of range"):
            normalize_worlds(range(10**6), 4)
        with pytest.raises(SelectorError, match=r"got \[-1000000, -999999, .*\] out of range"):
            normalize_worlds(range(-(10**6), 4), 4)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024, peak
