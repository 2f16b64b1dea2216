"""The VariationRecorder: publishes every draw of attached variations, tied to episodes."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import torch

from broker.messages import BUILD, Label, Phase, VariationSample

from ..errors import RecorderClosedError, VariationError
from ..recorder import Recorder
from ..selectors import WorldSelector
from .records import EpisodeSample, VariationDraw, VariationRecord, VariationSummary
from .variation import Variation

__all__ = ["VariationRecorder"]


class _Listener:
    """The sample listener bound to one attached variation. Holds the variation weakly."""

    __slots__ = ("__weakref__", "key", "labels", "owner", "phase", "variation")

    def __init__(self, owner: VariationRecorder, variation: Variation) -> None:
        self.owner = owner
        self.key = variation.name
        self.variation = weakref.ref(variation)
        self.phase: Phase = variation.phase
        self.labels = variation.labels

    def __call__(self, value: torch.Tensor, worlds: WorldSelector) -> None:
        variation = self.variation()
        if variation is not None:  # read at draw time: apply_cfg may have changed them
            self.phase, self.labels = variation.phase, variation.labels
        self.owner._on_draw(self.key, self.phase, self.labels, value, worlds)


class VariationRecorder:
    """Publishes each draw of the attached variations as one ``VariationSample`` on
    ``variation/<key>`` through ``recorder``, and keeps an in-memory record per key.

    A draw's worlds are normalized by the recorder, and each is tagged with the episode the
    world is in at the time of the draw: a draw made after ``record_pre_reset`` for those
    worlds belongs to their new episode. A build-time draw must come before the first step;
    it is in effect for every episode of its worlds for the whole run.

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

        Raises:
            VariationError: Two variations share a key, or a key is already attached.
            TypeError: An item is not a :class:`Variation`.
        """
        items = [variations] if isinstance(variations, Variation) else list(variations)
        seen: set[str] = set()
        for v in items:
            if not isinstance(v, Variation):
                raise TypeError(f"variations: expected Variation objects, got {v!r}")
            if v.enabled and (v.name in seen or v.name in self._listeners):
                raise VariationError(f"variations: duplicate variation key {v.name!r}")
            if v.enabled:
                seen.add(v.name)
        enabled = [v for v in items if v.enabled]
        for v in enabled:
            listener = _Listener(self, v)
            v.add_sample_listener(listener)
            self._listeners[v.name] = listener
            self._records.setdefault(v.name, VariationRecord(v.name))
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
        rec.start()  # RunStart takes its sequence number before this sample does
        episodes = rec.episodes_of(idx)
        if phase == BUILD and (rec.step != 0 or bool(episodes.any())):
            raise VariationError(
                f"variation {key!r}: expected build-time draws before the first step and first "
                f"reset, got one at step {rec.step}; use phase 'runtime' for draws at resets"
            )
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
