"""``worldtap-store export``: a run's episodes in the formats people train with.

Two formats, each written with its own library (imported on first use; ``pip install
'worldtap[export]'``):

- ``isaaclab-hdf5`` (h5py): the file Isaac Lab's recorder writes (``HDF5DatasetFileHandler``),
  which Isaac Lab's replay and mimic tools and robomimic read: ``data/demo_<i>/<key path>``
  datasets (gzip), ``data.attrs`` ``total`` (the sum of ``num_samples``) and ``env_args``
  (JSON: ``env_name``, ``type`` 2, and ``worldtap``: run, seed, metadata), each demo's attrs
  ``num_samples`` (rows of its ``actions``; 0 without), ``success``, ``seed`` (the run seed,
  when the run has one) and ``worldtap_world``/``worldtap_index`` (the episode it came from).
  Demos are numbered ``demo_0``, ``demo_1``, ... in the order the episodes ended (episodes
  that ended at one step in world order), as Isaac Lab numbers them; an episode with the
  outcome ``demo_id`` (Isaac Lab's ``export_episodes(demo_ids=...)``) is ``demo_<demo_id>``.
- ``minari`` (minari): a Minari dataset (``minari.load_dataset(id)``): per episode the
  observations (one more than the actions: the first observation and each step's next one),
  actions, rewards, terminations and truncations.

Mapping (``isaaclab-hdf5``): every field ``<term>/<field>`` of an episode
(:meth:`storage.RunStore.episode`) becomes the dataset at key path ``<field>`` (``--paths
field``, the default: a field recorded from an Isaac Lab term is that term's key path, e.g.
``obs/joint_pos``, so the term name is dropped) or ``<term>/<field>`` (``--paths term``);
``--rename`` sets the path of single fields. When several fields land on one path, their rows
are concatenated in the order they were recorded, as Isaac Lab's recorder appends them: by
step, then lifecycle point (``post_reset``, ``pre_step``, ``post_physics_decimation_step``,
``post_step``, ``pre_reset``), then the run's term order (the order in which the terms first
recorded), read from :meth:`storage.RunStore.episode_rows`. A path without rows in an episode
is left out of that demo, as Isaac Lab does; an episode with no rows at all is skipped.

Mapping (``minari``): each role names sources ``<term>/<path>``: a field, or a prefix whose
fields become a ``Dict`` space (``obs/<key>`` fields under ``reset/obs``). Observations take
several sources, concatenated in recording order like above. A store recorded by
:class:`capture.RecordingVectorEnv` has defaults: observations ``reset/obs`` then
``step/next_obs`` (the episode's first observation, then each step's next one, ending with
the final observation), actions ``step/action``, rewards ``step/reward``, terminations
``step/terminated``, truncations ``step/truncated``. Without terminations or truncations
sources, both are False but at the last step, which takes the episode's stored flags.

Filters (both formats): ``episodes`` (``all``, ``succeeded``, ``failed``), ``worlds``,
``min_length`` (steps) and ``limit`` (the first N episodes to end, after the other filters).
Episodes an Isaac Lab recorder discarded (outcome ``exported`` = 0) are never exported.

Output is atomic: the file (or dataset directory) is written beside its destination under a
temporary name and renamed at the end; an existing destination is kept unless ``overwrite``.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import importlib
import json
import math
import os
import shutil
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeAlias

import numpy as np

from ._format import StoreLocation
from .errors import RunNotFoundError, StorageError, StoreDamagedError, StoreFormatError
from .reader import RunStore, Table

__all__ = [
    "EPISODES",
    "FORMATS",
    "HELP",
    "LIFECYCLE",
    "ExportError",
    "ExportSummary",
    "MissingExtraError",
    "OutputExistsError",
    "add_arguments",
    "export_isaaclab_hdf5",
    "export_minari",
    "run",
    "select_episodes",
]

HELP = "export a run's episodes to Isaac Lab / robomimic HDF5 or to a Minari dataset"
FORMATS = ("isaaclab-hdf5", "minari")
EPISODES = ("all", "succeeded", "failed")
LIFECYCLE: Mapping[str, int] = {"post_reset": 0, "pre_step": 1, "post_physics_decimation_step": 2,
                                "post_step": 3, "pre_reset": 4}
"""The order of a step's lifecycle points within one episode (rows recorded at one step)."""

_GYM_DEFAULTS = {"observations": ("reset/obs", "step/next_obs"), "actions": ("step/action",),
                 "rewards": ("step/reward",), "terminations": ("step/terminated",),
                 "truncations": ("step/truncated",)}
"""The Minari sources of a store recorded by :class:`capture.RecordingVectorEnv`."""

Progress: TypeAlias = Callable[[int, int], object]
"""Called after each exported episode with ``(done, total)``."""
Leaf: TypeAlias = list[tuple[str, str]]
"""``(term, field)`` sources whose rows are concatenated in recording order."""
Tree: TypeAlias = "Leaf | dict[str, Tree]"
"""A leaf, or key -> subtree (a ``Dict`` space, or a group of datasets)."""


class ExportError(StorageError, ValueError):
    """The run cannot be exported as asked (fields, mapping, filters); the message says why."""


class OutputExistsError(StorageError, FileExistsError):
    """The export's destination exists and ``overwrite`` was not given."""


class MissingExtraError(StorageError, ImportError):
    """A library the format needs is not installed; the message names the extra to install."""


@dataclass(frozen=True, slots=True)
class ExportSummary:
    """What an export wrote.

    Attributes:
        format: One of :data:`FORMATS`.
        out: The file written (``isaaclab-hdf5``) or the dataset's directory (``minari``).
        episodes: ``(world, index)`` of each episode written, in order.
        names: The demo group (``isaaclab-hdf5``) or Minari episode id of each, in order.
        samples: ``num_samples`` summed (``isaaclab-hdf5``) or steps (``minari``).
        skipped: ``(world, index)`` of selected episodes left out: no rows (``isaaclab-hdf5``)
            or no step (``minari``).
    """

    format: str
    out: str
    episodes: tuple[tuple[int, int], ...]
    names: tuple[str, ...]
    samples: int
    skipped: tuple[tuple[int, int], ...]


# -- selection and reading ---------------------------------------------------------------


def select_episodes(reader: RunStore, run: str, *, episodes: str = "all",
                    worlds: Sequence[int] | None = None, min_length: int = 0,
                    limit: int | None = None) -> Table:
    """The episodes of ``run`` an export writes, in the order they ended.

    Args:
        reader: The store.
        run: The run id.
        episodes: ``"all"``, ``"succeeded"`` or ``"failed"``.
        worlds: Only these worlds (default: all).
        min_length: Only episodes of at least this many steps.
        limit: At most this many episodes (the first to end).

    Episodes whose outcome ``exported`` is 0 (an Isaac Lab recorder discarded them:
    :mod:`capture.isaaclab`) are never selected.

    Returns:
        The rows of :meth:`storage.RunStore.episodes` in the order the episodes ended: by
        ``end_step``, then world (Isaac Lab exports the worlds of one reset in this order).

    Raises:
        ValueError: A filter is not valid (the message names it).
        RunNotFoundError: No run ``run``.
    """
    if episodes not in EPISODES:
        raise ValueError(f"episodes: expected one of {', '.join(EPISODES)}, got {episodes!r}")
    for name, value in (("min_length", min_length), ("limit", limit)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}: expected an int >= 0, got {value!r}")
    num_worlds = int(reader.info(run)["num_worlds"])
    table = reader.episodes(run)
    mask = table["length"] >= min_length
    if "exported" in table.columns:  # an Isaac Lab recorder discarded those with 0 (NaN: not said)
        mask &= table["exported"] != 0
    if episodes != "all":
        mask &= table["success"] == (episodes == "succeeded")
    if worlds is not None:
        chosen = list(worlds)
        if any(isinstance(w, bool) or not isinstance(w, int | np.integer) or not 0 <= w < num_worlds
               for w in chosen):
            raise ValueError(f"worlds: expected ints in [0, {num_worlds}), got {chosen!r}")
        mask &= np.isin(table["world"], np.asarray(chosen, np.int64))
    rows = np.flatnonzero(mask)
    rows = rows[np.lexsort((table["world"][rows], table["end_step"][rows]))][:limit]
    return Table({name: column[rows] for name, column in table.columns.items()})


def _read(reader: RunStore, run: str, world: int, index: int, specs: Mapping[str, Mapping[str, Any]], *,
          rows: bool) -> tuple[dict[str, np.ndarray], dict[str, dict[str, np.ndarray]]]:
    """Every read of an export: the episode's fields and, when ``rows``, its row columns; a
    field or term of ``specs`` the store holds no rows of (none committed in the run) reads
    as empty."""
    fields = reader.episode(run, world, index)
    order = reader.episode_rows(run, world, index) if rows else {}
    for term, names in specs.items():
        for name, spec in names.items():
            dtype = "float32" if spec["dtype"] == "bfloat16" else spec["dtype"]
            fields.setdefault(f"{term}/{name}", np.zeros((0, *spec["shape"]), dtype))
        if rows:
            order.setdefault(term, {"step": np.zeros(0, np.int64), "hook": np.zeros(0, object)})
    return fields, order


def _open(store: RunStore | StoreLocation) -> RunStore:
    return store if isinstance(store, RunStore) else RunStore(store)


def _require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{what} needs {module} ({exc}); install it with: "
                                f"pip install 'worldtap[{extra}]'") from exc


# -- mapping fields to key paths ---------------------------------------------------------


def _spec(leaf: Leaf, specs: Mapping[str, Mapping[str, Any]], what: str) -> tuple[np.dtype[Any], tuple[int, ...]]:
    """The dtype (bfloat16 reads as float32) and row shape shared by ``leaf``'s sources.

    Raises:
        ExportError: The sources differ in dtype or shape, or two come from one term (their
            rows could not be ordered).
    """
    terms = [term for term, _ in leaf]
    if len(set(terms)) < len(terms):
        raise ExportError(f"{what}: {_names(leaf)} are fields of one term; their rows cannot be "
                          f"interleaved")
    found = set()
    for term, field in leaf:
        spec = specs[term][field]
        dtype = "float32" if spec["dtype"] == "bfloat16" else spec["dtype"]
        found.add((np.dtype(dtype), tuple(int(d) for d in spec["shape"])))
    if len(found) > 1:
        raise ExportError(f"{what}: {_names(leaf)} differ in dtype or shape "
                          f"({', '.join(f'{d}{list(s)}' for d, s in sorted(found, key=str))}); "
                          f"rows of one dataset must agree")
    return found.pop()


def _names(leaf: Leaf) -> str:
    return ", ".join(f"{term}/{field}" for term, field in leaf)


def _check_path(path: str, key: str) -> None:
    if any(part in ("", ".") for part in path.split("/")):
        raise ExportError(f"{key}: key path {path!r} has an empty or '.' component; name it with "
                          f"--rename {key}=PATH")
    if "\x00" in path:  # HDF5 ends a name at its first NUL: 'x\x00y' would be written as 'x'
        raise ExportError(f"{key!r}: key path {path!r} holds a NUL character, which HDF5 names cannot; "
                          f"name it with --rename")


def _hdf5_plan(specs: Mapping[str, Mapping[str, Any]], *, fields: Sequence[str] | None,
               rename: Mapping[str, str] | None, paths: str) -> dict[str, Leaf]:
    """Key path -> the fields whose rows it holds (see the module).

    Raises:
        ExportError: A pattern selects nothing, a renamed field is not selected, a path is
            both a dataset and a group, or the fields of one path disagree.
    """
    if paths not in ("field", "term"):
        raise ValueError(f"paths: expected 'field' or 'term', got {paths!r}")
    keys = {f"{term}/{field}": (term, field) for term, names in specs.items() for field in names}
    chosen = list(keys)
    if fields is not None:
        chosen = []
        for pattern in fields:
            hits = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
            if not hits:
                raise ExportError(f"fields: {pattern!r} matches no field of the run; fields: {sorted(keys)}")
            chosen += [k for k in hits if k not in chosen]
    rename = dict(rename or {})
    for key in rename:
        if key not in chosen:
            raise ExportError(f"rename: {key!r} is not a selected field of the run; fields: {sorted(chosen)}")
    plan: dict[str, Leaf] = {}
    for key in chosen:
        term, field = keys[key]
        path = rename.get(key, field if paths == "field" else key)
        _check_path(path, key)
        plan.setdefault(path, []).append((term, field))
    for path, leaf in plan.items():
        _spec(leaf, specs, f"key path {path!r}")
        for other in plan:
            if other.startswith(path + "/"):
                raise ExportError(f"key path {path!r} ({_names(leaf)}) is also the group of {other!r} "
                                  f"({_names(plan[other])}); give one of them another path with --rename")
    return plan


def _gather(leaf: Leaf, fields: Mapping[str, np.ndarray], rows: Mapping[str, Mapping[str, np.ndarray]],
            terms: Sequence[str]) -> np.ndarray:
    """The rows of ``leaf``'s sources in one episode, in recording order (see the module).

    Raises:
        ExportError: A row was recorded at a lifecycle point this export cannot order.
    """
    parts = [(term, fields[f"{term}/{field}"]) for term, field in leaf]
    if len(parts) == 1:
        return parts[0][1]
    step, rank, position, within = [], [], [], []
    for term, values in parts:
        hooks = rows[term]["hook"]
        unknown = sorted(set(hooks.tolist()) - set(LIFECYCLE))
        if unknown:
            raise ExportError(f"term {term!r} has rows recorded at {unknown}, which the export cannot "
                              f"order among {sorted(LIFECYCLE, key=LIFECYCLE.__getitem__)}")
        step.append(rows[term]["step"])
        rank.append(np.array([LIFECYCLE[h] for h in hooks.tolist()], np.int64))
        position.append(np.full(len(values), terms.index(term), np.int64))
        within.append(np.arange(len(values)))
    order = np.lexsort([np.concatenate(k) for k in (within, position, rank, step)])
    return np.concatenate([values for _, values in parts])[order]


# -- isaaclab-hdf5 -------------------------------------------------------------------------


def export_isaaclab_hdf5(
    store: RunStore | StoreLocation,
    run: str,
    out: str | os.PathLike[str],
    *,
    episodes: str = "all",
    worlds: Sequence[int] | None = None,
    min_length: int = 0,
    limit: int | None = None,
    fields: Sequence[str] | None = None,
    rename: Mapping[str, str] | None = None,
    paths: str = "field",
    env_name: str | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write ``run``'s episodes as the HDF5 file Isaac Lab's recorder writes (see the module).

    Args:
        store: A :class:`storage.RunStore` or its location.
        run: The run id.
        out: The file to write (its folder is created).
        episodes, worlds, min_length, limit: Which episodes (:func:`select_episodes`).
        fields: ``fnmatch`` patterns of ``"<term>/<field>"`` to export (default: every field).
        rename: ``"<term>/<field>"`` -> key path, for single fields.
        paths: ``"field"`` (key path = field name) or ``"term"`` (``<term>/<field>``).
        env_name: ``env_args["env_name"]`` (default: the run metadata's ``env_name`` or
            ``task``, else ``""``).
        overwrite: Replace ``out`` if it exists.
        progress: Called with ``(done, total)`` after each episode.

    Returns:
        What was written.

    Raises:
        MissingExtraError: h5py is not installed.
        OutputExistsError: ``out`` exists and ``overwrite`` is false.
        ExportError, ValueError: The fields or filters cannot be exported as asked.
        RunNotFoundError, StoreFormatError, StoreDamagedError: The store or run cannot be read;
            nothing is left at ``out`` (or its earlier file is kept).
    """
    h5py = _require("h5py", "export", "the isaaclab-hdf5 export")
    reader = _open(store)
    info = reader.info(run)
    table = select_episodes(reader, run, episodes=episodes, worlds=worlds, min_length=min_length,
                            limit=limit)
    specs: Mapping[str, Mapping[str, Any]] = info["fields"]
    plan = _hdf5_plan(specs, fields=fields, rename=rename, paths=paths)
    target = _destination(out, overwrite)
    metadata = info["metadata"]
    if env_name is None:
        named = [metadata.get(k) for k in ("env_name", "task") if isinstance(metadata.get(k), str)]
        env_name = named[0] if named else ""
    env_args = {"env_name": env_name, "type": 2,
                "worldtap": {"run": run, "seed": info["seed"], "metadata": metadata}}
    merge = any(len(leaf) > 1 for leaf in plan.values())
    terms = list(info["topics"])
    demo_ids = table["demo_id"].tolist() if "demo_id" in table.columns else [math.nan] * len(table)
    written: list[tuple[int, int]] = []
    names: list[str] = []
    skipped: list[tuple[int, int]] = []
    total = count = 0
    with _atomic(target) as partial, h5py.File(partial, "w") as file:
        data = file.create_group("data")
        data.attrs["total"] = 0
        data.attrs["env_args"] = json.dumps(env_args, default=str)
        for i, (world, index, success, demo_id) in enumerate(zip(
                table["world"].tolist(), table["index"].tolist(), table["success"].tolist(), demo_ids,
                strict=True)):
            values, rows = _read(reader, run, world, index, specs, rows=merge)
            arrays = {path: _gather([s for s in leaf if len(values[f"{s[0]}/{s[1]}"])], values, rows, terms)
                      for path, leaf in plan.items()
                      if any(len(values[f"{term}/{field}"]) for term, field in leaf)}
            if not arrays:
                skipped.append((world, index))
            else:
                if math.isnan(demo_id):  # Isaac Lab counts only the demos it names itself
                    name, count = f"demo_{count}", count + 1
                else:
                    name = f"demo_{int(demo_id)}"
                if name in data:
                    raise ExportError(f"episode (world {world}, index {index}): demo {name!r} exists already "
                                      f"(its outcome demo_id repeats a demo's name)")
                demo = data.create_group(name)
                samples = _num_samples(arrays)
                demo.attrs["num_samples"] = samples
                if info["seed"] is not None:
                    demo.attrs["seed"] = info["seed"]
                demo.attrs["success"] = bool(success)
                demo.attrs["worldtap_world"] = world
                demo.attrs["worldtap_index"] = index
                for path, array in arrays.items():
                    demo.create_dataset(path, data=array, compression="gzip")
                total += samples
                written.append((world, index))
                names.append(name)
            if progress is not None:
                progress(i + 1, len(table))
        data.attrs["total"] = total
    return ExportSummary("isaaclab-hdf5", str(target), tuple(written), tuple(names), total, tuple(skipped))


def _num_samples(arrays: Mapping[str, np.ndarray]) -> int:
    """Isaac Lab's ``num_samples``: ``len(episode.data["actions"])``: the rows of an ``actions``
    dataset, the entries of an ``actions`` group, or 0."""
    if "actions" in arrays:
        return len(arrays["actions"])
    return len({path.split("/")[1] for path in arrays if path.startswith("actions/")})


# -- minari --------------------------------------------------------------------------------


def export_minari(
    store: RunStore | StoreLocation,
    run: str,
    dataset_id: str,
    *,
    root: str | os.PathLike[str] | None = None,
    observations: Sequence[str] | None = None,
    actions: str | None = None,
    rewards: str | None = None,
    terminations: str | None = None,
    truncations: str | None = None,
    env: str | None = None,
    dataset_info: Mapping[str, Any] | None = None,
    episodes: str = "all",
    worlds: Sequence[int] | None = None,
    min_length: int = 0,
    limit: int | None = None,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> ExportSummary:
    """Write ``run``'s episodes as the Minari dataset ``dataset_id`` (see the module).

    Args:
        store: A :class:`storage.RunStore` or its location.
        run: The run id.
        dataset_id: The Minari id, ``(namespace/)name-v<version>``.
        root: Minari's datasets folder (default: ``$MINARI_DATASETS_PATH``, else
            ``~/.minari/datasets``, as Minari's own default).
        observations, actions, rewards, terminations, truncations: Sources ``<term>/<path>``
            (defaults: see the module).
        env: A gymnasium environment id whose spaces the dataset takes (and records, so
            ``dataset.recover_environment()`` works); default: ``Box`` spaces (``Dict`` for
            prefixes) of the stored dtypes and shapes, unbounded (integers: their dtype's range).
        dataset_info: More keywords of ``minari.create_dataset_from_buffers``: ``author``,
            ``author_email``, ``code_permalink``, ``algorithm_name``, ``description`` (default:
            the run and store), ``eval_env``, ``requirements``... (Minari's advice to set those
            left unset, and its note on a dataset without an environment spec, is not shown).
        episodes, worlds, min_length, limit: Which episodes (:func:`select_episodes`).
        overwrite: Replace an existing dataset ``dataset_id``.
        progress: Called with ``(done, total)`` after each episode.

    Returns:
        What was written (``out`` is the dataset's directory).

    Raises:
        MissingExtraError: minari (or h5py) is not installed.
        OutputExistsError: The dataset exists and ``overwrite`` is false.
        ExportError, ValueError: The sources or filters cannot be exported as asked, or an
            episode's rows do not fit (observations must be one more than actions).
        RunNotFoundError, StoreFormatError, StoreDamagedError: The store or run cannot be read;
            no dataset is left (or the earlier one is kept).
    """
    minari = _require("minari", "export", "the minari export")
    _require("h5py", "export", "the minari export")
    gym = _require("gymnasium", "export", "the minari export")
    namespaces = importlib.import_module("minari.namespace")
    try:
        namespace = importlib.import_module("minari.dataset.minari_dataset").parse_dataset_id(dataset_id)[0]
    except ValueError as exc:
        raise ExportError(f"dataset_id: {exc}") from None
    reader = _open(store)
    info = reader.info(run)
    table = select_episodes(reader, run, episodes=episodes, worlds=worlds, min_length=min_length,
                            limit=limit)
    specs: Mapping[str, Mapping[str, Any]] = info["fields"]
    roles = _minari_roles(specs, observations=observations, actions=actions, rewards=rewards,
                          terminations=terminations, truncations=truncations)
    if env is not None:
        try:
            made = gym.make(env)
        except Exception as exc:  # not registered, or its dependencies are missing
            raise ExportError(f"env: gymnasium cannot make {env!r}: {exc}") from exc
        obs_space, act_space = made.observation_space, made.action_space
        made.close()
    else:
        obs_space = _space(gym, roles["observations"], specs)
        act_space = _space(gym, roles["actions"], specs)
    _fits(gym, roles["observations"], obs_space, specs, "observations")
    _fits(gym, roles["actions"], act_space, specs, "actions")
    base = Path(root if root is not None else
                importlib.import_module("minari.storage.datasets_root_dir").get_dataset_path())
    target = base / dataset_id
    _destination(target, overwrite)
    merge = any(_has_merge(tree) for tree in roles.values())
    terms = list(info["topics"])
    written: list[tuple[int, int]] = []
    skipped: list[tuple[int, int]] = []
    steps = 0
    staging = base / f".worldtap-export-{uuid.uuid4().hex[:12]}"
    try:
        with _minari_root(staging), warnings.catch_warnings():
            warnings.filterwarnings("ignore", r"`\w+` is set to None|env_spec is None", UserWarning)
            dataset = minari.create_dataset_from_buffers(
                dataset_id, [], env=env, observation_space=obs_space, action_space=act_space,
                jpeg_encoding=False, **{"description": f"worldtap run {run!r} of store {str(reader.location)!r}",
                                        **(dataset_info or {})})
            batch: list[Any] = []
            columns = [table[c].tolist() for c in ("world", "index", "terminated", "truncated")]
            for i, (world, index, terminated, truncated) in enumerate(zip(*columns, strict=True)):
                values, rows = _read(reader, run, world, index, specs, rows=merge)
                episode = _minari_episode(roles, values, rows, terms, obs_space, act_space,
                                          (world, index), (terminated, truncated))
                if episode is None:
                    skipped.append((world, index))
                else:
                    batch.append(episode)
                    written.append((world, index))
                    steps += len(episode.rewards)
                if len(batch) >= 64 or (batch and i + 1 == len(table)):
                    dataset.update_dataset_from_buffer(batch)
                    batch = []
                if progress is not None:
                    progress(i + 1, len(table))
        if namespace is not None:
            with _minari_root(base):
                if namespace not in namespaces.list_local_namespaces():
                    namespaces.create_namespace(namespace)
        _replace_dir(staging / dataset_id, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ExportSummary("minari", str(target), tuple(written), tuple(str(i) for i in range(len(written))), steps,
                         tuple(skipped))


def _minari_roles(specs: Mapping[str, Mapping[str, Any]], **given: Any) -> dict[str, Tree]:
    """Role -> its tree of sources (observations: the merged tree of every source).

    Raises:
        ExportError: A required role has no source and no default, a source names no field,
            or the observation sources differ in structure.
    """
    gym_store = all(_names_fields(specs, source) for sources in _GYM_DEFAULTS.values() for source in sources)
    missing = [role for role in ("observations", "actions", "rewards") if given[role] is None and not gym_store]
    if missing:
        raise ExportError(f"the run was not recorded by capture.RecordingVectorEnv: name its "
                          f"{', '.join(missing)} (e.g. --observations TERM/FIELD[,TERM/FIELD] "
                          f"--actions TERM/FIELD --rewards TERM/FIELD)")
    roles: dict[str, Tree] = {}
    for role, default in _GYM_DEFAULTS.items():
        value = given[role]
        if value is None and not gym_store:
            continue
        sources = list(default) if value is None else [value] if isinstance(value, str) else list(value)
        if not sources or (role != "observations" and len(sources) > 1):
            raise ExportError(f"{role}: expected {'one source' if sources else 'a source'} TERM/FIELD, "
                              f"got {sources}")
        trees = [_tree(specs, source, role) for source in sources]
        tree = trees[0]
        for other in trees[1:]:
            tree = _merge(tree, other, role)
        if role in ("rewards", "terminations", "truncations"):
            if not isinstance(tree, list):
                raise ExportError(f"{role}: {sources[0]!r} is a group of fields; name one field")
            dtype, shape = _spec(tree, specs, role)
            if int(np.prod(shape)) != 1 or (role != "rewards" and dtype != np.bool_) or \
                    (role == "rewards" and dtype.kind not in "biuf"):
                raise ExportError(f"{role}: {sources[0]!r} holds {dtype}{list(shape)} per row; expected one "
                                  f"{'number' if role == 'rewards' else 'bool'} per step")
        roles[role] = tree
    return roles


def _names_fields(specs: Mapping[str, Mapping[str, Any]], source: str) -> bool:
    """Whether ``source`` (``<term>/<path>``) names a field of the run or a prefix of some."""
    term, _, path = source.partition("/")
    return any(field == path or field.startswith(path + "/") for field in specs.get(term, {}))


def _tree(specs: Mapping[str, Mapping[str, Any]], source: str, role: str) -> Tree:
    """The tree of one source ``<term>/<path>``: a field, or the fields under a prefix."""
    terms = [t for t in specs if source.startswith(t + "/")]
    if not terms:
        raise ExportError(f"{role}: {source!r} names no term of the run; terms: {sorted(specs)}")
    term = max(terms, key=len)
    path = source[len(term) + 1:]
    if path in specs[term]:
        return [(term, path)]
    under = sorted(f for f in specs[term] if f.startswith(path + "/"))
    if not path or not under:
        raise ExportError(f"{role}: {source!r} names no field of term {term!r}; its fields: "
                          f"{sorted(specs[term])}")
    tree: dict[str, Tree] = {}
    for field in under:
        node = tree
        keys = field[len(path) + 1:].split("/")
        if any("\x00" in key for key in keys):  # Minari's HDF5 would end the key at the NUL
            raise ExportError(f"{role}: field {term}/{field!r} would be a Dict space key holding a NUL "
                              f"character, which Minari's HDF5 names cannot")
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ExportError(f"{role}: {term}/{path}/{key} is a field and a prefix of fields")
            node = child
        if keys[-1] in node:
            raise ExportError(f"{role}: {term}/{field} is a field and a prefix of fields")
        node[keys[-1]] = [(term, field)]
    return tree


def _merge(a: Tree, b: Tree, role: str) -> Tree:
    if isinstance(a, list) and isinstance(b, list):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b):
        return {key: _merge(a[key], b[key], f"{role}[{key!r}]") for key in a}
    raise ExportError(f"{role}: its sources differ in structure ({_shape(a)} vs {_shape(b)})")


def _shape(tree: Tree) -> str:
    return "a field" if isinstance(tree, list) else "keys " + ", ".join(sorted(tree))


def _has_merge(tree: Tree) -> bool:
    if isinstance(tree, list):
        return len(tree) > 1
    return any(_has_merge(child) for child in tree.values())


def _space(gym: ModuleType, tree: Tree, specs: Mapping[str, Mapping[str, Any]]) -> Any:
    """A gymnasium space for ``tree``: ``Box`` per leaf (floats unbounded, integers over their
    dtype's range, bools 0..1), ``Dict`` per group."""
    if isinstance(tree, dict):
        return gym.spaces.Dict({key: _space(gym, child, specs) for key, child in tree.items()})
    dtype, shape = _spec(tree, specs, _names(tree))
    if dtype.kind == "f":
        low, high = -np.inf, np.inf
    elif dtype.kind == "b":
        low, high = 0, 1
    elif dtype.kind in "iu":
        low, high = np.iinfo(dtype).min, np.iinfo(dtype).max
    else:
        raise ExportError(f"{_names(tree)}: dtype {dtype} has no gymnasium space")
    return gym.spaces.Box(low, high, shape=shape, dtype=dtype)


def _fits(gym: ModuleType, tree: Tree, space: Any, specs: Mapping[str, Mapping[str, Any]], role: str) -> None:
    """Check that the sources' dtypes and shapes are the space's.

    Raises:
        ExportError: They are not (the message names the source and the space).
    """
    if isinstance(space, gym.spaces.Dict | gym.spaces.Tuple):
        keys = list(space.spaces) if isinstance(space, gym.spaces.Dict) else [str(i) for i in range(len(space))]
        if not isinstance(tree, dict) or set(tree) != set(keys):
            raise ExportError(f"{role}: the space {space} has keys {keys}; the sources have {_shape(tree)}")
        for key, sub in zip(keys, space.spaces.values() if isinstance(space, gym.spaces.Dict) else space.spaces,
                            strict=True):
            _fits(gym, tree[key], sub, specs, f"{role}[{key!r}]")
        return
    if isinstance(tree, dict) or getattr(space, "shape", None) is None or getattr(space, "dtype", None) is None:
        raise ExportError(f"{role}: cannot store {_shape(tree)} as {space}")
    dtype, shape = _spec(tree, specs, role)
    if shape != tuple(space.shape) or dtype != np.dtype(space.dtype):
        raise ExportError(f"{role}: {_names(tree)} holds {dtype}{list(shape)} per row; the space {space} "
                          f"holds {np.dtype(space.dtype)}{list(space.shape)}")


def _evaluate(tree: Tree, space: Any, values: Mapping[str, np.ndarray],
              rows: Mapping[str, Mapping[str, np.ndarray]], terms: Sequence[str]) -> Any:
    """An episode's rows of ``tree`` shaped for ``space`` (arrays, dicts, tuples)."""
    if isinstance(tree, list):
        return _gather(tree, values, rows, terms)
    subspaces = getattr(space, "spaces", {})
    if isinstance(subspaces, Sequence):  # a Tuple space
        return tuple(_evaluate(tree[str(i)], sub, values, rows, terms) for i, sub in enumerate(subspaces))
    return {key: _evaluate(child, subspaces.get(key), values, rows, terms) for key, child in tree.items()}


def _length(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return len(value)
    return _length(next(iter(value.values() if isinstance(value, dict) else value)))


def _minari_episode(roles: Mapping[str, Tree], values: Mapping[str, np.ndarray],
                    rows: Mapping[str, Mapping[str, np.ndarray]], terms: Sequence[str], obs_space: Any,
                    act_space: Any, key: tuple[int, int], flags: tuple[bool, bool]) -> Any:
    """One episode as a ``minari.EpisodeBuffer``, or ``None`` when it has no step.

    Raises:
        ExportError: Its observations are not one more than its actions, or its rewards or
            flags are not one per action.
    """
    obs = _evaluate(roles["observations"], obs_space, values, rows, terms)
    act = _evaluate(roles["actions"], act_space, values, rows, terms)
    steps = _length(act)
    if steps == 0:
        return None
    where = f"episode (world {key[0]}, index {key[1]})"
    if _length(obs) != steps + 1:
        raise ExportError(f"{where}: {_length(obs)} observations for {steps} actions; Minari needs one "
                          f"more (the first observation and each step's next one): name the first or "
                          f"the final observation too in --observations")
    columns: dict[str, np.ndarray] = {}
    for role, flag in (("rewards", None), ("terminations", flags[0]), ("truncations", flags[1])):
        tree = roles.get(role)
        if isinstance(tree, list):
            column = _gather(tree, values, rows, terms).reshape(-1)
        else:  # no source: the episode's stored flag at its last step
            column = np.zeros(steps, np.bool_)
            column[-1] = flag
        if len(column) != steps:
            raise ExportError(f"{where}: {len(column)} {role} for {steps} actions; expected one per step")
        columns[role] = column
    return importlib.import_module("minari.data_collector").EpisodeBuffer(observations=obs, actions=act, **columns)


@contextlib.contextmanager
def _minari_root(path: Path) -> Iterator[None]:
    """Minari's datasets folder (``MINARI_DATASETS_PATH``) is ``path`` inside the block (the
    variable is the process's: not for threads that use Minari meanwhile)."""
    before = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(path)
    try:
        yield
    finally:
        if before is None:
            del os.environ["MINARI_DATASETS_PATH"]
        else:
            os.environ["MINARI_DATASETS_PATH"] = before


# -- output --------------------------------------------------------------------------------


def _destination(out: str | os.PathLike[str], overwrite: bool) -> Path:
    """``out`` as a path, checked before anything is written.

    Raises:
        OutputExistsError: It exists and ``overwrite`` is false.
    """
    target = Path(out)
    if target.exists() and not overwrite:
        raise OutputExistsError(f"{str(target)!r} exists; pass overwrite (--overwrite) to replace it")
    return target


@contextlib.contextmanager
def _atomic(target: Path) -> Iterator[Path]:
    """A temporary path beside ``target`` (``<target>.partial``) renamed over it when the
    block succeeds and removed when it fails."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    try:
        yield partial
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _replace_dir(source: Path, target: Path) -> None:
    """Move directory ``source`` to ``target``, replacing an existing ``target`` (which is
    kept aside until the move succeeded)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:12]}")
    if target.exists():
        target.rename(old)
    try:
        source.rename(target)
    except BaseException:
        if old.exists():
            old.rename(target)
        raise
    shutil.rmtree(old, ignore_errors=True)


# -- command line ----------------------------------------------------------------------------


def _worlds(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected world indices like 0,3,5, got {text!r}") from None


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _rename(text: str) -> tuple[str, str]:
    key, sep, path = text.partition("=")
    if not sep or not key or not path:
        raise argparse.ArgumentTypeError(f"expected TERM/FIELD=PATH, got {text!r}")
    return key, path


def _list(text: str) -> list[str]:
    return [part for part in text.split(",") if part]


_HDF5_ONLY = ("fields", "rename", "paths")
_MINARI_INFO = ("author", "author_email", "code_permalink", "algorithm_name")
_MINARI_ONLY = ("observations", "actions", "rewards", "terminations", "truncations", "minari_root", *_MINARI_INFO)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``worldtap-store export``."""
    parser.add_argument("store", help="the run store (local directory or zarr/fsspec URL)")
    parser.add_argument("out", metavar="OUT",
                        help="isaaclab-hdf5: the file to write (OUT.hdf5); minari: the dataset id, "
                             "(namespace/)name-v<N>")
    parser.add_argument("--run", required=True, help="the run to export (worldtap-store info lists them)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--episodes", choices=EPISODES, default="all",
                        help="which episodes by success (default all)")
    parser.add_argument("--worlds", type=_worlds, default=None, metavar="W[,W...]", help="only these worlds")
    parser.add_argument("--min-length", type=_count, default=0, metavar="STEPS",
                        help="only episodes of at least this many steps")
    parser.add_argument("--limit", type=_count, default=None, metavar="N",
                        help="at most N episodes (the first to end)")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    parser.add_argument("--env", default=None, metavar="ID",
                        help="isaaclab-hdf5: env_args' env_name (default: the run metadata's env_name or "
                             "task); minari: a gymnasium id whose spaces the dataset takes")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    hdf5 = parser.add_argument_group("isaaclab-hdf5")
    hdf5.add_argument("--fields", type=_list, default=None, metavar="PATTERN[,...]",
                      help="fnmatch patterns of TERM/FIELD to export (default: all)")
    hdf5.add_argument("--rename", type=_rename, action="append", default=None, metavar="TERM/FIELD=PATH",
                      help="the key path of one field (repeatable)")
    hdf5.add_argument("--paths", choices=("field", "term"), default=None,
                      help="key path of a field: its name (default; Isaac Lab terms) or TERM/FIELD")
    mini = parser.add_argument_group("minari")
    mini.add_argument("--observations", type=_list, default=None, metavar="TERM/PATH[,...]",
                      help="observation sources, one more row than actions (default for gymnasium "
                           "stores: reset/obs,step/next_obs)")
    for role, default in (("actions", "action"), ("rewards", "reward"), ("terminations", "terminated"),
                          ("truncations", "truncated")):
        mini.add_argument(f"--{role}", default=None, metavar="TERM/PATH",
                          help=f"{role} source (default for gymnasium stores: step/{default})")
    mini.add_argument("--minari-root", default=None, metavar="DIR",
                      help="Minari's datasets folder (default: $MINARI_DATASETS_PATH or ~/.minari/datasets)")
    for name in _MINARI_INFO:
        mini.add_argument(f"--{name.replace('_', '-')}", default=None, help="the dataset's " + name.replace("_", " "))


def run(args: argparse.Namespace) -> int:
    """Run ``worldtap-store export``: 0 done; 1 unexpected error or OUT cannot be written; 2
    usage error (a bad option, an existing OUT, fields that cannot be mapped, a missing extra);
    3 the store cannot be opened or read, or the run is unknown; 130 interrupted by SIGINT or
    SIGTERM (whatever the process inherited), with nothing written. Errors are one line on
    stderr."""
    wrong = [o for o in (_MINARI_ONLY if args.format == "isaaclab-hdf5" else _HDF5_ONLY)
             if getattr(args, o) is not None]
    if wrong:
        return _fail(2, f"--{wrong[0].replace('_', '-')} does not apply to --format {args.format}")
    report = None if args.quiet else _Progress()
    filters: dict[str, Any] = {"episodes": args.episodes, "worlds": args.worlds, "min_length": args.min_length,
                               "limit": args.limit, "overwrite": args.overwrite, "progress": report}
    from broker.cli_args import signals_interrupt

    with signals_interrupt():  # a kill removes OUT.partial as Ctrl-C does
        try:
            if args.format == "isaaclab-hdf5":
                summary = export_isaaclab_hdf5(
                    args.store, args.run, args.out, fields=args.fields,
                    rename=dict(args.rename) if args.rename else None, paths=args.paths or "field",
                    env_name=args.env, **filters)
            else:
                summary = export_minari(
                    args.store, args.run, args.out, root=args.minari_root, observations=args.observations,
                    actions=args.actions, rewards=args.rewards, terminations=args.terminations,
                    truncations=args.truncations, env=args.env, **filters,
                    dataset_info={k: getattr(args, k) for k in _MINARI_INFO if getattr(args, k) is not None})
        except (StoreFormatError, StoreDamagedError, RunNotFoundError) as exc:
            return _fail(3, str(exc))
        except (ValueError, OutputExistsError, MissingExtraError) as exc:
            return _fail(2, str(exc))
        except KeyboardInterrupt:
            return _fail(130, "interrupted; nothing was written")
        except Exception as exc:  # the output cannot be written (disk full, ...), or a bug
            return _fail(1, f"export failed: {exc!r}")
        finally:
            if report is not None:
                report.close()
    skipped = f", {len(summary.skipped)} skipped (no rows)" if summary.skipped else ""
    print(f"worldtap-store export: run {args.run!r}: {len(summary.episodes)} episodes "
          f"({summary.samples} samples){skipped} -> {summary.out}", file=sys.stderr)
    return 0


def _fail(code: int, message: str) -> int:
    print(f"worldtap-store export: {message}", file=sys.stderr)
    return code


class _Progress:
    """Export progress on stderr: a rich bar on a terminal when rich is installed, else a
    line every tenth of the episodes (at most every 1000)."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._started = False
        self._start = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if not self._started:
            self._started = True
            if sys.stderr.isatty():
                with contextlib.suppress(ImportError):
                    from rich.progress import Progress

                    self._bar = Progress(transient=True)
                    self._task = self._bar.add_task("episodes", total=total)
                    self._bar.start()
        if self._bar is not None:
            self._bar.update(self._task, completed=done)
        elif done == total or done % max(1, min(1000, total // 10)) == 0:
            rate = done / max(time.monotonic() - self._start, 1e-9)
            print(f"worldtap-store export: {done}/{total} episodes ({rate:.0f}/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
