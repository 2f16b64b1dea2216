"""SampleTable: joins variation samples with episode outcomes into an (X, Y) table.

One row per finished episode: ``(run, world, episode, factor values..., success, terminated,
truncated, length, outcomes...)``, the table a sensitivity analysis takes: the extra numeric
outcomes of ``EpisodeEnd.outcomes`` (e.g. ``return``) are Y columns after the four fixed ones,
sorted by name, NaN for the episodes whose ``EpisodeEnd`` lacked them. The variation
declarations of ``RunStart`` and ``RunEnd`` (sampler kind, bounds, seed) are kept per run
(:meth:`SampleTable.declarations`), so a live analysis knows each factor's bounds. It depends only on the broker's
message types, so it works in process (tensors on any device) and on messages a remote
subscriber decoded from the wire (CPU tensors) alike.

Join rule, per variation key and finished episode: the last run-time sample drawn for that
world while it was in that episode, else the world's last build-time sample (build-time
samples are in effect for every episode of their worlds), else missing (NaN, label ``None``).
Samples and episode ends of a run must arrive in publication order, as the broker and the
ZeroMQ transport deliver them.

Ownership: every value is copied to host numpy arrays during the delivery call; nothing
borrowed from a message is kept.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from broker import Broker, EpisodeEnd, Message, RunEnd, RunStart, Subscription, VariationSample
from broker.messages import BUILD, RESERVED_OUTCOMES

from .errors import SampleTableError

__all__ = ["MAX_WORLDS_UNSEEN", "OUTCOME_COLUMNS", "SampleArrays", "SampleTable"]

OUTCOME_COLUMNS = ("success", "terminated", "truncated", "length")


def _copy(value: Any) -> Any:
    """A deep, plain copy of a declaration (mappings as dicts, tuples as lists)."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value


def _last_at(world: np.ndarray, seq: np.ndarray, at_world: np.ndarray, at_seq: np.ndarray) -> np.ndarray:
    """For each ``(at_world[i], at_seq[i])``, the position in ``world``/``seq`` of the last
    entry of that world whose ``seq`` is at most ``at_seq[i]`` (the last in position among
    equal numbers, as the last assignment wins), or -1."""
    if not world.size:
        return np.full(at_world.shape, -1, np.int64)
    order = np.lexsort((np.arange(world.size), seq, world))  # by world, number, position
    w, q = world[order], seq[order]
    # (world, number) pairs as one sortable key: numbers shifted to start at 0
    low = min(int(q.min()), int(at_seq.min()) if at_seq.size else 0)
    span = max(int(q.max()), int(at_seq.max()) if at_seq.size else 0) - low + 1
    keys = (w - int(w.min())) * span + (q - low)
    wanted = (at_world - int(w.min())) * span + (at_seq - low)
    pos = np.searchsorted(keys, wanted, side="right") - 1
    ok = (pos >= 0) & (w[np.maximum(pos, 0)] == at_world)
    return np.where(ok, order[np.maximum(pos, 0)], -1)


def _labels(where: str, raw: np.ndarray, labels: Sequence[Any]) -> np.ndarray:
    """The label of each categorical code (``raw[:, 0]``), as an object array.

    Raises:
        SampleTableError: A code is not an index of ``labels``.
    """
    first = raw[:, 0]
    if first.size and not (np.isfinite(first).all() and np.array_equal(first, np.trunc(first))
                           and first.min() >= 0 and first.max() < len(labels)):
        raise SampleTableError(f"{where}: expected codes in [0, {len(labels)}), got {first.min()}..{first.max()}")
    codes = first.astype(np.int64)
    vocabulary = np.empty(len(labels), dtype=object)
    vocabulary[:] = list(labels)
    out: np.ndarray = vocabulary[codes]
    return out


MAX_WORLDS_UNSEEN = 1 << 20
"""The world indices a run's messages may use when its ``RunStart`` was not seen (a table that
joined late): beyond it a message is rejected rather than grow the join state to its index."""


def _host(t: torch.Tensor) -> np.ndarray:
    """An owned host copy of a (possibly borrowed, possibly device) tensor; floats numpy has no
    dtype for (bfloat16, float8) as float32."""
    t = t.detach()
    if t.is_floating_point() and t.dtype not in (torch.float16, torch.float32, torch.float64):
        t = t.float()
    return np.array(t.cpu().numpy(), copy=True)


def _column(where: str, name: str, t: Any, n: int | None, *, integral: bool = False) -> np.ndarray:
    """``t``, a 1-D tensor of ``n`` real values (any length for ``None``; integers where
    ``integral``), as an owned host array.

    Raises:
        SampleTableError: It is not.
    """
    if (not isinstance(t, torch.Tensor) or t.dim() != 1 or (n is not None and t.shape[0] != n)
            or t.is_complex() or (integral and (t.is_floating_point() or t.dtype == torch.bool))):
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        size = "" if n is None else f" of {n} values"
        raise SampleTableError(f"{where}: {name}: expected a 1-D {'integer' if integral else 'real'} "
                               f"tensor{size}, got {got}")
    return _host(t)


@dataclass(frozen=True, slots=True, eq=False)
class SampleArrays:
    """The table as arrays (all owned copies), one row per finished episode.

    Attributes:
        run, world, episode: The episode keys, shape ``(rows,)``.
        x: float64 factors, shape ``(rows, len(x_columns))``; NaN where a factor is missing;
            categorical factors give their codes.
        y: float64 outcomes (``success``, ``terminated``, ``truncated`` as 0/1, ``length``, then
            the extra outcomes, sorted by name; NaN where an episode lacks one).
        x_columns, y_columns: Column names of ``x`` and ``y``.
        labels: Categorical key -> object array of labels (``None`` where missing).
    """

    run: np.ndarray
    world: np.ndarray
    episode: np.ndarray
    x: np.ndarray
    y: np.ndarray
    x_columns: tuple[str, ...]
    y_columns: tuple[str, ...]
    labels: dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class _Factor:
    shape: tuple[int, ...]
    categorical: bool

    @property
    def width(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def columns(self, key: str) -> list[str]:
        if not self.shape:
            return [key]
        return [f"{key}[{','.join(map(str, i))}]" for i in np.ndindex(*self.shape)]


class _KeyState:
    """Per run and key: each world's latest run-time value (and its episode) and build value."""

    __slots__ = ("build", "build_label", "episode", "label", "value")

    def __init__(self, width: int, capacity: int) -> None:
        self.value = np.full((capacity, width), np.nan)
        self.episode = np.full(capacity, -1, dtype=np.int64)
        self.build = np.full((capacity, width), np.nan)
        self.label = np.full(capacity, None, dtype=object)
        self.build_label = np.full(capacity, None, dtype=object)

    def grow(self, capacity: int) -> None:
        for name in self.__slots__:
            old = getattr(self, name)
            fill: Any = -1 if name == "episode" else (None if old.dtype == object else np.nan)
            new = np.full((capacity, *old.shape[1:]), fill, dtype=old.dtype)
            new[: old.shape[0]] = old
            setattr(self, name, new)


@dataclass(frozen=True, slots=True, eq=False)
class _Chunk:
    run: str
    world: np.ndarray
    episode: np.ndarray
    outcomes: np.ndarray
    extra: dict[str, np.ndarray]
    values: dict[str, np.ndarray]
    labels: dict[str, np.ndarray]


class SampleTable:
    """A broker consumer joining ``VariationSample`` and ``EpisodeEnd`` messages into rows.

    Subscribe it with :meth:`attach` (or to ``variation/``, ``episode/`` and ``run/``
    yourself). ``RunStart`` and ``RunEnd`` give the run's variation declarations (a
    ``RunEnd``'s replace the earlier ones key by key); ``RunEnd`` also frees that run's join
    state. Batches are ignored.

    Raises (from the delivery call, which then changes nothing):
        SampleTableError: A world index is outside the run (``[0, num_worlds)`` of its
            ``RunStart``, or of :data:`MAX_WORLDS_UNSEEN` where that was not seen), a sample's
            value or episodes do not match its worlds, a value is complex, a categorical code is
            not an index of the labels, a key changes its per-world shape or switches between
            categorical and numeric, or an outcome is not a 1-D real tensor of one value per
            world or has a reserved name (:data:`broker.messages.RESERVED_OUTCOMES`).
    """

    name = "sample-table"

    def __init__(self) -> None:
        self._factors: dict[str, _Factor] = {}
        self._runs: dict[str, dict[str, _KeyState]] = {}
        self._capacity: dict[str, int] = {}
        self._chunks: list[_Chunk] = []
        self._rows = 0
        self._outcomes: set[str] = set()
        self._declarations: dict[str, dict[str, dict[str, Any]]] = {}
        self._seeds: dict[str, int | None] = {}
        self._num_worlds: dict[str, int] = {}

    def attach(self, broker: Broker) -> list[Subscription]:
        """Subscribe to ``variation/``, ``episode/`` and ``run/`` on ``broker``."""
        return [broker.subscribe("variation/", self, name=self.name),
                broker.subscribe("episode/", self, name=self.name),
                broker.subscribe("run/", self, name=self.name)]

    def __call__(self, message: Message) -> None:
        if isinstance(message, VariationSample):
            self._sample(message)
        elif isinstance(message, EpisodeEnd):
            self._end(message)
        elif isinstance(message, RunStart | RunEnd):
            self._declare(message)
            if isinstance(message, RunEnd):
                self._runs.pop(message.run, None)
                self._capacity.pop(message.run, None)

    def _declare(self, message: RunStart | RunEnd) -> None:
        if isinstance(message.num_worlds, int) and message.num_worlds > 0:
            self._num_worlds[message.run] = message.num_worlds
        declared = self._declarations.setdefault(message.run, {})
        for key, decl in message.variations.items():
            declared[key] = _copy(decl)
        if message.seed is not None or message.run not in self._seeds:
            self._seeds[message.run] = message.seed

    def declarations(self, run: str | None = None) -> dict[str, dict[str, Any]]:
        """Variation key -> declaration (``kind``, ``phase``, ``shape``, ``seed``, ``low``/
        ``high``, ...) of ``run``, as its ``RunStart``/``RunEnd`` declared them (owned copies);
        with ``run=None``, those of every run (a later run's declaration of a key wins)."""
        runs = [run] if run is not None else list(self._declarations)
        out: dict[str, dict[str, Any]] = {}
        for r in runs:
            out.update({k: _copy(d) for k, d in self._declarations.get(r, {}).items()})
        return out

    @property
    def variations(self) -> dict[str, dict[str, Any]]:
        """The declarations of every run seen (see :meth:`declarations`)."""
        return self.declarations()

    def seed(self, run: str) -> int | None:
        """The run seed ``run``'s ``RunStart``/``RunEnd`` gave (``None`` if none or unseen)."""
        return self._seeds.get(run)

    # -- joining -------------------------------------------------------------------------

    def _worlds(self, where: str, run: str, t: Any) -> np.ndarray:
        """A message's worlds (a 1-D integer tensor), each in the run.

        Raises:
            SampleTableError: They are not.
        """
        worlds = _column(where, "worlds", t, None, integral=True)
        bound = self._num_worlds.get(run, MAX_WORLDS_UNSEEN)
        if worlds.size and (int(worlds.min()) < 0 or int(worlds.max()) >= bound):
            of = f"the run's {bound} worlds" if run in self._num_worlds else \
                f"[0, {bound}) (the run's RunStart was not seen)"
            raise SampleTableError(f"{where}: worlds: expected indices of {of}, got "
                                   f"{int(worlds.min())}..{int(worlds.max())}")
        return worlds

    def _state(self, run: str, key: str, factor: _Factor, worlds: np.ndarray) -> _KeyState:
        states = self._runs.setdefault(run, {})
        capacity = self._capacity.get(run, 0)
        needed = int(worlds.max()) + 1 if worlds.size else 0
        if needed > capacity:
            capacity = min(max(needed, 2 * capacity), self._num_worlds.get(run, MAX_WORLDS_UNSEEN))
            self._capacity[run] = capacity
            for state in states.values():
                state.grow(capacity)
        if key not in states:
            states[key] = _KeyState(factor.width, capacity)
        return states[key]

    def _checked(self, where: str, key: str, factor: _Factor) -> _Factor:
        """``factor``, which must be the one the key had before (if any)."""
        known = self._factors.get(key, factor)
        if known != factor:
            raise SampleTableError(
                f"{where}: expected per-world shape {known.shape} "
                f"({'categorical' if known.categorical else 'numeric'}), got {factor.shape} "
                f"({'categorical' if factor.categorical else 'numeric'})"
            )
        return factor

    def _sample(self, message: VariationSample) -> None:
        where = f"topic {message.topic!r}"
        worlds = self._worlds(where, message.run, message.worlds)
        n = worlds.shape[0]
        value, episodes_in = message.value, message.episodes
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in (value, episodes_in)]
        if shapes[0] == () or not isinstance(shapes[0], tuple) or shapes[0][0] != n or shapes[1] != (n,):
            raise SampleTableError(f"{where}: expected value and episodes with a leading dimension "
                                   f"of {n}, got shapes {shapes[0]} and {shapes[1]}")
        episodes = _column(where, "episodes", episodes_in, n, integral=True)
        if value.is_complex():
            raise SampleTableError(f"{where}: expected a real value, got {value.dtype}")
        factor = self._checked(where, message.key, _Factor(tuple(value.shape[1:]), message.labels is not None))
        raw = _host(value).reshape(n, factor.width)
        labels = None if message.labels is None else _labels(where, raw, message.labels)
        # checked: from here on nothing raises
        self._factors.setdefault(message.key, factor)
        if not n:  # the key is known; no world has a sample to keep
            return
        state = self._state(message.run, message.key, factor, worlds)
        values = raw.astype(np.float64)
        if message.phase == BUILD:
            state.build[worlds] = values
            if labels is not None:
                state.build_label[worlds] = labels
        else:
            state.value[worlds] = values
            state.episode[worlds] = episodes
            if labels is not None:
                state.label[worlds] = labels

    def _end(self, message: EpisodeEnd) -> None:
        where = f"topic {message.topic!r}"
        worlds = self._worlds(where, message.run, message.worlds)
        n = worlds.shape[0]
        episodes = _column(where, "episodes", message.episodes, n, integral=True)
        outcomes = np.stack([_column(where, name, getattr(message, name), n).astype(np.float64)
                             for name in OUTCOME_COLUMNS], axis=1).reshape(n, len(OUTCOME_COLUMNS))
        extra: dict[str, np.ndarray] = {}
        for name, t in message.outcomes.items():
            if not isinstance(name, str) or not name or name in RESERVED_OUTCOMES:
                raise SampleTableError(f"topic {message.topic!r}: outcome name {name!r:.80} must be a "
                                       f"non-empty str not in {sorted(RESERVED_OUTCOMES)}")
            if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.shape[0] != n or t.is_complex():
                got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise SampleTableError(f"topic {message.topic!r}: outcome {name!r}: expected a 1-D "
                                       f"numeric tensor of {n} values, got {got}")
            extra[name] = t.detach().to("cpu", torch.float64).numpy().copy()
        values: dict[str, np.ndarray] = {}
        labels: dict[str, np.ndarray] = {}
        capacity = self._capacity.get(message.run, 0)
        for key, state in self._runs.get(message.run, {}).items():
            known = worlds < capacity
            at = np.where(known, worlds, 0)
            current = known & (state.episode[at] == episodes)
            values[key] = np.where(current[:, None], state.value[at], state.build[at])
            values[key][~known] = np.nan
            if self._factors[key].categorical:
                label = np.where(current, state.label[at], state.build_label[at])
                label[~known] = None
                labels[key] = label
        self._chunks.append(_Chunk(message.run, worlds, episodes, outcomes, extra, values, labels))
        self._outcomes.update(extra)
        self._rows += n

    def add_run(self, run: str, samples: Mapping[str, Mapping[str, Any]], ends: Mapping[str, Any]) -> None:
        """Append the finished episodes of a whole run at once, as its messages delivered in
        publication order would: the table's rows are the same, in the same order (a reader
        of a store replays a stored run with it). Like a ``RunEnd``, it leaves no join state
        for the run; send its ``RunStart`` (for the declarations) as a message.

        Args:
            run: The run.
            samples: Variation key -> ``seq``, ``world``, ``episode`` (``(n,)`` int arrays: each
                sample's message number, world and episode), ``value`` (``(n, *shape)``),
                ``phase`` and ``labels`` (a sequence, or ``None`` for a numeric key), the
                samples of every message of that key, in stored (message, then row) order.
            ends: ``world``, ``episode``, ``seq`` (the message number of each episode's end),
                ``success``, ``terminated``, ``truncated``, ``length`` (``(m,)`` arrays) and
                ``outcomes`` (name -> ``(m,)`` numeric array), in stored order.

        Raises:
            SampleTableError: As the messages would raise it.
        """
        world_e = np.asarray(ends["world"], np.int64)
        order = np.argsort(np.asarray(ends["seq"], np.int64), kind="stable")  # end messages by number
        world_e, seq_e = world_e[order], np.asarray(ends["seq"], np.int64)[order]
        episode_e = np.asarray(ends["episode"], np.int64)[order]
        m = world_e.shape[0]
        outcomes = np.stack([np.asarray(ends[c])[order].astype(np.float64).reshape(m) for c in OUTCOME_COLUMNS],
                            axis=1)
        extra: dict[str, np.ndarray] = {}
        for name, column in (ends.get("outcomes", {}) if m else {}).items():
            if not isinstance(name, str) or not name or name in RESERVED_OUTCOMES:
                raise SampleTableError(f"run {run!r}: outcome name {name!r:.80} must be a non-empty str "
                                       f"not in {sorted(RESERVED_OUTCOMES)}")
            extra[name] = np.asarray(column)[order].astype(np.float64)
        values: dict[str, np.ndarray] = {}
        labels: dict[str, np.ndarray] = {}
        factors: dict[str, _Factor] = {}
        for key, s in samples.items():
            value = np.asarray(s["value"])
            n = value.shape[0] if value.ndim else -1
            if not n:  # no sample of the key: no message to join (a store holds no empty one)
                continue
            factor = factors[key] = self._checked(f"run {run!r} key {key!r}", key,
                                                  _Factor(tuple(value.shape[1:]), s.get("labels") is not None))
            world_s, episode_s = np.asarray(s["world"], np.int64), np.asarray(s["episode"], np.int64)
            seq_s = np.asarray(s["seq"], np.int64)
            if n < 0 or world_s.shape != (n,) or episode_s.shape != (n,) or seq_s.shape != (n,):
                raise SampleTableError(f"run {run!r} key {key!r}: expected value and episodes with a leading "
                                       f"dimension of {world_s.shape[0]}, got shapes {value.shape} and "
                                       f"{episode_s.shape}")
            raw = value.reshape(n, factor.width)
            label = _labels(f"run {run!r} key {key!r}", raw, s["labels"]) if factor.categorical else None
            # the world's last sample (by message number, then row) at or before the end's
            # number: a build-time key's value, else a run-time key's where drawn in that episode
            last = _last_at(world_s, seq_s, world_e, seq_e)
            found = last >= 0
            if s["phase"] == BUILD:
                use = found & (episode_e != -1)  # -1: the join state's "no run-time episode"
            else:
                use = found & (episode_s[np.maximum(last, 0)] == episode_e)
            values[key] = np.full((m, factor.width), np.nan)
            values[key][use] = raw[last[use]]
            if label is not None:
                labels[key] = np.full(m, None, dtype=object)
                labels[key][use] = label[last[use]]
        self._factors.update(factors)  # nothing is kept of a run that fails a check
        self._chunks.append(_Chunk(run, world_e, episode_e, outcomes, extra, values, labels))
        self._outcomes.update(extra)
        self._rows += m

    # -- reading -------------------------------------------------------------------------

    def __len__(self) -> int:
        return self._rows

    @property
    def keys(self) -> tuple[str, ...]:
        """The variation keys seen, sorted (the order of the factor columns)."""
        return tuple(sorted(self._factors))

    @property
    def x_columns(self) -> tuple[str, ...]:
        """Numeric factor columns: ``key`` for scalars, ``key[i]`` per vector component."""
        return tuple(c for k in self.keys for c in self._factors[k].columns(k))

    @property
    def y_columns(self) -> tuple[str, ...]:
        """Outcome columns: :data:`OUTCOME_COLUMNS`, then the extra outcomes seen, sorted."""
        return (*OUTCOME_COLUMNS, *sorted(self._outcomes))

    @property
    def columns(self) -> tuple[str, ...]:
        """Every row column: keys, factor values (with ``key.label`` after each categorical
        code), then the outcomes."""
        cols = ["run", "world", "episode"]
        for key in self.keys:
            cols += self._factors[key].columns(key)
            if self._factors[key].categorical:
                cols.append(f"{key}.label")
        return (*cols, *self.y_columns)

    def arrays(self) -> SampleArrays:
        """The whole table as owned numpy arrays (built on each call)."""
        keys = self.keys
        widths = [self._factors[k].width for k in keys]
        offsets = np.concatenate([[0], np.cumsum(widths, dtype=np.int64)])
        x = np.full((self._rows, int(offsets[-1])), np.nan)
        y_columns = self.y_columns
        extra = {name: len(OUTCOME_COLUMNS) + i for i, name in enumerate(y_columns[len(OUTCOME_COLUMNS):])}
        y = np.full((self._rows, len(y_columns)), np.nan)
        labels = {k: np.full(self._rows, None, dtype=object) for k in keys
                  if self._factors[k].categorical}
        runs: list[str] = []
        row = 0
        for chunk in self._chunks:
            end = row + chunk.world.shape[0]
            y[row:end, :len(OUTCOME_COLUMNS)] = chunk.outcomes
            for name, values in chunk.extra.items():
                y[row:end, extra[name]] = values
            runs += [chunk.run] * (end - row)
            for i, key in enumerate(keys):
                if key in chunk.values:
                    x[row:end, offsets[i]:offsets[i + 1]] = chunk.values[key]
                if key in chunk.labels:
                    labels[key][row:end] = chunk.labels[key]
            row = end
        empty = np.empty(0, dtype=np.int64)
        world = np.concatenate([c.world for c in self._chunks]) if self._chunks else empty
        episode = np.concatenate([c.episode for c in self._chunks]) if self._chunks else empty
        return SampleArrays(np.array(runs, dtype=str), world, episode, x, y, self.x_columns,
                            y_columns, labels)

    def to_numpy(self) -> tuple[np.ndarray, np.ndarray]:
        """``(X, Y)``: factors and outcomes; column names in ``x_columns`` and
        ``y_columns``."""
        a = self.arrays()
        return a.x, a.y

    def _columns(self) -> dict[str, np.ndarray]:
        a = self.arrays()
        out: dict[str, np.ndarray] = {"run": a.run, "world": a.world, "episode": a.episode}
        j = 0
        for key in self.keys:
            factor = self._factors[key]
            for name in factor.columns(key):
                out[name] = a.x[:, j]
                j += 1
            if factor.categorical:
                out[f"{key}.label"] = a.labels[key]
        for i, name in enumerate(a.y_columns):
            if i < len(OUTCOME_COLUMNS):
                out[name] = a.y[:, i].astype(np.int64 if name == "length" else bool)
            else:
                out[name] = a.y[:, i]
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One dict per finished episode, keyed by ``columns`` (Python scalars)."""
        cols = self._columns()
        lists = {name: np.asarray(col, dtype=object).tolist() if name.endswith(".label")
                 else np.asarray(col).tolist() for name, col in cols.items()}
        return [{name: lists[name][i] for name in cols} for i in range(self._rows)]

    def to_pandas(self) -> Any:
        """The table as a ``pandas.DataFrame`` (pandas is imported here, on demand).

        Raises:
            ImportError: pandas is not installed.
        """
        try:
            pandas = importlib.import_module("pandas")
        except ImportError as exc:
            raise ImportError("SampleTable.to_pandas() needs pandas: pip install pandas") from exc
        return pandas.DataFrame(self._columns())
