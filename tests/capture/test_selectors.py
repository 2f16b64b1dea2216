from __future__ import annotations

import numpy as np
import pytest
import torch

from capture import SelectorError, normalize_worlds

N = 6

DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        (None, [0, 1, 2, 3, 4, 5]),
        (3, [3]),
        (np.int64(2), [2]),
        ([4, 1], [4, 1]),
        ((0, 1), [0, 1]),
        ((5,), [5]),
        (range(1, 5, 2), [1, 3]),
        (slice(None), [0, 1, 2, 3, 4, 5]),
        (slice(-2, None), [4, 5]),
        (slice(None, None, -2), [5, 3, 1]),
        (slice(10, 20), []),
        (torch.tensor([2, 0]), [2, 0]),
        (torch.tensor(4), [4]),
        (torch.tensor([1, 3], dtype=torch.int32), [1, 3]),
        (np.array([5, 0]), [5, 0]),
        (np.array([5, 0], dtype=">i4"), [5, 0]),
        (np.arange(6)[::-2], [5, 3, 1]),
        (torch.tensor([True, False, False, True, False, True]), [0, 3, 5]),
        (np.array([False] * N), []),
        ([], []),
        ((), []),
        (torch.tensor([], dtype=torch.int64), []),
    ],
)
def test_accepted_forms(selector: object, expected: list[int]) -> None:
    out = normalize_worlds(selector, N)  # type: ignore[arg-type]
    assert out.dtype == torch.int64
    assert out.dim() == 1
    assert out.tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_result_lives_on_the_requested_device(device: str) -> None:
    out = normalize_worlds((0, 1), N, device)
    assert out.device.type == device
    assert normalize_worlds(torch.tensor([True] * N), N, device).device.type == device


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (6, r"worlds: expected world indices in \[0, 6\), got \[6\] out of range"),
        (-1, r"worlds: expected world indices in \[0, 6\), got \[-1\] out of range"),
        ((0, 7, 9), r"worlds: expected world indices in \[0, 6\), got \[7, 9\] out of range"),
        (torch.tensor([1, 6]), r"got \[6\] out of range"),
        (range(4, 8), r"got \[6, 7\] out of range"),
        ((1, 2, 1), r"worlds: expected distinct world indices, got duplicates \[1\]"),
        (torch.tensor([3, 3, 0, 0]), r"expected distinct world indices, got duplicates \[0, 3\]"),
        (torch.tensor([True, False]), r"worlds: expected a boolean mask of shape \(6,\), got shape \(2,\)"),
        (np.ones((2, 3), dtype=bool), r"expected a boolean mask of shape \(6,\), got shape \(2, 3\)"),
        (torch.tensor([0.0, 1.0]), r"worlds: expected an integer or bool tensor, got dtype torch.float32"),
        (torch.zeros((2, 2), dtype=torch.int64), r"expected a 1-D index tensor, got shape \(2, 2\)"),
        ((0, 1.5), r"worlds: expected a sequence of int world indices, got element 1.5 of type float"),
        ([True, False], r"got element True of type bool"),
        (True, r"worlds: expected world indices or a boolean mask, got the bool True"),
        ("01", r"worlds: expected None, an int, a sequence of ints, .* got str '01'"),
        (2.0, r"got float 2.0"),
        (slice(None, None, 0), r"worlds: expected a slice of int bounds and a non-zero int step, got slice\(None, None, 0\)"),
        (slice(0.5, 3), r"worlds: expected a slice of int bounds and a non-zero int step"),
        (np.array(["1"]), r"worlds: expected an integer or bool array, got dtype <U1"),
        (np.array([1.0]), r"worlds: expected an integer or bool array, got dtype float64"),
        (range(10**15), r"worlds: expected world indices in \[0, 6\), got \[6, 7, 8, 9, 10, 11, 12, 13, \.\.\.\]"),
    ],
)
def test_rejected_forms_name_the_argument(selector: object, message: str) -> None:
    with pytest.raises(SelectorError, match=message):
        normalize_worlds(selector, N)  # type: ignore[arg-type]


def test_selector_error_is_a_value_error_and_names_the_argument() -> None:
    with pytest.raises(ValueError, match=r"^env_ids: "):
        normalize_worlds(9, N, name="env_ids")


def test_does_not_alias_the_callers_tensor_on_another_dtype() -> None:
    src = torch.tensor([1, 2], dtype=torch.int32)
    out = normalize_worlds(src, N)
    src[0] = 5
    assert out.tolist() == [1, 2]
