"""``TopicSchema.check`` of numpy arrays (the daemon's decoder hands it numpy arrays) compares
dtypes without spelling each array's dtype name (numpy's ``dtype.name`` is Python code, a
microsecond a field). It must refuse exactly what the names refuse: another dtype, a
non-native byte order, bfloat16 bits where uint16 is expected and the other way round."""

from __future__ import annotations

import numpy as np
import pytest

from broker import BFloat16Bits, FieldSpec, SchemaError, TopicSchema
from broker.schema import dtype_name

SPEC_DTYPES = ["float32", "float64", "float16", "bfloat16", "uint16", "int16", "int64", "uint8", "int8",
               "bool", "complex64", "complex128", "uint32", "uint64", "float8_e4m3fn"]


def _arrays() -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for name in ["float32", "float64", "float16", "uint16", "int16", "int64", "uint8", "int8", "bool",
                 "complex64", "complex128", "uint32", "uint64"]:
        a = np.zeros((2, 3), name)
        out.append(a)
        if a.dtype.itemsize > 1:
            out.append(a.astype(a.dtype.newbyteorder()))  # non-native: no schema accepts it
    out.append(np.zeros((2, 3), np.uint16).view(BFloat16Bits))
    return out


@pytest.mark.parametrize("spec_dtype", SPEC_DTYPES)
def test_numpy_dtypes_are_checked_as_their_names_are(spec_dtype: str) -> None:
    schema = TopicSchema({"x": FieldSpec(spec_dtype, (3,))})
    for array in _arrays():
        if dtype_name(array) == spec_dtype:
            schema.check({"x": array}, topic="t", rows=2)
        else:
            with pytest.raises(SchemaError, match="field 'x': expected"):
                schema.check({"x": array}, topic="t", rows=2)
