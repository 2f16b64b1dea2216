"""The lifecycle points a store's ``_hook`` codes index: one list for the message types, the
recorder and the store, append-only, and the root attribute that names them."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import zarr

from broker.messages import Hook
from capture.terms import HOOKS as CAPTURE_HOOKS
from storage import RunStoreWriter, StoreFormatError
from storage._format import HOOKS


def test_one_append_only_hook_list() -> None:
    """Catches a lifecycle point known to the messages but not to the store (its batches would
    be refused) and codes 0-3 changing meaning (every existing store would read wrong)."""
    assert HOOKS[:4] == ("pre_step", "post_step", "pre_reset", "post_reset")
    assert set(HOOKS) == set(get_args(Hook)) == set(CAPTURE_HOOKS)
    assert len(set(HOOKS)) == len(HOOKS)


def _root(path: Path, hooks: object) -> None:
    RunStoreWriter(path)
    root = zarr.open_group(path, mode="a")
    root.update_attributes({"worldtap": {**root.attrs["worldtap"], "hooks": hooks}})


def _hooks(path: Path) -> object:
    return zarr.open_group(path, mode="r").attrs["worldtap"]["hooks"]


@pytest.mark.parametrize("hooks", [["post_step", "pre_step"], ["a"], "pre_step", None])
def test_a_foreign_hook_list_is_refused_untouched(tmp_path: Path, hooks: object) -> None:
    """Catches a writer that appends codes to a store whose codes mean other points."""
    path = tmp_path / "s.zarr"
    _root(path, hooks)
    with pytest.raises(StoreFormatError, match="hooks"):
        RunStoreWriter(path)
    assert _hooks(path) == hooks


def test_older_lists_are_extended_newer_ones_kept(tmp_path: Path) -> None:
    """Catches an old store (four hooks) left without a name for code 4, and a store of a newer
    writer (more hooks) cut back to this one's list."""
    old, new = tmp_path / "old.zarr", tmp_path / "new.zarr"
    _root(old, list(HOOKS[:4]))
    RunStoreWriter(old)
    assert _hooks(old) == list(HOOKS)
    _root(new, [*HOOKS, "later"])
    RunStoreWriter(new)
    assert _hooks(new) == [*HOOKS, "later"]
