"""The tables the reader returns: :class:`Table` (equal-length numpy columns: the episode
list, queries, gaps, variation samples) and :class:`EpisodeBatch` (many episodes' rows read at
once, :meth:`storage.RunStore.read_batch`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["EpisodeBatch", "Table"]


@dataclass(frozen=True, slots=True)
class Table:
    """Equal-length numpy columns. Filter with :meth:`where` or :meth:`filter`."""

    columns: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __getitem__(self, column: str) -> np.ndarray:
        return self.columns[column]

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def where(self, mask: np.ndarray) -> Table:
        """The rows where the boolean ``mask`` is true (or, given integers, the rows at those
        positions, in that order)."""
        return Table({k: v[mask] for k, v in self.columns.items()})

    def filter(self, **equal: Any) -> Table:
        """The rows whose columns equal the given values (``filter(success=True, world=3)``)."""
        mask = np.ones(len(self), bool)
        for column, value in equal.items():
            if column not in self.columns:
                raise KeyError(f"filter: no column {column!r}; columns are {sorted(self.columns)}")
            mask &= self.columns[column] == value
        return self.where(mask)

    def rows(self) -> list[dict[str, Any]]:
        """The rows as dicts of Python scalars."""
        return [{k: v[i].item() if hasattr(v[i], "item") else v[i] for k, v in self.columns.items()}
                for i in range(len(self))]

    def to_pandas(self) -> Any:
        """A ``pandas.DataFrame`` (pandas is imported lazily)."""
        import pandas as pd  # type: ignore[import-untyped]

        return pd.DataFrame({k: list(v) if v.ndim > 1 else v for k, v in self.columns.items()})


@dataclass(frozen=True, slots=True, eq=False)
class EpisodeBatch:
    """Many episodes of one run read at once (:meth:`RunStore.read_batch`): the rows of every
    episode concatenated, field by field.

    The rows of episode ``i`` (row ``i`` of :attr:`table`) in field ``name`` are
    ``data[name][offsets[name][i]:offsets[name][i + 1]]``; the fields of one term share one
    offsets array. :meth:`episode` cuts them out.

    Attributes:
        run: The run read (``None`` for an empty selection of no particular run).
        table: The episodes, one row each, in the order read.
        data: ``"<term>/<field>"`` -> the rows of every episode, concatenated (bfloat16 fields
            as float32, as :meth:`RunStore.episode` returns them).
        offsets: ``"<term>/<field>"`` -> ``len(table) + 1`` int64 row offsets into ``data``.
    """

    run: str | None
    table: Table
    data: Mapping[str, np.ndarray]
    offsets: Mapping[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.table)

    def episode(self, i: int) -> dict[str, np.ndarray]:
        """Episode ``i``: the same keys and values as :meth:`RunStore.episode` (views into
        :attr:`data`)."""
        return {name: values[self.offsets[name][i]:self.offsets[name][i + 1]]
                for name, values in self.data.items()}

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        """The episodes in order, as :meth:`episode` gives them."""
        return (self.episode(i) for i in range(len(self)))
