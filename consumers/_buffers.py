"""Preallocated batched buffers behind :class:`consumers.Retention`.

Two layouts, one per kind of topic:

- :class:`SharedAxisBuffer` for topics recorded every step. All worlds share one time axis: a
  ring of ``capacity`` slots, each slot ``[worlds, ...]``. A step's batch is one contiguous copy
  per field into the next slot, its rows in the order the batch has them; a ``[capacity,
  worlds]`` map on the device records which row of each slot holds which world (``-1``: none).
  Each world only remembers (on the device) the absolute time at which its current episode
  started. The host tracks a lower bound of the oldest live start, so an ordinary append never
  reads the device; only when the ring looks full is the true oldest start read, and the ring
  grows so that the next such read is at least ``capacity / 2`` appends away.
- :class:`PerWorldBuffer` for topics recorded only at resets (initial state at post_reset,
  final state at pre_reset). Each world has its own write counter on the device and rows are
  scattered to ``[counter[w], w]``; a host upper bound of the largest counter gates growth, with
  the same ``capacity / 2`` spacing of reads.

Fields are matched to their buffers by name through the topic's :class:`broker.TopicSchema`,
never by position. Nothing of a batch (fields, worlds) is referenced after ``append`` returns:
the worlds tensor is only read through device ops, so a publisher may refill it in place.
Neither layout runs a Python loop over worlds when appending.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from broker import SchemaError, TopicSchema

from .errors import RetentionSchemaError

__all__ = ["PerWorldBuffer", "SharedAxisBuffer"]


class _Buffer:
    """``[capacity, worlds, ...]`` tensors, one per field of ``schema``, in its canonical order."""

    def __init__(
        self, topic: str, schema: TopicSchema, num_worlds: int, capacity: int, device: torch.device,
        growth: float,
    ) -> None:
        self.topic = topic
        self.schema = schema
        self.growth = growth
        self.num_worlds = num_worlds
        self.capacity = capacity
        self.device = device
        self.bufs: dict[str, torch.Tensor] = {
            name: torch.empty((capacity, num_worlds, *spec.shape), dtype=spec.torch_dtype, device=device)
            for name, spec in schema.fields.items()
        }

    def check(self, worlds: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> None:
        """Check ``fields`` against the schema by name, with ``len(worlds)`` leading rows.

        Raises:
            RetentionSchemaError: The fields do not match.
        """
        try:
            self.schema.check(fields, topic=self.topic, rows=worlds.shape[0])
        except SchemaError as exc:
            raise RetentionSchemaError(str(exc)) from exc

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())

    def _grown(self, needed: int) -> int:
        cap = self.capacity
        while cap < needed:
            cap = max(cap + 1, int(cap * self.growth))
        return cap


class SharedAxisBuffer(_Buffer):
    """Ring of ``[capacity, worlds, ...]`` slots on one time axis shared by all worlds."""

    def __init__(
        self, topic: str, schema: TopicSchema, num_worlds: int, capacity: int, device: torch.device,
        growth: float,
    ) -> None:
        super().__init__(topic, schema, num_worlds, capacity, device, growth)
        self.time = 0  # absolute number of appends (host)
        self.start = torch.zeros(num_worlds, dtype=torch.int64, device=device)
        self._oldest = 0  # host lower bound of start.min()
        # row[slot, w]: the row of slot ``slot`` holding world w's data, -1 when none does.
        self.row = torch.full((capacity, num_worlds), -1, dtype=torch.int32, device=device)
        self._rows = torch.arange(num_worlds, dtype=torch.int32, device=device)
        self._slots = self._slot_views()

    def _slot_views(self) -> list[list[torch.Tensor]]:
        bufs = list(self.bufs.values())
        return [[b[i] for b in bufs] for i in range(self.capacity)]

    def nbytes(self) -> int:
        return super().nbytes() + self.row.numel() * self.row.element_size()

    def append(self, worlds: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> None:
        """Copy ``fields`` (``len(worlds)`` rows, borrowed) into the next slot.

        ``worlds`` is an int64 index tensor on this buffer's device, of distinct worlds.
        """
        self.check(worlds, fields)
        k = worlds.shape[0]
        if k == 0:
            return
        if self.time - self._oldest >= self.capacity:
            self._make_room()
        slot = self.time % self.capacity
        dst = self._slots[slot]
        row = self.row[slot]
        if k != self.num_worlds:
            dst = [d[:k] for d in dst]
            row.fill_(-1)
        # A batch of every world is a permutation of them: each entry of ``row`` is written.
        torch._foreach_copy_(dst, self.schema.ordered(fields))
        row.index_copy_(0, worlds, self._rows[:k])
        self.time += 1

    def _make_room(self) -> None:
        # The only device read on the append path. After it, the ring holds at least twice
        # the live span, so the next read is at least capacity / 2 appends away (with fixed
        # episode lengths just under the capacity it would otherwise come every few appends).
        self._oldest = int(self.start.min())
        live = self.time - self._oldest
        if 2 * live <= self.capacity:
            return
        new_cap = self._grown(2 * live)
        times = torch.arange(self._oldest, self.time, device=self.device)
        old_slots, new_slots = times % self.capacity, times % new_cap
        for name, b in self.bufs.items():
            nb = torch.empty((new_cap, *b.shape[1:]), dtype=b.dtype, device=b.device)
            nb.index_copy_(0, new_slots, b.index_select(0, old_slots))
            self.bufs[name] = nb
        row = torch.full((new_cap, self.num_worlds), -1, dtype=self.row.dtype, device=self.device)
        row.index_copy_(0, new_slots, self.row.index_select(0, old_slots))
        self.row = row
        self.capacity = new_cap
        self._slots = self._slot_views()

    def restart(self, worlds: torch.Tensor) -> None:
        """Start a new episode for ``worlds`` at the current time (their rows become free)."""
        self.start.index_fill_(0, worlds, self.time)

    def _episode_rows(self, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.arange(int(self.start[world]), self.time, device=self.device) % self.capacity
        rows = self.row[:, world].index_select(0, slots)
        keep = rows >= 0
        return slots[keep], rows[keep].long()

    def length(self, world: int) -> int:
        return int(self._episode_rows(world)[0].shape[0])

    def read(self, world: int) -> dict[str, torch.Tensor]:
        """An owned ``[T, ...]`` copy of ``world``'s current episode, per field."""
        slots, rows = self._episode_rows(world)
        return {name: b[slots, rows] for name, b in self.bufs.items()}


class PerWorldBuffer(_Buffer):
    """``[capacity, worlds, ...]`` rows written at per-world counters kept on the device."""

    def __init__(
        self, topic: str, schema: TopicSchema, num_worlds: int, capacity: int, device: torch.device,
        growth: float,
    ) -> None:
        super().__init__(topic, schema, num_worlds, capacity, device, growth)
        self.count = torch.zeros(num_worlds, dtype=torch.int64, device=device)
        self._ones = torch.ones(num_worlds, dtype=torch.int64, device=device)
        self._highest = 0  # host upper bound of count.max()

    def append(self, worlds: torch.Tensor, fields: Mapping[str, torch.Tensor]) -> None:
        """Scatter ``fields`` (``len(worlds)`` rows, borrowed) to each world's next row.

        ``worlds`` is an int64 index tensor on this buffer's device, of distinct worlds.
        """
        self.check(worlds, fields)
        if worlds.shape[0] == 0:
            return
        if self._highest >= self.capacity:
            self._make_room()
        pos = self.count.index_select(0, worlds)
        for name, b in self.bufs.items():
            b.index_put_((pos, worlds), fields[name])
        self.count.index_add_(0, worlds, self._ones[: worlds.shape[0]])
        self._highest += 1

    def _make_room(self) -> None:
        # The only device read on the append path, spaced like SharedAxisBuffer's.
        self._highest = int(self.count.max())
        if 2 * self._highest <= self.capacity:
            return
        new_cap = self._grown(2 * self._highest)
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
