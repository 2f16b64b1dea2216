"""Stateful test of the draw rules: steps, resets and draws in any order against a model.

The model says which draws are accepted (build draws before the first step and reset, runtime
draws only for worlds whose episode has not stepped yet, design draws only while rows are
left), which design rows each accepted draw gets, and which value is in effect for every
(world, episode); the published samples and the in-memory record are checked byte for byte.
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from broker import Broker, Message, VariationSample
from capture import Recorder
from capture.variations import (
    DesignCfg,
    UniformCfg,
    Variation,
    VariationCfg,
    VariationError,
    VariationRecorder,
)

N = 4
ROWS = 12
DESIGN = np.linspace(0.0, 1.0, ROWS * 2, dtype=np.float32).reshape(ROWS, 2)

worlds_st = st.lists(st.integers(0, N - 1), min_size=0, max_size=N, unique=True)


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().numpy().tobytes()


class DrawRules(RuleBasedStateMachine):
    """Catches a runtime draw accepted for an episode that has already stepped, a build draw
    accepted late, a refused draw that still published or recorded something, design rows
    skipped or reused, and samples tagged with the wrong episode."""

    def __init__(self) -> None:
        super().__init__()
        self.broker = Broker(strict=True)
        self.messages: list[Message] = []
        self.broker.subscribe("variation/", self.messages.append)
        self.recorder = Recorder(N, broker=self.broker, run="sm", seed=3)
        self.mass = Variation("mass", VariationCfg(sampler=UniformCfg(1, 2), phase="build"))
        self.friction = Variation("friction", VariationCfg(sampler=UniformCfg(0, 1)))
        self.design = Variation("design", VariationCfg(sampler=DesignCfg(DESIGN)))
        self.vr = VariationRecorder(self.recorder)
        self.vr.attach([self.mass, self.friction, self.design])
        self.episode = [0] * N
        self.length = [0] * N
        self.steps = 0
        self.cursor = 0  # design rows taken (refused-by-recorder draws take theirs too)
        self.truth: dict[str, dict[tuple[int, int], bytes]] = {"friction": {}, "design": {}}
        self.build: dict[int, bytes] = {}
        self.published = 0

    @rule()
    def step(self) -> None:
        self.recorder.record_pre_step()
        self.recorder.record_post_step()
        self.length = [n + 1 for n in self.length]
        self.steps += 1

    @rule(worlds=worlds_st)
    def reset(self, worlds: list[int]) -> None:
        self.recorder.record_pre_reset(worlds)
        for w in worlds:
            self.episode[w] += 1
            self.length[w] = 0

    def _accept(self, variation: Variation, worlds: list[int], expect_ok: bool) -> torch.Tensor | None:
        before = len(self.vr[variation.name].draws)
        try:
            value = variation.sample(len(worlds), worlds)
        except VariationError:
            assert not expect_ok
            assert len(self.vr[variation.name].draws) == before
            assert len(self._samples()) == self.published
            return None
        assert expect_ok
        if worlds:
            self.published += 1
            sample = self._samples()[-1]
            assert sample.key == variation.name
            assert sample.worlds.tolist() == worlds
            assert _bytes(sample.value) == _bytes(value)
            if variation.phase == "runtime":
                assert sample.episodes.tolist() == [self.episode[w] for w in worlds]
        return value

    @rule(worlds=worlds_st)
    def draw_friction(self, worlds: list[int]) -> None:
        ok = all(self.length[w] == 0 for w in worlds)  # empty selections are no-ops
        value = self._accept(self.friction, worlds, ok)
        if value is not None:
            for i, w in enumerate(worlds):
                self.truth["friction"][(w, self.episode[w])] = _bytes(value[i])

    @rule(worlds=worlds_st)
    def draw_design(self, worlds: list[int]) -> None:
        rows_left = ROWS - self.cursor >= len(worlds)
        ok = rows_left and all(self.length[w] == 0 for w in worlds)
        value = self._accept(self.design, worlds, ok)
        if rows_left:  # the sampler took the rows, even if the recorder then refused the draw
            rows = DESIGN[self.cursor:self.cursor + len(worlds)]
            self.cursor += len(worlds)
            if value is not None:
                assert _bytes(value) == rows.tobytes()
                for i, w in enumerate(worlds):
                    self.truth["design"][(w, self.episode[w])] = rows[i].tobytes()

    @rule(worlds=worlds_st)
    def draw_mass(self, worlds: list[int]) -> None:
        ok = not worlds or (self.steps == 0 and all(self.episode[w] == 0 for w in worlds))
        value = self._accept(self.mass, worlds, ok)
        if value is not None:
            for i, w in enumerate(worlds):
                self.build[w] = _bytes(value[i])

    def _samples(self) -> list[VariationSample]:
        return [m for m in self.messages if isinstance(m, VariationSample)]

    @invariant()
    def every_episode_has_the_value_drawn_at_its_start(self) -> None:
        for key, truth in self.truth.items():
            for (w, e), expected in truth.items():
                assert _bytes(self.vr.sample_for_episode(w, e)[key].value) == expected
        for w, expected in self.build.items():
            assert _bytes(self.vr.sample_for_episode(w, self.episode[w])["mass"].value) == expected
        assert self.design.sampler.remaining == ROWS - self.cursor  # type: ignore[attr-defined]


DrawRules.TestCase.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestDrawRules = DrawRules.TestCase
