"""Queries on the episode table: the where-expressions of :meth:`storage.RunStore.query`, and
``worldtap-store episodes``, which prints the table.

An expression is a Python-like condition over the table's columns, evaluated column-wise on
numpy arrays (it is parsed with :mod:`ast` and never run as Python code):

- columns by name (``success``, ``length``, ``mass``, an outcome such as ``return``); a
  vector variation's components as ``pole[0]`` (2-D: ``pole[0, 1]``), a categorical label as
  ``color.label``; any other name in backticks (`` `my outcome` ``);
- numbers, strings, ``True``, ``False``, ``None``; ``+ - * / // % **``;
- comparisons ``== != < <= > >=`` (chained: ``0.1 < mass <= 0.3``), ``in`` / ``not in`` a
  list (``world in [0, 3]``);
- ``and``, ``or``, ``not`` (and ``&``, ``|``, ``~``) on conditions;
- ``abs(x)``, ``isnan(x)``, ``isfinite(x)``.

Comparisons with NaN (an episode without that value) are false.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import keyword
import math
import re
import sys
import tokenize
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = ["HELP", "QueryError", "add_arguments", "evaluate", "run"]

HELP = "print a store's episode table, its variation values joined, filtered by an expression"


class QueryError(ValueError):
    """A where-expression that cannot be parsed or evaluated (the message says why)."""


_BACKTICKS = re.compile(r"`([^`]*)`")
_SYNTAX = frozenset({"and", "or", "not", "in", "is", "True", "False", "None"})
_FUNCTIONS: Mapping[str, Callable[[Any], Any]] = {"abs": np.abs, "isnan": np.isnan, "isfinite": np.isfinite}
_BINARY: Mapping[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: np.add, ast.Sub: np.subtract, ast.Mult: np.multiply, ast.Div: np.true_divide,
    ast.FloorDiv: np.floor_divide, ast.Mod: np.mod, ast.Pow: np.power, ast.BitAnd: np.bitwise_and,
    ast.BitOr: np.bitwise_or, ast.BitXor: np.bitwise_xor,
}
_COMPARE: Mapping[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: np.equal, ast.NotEq: np.not_equal, ast.Lt: np.less, ast.LtE: np.less_equal,
    ast.Gt: np.greater, ast.GtE: np.greater_equal,
}


def evaluate(where: str, columns: Mapping[str, np.ndarray], rows: int) -> np.ndarray:
    """The rows of a table where ``where`` holds.

    Args:
        where: The expression (see the module's documentation).
        columns: The table's columns by name, each of ``rows`` values.
        rows: The table's length.

    Returns:
        A boolean mask of ``rows`` values.

    Raises:
        QueryError: ``where`` is not a str, cannot be parsed, uses something other than the
            above, names an unknown column (the message lists the columns), or does not give
            one True/False per row.
    """
    if not isinstance(where, str) or not where.strip():
        raise QueryError(f"where: expected a non-empty expression, got {where!r}")
    quoted: dict[str, str] = {}

    def quote(match: re.Match[str]) -> str:
        quoted[f"__q{len(quoted)}__"] = match.group(1)
        return f" __q{len(quoted) - 1}__ "

    text = _BACKTICKS.sub(quote, where)
    try:
        tokens: list[tuple[int, str]] = []
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            string = tok.string
            if tok.type == tokenize.NAME and keyword.iskeyword(string) and string not in _SYNTAX:
                string = f"__q{len(quoted)}__"  # a column named like a keyword: return
                quoted[string] = tok.string
            tokens.append((tok.type, string))
        tree = ast.parse(tokenize.untokenize(tokens).strip(), mode="eval")
    except (SyntaxError, tokenize.TokenError) as exc:
        raise QueryError(f"where: cannot parse {where!r}: {exc.args[0] if exc.args else exc}") from None
    try:
        with np.errstate(all="ignore"):
            value = np.asarray(_Evaluator(where, columns, quoted).visit(tree.body))
    except QueryError:
        raise
    except Exception as exc:  # numpy refusing an operation: a str compared with a number, ...
        raise QueryError(f"where: {where!r} cannot be evaluated: {exc}") from None
    if value.dtype != bool:
        raise QueryError(f"where: {where!r} gives {value.dtype} values, not a condition (True/False)")
    if value.ndim == 0:
        return np.full(rows, bool(value))
    if value.shape != (rows,):
        raise QueryError(f"where: {where!r} gives shape {value.shape}, expected one value per row ({rows})")
    return value


class _Evaluator:
    """Evaluates an expression tree over numpy columns; anything not listed is refused."""

    def __init__(self, where: str, columns: Mapping[str, np.ndarray], quoted: Mapping[str, str]) -> None:
        self.where, self.columns, self.quoted = where, columns, quoted

    def fail(self, what: str) -> QueryError:
        return QueryError(f"where: {what} in {self.where!r}")

    def column(self, name: str) -> np.ndarray:
        if name not in self.columns:
            raise QueryError(f"where: unknown column {name!r} in {self.where!r}; columns: "
                             f"{list(self.columns)}")
        return self.columns[name]

    def name(self, node: ast.expr) -> str | None:
        """The column name ``node`` spells (``mass``, ``pole[0]``, ``color.label``), if any."""
        if isinstance(node, ast.Name):
            return self.quoted.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.name(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Subscript):
            base = self.name(node.value)
            parts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            if base is None or not all(isinstance(p, ast.Constant) and type(p.value) is int for p in parts):
                return None
            return f"{base}[{','.join(str(p.value) for p in parts if isinstance(p, ast.Constant))}]"
        return None

    def condition(self, node: ast.expr) -> Any:
        value = self.visit(node)
        if np.asarray(value).dtype != bool:
            raise self.fail(f"{ast.unparse(node)!r} is not a condition (True/False)")
        return value

    def visit(self, node: ast.expr) -> Any:
        name = self.name(node)
        if name is not None:
            return self.column(name)
        if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, int | float | str)):
            return node.value
        if isinstance(node, ast.BoolOp):
            combine = np.logical_and if isinstance(node.op, ast.And) else np.logical_or
            out = self.condition(node.values[0])
            for other in node.values[1:]:
                out = combine(out, self.condition(other))
            return out
        if isinstance(node, ast.UnaryOp):
            if isinstance(node.op, ast.Not):
                return np.logical_not(self.condition(node.operand))
            operand = self.visit(node.operand)
            if isinstance(node.op, ast.Invert):
                return np.invert(operand)
            return np.negative(operand) if isinstance(node.op, ast.USub) else np.positive(operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](self.visit(node.left), self.visit(node.right))
        if isinstance(node, ast.Compare):
            result: Any = True
            left = self.visit(node.left)
            for op, comparator in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn):
                    if not isinstance(comparator, ast.List | ast.Tuple | ast.Set):
                        raise self.fail("'in' takes a list of values ([1, 2])")
                    options = [self.visit(e) for e in comparator.elts]
                    hit = np.zeros(np.shape(left), bool)
                    for option in options:
                        hit = hit | np.equal(left, option)
                    result = np.logical_and(result, hit if isinstance(op, ast.In) else ~hit)
                    continue
                if type(op) not in _COMPARE:
                    raise self.fail(f"{type(op).__name__} is not allowed (use == and !=)")
                right = self.visit(comparator)
                result = np.logical_and(result, _COMPARE[type(op)](left, right))
                left = right
            return result
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS:
            if node.keywords or len(node.args) != 1:
                raise self.fail(f"{node.func.id}() takes one argument")
            return _FUNCTIONS[node.func.id](self.visit(node.args[0]))
        raise self.fail(f"{ast.unparse(node)!r} is not allowed (columns, constants, arithmetic, "
                        f"comparisons, and/or/not, {', '.join(f + '()' for f in _FUNCTIONS)})")


# -- worldtap-store episodes ----------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worldtap-store episodes``."""
    parser.add_argument("store", help="local directory or zarr/fsspec URL of a run store")
    parser.add_argument("--run", default=None, help="one run (default: every run)")
    parser.add_argument("--where", default=None, metavar="EXPR",
                        help="keep the episodes where EXPR holds, e.g. \"not success and mass > 0.3\"")
    parser.add_argument("--columns", nargs="+", default=None, metavar="COLUMN",
                        help="columns to print, in order (space- or comma-separated; default all)")
    parser.add_argument("--limit", type=_count, default=None, metavar="N", help="print the first N rows")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line (NaN as null) instead of aligned text")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    """Print the episode table; returns 0, 2 (a bad expression, run or column) or 3 (a store
    that cannot be opened or is damaged), with one line on stderr for an error."""
    from .errors import RunNotFoundError, StorageError
    from .reader import RunStore

    def fail(code: int, message: object) -> int:
        print(f"worldtap-store episodes: {message}", file=sys.stderr)
        return code

    try:
        store = RunStore(args.store)
    except StorageError as exc:
        return fail(3, exc)
    try:
        table = store.query(args.where, run=args.run)
    except (QueryError, RunNotFoundError) as exc:
        return fail(2, exc)
    except StorageError as exc:
        return fail(3, exc)
    names = list(table.columns)
    if args.columns is not None:
        names = [c for item in args.columns for c in item.split(",") if c]
        unknown = [c for c in names if c not in table.columns]
        if unknown:
            return fail(2, f"no column(s) {unknown}; columns: {list(table.columns)}")
    count = len(table) if args.limit is None else min(args.limit, len(table))
    cells = {c: [_plain(v) for v in table[c][:count].tolist()] for c in names}
    out = sys.stdout
    if args.json:
        for i in range(count):
            out.write(json.dumps({c: cells[c][i] for c in names}) + "\n")
        return 0
    text = {c: [_text(v) for v in cells[c]] for c in names}
    widths = {c: max([len(c), *(len(t) for t in text[c])]) for c in names}
    right = {c: all(isinstance(v, int | float) for v in cells[c]) for c in names}
    out.write("  ".join(c.rjust(widths[c]) if right[c] else c.ljust(widths[c]) for c in names).rstrip() + "\n")
    for i in range(count):
        out.write("  ".join(text[c][i].rjust(widths[c]) if right[c] else text[c][i].ljust(widths[c])
                            for c in names).rstrip() + "\n")
    return 0


def _plain(value: Any) -> Any:
    """A table cell as JSON takes it: NaN and infinities as ``None``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "-" if value is None else str(value)
