"""Preallocated batched buffers behind :class:`consumers.Retention`.

Two layouts, one per kind of topic:

- :class:`SharedAxisBuffer` for topics recorded every step. All worlds share one time axis: a
  ring of ``capacity`` slots, each slot ``[worlds, ...]``. A step's batch is one contiguous copy
  per field into the next slot; each world only remembers (on the device) the absolute time at
  which its current episode started. The host tracks a lower bound of the oldest live start,
  so an ordinary append never reads the device; only when the ring looks full is the true
  oldest start read, and the ring grows geometrically if it really is full.
- :class:`PerWorldBuffer` for topics recorded only at resets (initial state at post_reset,
  final state at pre_reset). Each world has its own write counter on the device and rows are
  scattered to ``[counter[w], w]``; a host upper bound of the largest counter gates growth.

Neither runs a Python loop over worlds when appending.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .errors import RetentionError

__all__ = ["PerWorldBuffer", "SharedAxisBuffer"]


def _check_fields(topic: str, bufs: Mapping[str, torch.Tensor], fields: Mapping[str, torch.Tensor]) -> None:
    if bufs.keys() != fields.keys():
        raise RetentionError(f"topic {topic!r}: expected fields {sorted(bufs)}, got {sorted(fields)}")
    for name, t in fields.items():
        b = bufs[name]
        if t.dtype != b.dtype or t.shape[1:] != b.shape[2:]:
            raise RetentionError(
                f"topic {topic!r} field {name!r}: expected {b.dtype} per-world shape "
                f"{tuple(b.shape[2:])}, got {t.dtype} per-world shape {tuple(t.shape[1:])}"
            )


class _Buffer:
    def __init__(
        self, topic: str, num_worlds: int, capacity: int, fields: Mapping[str, torch.Tensor],
        growth: float,
    ) -> None:
        self.topic = topic
        self.growth = growth
        self.num_worlds = num_worlds
        self.capacity = capacity
        first = next(iter(fields.values()))
        self.device = first.device
        self.bufs: dict[str, torch.Tensor] = {
            name: torch.empty((capacity, num_worlds, *t.shape[1:]), dtype=t.dtype, device=t.device)
            for name, t in fields.items()
        }

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def _grown(self, needed: int, growth: float) -> int:
        cap = self.capacity
        while cap < needed:
            cap = max(cap + 1, int(cap * growth))
        return cap


class SharedAxisBuffer(_Buffer):
    """Ring of ``[capacity, worlds, ...]`` slots on one time axis shared by all worlds."""

    def __init__(
        self, topic: str, num_worlds: int, capacity: int, fields: Mapping[str, torch.Tensor],
        growth: float,
    ) -> None:
        super().__init__(topic, num_worlds, capacity, fields, growth)
        self.time = 0  # absolute number of appends (host)
        self.start = torch.zeros(num_worlds, dtype=torch.int64, device=self.device)
        self._oldest = 0  # host lower bound of start.min()
        self.valid: torch.Tensor | None = None  # [capacity, worlds] once a partial batch arrived
        self._slots = self._slot_views()

    def _slot_views(self) -> list[list[torch.Tensor]]:
        bufs = list(self.bufs.values())
        return [[b[i] for b in bufs] for i in range(self.capacity)]

    def append(self, worlds: torch.Tensor, fields: Mapping[str, torch.Tensor], full: bool) -> None:
        if self.time - self._oldest >= self.capacity:
            self._make_room()
        slot = self.time % self.capacity
        if full:
            _check_fields(self.topic, self.bufs, fields)
            torch._foreach_copy_(self._slots[slot], list(fields.values()))
            if self.valid is not None:
                self.valid[slot] = True
        else:
            _check_fields(self.topic, self.bufs, fields)
            for name, t in fields.items():
                self.bufs[name][slot].index_copy_(0, worlds, t)
            if self.valid is None:
                self.valid = torch.ones(
                    (self.capacity, self.num_worlds), dtype=torch.bool, device=self.device
                )
            self.valid[slot] = False
            self.valid[slot].index_fill_(0, worlds, True)
        self.time += 1

    def _make_room(self) -> None:
        # The only device read on the append path, once per ``capacity`` appends at most.
        self._oldest = int(self.start.min())
        live = self.time - self._oldest
        if live < self.capacity:
            return
        new_cap = self._grown(live + 1, self.growth)
        times = torch.arange(self._oldest, self.time, device=self.device)
        old_slots, new_slots = times % self.capacity, times % new_cap
        for name, b in self.bufs.items():
            nb = torch.empty((new_cap, *b.shape[1:]), dtype=b.dtype, device=b.device)
            nb.index_copy_(0, new_slots, b.index_select(0, old_slots))
            self.bufs[name] = nb
        if self.valid is not None:
            nv = torch.ones((new_cap, self.num_worlds), dtype=torch.bool, device=self.device)
            nv.index_copy_(0, new_slots, self.valid.index_select(0, old_slots))
            self.valid = nv
        self.capacity = new_cap
        self._slots = self._slot_views()

    def restart(self, worlds: torch.Tensor) -> None:
        """Start a new episode for ``worlds`` at the current time (their rows become free)."""
        self.start.index_fill_(0, worlds, self.time)

    def length(self, world: int) -> int:
        return self.time - int(self.start[world])

    def read(self, world: int) -> dict[str, torch.Tensor]:
        """An owned ``[T, ...]`` copy of ``world``'s current episode, per field."""
        begin = int(self.start[world])
        slots = torch.arange(begin, self.time, device=self.device) % self.capacity
        keep: torch.Tensor | None = None
        if self.valid is not None:
            keep = self.valid[:, world].index_select(0, slots)
            slots = slots[keep]
        return {name: b[:, world].index_select(0, slots) for name, b in self.bufs.items()}


class PerWorldBuffer(_Buffer):
    """``[capacity, worlds, ...]`` rows written at per-world counters kept on the device."""

    def __init__(
        self, topic: str, num_worlds: int, capacity: int, fields: Mapping[str, torch.Tensor],
        growth: float,
    ) -> None:
        super().__init__(topic, num_worlds, capacity, fields, growth)
        self.count = torch.zeros(num_worlds, dtype=torch.int64, device=self.device)
        self._highest = 0  # host upper bound of count.max()

    def append(self, worlds: torch.Tensor, fields: Mapping[str, torch.Tensor], full: bool) -> None:
        if self._highest >= self.capacity:
            self._make_room()
        _check_fields(self.topic, self.bufs, fields)
        pos = self.count.index_select(0, worlds)
        for name, t in fields.items():
            self.bufs[name].index_put_((pos, worlds), t)
        self.count.index_add_(0, worlds, torch.ones_like(worlds))
        self._highest += 1

    def _make_room(self) -> None:
        self._highest = int(self.count.max())
        if self._highest < self.capacity:
            return
        new_cap = self._grown(self._highest + 1, self.growth)
        for name, b in self.bufs.items():
            nb = torch.empty((new_cap, *b.shape[1:]), dtype=b.dtype, device=b.device)
            nb[: self.capacity].copy_(b)
            self.bufs[name] = nb
        self.capacity = new_cap

    def restart(self, worlds: torch.Tensor) -> None:
        self.count.index_fill_(0, worlds, 0)

    def length(self, world: int) -> int:
        return int(self.count[world])

    def read(self, world: int) -> dict[str, torch.Tensor]:
        n = int(self.count[world])
        return {name: b[:n, world].clone() for name, b in self.bufs.items()}
