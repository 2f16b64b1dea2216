"""The schema of a topic: field name -> dtype and per-world shape, compared by name only.

One type, :class:`TopicSchema`, is what the recorder fixes with a topic's first batch, what
retention allocates its buffers from, and what the storage daemon checks batches against. It
never depends on the order of a mapping's keys: equality and checks go by field name, and
:meth:`TopicSchema.ordered` is the one canonical order (sorted names) for anything positional.

Dtype names use the ``torch`` spelling (``"float32"``, ``"bool"``, ``"bfloat16"``). A numpy
array is spelled by its dtype's name, which agrees with torch's for every dtype both have; a
:class:`BFloat16Bits` array (bfloat16 values as their bits) is spelled ``"bfloat16"``. Nothing
here imports torch until a torch tensor or a dtype name only torch knows turns up, so the
storage daemon checks numpy arrays without it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypeAlias, TypeGuard, TypeVar

import numpy as np

from .errors import SchemaError

if TYPE_CHECKING:
    import torch

__all__ = ["Array", "BFloat16Bits", "FieldSpec", "TopicSchema", "dtype_name", "is_tensor"]

Array: TypeAlias = "torch.Tensor | np.ndarray"
"""What a schema describes: a batched tensor, or a numpy array (the daemon's decoded view)."""

T = TypeVar("T")

_PLAIN: Final = frozenset({
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16",
    "bfloat16", "float32", "float64", "complex64", "complex128",
})
"""Canonical dtype names that torch and numpy spell alike (and bfloat16): known without torch."""


class BFloat16Bits(np.ndarray):
    """bfloat16 values as their 16 bits: a ``uint16`` numpy array that :func:`dtype_name` spells
    ``"bfloat16"`` (numpy has no bfloat16). The wire decoder's numpy arrays hold bfloat16 tensors
    so. Its values are bits: arithmetic on it is integer arithmetic."""


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    """Whether ``value`` is a ``torch.Tensor``, without importing torch (no tensor exists before
    torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _canonical(name: str) -> str | None:
    """The canonical torch spelling of dtype name ``name`` (``"float"`` -> ``"float32"``), or
    ``None`` when torch has no such dtype (or is not installed and ``name`` is not plain)."""
    if name in _PLAIN:
        return name
    try:
        import torch
    except ImportError:
        return None
    dtype = getattr(torch, name, None)
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None


def _numpy_of(name: str) -> tuple[np.dtype[Any] | None, bool]:
    """The native numpy dtype an array of canonical dtype ``name`` has, and whether it is a
    :class:`BFloat16Bits` array (``"bfloat16"``: uint16); ``None`` where numpy has no such
    dtype (the array's name is then compared)."""
    if name == "bfloat16":
        return np.dtype(np.uint16), True
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None, False
    return (dtype, False) if dtype.name == name and dtype.isnative else (None, False)


def dtype_name(value: Array) -> str:
    """The dtype of ``value`` in torch spelling (``torch.float32`` and numpy ``float32`` are
    both ``"float32"``, a :class:`BFloat16Bits` array is ``"bfloat16"``). A numpy array in a
    non-native byte order is spelled like ``">f4"``, which no schema accepts."""
    if isinstance(value, np.ndarray):
        dtype = value.dtype
        if isinstance(value, BFloat16Bits) and dtype == np.uint16:
            return "bfloat16"
        return dtype.name if dtype.isnative else dtype.str
    return str(value.dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """Schema of one field: dtype name (``torch`` spelling, e.g. ``"float32"``) and the
    per-world trailing shape (the shape without the leading worlds dimension).

    Raises:
        SchemaError: ``dtype`` is not the name of a torch dtype, or ``shape`` holds something
            other than non-negative ints.
    """

    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        canonical = _canonical(self.dtype) if isinstance(self.dtype, str) else None
        if canonical is None:
            raise SchemaError(f"dtype: expected the name of a torch dtype (e.g. 'float32'), got {self.dtype!r}")
        # Canonical spelling, so that aliases ("float", "long") compare equal to it.
        object.__setattr__(self, "dtype", canonical)
        shape: object = self.shape
        if not isinstance(shape, tuple) or any(
            isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0 for d in shape
        ):
            raise SchemaError(f"shape: expected a tuple of non-negative ints, got {shape!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in shape))

    @classmethod
    def of(cls, value: Array) -> FieldSpec:
        """The spec of a batched tensor or array whose first dimension is the worlds dimension.

        Raises:
            SchemaError: ``value`` has no dimension, or a dtype torch does not have.
        """
        return TopicSchema.of({"value": value}).fields["value"]

    @property
    def torch_dtype(self) -> torch.dtype:
        """The ``torch.dtype`` named by :attr:`dtype` (imports torch)."""
        import torch

        dtype: torch.dtype = getattr(torch, self.dtype)  # a torch dtype: checked in __post_init__
        return dtype

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> FieldSpec:
        return cls(str(value["dtype"]), tuple(int(d) for d in value["shape"]))


@dataclass(frozen=True, slots=True)
class TopicSchema:
    """Field name -> :class:`FieldSpec` of one topic; equality and checks are by name, never by
    order.

    Immutable: ``fields`` is a read-only copy in canonical order (sorted names), whatever order
    the mapping given had. Two schemas are equal when they name the same fields with the same
    specs.

    Raises:
        SchemaError: A field name is not a non-empty str, or a value is not a :class:`FieldSpec`.
    """

    fields: Mapping[str, FieldSpec]
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    _name_set: frozenset[str] = field(init=False, repr=False, compare=False)
    _expect: tuple[tuple[str, FieldSpec], ...] = field(init=False, repr=False, compare=False)
    _torch: tuple[torch.dtype, ...] | None = field(init=False, repr=False, compare=False)
    _numpy: tuple[tuple[np.dtype[Any] | None, bool], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, spec in self.fields.items():
            if not isinstance(name, str) or not name:
                raise SchemaError(f"fields: expected non-empty str field names, got {name!r}")
            if not isinstance(spec, FieldSpec):
                raise SchemaError(f"fields: field {name!r}: expected a FieldSpec, got {type(spec).__name__}")
        names = tuple(sorted(self.fields))
        object.__setattr__(self, "fields", MappingProxyType({n: self.fields[n] for n in names}))
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_name_set", frozenset(names))
        object.__setattr__(self, "_expect", tuple(self.fields.items()))
        object.__setattr__(self, "_torch", None)  # the torch dtypes, on the first tensor checked
        object.__setattr__(self, "_numpy", tuple(_numpy_of(spec.dtype) for _, spec in self._expect))

    def __hash__(self) -> int:
        return hash(tuple(self.fields.items()))

    @classmethod
    def of(cls, fields: Mapping[str, Array], *, topic: str | None = None) -> TopicSchema:
        """The schema of a batch's fields (per-world shape = ``shape[1:]``).

        Args:
            fields: Field name -> batched tensor or array; only read.
            topic: Named in error messages.

        Raises:
            SchemaError: A value has no leading dimension or a dtype torch does not have.
        """
        specs: dict[str, FieldSpec] = {}
        for name, value in fields.items():
            if not isinstance(value, np.ndarray) and not is_tensor(value):
                raise _not_an_array(topic, name, value)
            if value.ndim == 0:
                raise SchemaError(f"{_where(topic, name)}: expected a leading worlds dimension, got shape ()")
            dtype = dtype_name(value)
            if _canonical(dtype) is None:
                raise SchemaError(f"{_where(topic, name)}: expected a dtype torch has, got {dtype!r}")
            specs[name] = FieldSpec(dtype, tuple(value.shape[1:]))
        return cls(specs)

    @property
    def names(self) -> tuple[str, ...]:
        """The field names in canonical order (sorted)."""
        return self._names

    def check(self, fields: Mapping[str, Array], *, topic: str, rows: int | None = None) -> None:
        """Check ``fields`` against this schema, by name.

        Args:
            fields: Field name -> batched tensor or array; only read (shapes and dtypes).
            topic: The topic the fields belong to, named in the error.
            rows: When given, the leading dimension every field must have.

        Raises:
            SchemaError: A field is missing or extra, or has another dtype, per-world shape or
                leading dimension; the message names the topic, the field, what was expected
                and what was received.
        """
        if fields.keys() != self._name_set:
            got = sorted(fields, key=str)
            missing = [n for n in self._names if n not in fields]
            extra = [n for n in got if n not in self._name_set]
            raise SchemaError(f"topic {topic!r}: expected fields {list(self._names)}, got {got} "
                              f"(missing {missing}, extra {extra})")
        for i, (name, spec) in enumerate(self._expect):
            value = fields[name]
            if is_tensor(value):
                same = value.dtype == self._torch_dtypes()[i]
            elif isinstance(value, np.ndarray):
                want, bits = self._numpy[i]  # (numpy's dtype.name is Python code: slow per field)
                same = value.dtype == want and value.dtype.isnative and isinstance(value, BFloat16Bits) == bits \
                    if want is not None else dtype_name(value) == spec.dtype
            else:
                raise _not_an_array(topic, name, value)
            shape = value.shape
            if not same or not shape or shape[1:] != spec.shape:
                got_shape = f"per-world shape {tuple(shape[1:])}" if shape else "no worlds dimension (shape ())"
                raise SchemaError(f"topic {topic!r} field {name!r}: expected {spec.dtype} per-world shape "
                                  f"{spec.shape}, got {dtype_name(value)} {got_shape}")
            if rows is not None and shape[0] != rows:
                raise SchemaError(f"topic {topic!r} field {name!r}: expected a leading worlds dimension of "
                                  f"{rows}, got shape {tuple(shape)}")

    def _torch_dtypes(self) -> tuple[torch.dtype, ...]:
        """The torch dtype of each field, in canonical order (made once, on first use)."""
        dtypes = self._torch
        if dtypes is None:
            dtypes = tuple(spec.torch_dtype for _, spec in self._expect)
            object.__setattr__(self, "_torch", dtypes)
        return dtypes

    def ordered(self, fields: Mapping[str, T]) -> list[T]:
        """The values of ``fields`` in this schema's canonical order (sorted names).

        Raises:
            SchemaError: A field of the schema is missing from ``fields``.
        """
        try:
            return [fields[name] for name in self._names]
        except KeyError as exc:
            raise SchemaError(f"fields: expected the fields {list(self._names)}, got {sorted(fields, key=str)} "
                              f"(missing {exc.args[0]!r})") from None

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """``{field: {"dtype": ..., "shape": [...]}}`` in canonical order (msgpack/JSON-able)."""
        return {name: spec.to_dict() for name, spec in self.fields.items()}

    @classmethod
    def from_dict(cls, value: Mapping[str, Mapping[str, Any]]) -> TopicSchema:
        """The inverse of :meth:`to_dict`.

        Raises:
            SchemaError: An entry is not a valid field spec.
        """
        try:
            return cls({name: FieldSpec.from_dict(spec) for name, spec in value.items()})
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, SchemaError):
                raise
            raise SchemaError(f"value: expected {{field: {{'dtype': str, 'shape': [int, ...]}}}}, "
                              f"got {value!r}") from exc


def _where(topic: str | None, name: str) -> str:
    return f"field {name!r}" if topic is None else f"topic {topic!r} field {name!r}"


def _not_an_array(topic: str | None, name: str, value: object) -> SchemaError:
    return SchemaError(f"{_where(topic, name)}: expected a torch.Tensor or numpy.ndarray, "
                       f"got {type(value).__name__}")
