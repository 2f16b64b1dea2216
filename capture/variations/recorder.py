"""The VariationRecorder: publishes every draw of attached variations, tied to episodes."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch

from broker.messages import BUILD, RUNTIME, Label, Phase, VariationSample

from ..errors import RecorderClosedError, VariationError
from ..recorder import Recorder
from ..selectors import WorldSelector
from .records import EpisodeSample, VariationDraw, VariationRecord, VariationSummary
from .samplers import Sampler
from .variation import Variation

__all__ = ["VariationRecorder"]


class _Listener:
    """The sample listener bound to one attached variation. Holds the variation weakly."""

    __slots__ = ("__weakref__", "declared", "key", "labels", "owner", "phase", "variation")

    def __init__(self, owner: VariationRecorder, variation: Variation) -> None:
        self.owner = owner
        self.key = variation.name
        self.variation = weakref.ref(variation)
        self.phase: Phase = variation.phase
        self.labels = variation.labels
        # the sampler whose declaration the recorder holds (weakly: no cycle through it)
        self.declared: weakref.ref[Sampler[Any]] = weakref.ref(variation.sampler)

    def __call__(self, value: torch.Tensor, worlds: WorldSelector) -> None:
        variation = self.variation()
        declaration = None
        if variation is not None:  # read at draw time: apply_cfg may have changed them
            self.phase, self.labels = variation.phase, variation.labels
            if self.declared() is not variation.sampler:
                declaration = variation.declaration()
        self.owner._on_draw(self.key, self.phase, self.labels, value, worlds)
        if variation is not None and declaration is not None:  # the draw was accepted
            self.owner._recorder.declare_variation(self.key, declaration)
            self.declared = weakref.ref(variation.sampler)


class VariationRecorder:
    """Publishes each draw of the attached variations as one ``VariationSample`` on
    ``variation/<key>`` through ``recorder``, and keeps an in-memory record per key.

    A draw's worlds are normalized by the recorder, and each is tagged with the episode the
    world is in at the time of the draw: a draw made after ``record_pre_reset`` for those
    worlds belongs to their new episode. A build-time draw must come before the first step;
    it is in effect for every episode of its worlds for the whole run. A runtime draw must
    come before the first step of the episode it is for (at reset: after ``record_pre_reset``
    and before the next ``record_post_step``); one for a world whose episode has already
    stepped would silently change a factor the episode partly ran without, so it is refused
    with a :class:`VariationError` and nothing is published or recorded (the sampler has
    drawn by then).

    Declarations and seeds: ``attach`` derives the seed of every variation left without one
    from the recorder's run seed (``Variation.set_run_seed``) and registers each variation's
    declaration on the recorder (``Recorder.declare_variation``), so it travels in
    ``RunStart`` (or, if the run has already started, in ``RunEnd``). After
    ``Variation.apply_cfg`` the new declaration replaces the old one at the next accepted
    draw.

    Ownership: the published message borrows the sampler's output tensor for the delivery
    call; the in-memory record keeps copies (on the recorder's device; ``clear()`` drops
    them, ``keep_records=False`` keeps none). The recorder holds the variations weakly and
    nothing of the environment or simulator.

    Args:
        recorder: The run's recorder (run id, sequence numbers, step, episodes, broker).
        keep_records: Keep the in-memory record (``records``, ``sample_for_episode``).
    """

    def __init__(self, recorder: Recorder, *, keep_records: bool = True) -> None:
        self._recorder = recorder
        self._keep = keep_records
        self._records: dict[str, VariationRecord] = {}
        self._listeners: dict[str, _Listener] = {}

    @property
    def recorder(self) -> Recorder:
        return self._recorder

    # -- attaching -----------------------------------------------------------------------

    def attach(self, variations: Variation | Iterable[Variation]) -> tuple[str, ...]:
        """Record every draw of the enabled ``variations`` from now on (disabled ones are
        skipped). Nothing is attached if any check fails.

        Returns:
            The keys attached.

        Each attached variation whose configuration gives no seed has its seed derived from
        the recorder's run seed and its key (its sampler rebuilt if that changes the seed), and
        its declaration is registered on the recorder.

        Raises:
            VariationError: Two variations share a key, a key is already attached, or a
                variation without a seed of its own has already drawn from a seed that the
                recorder's run seed would change.
            TypeError: An item is not a :class:`Variation`.
            RecorderClosedError: The recorder is closed.
        """
        items = [variations] if isinstance(variations, Variation) else list(variations)
        seen: set[str] = set()
        run_seed = self._recorder.seed
        for v in items:
            if not isinstance(v, Variation):
                raise TypeError(f"variations: expected Variation objects, got {v!r}")
            if v.enabled and (v.name in seen or v.name in self._listeners):
                raise VariationError(f"variations: duplicate variation key {v.name!r}")
            if v.enabled:
                seen.add(v.name)
                error = v.reseed_error(run_seed)
                if error is not None:
                    raise VariationError(error)
        if self._recorder.closed:
            raise RecorderClosedError(f"attach: recorder of run {self._recorder.run!r} is closed")
        enabled = [v for v in items if v.enabled]
        for v in enabled:
            v.set_run_seed(run_seed)
            listener = _Listener(self, v)
            v.add_sample_listener(listener)
            self._listeners[v.name] = listener
            self._records.setdefault(v.name, VariationRecord(v.name))
            self._recorder.declare_variation(v.name, v.declaration())
        return tuple(v.name for v in enabled)

    def detach(self, key: str | None = None) -> None:
        """Stop recording variation ``key`` (all when ``None``); records are kept."""
        keys = list(self._listeners) if key is None else [key]
        for k in keys:
            listener = self._listeners.pop(k, None)
            if listener is None:
                raise KeyError(f"key: no attached variation {k!r}")
            variation = listener.variation()
            if variation is not None:
                variation.remove_sample_listener(listener)

    @property
    def attached(self) -> tuple[str, ...]:
        """Keys whose draws are being recorded."""
        return tuple(self._listeners)

    # -- the draw path -------------------------------------------------------------------

    def _on_draw(
        self,
        key: str,
        phase: Phase,
        labels: tuple[Label, ...] | None,
        value: torch.Tensor,
        worlds: WorldSelector,
    ) -> None:
        rec = self._recorder
        if rec.closed:
            raise RecorderClosedError(f"variation {key!r}: recorder of run {rec.run!r} is closed")
        idx = rec.select(worlds)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != idx.numel():
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise VariationError(
                f"variation {key!r}: expected a draw with a leading dimension of {idx.numel()} "
                f"(one value per selected world), got {shape}"
            )
        if idx.numel() == 0:
            return
        episodes = rec.episodes_of(idx)
        if phase == BUILD and (rec.step != 0 or bool(episodes.any())):
            raise VariationError(
                f"variation {key!r}: expected build-time draws before the first step and first "
                f"reset, got one at step {rec.step}; use phase 'runtime' for draws at resets"
            )
        if phase == RUNTIME:
            self._check_episode_start(key, idx)
        rec.start()  # RunStart takes its sequence number before this sample does
        if value.device != rec.device:
            value = value.to(rec.device)
        message = VariationSample(rec.run, rec.next_seq(), rec.step, key, phase, idx, episodes,
                                  value, labels)
        if self._keep:
            self._records[key].append(VariationDraw(
                message.seq, message.step, phase, idx.clone(), episodes.clone(),
                value.detach().clone(), labels,
            ))
        rec.publish(message)

    def _check_episode_start(self, key: str, idx: torch.Tensor) -> None:
        """Refuse a runtime draw for worlds whose current episode has already stepped."""
        rec = self._recorder
        lengths = rec.lengths_of(idx)
        stepped = lengths > 0
        step = rec.step

        def late(count: int) -> VariationError:
            return VariationError(
                f"variation {key!r}: a runtime draw at step {step} was for {count} world(s) whose current "
                f"episode had already stepped (checked on the device, so reported after the draw, "
                f"which was recorded; Recorder(worlds_check='host') names them at the draw); a "
                f"runtime value holds for a whole episode, so draw it at reset")

        if rec._defer_check(stepped.sum(), late):  # read later, without a device sync
            return
        if not bool(stepped.any()):
            return
        worlds, steps = idx[stepped].tolist(), lengths[stepped].tolist()
        shown = ", ".join(f"world {w} (at step {s} of its episode)" for w, s in zip(worlds[:8], steps[:8], strict=True))
        more = f" and {len(worlds) - 8} more" if len(worlds) > 8 else ""
        raise VariationError(
            f"variation {key!r}: a runtime draw at step {rec.step} for worlds whose current "
            f"episode has already stepped: {shown}{more}; a runtime value holds for a whole "
            f"episode, so draw it at reset, after record_pre_reset(worlds) and before the first "
            f"step of the new episode (or use phase 'build' for a value fixed for the run)"
        )

    # -- the record ----------------------------------------------------------------------

    @property
    def records(self) -> Mapping[str, VariationRecord]:
        """Key -> record, for every key ever attached (read-only view)."""
        return MappingProxyType(self._records)

    def __getitem__(self, key: str) -> VariationRecord:
        return self._records[key]

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        """Drop every kept draw (the keys stay)."""
        for record in self._records.values():
            record.clear()

    def summary(self) -> dict[str, VariationSummary]:
        """Key -> count, per-world shape, first and last draw."""
        return {key: record.summary() for key, record in self._records.items()}

    def details(self) -> dict[str, tuple[VariationDraw, ...]]:
        """Key -> every draw, in draw order."""
        return {key: record.draws for key, record in self._records.items()}

    def sample_for_episode(self, world: int, episode: int) -> dict[str, EpisodeSample]:
        """Key -> the value in effect for that episode of that world (the run-time draw made
        at its start, else the build-time value); keys without one are left out."""
        found = {k: r.sample_for_episode(world, episode) for k, r in self._records.items()}
        return {k: s for k, s in found.items() if s is not None}

    def report(self) -> str:
        """A human-readable summary, one line per key."""
        lines = [f"variations of run {self._recorder.run!r}:"]
        for key, s in self.summary().items():
            if s.first is None or s.last is None:
                lines.append(f"  {key}: no draws")
                continue
            lines.append(
                f"  {key}: {s.count} draws, {s.samples} values of shape {s.shape}, "
                f"first at step {s.first.step} ({s.first.phase}), last at step {s.last.step}"
            )
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"VariationRecorder(run={self._recorder.run!r}, keys={list(self._records)})"
