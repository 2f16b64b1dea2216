"""PyTorch datasets over a run store, built on the bulk reads of :class:`storage.RunStore`.

- :class:`EpisodeDataset`: map-style, one item per episode (its rows, whole).
- :class:`WindowDataset`: map-style, one item per fixed-length window of rows inside an
  episode (windows never cross episodes; padding rules in its docstring).
- :class:`IterableEpisodeDataset`: every episode once, sharded across DataLoader workers and
  distributed ranks, optionally shuffled with a seed.

And for the DataLoader: :class:`BlockShuffleSampler` (a block-wise shuffle of a map-style
dataset: a batch decodes a few chunks), and the collate functions :func:`concatenate`
(episodes of different lengths: rows concatenated, with offsets) and :func:`stack` (items of
equal shapes, as the default collate), whose batches (:class:`Packed`) a worker process sends
as one piece of shared memory.

Each takes a store (a :class:`storage.RunStore`, a local directory, an fsspec URL or a zarr
store), a ``run`` (``None``: every run), a ``where`` expression (:meth:`RunStore.query`) and
``fields`` (``"<term>/<field>"`` names or term names; ``None``: every field). Its ``table`` is
the selected episodes (:meth:`RunStore.query`'s columns, variation values included); an item's
``"episode"`` is its row in ``table``. Items are dicts of tensors keyed like
:meth:`RunStore.episode` (bfloat16 fields as float32). Batches of several items are read at
once (``__getitems__``), each chunk once; every process (DataLoader worker) opens the store
again, so no zarr object is shared across a fork. Episodes differ in length: give
:class:`torch.utils.data.DataLoader` ``collate_fn=concatenate`` (each key's rows concatenated,
with offsets: :class:`Concatenated`), ``batch_size=None``, or a ``collate_fn`` that pads, or use
:class:`WindowDataset`. With worker processes, batch with :func:`concatenate` or
:func:`stack`: a batch crosses to the main process as one piece of shared memory, where every
tensor of a list of items, of a plain dict (the default collate's) or of items sent one by one
crosses on its own, each with its own shared-memory handle.

``import storage`` does not import this module (it needs torch.utils.data).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence, Sized
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from ._format import StoreLocation
from .reader import RunStore, Table

__all__ = ["BlockShuffleSampler", "Concatenated", "EpisodeDataset", "IterableEpisodeDataset", "Packed",
           "WindowDataset", "concatenate", "stack"]

Item = dict[str, torch.Tensor]


class _Source:
    """The episodes a dataset reads and the store it reads them from, opened once per
    process.

    Raises:
        QueryError: A bad ``where``.
        ValueError, TypeError: A bad ``fields`` (the message names the field).
        StorageError: The store cannot be opened or its tables are damaged.
    """

    def __init__(self, store: RunStore | StoreLocation, run: str | None, where: str | None,
                 fields: Sequence[str] | None, cache_bytes: int) -> None:
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
            raise ValueError(f"cache_bytes: expected an integer >= 0, got {cache_bytes!r}")
        reader = store if isinstance(store, RunStore) else RunStore(store, cache_bytes=cache_bytes)
        self.location, self.cache_bytes = reader.location, cache_bytes
        self.table = reader.query(where, run)
        self.rows = np.zeros(len(self.table), np.int64)
        self.terms: dict[str, dict[str, list[str]]] = {}
        names = self.table["run"]
        reader._read_indexes(list(dict.fromkeys(names.tolist())))  # every run's at once
        for r in dict.fromkeys(names.tolist()):
            mine = names == r
            self.rows[mine] = reader._locate(r, self.table["world"][mine], self.table["index"][mine])
            self.terms[r] = reader._fields(r, fields)
        self._reader: RunStore | None = reader
        self._pid = os.getpid()

    def reader(self) -> RunStore:
        """This process's store (opened again after a fork or in a spawned worker)."""
        if self._reader is None or self._pid != os.getpid():
            self._reader, self._pid = RunStore(self.location, cache_bytes=self.cache_bytes), os.getpid()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_reader"] = None
        return state

    def read(self, positions: np.ndarray, start: np.ndarray | None = None,
             stop: np.ndarray | None = None) -> list[Item]:
        """The episodes at ``positions`` of :attr:`table` (rows ``[start, stop)`` of each when
        given), in that order, one bulk read per run, each with its ``"episode"``. The tensors
        of one key are views of one tensor, which :func:`concatenate` hands on uncopied."""
        reader = self.reader()
        episode = torch.from_numpy(np.array(positions, dtype=np.int64))
        out: list[Item] = [{"episode": episode[i]} for i in range(len(positions))]
        names = self.table["run"][positions]
        runs = list(dict.fromkeys(names.tolist()))
        for r in runs:
            at = np.flatnonzero(names == r)
            data, offsets = reader._gather(r, self.rows[positions[at]], self.terms[r],
                                           None if start is None else start[at],
                                           None if stop is None else stop[at])
            whole = {n: torch.from_numpy(v) for n, v in data.items()}
            for k, i in enumerate(at.tolist()):
                out[i].update({n: v[int(offsets[n][k]):int(offsets[n][k + 1])] for n, v in whole.items()})
            if len(runs) == 1:
                return _Read(out, episode, whole, offsets)
        return out


class _Read(list[Item]):
    """The items of one bulk read of one run, with the tensors they were cut from and where:
    :func:`concatenate` takes those as they are while every item still holds exactly the
    views the read made (no per-item checks of how the views lie)."""

    def __init__(self, items: list[Item], episode: torch.Tensor, whole: dict[str, torch.Tensor],
                 offsets: dict[str, np.ndarray]) -> None:
        super().__init__(items)
        self.episode, self.whole, self.offsets = episode, whole, offsets
        self.made = [tuple(item.items()) for item in items]

    def untouched(self) -> bool:
        """Whether these are still the items the read made, each holding its very tensors."""
        return len(self) == len(self.made) and all(
            len(item) == len(made) and all(item.get(k) is v for k, v in made)
            for item, made in zip(self, self.made, strict=True))


def _positions(indices: Sequence[int] | np.ndarray, n: int) -> np.ndarray:
    """``indices`` as rows of a dataset of ``n`` items (negative ones from the end).

    Raises:
        IndexError: An index out of range.
    """
    out = np.asarray(indices, dtype=np.int64).reshape(-1)
    bad = (out < -n) | (out >= n)
    if bad.any():
        raise IndexError(f"index {int(out[bad][0])} is out of range for a dataset of {n} items")
    return np.where(out < 0, out + n, out)


class EpisodeDataset(Dataset[Item]):
    """One item per selected episode: its fields (``"<term>/<field>"`` -> tensor of its rows)
    and ``"episode"`` (its row in :attr:`table`).

    Args:
        store: A :class:`storage.RunStore`, a local directory, an fsspec URL or a zarr store.
        run: One run, or ``None`` for every run.
        where: Keep the episodes where this expression holds (:meth:`RunStore.query`).
        fields: ``"<term>/<field>"`` names or term names; ``None`` for every field.
        cache_bytes: Decoded chunks each process keeps (:class:`storage.RunStore`); random
            access decodes a chunk again once it has left this cache, so reads are fastest
            when it holds the data read (a ``RunStore`` passed as ``store`` keeps its own in
            this process).

    Raises:
        QueryError: A bad ``where``.
        ValueError, TypeError: A bad ``fields`` (the message names the field), or
            ``cache_bytes``.
        StorageError: The store cannot be opened or its tables are damaged.
    """

    def __init__(self, store: RunStore | StoreLocation, run: str | None = None, where: str | None = None,
                 fields: Sequence[str] | None = None, *, cache_bytes: int = 256 << 20) -> None:
        self.source = _Source(store, run, where, fields, cache_bytes)

    @property
    def table(self) -> Table:
        """The selected episodes, item ``i`` being row ``i``."""
        return self.source.table

    def __len__(self) -> int:
        return len(self.source.table)

    def __getitem__(self, index: int) -> Item:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """Several items, read in one bulk read (DataLoader calls this for each batch)."""
        positions = _positions(indices, len(self))
        return self.source.read(positions)


class Packed(dict[str, Any]):
    """A batch as a dict whose values are CPU tensors or dicts of them, which pickles as one
    tensor of bytes and where each tensor lies in it: a DataLoader worker sends it to the main
    process as one piece of shared memory, where a plain dict sends every tensor on its own,
    each with its own shared-memory handle. Anything else inside (a value its user put there,
    a tensor on a device) is pickled as a plain dict would be. ``pin_memory`` pins it as any
    dict of tensors."""

    def __copy__(self) -> Packed:
        return type(self)(self)  # shallow, as a dict's copy (DataLoader's pin_memory makes one)

    def __reduce__(self) -> tuple[Any, ...]:
        nested = {k: isinstance(v, dict) for k, v in self.items()}  # every key, in order
        leaves: list[tuple[str, str | None, Any]] = []
        for k, v in self.items():
            leaves += [(k, kk, t) for kk, t in v.items()] if isinstance(v, dict) else [(k, None, v)]
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad
                   for _, _, t in leaves):
            return (_rebuild_plain, (type(self), dict(self)))
        layout, at = [], 0
        for k, kk, t in leaves:
            nbytes = t.numel() * t.element_size()
            layout.append((k, kk, t.dtype, tuple(t.shape), at, nbytes))
            at += -(-nbytes // 64) * 64
        packed = _buffer(at)
        for (_, _, dtype, shape, offset, nbytes), (_, _, t) in zip(layout, leaves, strict=True):
            if nbytes:  # into a view of its own dtype and shape: any strides copy right
                packed[offset:offset + nbytes].view(dtype).view(shape).copy_(t)
        return (_rebuild_packed, (type(self), nested, packed, layout))


class Concatenated(Packed):
    """A batch of episodes from :func:`concatenate`: ``"episode"`` (their rows of the dataset's
    ``table``, int64), ``"data"`` (key -> every episode's rows, concatenated) and ``"offsets"``
    (key -> ``len(episode) + 1`` int64 offsets: episode ``i``'s rows of ``key`` are
    ``data[key][offsets[key][i]:offsets[key][i + 1]]``), as :meth:`RunStore.read_batch`; sent
    from worker processes as one piece of shared memory (:class:`Packed`)."""

    def episode(self, i: int) -> Item:
        """Episode ``i`` of the batch, as the dataset's item (views)."""
        data, offsets = self["data"], self["offsets"]
        item: Item = {key: data[key][int(offsets[key][i]):int(offsets[key][i + 1])] for key in data}
        item["episode"] = self["episode"][i]
        return item


def _buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` bytes, in shared memory inside a DataLoader worker (as default_collate does:
    the transfer to the main process then copies nothing)."""
    if get_worker_info() is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    empty: Any = torch.empty(0, dtype=torch.uint8)
    return empty.set_(empty._typed_storage()._new_shared(nbytes))  # type: ignore[no-any-return]


def _rebuild_plain(cls: type[Packed], state: dict[str, Any]) -> Packed:
    return cls(state)


def _rebuild_packed(cls: type[Packed], nested: dict[str, bool], packed: torch.Tensor,
                    layout: list[tuple[str, str | None, torch.dtype, tuple[int, ...], int, int]]) -> Packed:
    out = cls({k: {} if inner else None for k, inner in nested.items()})  # the keys in their order
    for k, kk, dtype, shape, offset, nbytes in layout:
        t = packed[offset:offset + nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        if kk is None:
            out[k] = t
        else:
            out[k][kk] = t
    return out


def _same_keys(items: Sequence[Item], what: str) -> None:
    """Raises ValueError: no items, or items whose keys differ (named)."""
    if not items:
        raise ValueError(f"{what}: no items")
    for i, item in enumerate(items):
        if item.keys() != items[0].keys():
            odd = sorted(set(item) ^ set(items[0]))
            raise ValueError(f"{what}: the keys of item {i} and item 0 differ in {odd} (items of "
                             f"runs with different fields: choose fields they share)")


def stack(items: Sequence[Item]) -> Packed:
    """A DataLoader ``collate_fn`` for items of equal shapes (:class:`WindowDataset`'s): each
    key's tensors stacked, as the default collate does, in a :class:`Packed` dict that a worker
    process sends as one piece of shared memory (the default collate's dict sends one per key).

    Raises:
        ValueError: No items, items with different keys (named), or shapes that differ.
    """
    _same_keys(items, "stack")
    out = Packed()
    for key in items[0]:
        try:
            out[key] = torch.stack([item[key] for item in items])
        except RuntimeError as exc:
            raise ValueError(f"stack: the items' {key!r} differ in shape: {exc}") from exc
    return out


def concatenate(items: Sequence[Item]) -> Concatenated:
    """A DataLoader ``collate_fn`` for episodes of different lengths: each key's rows
    concatenated, with offsets (:class:`Concatenated`).

    The items of one ``__getitems__`` call are views of one tensor per key, in order: that
    tensor is taken as it is, no copy. With worker processes this is the cheap way to batch
    whole episodes: a batch crosses to the main process as one piece of shared memory
    (:class:`Packed`), where a list of items sends every tensor of every item on its own, each
    with its own shared-memory handle.

    Raises:
        ValueError: No items, or items with different keys (the message names the key).
    """
    if isinstance(items, _Read) and items.untouched():
        return Concatenated(episode=items.episode, data=dict(items.whole),
                            offsets={k: torch.from_numpy(v) for k, v in items.offsets.items()})
    _same_keys(items, "concatenate")
    keys = [k for k in items[0] if k != "episode"]
    episode = torch.stack([torch.as_tensor(item["episode"], dtype=torch.int64) for item in items])
    data: dict[str, torch.Tensor] = {}
    offsets: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [item[key] for item in items]
        lengths = torch.tensor([0] + [len(t) for t in parts], dtype=torch.int64)
        offsets[key] = torch.cumsum(lengths, 0)
        data[key] = _whole(parts)
    return Concatenated(episode=episode, data=data, offsets=offsets)


def _whole(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; uncopied when they are views of one tensor's consecutive rows, in
    order: the view of those rows."""
    base = parts[0]._base
    row = math.prod(base.shape[1:]) if base is not None and base.dim() else 0
    if base is not None and row and base.is_contiguous() and all(
            t._base is base and t.dtype == base.dtype and t.is_contiguous() and t.shape[1:] == base.shape[1:]
            for t in parts):
        first = at = parts[0].storage_offset()
        for t in parts:
            if t.storage_offset() != at:
                break
            at += t.numel()
        else:
            start, stop = first - base.storage_offset(), at - base.storage_offset()
            if start % row == 0:
                return base[start // row:stop // row]
    return torch.cat(parts)


class WindowDataset(Dataset[Item]):
    """One item per window of ``window`` consecutive rows inside a selected episode.

    Windows never cross episodes. In each episode of ``n`` rows they start at rows ``0,
    stride, 2 * stride, ...``; every window that fits whole is an item. With ``pad="zeros"``
    (the default) or ``pad="edge"``, the first start whose window runs past the episode's end
    (if that start is still inside the episode) gives one more item, padded to ``window`` rows
    with zeros or with copies of the episode's last row; so with ``stride <= window`` every
    row is in some window, and an episode shorter than ``window`` gives one padded window.
    With ``pad="drop"`` only whole windows are items (shorter episodes give none). Each item
    holds the fields (``window`` rows each), ``"mask"`` (bool, ``window`` values: true on the
    episode's rows, false on padding), ``"episode"`` (the row in :attr:`table`) and
    ``"start"`` (the window's first row in the episode).

    The fields must be of one term, or of terms with as many rows in every episode (two
    ``post_step`` terms, say): windows count rows.

    Args:
        store, run, where, fields, cache_bytes: As :class:`EpisodeDataset` takes them.
        window: Rows per window (>= 1).
        stride: Rows between the starts of consecutive windows (>= 1; default ``window``).
        pad: ``"zeros"``, ``"edge"`` or ``"drop"``.

    Raises:
        ValueError: A bad ``window``, ``stride`` or ``pad``, or fields of terms whose row
            counts differ (the message names the terms and an episode).
        QueryError, TypeError, StorageError: As :class:`EpisodeDataset`.
    """

    def __init__(self, store: RunStore | StoreLocation, run: str | None = None, where: str | None = None,
                 fields: Sequence[str] | None = None, *, window: int, stride: int | None = None,
                 pad: Literal["zeros", "edge", "drop"] = "zeros", cache_bytes: int = 256 << 20) -> None:
        stride = window if stride is None else stride
        for name, value in (("window", window), ("stride", stride)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
        if pad not in ("zeros", "edge", "drop"):
            raise ValueError(f"pad: expected 'zeros', 'edge' or 'drop', got {pad!r}")
        self.window, self.stride, self.pad = window, stride, pad
        self.source = source = _Source(store, run, where, fields, cache_bytes)
        reader = source.reader()
        self.lengths = np.zeros(len(source.table), np.int64)
        names = source.table["run"]
        for r, terms in source.terms.items():
            mine = np.flatnonzero(names == r)
            counts = reader._term_rows(r, source.rows[mine])
            first, *others = terms
            for term in others:
                differ = np.flatnonzero(counts[term] != counts[first])
                if len(differ):
                    i = int(mine[differ[0]])
                    raise ValueError(
                        f"fields: windows count rows, but episode (world {int(source.table['world'][i])}, "
                        f"index {int(source.table['index'][i])}) of run {r!r} has "
                        f"{int(counts[first][differ[0]])} rows of term {first!r} and "
                        f"{int(counts[term][differ[0]])} of term {term!r}; pass fields of one term")
            self.lengths[mine] = counts[first]
        whole = np.where(self.lengths >= window, (self.lengths - window) // stride + 1, 0)
        windows = whole + ((pad != "drop") & (whole * stride < self.lengths))
        # Items are numbered episode after episode: each episode's first item, and the count.
        # Per episode, not per window (16 bytes a window would be 16 GB for 10^9 of them).
        self._first = np.cumsum(windows) - windows
        self._items = int(windows.sum())

    @property
    def table(self) -> Table:
        """The selected episodes (``"episode"`` of an item is its row here)."""
        return self.source.table

    def __len__(self) -> int:
        return self._items

    def locate(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The episode (row of :attr:`table`) and the start row of each item of ``indices``.

        Raises:
            IndexError: An index out of range.
        """
        at = _positions(indices, len(self))
        # the last episode whose first item is at or before: episodes without windows share
        # their first item with the episode after them, which comes last among equals
        episodes = np.searchsorted(self._first, at, side="right") - 1
        return episodes, (at - self._first[episodes]) * self.stride

    def __getitem__(self, index: int) -> Item:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[Item]:
        """Several windows, read in one bulk read (DataLoader calls this for each batch)."""
        episodes, starts = self.locate(indices)
        start = torch.from_numpy(starts)
        mask = torch.from_numpy(np.arange(self.window) < (self.lengths[episodes] - starts)[:, None])
        items = self.source.read(episodes, starts, starts + self.window)
        for i, item in enumerate(items):
            item.update({name: self._padded(value) for name, value in item.items() if name != "episode"})
            item.update(start=start[i], mask=mask[i])
        return items

    def _padded(self, rows: torch.Tensor) -> torch.Tensor:
        missing = self.window - len(rows)
        if not missing:
            return rows
        tail = rows[-1:].expand(missing, *rows.shape[1:]) if self.pad == "edge" else \
            rows.new_zeros((missing, *rows.shape[1:]))
        return torch.cat([rows, tail])


class IterableEpisodeDataset(IterableDataset[Item]):
    """Every selected episode exactly once across all shards, items as
    :class:`EpisodeDataset` gives them.

    The episodes (rows of :attr:`table`) are cut into blocks of ``block`` consecutive ones;
    block ``j`` (of the block order) goes to shard ``j % (world_size * workers)``, the shard of
    DataLoader worker ``w`` of rank ``r`` being ``r * workers + w``. A shard reads its
    episodes a block at a time (one bulk read each). With ``shuffle``, the block order and the
    order inside each block are permuted, from ``seed`` and the epoch (:meth:`set_epoch`), the
    same on every rank and worker: a block shuffle, which keeps reads chunk-friendly
    (``block=1`` shuffles fully). Shards differ in size by less than two blocks.

    Args:
        store, run, where, fields, cache_bytes: As :class:`EpisodeDataset` takes them.
        shuffle: Permute blocks and episodes (default: table order).
        seed: Seed of the permutation (an integer >= 0).
        block: Episodes per block (>= 1).
        rank, world_size: This process's distributed rank and the number of ranks; by default
            those of ``torch.distributed`` when it is initialised, else 0 and 1.

    Raises:
        ValueError: A bad ``seed``, ``block``, ``rank`` or ``world_size``.
        QueryError, TypeError, StorageError: As :class:`EpisodeDataset`.
    """

    def __init__(self, store: RunStore | StoreLocation, run: str | None = None, where: str | None = None,
                 fields: Sequence[str] | None = None, *, shuffle: bool = False, seed: int = 0,
                 block: int = 64, rank: int | None = None, world_size: int | None = None,
                 cache_bytes: int = 256 << 20) -> None:
        _check_order(seed, block, rank, world_size)
        self.shuffle, self.seed, self.block = bool(shuffle), seed, block
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.source = _Source(store, run, where, fields, cache_bytes)

    @property
    def table(self) -> Table:
        """The selected episodes (``"episode"`` of an item is its row here)."""
        return self.source.table

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of epoch ``epoch`` from now on (with ``shuffle``)."""
        self.epoch = int(epoch)

    def shard(self, rank: int = 0, world_size: int = 1, worker: int = 0, workers: int = 1) -> np.ndarray:
        """The rows of :attr:`table` that worker ``worker`` of ``workers`` on rank ``rank`` of
        ``world_size`` yields, in order.

        Raises:
            ValueError: A rank or worker out of range.
        """
        _check_rank(rank, world_size)
        if not (0 <= worker < workers):
            raise ValueError(f"worker: expected 0 <= worker < workers ({workers}), got {worker}")
        order = _blocks(len(self.source.table), self.block, self.shuffle, self.seed, self.epoch)
        parts = order[rank * workers + worker::world_size * workers]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def __iter__(self) -> Iterator[Item]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        rank, world_size = _ranks(self.rank, self.world_size)
        positions = self.shard(rank, world_size, worker, workers)
        for a in range(0, len(positions), self.block):
            part = positions[a:a + self.block]
            yield from self.source.read(part)


class BlockShuffleSampler(Sampler[int]):
    """The indices of a map-style dataset (:class:`EpisodeDataset`, :class:`WindowDataset`)
    shuffled block-wise, for ``DataLoader(dataset, sampler=...)``: blocks of ``block``
    consecutive indices in a permuted order, the indices inside each block permuted, from
    ``seed`` and the epoch (:meth:`set_epoch`), as :class:`IterableEpisodeDataset` shuffles.

    Neighbouring items lie in the same chunks of the store, so a batch drawn from a block
    decodes a few chunks, where a full shuffle (``shuffle=True``) decodes about one chunk per
    field for every item once the data read no longer fits the chunk cache (``cache_bytes``).
    ``block=1`` shuffles fully.

    With distributed ranks (``rank``/``world_size``, by default ``torch.distributed``'s when it
    is initialised), block ``j`` of the permuted order goes to rank ``j % world_size``, the
    same permutation on every rank, and every rank yields as many indices, as
    :class:`torch.utils.data.DistributedSampler` does: a rank short of the longest share
    repeats indices of its own from its start (``drop_last=False``), or every rank stops at the
    shortest share (``drop_last=True``; the surplus is left out of that epoch).

    Args:
        data_source: The dataset (or its length).
        block: Consecutive indices per block (>= 1).
        seed: Seed of the permutation (an integer >= 0).
        rank, world_size: This process's rank and the number of ranks (together).
        drop_last: Drop the surplus instead of repeating indices to even the ranks out.

    Raises:
        ValueError: A bad ``block``, ``seed``, ``rank`` or ``world_size``, or a negative length.
    """

    def __init__(self, data_source: Sized | int, *, block: int = 256, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, drop_last: bool = False) -> None:
        super().__init__()
        _check_order(seed, block, rank, world_size)
        n = data_source if isinstance(data_source, int) else len(data_source)
        if n < 0:
            raise ValueError(f"data_source: expected a length >= 0, got {n}")
        self.n, self.block, self.seed, self.epoch = n, block, seed, 0
        self.rank, self.world_size, self.drop_last = rank, world_size, bool(drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of epoch ``epoch`` from now on."""
        self.epoch = int(epoch)

    def indices(self) -> np.ndarray:
        """This rank's indices of the current epoch, in order."""
        rank, world_size = _ranks(self.rank, self.world_size)
        order = _blocks(self.n, self.block, True, self.seed, self.epoch)
        if world_size == 1:
            return np.concatenate(order) if order else np.zeros(0, np.int64)
        shares = [sum(len(b) for b in order[r::world_size]) for r in range(world_size)]
        length = min(shares) if self.drop_last else max(shares)
        mine = order[rank::world_size]
        rows = np.concatenate(mine) if mine else np.zeros(0, np.int64)
        if len(rows) < length:  # repeat this rank's first indices (any, if it has none)
            rows = np.concatenate([rows, np.resize(rows if len(rows) else np.concatenate(order), length - len(rows))])
        return rows[:length]

    def __len__(self) -> int:
        return self.n if _ranks(self.rank, self.world_size)[1] == 1 else len(self.indices())

    def __iter__(self) -> Iterator[int]:
        yield from self.indices().tolist()


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size``, by default those of ``torch.distributed`` when it is
    initialised, else 0 and 1."""
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = torch.distributed
    ready = dist.is_available() and dist.is_initialized()
    return (dist.get_rank(), dist.get_world_size()) if ready else (0, 1)


def _blocks(n: int, block: int, shuffle: bool, seed: int, epoch: int) -> list[np.ndarray]:
    """Rows ``0..n-1`` in blocks of ``block`` consecutive ones, in block order; with
    ``shuffle``, the block order and the rows inside block ``b`` permuted from ``(seed, epoch)``
    and ``(seed, epoch, b)``."""
    blocks = np.arange(-(-n // block))
    if shuffle:
        blocks = np.random.default_rng([seed, epoch]).permutation(blocks)
    out = []
    for b in blocks.tolist():
        rows = np.arange(b * block, min(n, (b + 1) * block))
        if shuffle:
            rows = np.random.default_rng([seed, epoch, b]).permutation(rows)
        out.append(rows)
    return out


def _check_order(seed: Any, block: Any, rank: Any, world_size: Any) -> None:
    """Raises ValueError: a bad ``seed`` or ``block`` of a block shuffle, or ``rank`` and
    ``world_size`` (given together, or neither)."""
    for name, value, low in (("seed", seed, 0), ("block", block, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
    if (rank is None) != (world_size is None):
        raise ValueError(f"rank and world_size go together, got rank={rank!r} world_size={world_size!r}")
    if world_size is not None:
        _check_rank(rank, world_size)


def _check_rank(rank: Any, world_size: Any) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not (0 <= rank < world_size):
        raise ValueError(f"rank: expected 0 <= rank < world_size ({world_size}), got {rank!r}")
