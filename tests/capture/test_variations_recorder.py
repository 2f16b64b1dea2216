"""VariationRecorder: publishing draws tied to episodes, the in-memory record, no env leak."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch

from broker import Broker, Message, VariationSample
from capture import Recorder
from capture.errors import RecorderClosedError, SelectorError
from capture.variations import (
    ChoiceCfg,
    UniformCfg,
    Variation,
    VariationCfg,
    VariationError,
    VariationRecorder,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _setup(num_worlds: int = 4, device: str = "cpu") -> tuple[Recorder, list[Message]]:
    broker = Broker(strict=True)
    messages: list[Message] = []
    broker.subscribe("", messages.append)
    return Recorder(num_worlds, device, broker, run="r1"), messages


def _samples(messages: list[Message]) -> list[VariationSample]:
    return [m for m in messages if isinstance(m, VariationSample)]


def _var(name: str, sampler: UniformCfg | ChoiceCfg, phase: str = "runtime",
         enabled: bool = True, device: str = "cpu") -> Variation:
    return Variation(name, VariationCfg(sampler=sampler, phase=phase,  # type: ignore[arg-type]
                                        enabled=enabled), device=device)


def test_each_draw_publishes_one_sample_with_worlds_and_episodes() -> None:
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1, seed=1))
    vr = VariationRecorder(recorder)
    assert vr.attach([friction]) == ("friction",)
    first = friction.sample(4)
    recorder.record_post_step()
    recorder.record_pre_reset([2, 0])
    second = friction.sample(2, torch.tensor([2, 0]))
    samples = _samples(messages)
    assert len(samples) == 2
    a, b = samples
    assert (a.run, a.step, a.key, a.phase, a.topic) == ("r1", 0, "friction", "runtime",
                                                        "variation/friction")
    assert a.worlds.tolist() == [0, 1, 2, 3]
    assert a.episodes.tolist() == [0, 0, 0, 0]
    assert a.value is first  # published borrowed, not copied
    assert a.labels is None
    assert b.step == 1
    assert b.worlds.tolist() == [2, 0]
    assert b.episodes.tolist() == [1, 1]  # drawn after pre_reset: the new episode
    assert torch.equal(b.value, second)
    seqs = [m.seq for m in messages]  # run/start, sample, episode/end, sample
    assert seqs == sorted(seqs)
    assert len(set(seqs)) == len(seqs)
    assert messages[0].topic == "run/start"


def test_a_draw_before_the_reset_belongs_to_the_ending_episode() -> None:
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1))
    VariationRecorder(recorder).attach(friction)
    friction.sample(1, 3)
    recorder.record_pre_reset(3)
    friction.sample(1, 3)
    assert [s.episodes.tolist() for s in _samples(messages)] == [[0], [1]]


def test_attach_skips_disabled_and_rejects_duplicate_keys_atomically() -> None:
    recorder, messages = _setup()
    vr = VariationRecorder(recorder)
    on = _var("mass", UniformCfg(0, 1))
    off = _var("light", UniformCfg(0, 1), enabled=False)
    assert vr.attach([on, off]) == ("mass",)
    assert "mass" in vr
    assert "light" not in vr
    off.sample(4)
    assert _samples(messages) == []
    other = _var("other", UniformCfg(0, 1))
    with pytest.raises(VariationError, match=r"variations: duplicate variation key 'mass'"):
        vr.attach([other, _var("mass", UniformCfg(0, 1))])
    assert "other" not in vr  # nothing attached when the check fails
    with pytest.raises(VariationError, match=r"duplicate variation key 'x'"):
        vr.attach([_var("x", UniformCfg(0, 1)), _var("x", UniformCfg(0, 2))])
    with pytest.raises(TypeError, match=r"variations: expected Variation objects"):
        vr.attach([object()])  # type: ignore[list-item]


def test_draw_size_and_selector_are_checked() -> None:
    recorder, _ = _setup()
    friction = _var("friction", UniformCfg(0, 1))
    VariationRecorder(recorder).attach(friction)
    with pytest.raises(VariationError, match=r"variation 'friction': expected a draw with a "
                                             r"leading dimension of 2 .*got \(3,\)"):
        friction.sample(3, [0, 1])
    with pytest.raises(SelectorError, match=r"worlds: expected world indices in \[0, 4\)"):
        friction.sample(1, 9)


def test_empty_selection_publishes_nothing() -> None:
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1))
    vr = VariationRecorder(recorder)
    vr.attach(friction)
    friction.sample(0, [])
    assert messages == []
    assert vr["friction"].count == 0


def test_build_draws_must_precede_the_first_step() -> None:
    recorder, _ = _setup()
    mass = _var("mass", UniformCfg(1, 2, seed=1), phase="build")
    vr = VariationRecorder(recorder)
    vr.attach(mass)
    mass.sample(2, [0, 1])
    mass.sample(2, [2, 3])  # in chunks is fine
    redrawn = mass.sample(1, 0).clone()  # a redraw during setup replaces the earlier value
    assert torch.equal(vr.sample_for_episode(0, 0)["mass"].value, redrawn[0])
    recorder.record_post_step()
    with pytest.raises(VariationError, match=r"expected build-time draws before the first step "
                                             r"and first reset, got one at step 1"):
        mass.sample(4)


def test_record_summary_details_and_lookup() -> None:
    recorder, _ = _setup()
    mass = _var("mass", UniformCfg([1, 2], [2, 3], seed=1), phase="build")
    friction = _var("friction", UniformCfg(0, 1, seed=2))
    vr = VariationRecorder(recorder)
    vr.attach([mass, friction])
    m = mass.sample(4).clone()
    f0 = friction.sample(4).clone()
    recorder.record_post_step()
    recorder.record_pre_reset([1])
    f1 = friction.sample(1, [1]).clone()
    assert set(vr) == {"mass", "friction"}
    assert len(vr) == 2
    assert set(vr.records) == {"mass", "friction"}
    summary = vr.summary()
    assert (summary["mass"].count, summary["mass"].samples, summary["mass"].shape) == (1, 4, (2,))
    s = summary["friction"]
    assert (s.count, s.samples, s.shape) == (2, 5, ())
    assert s.first is not None
    assert s.last is not None
    assert torch.equal(s.first.value, f0)
    assert torch.equal(s.last.value, f1)
    assert s.last.episodes.tolist() == [1]
    assert [d.step for d in vr.details()["friction"]] == [0, 1]
    got = vr.sample_for_episode(1, 1)
    assert torch.equal(got["friction"].value, f1[0])
    assert got["friction"].phase == "runtime"
    assert torch.equal(got["mass"].value, m[1])  # build-time value applies to every episode
    assert got["mass"].phase == "build"
    assert torch.equal(vr.sample_for_episode(1, 0)["friction"].value, f0[1])
    assert set(vr.sample_for_episode(0, 1)) == {"mass"}  # no run-time draw for it yet
    assert "friction: 2 draws, 5 values of shape ()" in vr.report()
    vr.clear()
    assert vr["friction"].count == 0


def test_records_are_copies_of_what_the_caller_and_consumers_may_overwrite() -> None:
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1, seed=3))
    vr = VariationRecorder(recorder)
    vr.attach(friction)
    worlds = torch.tensor([3, 1])
    value = friction.sample(2, worlds)
    expected = value.clone()
    value.fill_(-1.0)  # the simulator reuses its buffer
    worlds.copy_(torch.tensor([0, 2]))  # and its index tensor
    sample = _samples(messages)[0]
    sample.episodes.fill_(7)  # a misbehaving consumer
    draw = vr["friction"].draws[0]
    assert torch.equal(draw.value, expected)
    assert draw.worlds.tolist() == [3, 1]
    assert draw.episodes.tolist() == [0, 0]
    got = vr.sample_for_episode(3, 0)["friction"].value
    got.fill_(5.0)  # lookups hand out copies too
    assert torch.equal(vr["friction"].draws[0].value, expected)


def test_categorical_samples_keep_codes_and_labels() -> None:
    recorder, messages = _setup(num_worlds=6)
    obj = _var("object", ChoiceCfg([{"usd": "cube.usd"}, {"usd": "mug.usd"}, {"usd": "ball"}],
                                   labels=["cube", "mug", "ball"], seed=5))
    vr = VariationRecorder(recorder)
    vr.attach(obj)
    codes = obj.sample(6).clone()
    sample = _samples(messages)[0]
    assert sample.labels == ("cube", "mug", "ball")
    assert torch.equal(sample.value, codes)
    assert sample.value.dtype == torch.int64
    for world in range(6):
        got = vr.sample_for_episode(world, 0)["object"]
        assert int(got.value) == int(codes[world])
        assert got.label == ("cube", "mug", "ball")[int(codes[world])]
    obj.apply_cfg(VariationCfg(sampler=ChoiceCfg(["red", "blue"], seed=1)))
    obj.sample(1, 0)  # labels follow the new configuration
    assert _samples(messages)[-1].labels == ("red", "blue")


def test_detach_and_keep_records_false() -> None:
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1))
    vr = VariationRecorder(recorder)
    vr.attach(friction)
    friction.sample(4)
    vr.detach("friction")
    friction.sample(4)
    assert len(_samples(messages)) == 1
    assert vr.attached == ()
    assert vr["friction"].count == 1
    with pytest.raises(KeyError, match="no attached variation 'friction'"):
        vr.detach("friction")
    light = VariationRecorder(recorder, keep_records=False)
    light.attach(friction)
    friction.sample(4)
    assert len(_samples(messages)) == 2
    assert light["friction"].count == 0


def test_draw_after_close_raises() -> None:
    recorder, _ = _setup()
    friction = _var("friction", UniformCfg(0, 1))
    VariationRecorder(recorder).attach(friction)
    recorder.close()
    with pytest.raises(RecorderClosedError, match=r"variation 'friction': recorder of run 'r1'"):
        friction.sample(4)


def test_simulated_loop_every_episode_carries_the_samples_drawn_at_its_start() -> None:
    n = 6
    recorder, messages = _setup(num_worlds=n)
    mass = _var("mass", UniformCfg([1, 2, 3], [2, 3, 4], seed=1), phase="build")
    friction = _var("friction", UniformCfg(0.1, 1.0, seed=2))
    obj = _var("object", ChoiceCfg(["cube", "ball", "mug"], seed=3))
    vr = VariationRecorder(recorder)
    vr.attach([mass, friction, obj])
    episode = [0] * n
    truth: dict[tuple[int, int], tuple[float, str]] = {}

    def draw(worlds: list[int]) -> None:
        f = friction.sample(len(worlds), worlds)
        o = obj.sample(len(worlds), worlds)
        for i, w in enumerate(worlds):
            truth[(w, episode[w])] = (float(f[i]), ("cube", "ball", "mug")[int(o[i])])
        f.fill_(-1.0)  # the simulator consumes and overwrites the draws
        o.fill_(0)

    built = mass.sample(n)
    build_value = built.clone()
    built.zero_()
    draw(list(range(n)))
    rng = random.Random(0)
    age = [0] * n
    life = [rng.randint(2, 6) for _ in range(n)]
    for _ in range(40):
        recorder.record_pre_step()
        recorder.record_post_step()
        age = [a + 1 for a in age]
        done = [w for w in range(n) if age[w] >= life[w]]
        if done:
            recorder.record_pre_reset(done, success=torch.ones(len(done), dtype=torch.bool))
            for w in done:
                episode[w] += 1
                age[w], life[w] = 0, rng.randint(2, 6)
            draw(done)
            recorder.record_post_reset(done)
    ended = [(w, e) for m in messages if m.topic == "episode/end"
             for w, e in zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)]  # type: ignore[union-attr]
    assert len(ended) > 3 * n
    assert len({w for w, _ in ended}) == n
    for w, e in ended:
        got = vr.sample_for_episode(w, e)
        assert float(got["friction"].value) == truth[(w, e)][0]
        assert got["object"].label == truth[(w, e)][1]
        assert torch.equal(got["mass"].value, build_value[w])
    assert vr["mass"].count == 1


class _Env:
    """An environment whose variation refers back to it (as a scene-editing one would)."""

    def __init__(self, cyclic: bool) -> None:
        self.recorder = Recorder(4, run="env")
        self.payload = torch.zeros(1000)
        self.friction = _var("friction", UniformCfg(0, 1))
        if cyclic:
            self.friction.env = self  # type: ignore[attr-defined]
        self.variations_recorder = VariationRecorder(self.recorder)
        self.variations_recorder.attach([self.friction])
        self.friction.sample(4)


def test_dropping_the_environment_frees_it_while_the_recorder_is_kept() -> None:
    env = _Env(cyclic=True)
    ref = weakref.ref(env)
    vr = env.variations_recorder
    del env
    gc.collect()
    assert ref() is None
    assert vr["friction"].count == 1  # the record outlives the environment


def test_the_recorder_adds_no_reference_cycle_through_the_environment() -> None:
    gc.collect()
    gc.disable()
    try:
        env = _Env(cyclic=False)
        ref = weakref.ref(env)
        del env
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()


@pytest.mark.cuda
@cuda
def test_cuda_draws_are_published_and_recorded_on_the_device() -> None:
    recorder, messages = _setup(device="cuda")
    friction = _var("friction", UniformCfg(0, 1), device="cuda")
    vr = VariationRecorder(recorder)
    vr.attach(friction)
    friction.sample(2, [1, 3])
    sample = _samples(messages)[0]
    assert sample.value.device.type == "cuda"
    assert sample.worlds.device.type == "cuda"
    assert vr["friction"].draws[0].value.device.type == "cuda"
    assert vr.sample_for_episode(3, 0)["friction"].value.device.type == "cuda"


def test_a_runtime_draw_in_the_middle_of_an_episode_is_refused() -> None:
    """Catches a runtime draw for a world whose episode has already stepped being accepted:
    it was tagged with that episode and silently replaced the factor the episode had run
    with (the table then showed a value the episode ran with for part of its steps only)."""
    recorder, messages = _setup()
    friction = _var("friction", UniformCfg(0, 1, seed=1))
    vr = VariationRecorder(recorder)
    vr.attach(friction)
    start = friction.sample(4).clone()  # before the first step: fine
    recorder.record_pre_step()
    recorder.record_post_step()
    recorder.record_pre_reset([2])
    recorder.record_post_reset([2])
    with pytest.raises(VariationError, match=r"variation 'friction': a runtime draw at step 1 for "
                                             r"worlds whose current episode has already stepped: "
                                             r"world 0 \(at step 1 of its episode\), world 3 \(at "
                                             r"step 1 of its episode\); .* draw it at reset, after "
                                             r"record_pre_reset\(worlds\) and before the first step"):
        friction.sample(3, [0, 2, 3])
    assert [s.value.tolist() for s in _samples(messages)] == [start.tolist()]  # nothing published
    assert vr["friction"].count == 1
    assert torch.equal(vr.sample_for_episode(0, 0)["friction"].value, start[0])
    fresh = friction.sample(1, [2])  # world 2 has just reset: its new episode has not stepped
    assert _samples(messages)[-1].episodes.tolist() == [1]
    assert torch.equal(vr.sample_for_episode(2, 1)["friction"].value, fresh[0])


def test_a_mid_episode_refusal_lists_at_most_eight_worlds() -> None:
    recorder, _ = _setup(num_worlds=20)
    friction = _var("friction", UniformCfg(0, 1))
    VariationRecorder(recorder).attach(friction)
    recorder.record_post_step()
    recorder.record_post_step()
    with pytest.raises(VariationError, match=r"world 7 \(at step 2 of its episode\) and 12 more;"):
        friction.sample(20)


@pytest.mark.cuda
@cuda
def test_cuda_mid_episode_runtime_draw_is_reported_without_a_sync() -> None:
    """On CUDA the mid-episode check is read back without a device sync: a draw for worlds
    whose episode has stepped is reported by check_worlds() (or a later call), not lost."""
    recorder, _ = _setup(device="cuda")
    friction = _var("friction", UniformCfg(0, 1), device="cuda")
    VariationRecorder(recorder).attach(friction)
    recorder.record_post_step()
    recorder.record_pre_reset(torch.tensor([2], device="cuda"))
    fresh, stepped = torch.tensor([2], device="cuda"), torch.tensor([0, 2], device="cuda")  # copies that sync
    sync_mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        friction.sample(1, fresh)  # fresh episode: sound
        friction.sample(2, stepped)  # world 0 has stepped
    finally:
        torch.cuda.set_sync_debug_mode(sync_mode)
    with pytest.raises(VariationError, match=r"variation 'friction': a runtime draw at step 1 was for 1 "
                                             r"world\(s\) whose current episode had already stepped"):
        recorder.check_worlds()
    recorder.check_worlds()  # reported once
