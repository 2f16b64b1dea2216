"""Retention against a per-world reference, driven by a hypothesis state machine.

The publisher behaves as badly as the contract allows: the fields of a topic come in a random
dict order each batch; the worlds of full batches live in ONE tensor it refills in place (the
identity, or any permutation); partial batches name random subsets of worlds in random order;
and after every publish it scribbles over everything it published (fields, worlds, episodes).
The reference keeps plain per-world lists of copied rows; after every step each world's
retained episode must equal it byte for byte, and every finished episode handed to the sink
must equal the reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from broker import Batch, EpisodeEnd, RunStart
from consumers import FinishedEpisode, Retention

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
          torch.bool]
STEP_HOOKS = ["pre_step", "post_step"]
RESET_HOOKS = ["pre_reset", "post_reset"]


@dataclass(frozen=True)
class Topic:
    name: str
    reset_only: bool
    fields: dict[str, tuple[torch.dtype, tuple[int, ...]]]

    @property
    def term(self) -> str:
        return self.name.removeprefix("batch/")


def topics() -> st.SearchStrategy[list[Topic]]:
    field = st.tuples(st.sampled_from(DTYPES), st.lists(st.integers(1, 3), max_size=2).map(tuple))
    fields = st.dictionaries(st.sampled_from(["a", "b", "c", "obs/x"]), field, min_size=1, max_size=4)
    kinds = st.lists(st.tuples(st.booleans(), fields), min_size=1, max_size=3)
    return kinds.map(lambda ks: [Topic(f"batch/t{i}", r, f) for i, (r, f) in enumerate(ks)])


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bytes of ``dtype`` (any bit pattern, NaNs included; bools 0 or 1)."""
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return (raw % 2).view(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    dense = [torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).view(torch.uint8) for t in (a, b)]
    return torch.equal(*dense)


class RetentionMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.retention: Retention | None = None

    @initialize(num_worlds=st.integers(1, 6), capacity=st.integers(1, 3), growth=st.sampled_from([1.5, 2.0]),
                topics=topics(), via_run_start=st.booleans())
    def start(self, num_worlds: int, capacity: int, growth: float, topics: list[Topic], via_run_start: bool) -> None:
        self.n = num_worlds
        self.topics = topics
        self.sunk: list[FinishedEpisode] = []
        self.retention = Retention(num_worlds=None if via_run_start else num_worlds, initial_capacity=capacity,
                                   growth=growth, sink=self.sunk.append)
        if via_run_start:
            self.retention(RunStart("run", 0, 0, num_worlds, "cpu"))
        # The reference: world -> term -> field -> rows, for the topics retention has seen.
        self.rows: dict[int, dict[str, dict[str, list[torch.Tensor]]]] = {w: {} for w in range(num_worlds)}
        self.seen: list[Topic] = []
        self.expected_sunk: list[tuple[int, int, bool, dict[str, dict[str, torch.Tensor]]]] = []
        self.episode = [0] * num_worlds
        self.worlds = torch.arange(num_worlds)  # ONE buffer, refilled in place for every full batch
        self.seq = 1
        self.batches = 0

    # -- what the reference expects -----------------------------------------------------------

    def expected(self, world: int) -> dict[str, dict[str, torch.Tensor]]:
        out: dict[str, dict[str, torch.Tensor]] = {}
        for topic in self.seen:
            rows = self.rows[world].get(topic.term, {})
            out[topic.term] = {
                name: torch.stack(rows[name]) if rows.get(name) else torch.empty((0, *shape), dtype=dtype)
                for name, (dtype, shape) in topic.fields.items()
            }
        return out

    # -- the publisher ------------------------------------------------------------------------

    def publish(self, topic: Topic, idx: torch.Tensor, worlds: list[int], data: st.DataObject) -> None:
        assert self.retention is not None
        hook = data.draw(st.sampled_from(RESET_HOOKS if topic.reset_only else STEP_HOOKS), label="hook")
        gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), label="seed"))
        made = {name: random_tensor(dtype, (len(worlds), *shape), gen) for name, (dtype, shape) in topic.fields.items()}
        order = data.draw(st.permutations(sorted(made)), label="field order")
        fields = {name: made[name] for name in order}
        episodes = torch.tensor([self.episode[w] for w in worlds], dtype=torch.int64)
        self.retention(Batch("run", self.seq, self.seq, topic.name, idx, episodes, fields, hook))  # type: ignore[arg-type]
        self.seq += 1
        self.batches += 1
        if topic not in self.seen:
            self.seen.append(topic)
        for row, w in enumerate(worlds):
            term = self.rows[w].setdefault(topic.term, {})
            for name, t in fields.items():
                term.setdefault(name, []).append(t[row].clone())
        # The publisher owns its tensors again: nothing kept may change with them.
        for t in fields.values():
            t.view(torch.uint8).fill_(0xA5)
        episodes.fill_(-1)
        idx.copy_(idx.flip(0))

    @rule(data=st.data(), which=st.integers(0, 2), identity=st.booleans())
    def full_batch(self, data: st.DataObject, which: int, identity: bool) -> None:
        topic = self.topics[which % len(self.topics)]
        order = list(range(self.n)) if identity else data.draw(st.permutations(range(self.n)), label="worlds")
        self.worlds.copy_(torch.tensor(order))  # in place: same object, other contents
        self.publish(topic, self.worlds, order, data)

    @rule(data=st.data(), which=st.integers(0, 2))
    def partial_batch(self, data: st.DataObject, which: int) -> None:
        topic = self.topics[which % len(self.topics)]
        worlds = data.draw(st.lists(st.integers(0, self.n - 1), unique=True, max_size=self.n), label="worlds")
        self.publish(topic, torch.tensor(worlds, dtype=torch.int64), worlds, data)

    def _chosen(self, data: st.DataObject) -> list[int]:
        return data.draw(st.lists(st.integers(0, self.n - 1), unique=True, max_size=self.n), label="worlds")

    @rule(data=st.data())
    def end_episodes(self, data: st.DataObject) -> None:
        assert self.retention is not None
        worlds = self._chosen(data)
        success = [data.draw(st.booleans(), label="success") for _ in worlds]
        for w, ok in zip(worlds, success, strict=True):
            exp = self.expected(w)
            if any(t.shape[0] for fields in exp.values() for t in fields.values()):  # skip_empty
                self.expected_sunk.append((w, self.episode[w], ok, exp))
        k = len(worlds)
        idx = torch.tensor(worlds, dtype=torch.int64)
        episodes = torch.tensor([self.episode[w] for w in worlds], dtype=torch.int64)
        flags = torch.tensor(success, dtype=torch.bool)
        self.retention(EpisodeEnd("run", self.seq, self.seq, idx, episodes, flags, torch.zeros(k, dtype=torch.bool),
                                  torch.ones(k, dtype=torch.bool), torch.zeros(k, dtype=torch.int64)))
        self.seq += 1
        for w in worlds:
            self.rows[w] = {}
            self.episode[w] += 1
        idx.copy_(idx.flip(0))
        flags.logical_not_()

    @rule(data=st.data())
    def drop_episodes(self, data: st.DataObject) -> None:
        """``reset(worlds)``: rows dropped, nothing handed to the sink."""
        assert self.retention is not None
        worlds = self._chosen(data)
        idx = torch.tensor(worlds, dtype=torch.int64)
        self.retention.reset(idx)
        for w in worlds:
            self.rows[w] = {}
        idx.copy_(idx.flip(0))

    # -- invariants ---------------------------------------------------------------------------

    @precondition(lambda self: self.retention is not None)
    @invariant()
    def every_world_equals_the_reference(self) -> None:
        assert self.retention is not None
        for w in range(self.n):
            got, exp = self.retention.episode(w), self.expected(w)
            assert got.keys() == exp.keys(), w
            for term, fields in exp.items():
                assert got[term].keys() == fields.keys(), (w, term)
                for name, t in fields.items():
                    assert same_bytes(got[term][name], t), (w, term, name, got[term][name], t)
                assert self.retention.episode_length(w, term) == len(self.rows[w].get(term, {}).get(
                    next(iter(fields)), [])), (w, term)

    @precondition(lambda self: self.retention is not None)
    @invariant()
    def the_sink_got_every_finished_episode(self) -> None:
        assert [(e.world, e.episode, e.success) for e in self.sunk] == [
            (w, ep, ok) for w, ep, ok, _ in self.expected_sunk]
        for got, (_, _, _, exp) in zip(self.sunk, self.expected_sunk, strict=True):
            assert got.run == "run"
            assert (got.terminated, got.truncated) == (False, True)
            assert got.data.keys() == exp.keys()
            for term, fields in exp.items():
                assert got.data[term].keys() == fields.keys()
                for name, t in fields.items():
                    assert same_bytes(got.data[term][name], t), (got.world, term, name)

    @precondition(lambda self: self.retention is not None)
    @invariant()
    def statistics_count_every_batch(self) -> None:
        assert self.retention is not None
        stats = self.retention.statistics()
        assert (stats.batches, stats.topics, stats.episodes_sunk) == (self.batches, len(self.seen), len(self.sunk))


RetentionMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestRetention = RetentionMachine.TestCase

