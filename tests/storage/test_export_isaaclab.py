"""``worldtap-store export --format isaaclab-hdf5``, checked with Isaac Lab's own code.

The run is recorded the way Isaac Lab records: terms at ``post_reset`` (``initial_state``, a
nested dict), ``pre_step`` (``actions``, ``obs/joint_pos``, ``obs/joint_vel``, ``obs/gripper``),
``pre_reset`` (the final ``obs/joint_pos`` and ``obs/joint_vel``: the same key paths as the
``pre_step`` term, so both land in one dataset) and ``post_step`` (``states``), called in the
order of Isaac Lab's ``ManagerBasedRLEnv.step`` (pre_step, then for the worlds that are done
pre_reset and post_reset, then post_step). Beside the worldtap Recorder (-> Broker -> the real
StoreDaemon -> a Zarr store on disk), every term value goes into Isaac Lab's own ``EpisodeData``
and every ended episode through Isaac Lab's own ``HDF5DatasetFileHandler.write_episode``, as
its ``RecorderManager`` does in each export mode: those files are the reference the export must
equal, dataset for dataset, byte for byte, with the same attributes and dtypes.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from broker import Broker
from capture import FunctionTerm, Recorder
from storage import RunStore, StoreDaemon
from storage.cli import main as cli_main
from storage.export import (
    ExportError,
    MissingExtraError,
    OutputExistsError,
    export_isaaclab_hdf5,
    select_episodes,
)

pytestmark = pytest.mark.timeout(120)


def _isaaclab_datasets() -> ModuleType:
    """``isaaclab.utils.datasets`` from the installed isaaclab wheel. The wheel's top-level
    ``isaaclab`` package boots Isaac Sim; the framework itself lies under
    ``isaaclab/source/isaaclab/isaaclab``, which is what Isaac Lab puts on the path."""
    spec = importlib.util.find_spec("isaaclab")
    if spec is None or spec.origin is None:
        pytest.skip("isaaclab is not installed (bash deploy/install.sh dev installs it: "
                    "pip install --no-deps isaaclab==2.3.2.post1)", allow_module_level=True)
    source = Path(spec.origin).parent / "source" / "isaaclab"
    if source.is_dir() and str(source) not in sys.path:
        sys.path.insert(0, str(source))
    try:
        return importlib.import_module("isaaclab.utils.datasets")
    except ImportError as exc:
        pytest.skip(f"isaaclab.utils.datasets cannot be imported: {exc!r}", allow_module_level=True)


datasets = _isaaclab_datasets()
h5py = pytest.importorskip("h5py")

ROOT = Path(__file__).resolve().parents[2]

RUN = "isaac"
SEED = 1234
ENV_NAME = "Isaac-Fake-Reach-v0"
WORLDS = 4
MODES = ("all", "succeeded", "failed")


class IsaacLikeRun:
    """A run recorded in Isaac Lab's call order, into a worldtap Recorder and, beside it, into
    Isaac Lab's EpisodeData and HDF5DatasetFileHandler files (one per export filter)."""

    def __init__(self, broker: Broker, reference: Path, *, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = np.random.default_rng(seed)
        self.rec = Recorder(WORLDS, broker=broker, run=RUN, seed=SEED, metadata={"env_name": ENV_NAME})
        self.episodes = {w: datasets.EpisodeData() for w in range(WORLDS)}
        self.files = {}
        for mode in MODES:
            handler = datasets.HDF5DatasetFileHandler()
            handler.create(str(reference / f"{mode}.hdf5"), env_name=ENV_NAME)
            self.files[mode] = handler
        every = torch.arange(WORLDS)
        self._term("initial_state", "post_reset", lambda n: {"articulation": {"robot": {
            "joint_position": self._randn(n, 3), "root_pose": self._randn(n, 7)}}})
        self._term("actions", "pre_step", lambda n: self._randn(n, 2), worlds=every)
        self._term("obs", "pre_step", lambda n: {"joint_pos": self._randn(n, 3),
                                                 "joint_vel": self._randn(n, 3).double(),
                                                 "gripper": torch.rand(n, generator=self.gen) > 0.5},
                   worlds=every)
        self._term("final_obs", "pre_reset", lambda n: {"joint_pos": self._randn(n, 3),
                                                        "joint_vel": self._randn(n, 3).double()}, key="obs")
        self._term("states", "post_step", lambda n: {"articulation": {"robot": {
            "joint_position": self._randn(n, 3)}}, "count": torch.randint(0, 9, (n,), generator=self.gen)},
                   worlds=every)
        self.last = False  # term "tail" records at the last step only: no stored episode has its rows
        self.rec.add_term("tail", FunctionTerm(post_step=lambda: self._tail(every) if self.last else None))

    def _tail(self, worlds: torch.Tensor) -> dict[str, Any]:
        value = self._randn(len(worlds))
        self._add("tail", value, worlds.tolist())
        return {"tail": value}

    def _randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    def _term(self, name: str, hook: str, make: Callable[[int], Any], *, key: str | None = None,
              worlds: torch.Tensor | None = None) -> None:
        """A term recording ``make(n)`` under ``key`` (default ``name``): into the Recorder as
        ``{key: value}`` (fields ``key`` or ``key/sub/...``), and into Isaac Lab's episodes as
        its manager's ``add_to_episodes(key, value, env_ids)`` does."""
        key = key or name

        def record(ids: torch.Tensor) -> dict[str, Any]:
            value = make(len(ids))
            self._add(key, value, ids.tolist())
            return {key: value}

        fn = (lambda: record(worlds)) if worlds is not None else record
        self.rec.add_term(name, FunctionTerm(**{hook: fn}))

    def _add(self, key: str, value: Any, ids: list[int]) -> None:
        if isinstance(value, dict):
            for sub, item in value.items():
                self._add(f"{key}/{sub}", item, ids)
            return
        for i, w in enumerate(ids):
            self.episodes[w].add(key, value[i])

    def reset_all(self) -> None:
        self.rec.record_post_reset(None)

    def step(self, force: tuple[int, ...] = (), *, resets: bool = True) -> None:
        """One step of ``ManagerBasedRLEnv.step``: pre_step, resets of the done worlds, post_step."""
        self.rec.record_pre_step()
        done = sorted({w for w in range(WORLDS) if resets and self.rng.random() < 0.15} | set(force))
        if done:
            # an episode Isaac Lab discards (reset without export) ends with outcome exported = 0
            kept = torch.tensor([w == 0 or self.rng.random() < 0.85 for w in done])
            success = torch.tensor([bool(self.rng.random() < 0.5) for _ in done]) & kept
            self.rec.record_pre_reset(torch.tensor(done), success=success, terminated=success,
                                      truncated=~success & kept, outcomes={"exported": kept})
            for w, ok, keep in zip(done, success.tolist(), kept.tolist(), strict=True):
                episode = self.episodes[w]  # RecorderManager.export_episodes
                episode.success = ok
                episode.seed = SEED  # the export writes the run seed as each demo's seed
                if keep and not episode.is_empty():
                    episode.pre_export()
                    self.files["all"].write_episode(episode)
                    self.files["succeeded" if ok else "failed"].write_episode(episode)
                self.episodes[w] = datasets.EpisodeData()
            self.rec.record_post_reset(torch.tensor(done))
        self.rec.record_post_step()

    def close(self) -> None:
        self.rec.close()
        for handler in self.files.values():
            handler.close()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(store, folder of Isaac Lab's reference files) of one run of 24 steps."""
    folder = tmp_path_factory.mktemp("isaac")
    store = folder / "runs.zarr"
    (folder / "reference").mkdir()
    broker = Broker(strict=True)
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    try:
        sim = IsaacLikeRun(broker, folder / "reference")
        sim.reset_all()
        sim.step(force=(0,))  # world 0's first episode ends before any post_step
        for _ in range(22):
            sim.step()
        sim.last = True
        sim.step(resets=False)
        sim.close()
    finally:
        daemon.close()
        broker.close()
    stats = daemon.statistics()
    assert sum(stats.rejected.values()) == 0, stats.rejected
    assert "tail" in RunStore(store).info(RUN)["fields"]  # declared, no committed row
    exported = RunStore(store).episodes(RUN)["exported"]
    assert 0 < int((exported == 0).sum()) < len(exported) // 3  # a few discarded
    return store, folder / "reference"


def contents(path: Path) -> dict[str, Any]:
    """Every group and dataset of an HDF5 file: attributes (value and dtype), and for datasets
    dtype, shape, exact bytes, compression and chunks."""
    out: dict[str, Any] = {}

    def attrs(obj: Any) -> dict[str, Any]:
        return {k: (v.tolist() if isinstance(v, np.ndarray) else v, type(v).__name__, getattr(v, "dtype", None))
                for k, v in obj.attrs.items()}

    def visit(name: str, obj: Any) -> None:
        if isinstance(obj, h5py.Dataset):
            value = obj[()]
            out[name] = ("dataset", value.dtype, value.shape, value.tobytes(), obj.compression,
                         obj.compression_opts, obj.chunks, attrs(obj))
        else:
            out[name] = ("group", attrs(obj))

    with h5py.File(path, "r") as f:
        out["/"] = ("group", attrs(f))
        f.visititems(visit)
    return out


def assert_same_as_isaaclab(ours: Path, reference: Path, run: str = RUN) -> None:
    """``ours`` holds exactly what Isaac Lab wrote in ``reference``, plus the worldtap keys in
    ``env_args`` and the ``worldtap_world``/``worldtap_index`` demo attributes."""
    got, want = contents(ours), contents(reference)
    env_got = json.loads(got["data"][1].pop("env_args")[0])
    env_want = json.loads(want["data"][1].pop("env_args")[0])
    assert env_got.pop("worldtap") == {"run": run, "seed": SEED, "metadata": {"env_name": ENV_NAME}}
    assert env_got == env_want == {"env_name": ENV_NAME, "type": 2}
    for name, entry in got.items():
        if name.count("/") == 1 and name.startswith("data/demo_"):
            assert set(entry[1]) - set(want.get(name, ("group", {}))[1]) == {"worldtap_world", "worldtap_index"}
            for extra in ("worldtap_world", "worldtap_index"):
                entry[1].pop(extra)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name] == want[name], name


@pytest.mark.parametrize("mode", MODES)
def test_export_equals_isaaclab_recorder_files(recorded: tuple[Path, Path], tmp_path: Path, mode: str) -> None:
    """Each filter writes what Isaac Lab's RecorderManager writes in the matching export mode
    (EXPORT_ALL, EXPORT_SUCCEEDED_ONLY, the failed file of
    EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES): the same demo names in the same order, the
    same datasets (key paths, dtypes, shapes, bytes, gzip), the merged ``obs`` rows in call
    order, and the same ``num_samples``, ``success``, ``seed``, ``total`` and ``env_args``.
    Catches any drift from Isaac Lab's layout (a dataset under the term name, demos in table
    order instead of end order, a missing gzip, ``success`` stored as an int, the final obs
    row sorted first)."""
    store, reference = recorded
    summary = export_isaaclab_hdf5(store, RUN, tmp_path / "out.hdf5", episodes=mode)
    assert summary.out == str(tmp_path / "out.hdf5")
    assert not (tmp_path / "out.hdf5.partial").exists()
    assert_same_as_isaaclab(tmp_path / "out.hdf5", reference / f"{mode}.hdf5")
    reader = RunStore(store)
    table = reader.episodes(RUN, exported=1.0)
    want = {"all": table, "succeeded": table.filter(success=True), "failed": table.filter(success=False)}[mode]
    assert sorted(summary.episodes) == sorted(zip(want["world"].tolist(), want["index"].tolist(), strict=True))
    assert summary.skipped == ()
    assert len(summary.episodes) >= 5


def test_isaaclab_handler_loads_every_value(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """Isaac Lab's HDF5DatasetFileHandler opens the export, and every tensor of every episode
    it loads equals the store's value for value (the merged ``obs`` is the pre_step rows then
    the pre_reset row); robomimic-style plain h5py reads see the same ``actions`` and attrs.
    Catches values taken from the wrong episode, rows reordered, a dtype changed on the way."""
    store, _ = recorded
    out = tmp_path / "demo.hdf5"
    summary = export_isaaclab_hdf5(store, RUN, out)
    reader = RunStore(store)
    success = {(r["world"], r["index"]): r["success"] for r in reader.episodes(RUN).rows()}
    episodes = {key: reader.episode(RUN, *key) for key in summary.episodes}
    handler = datasets.HDF5DatasetFileHandler()
    handler.open(str(out))
    try:
        assert handler.get_num_episodes() == len(summary.episodes)
        assert handler.get_env_name() == ENV_NAME
        names = sorted(handler.get_episode_names(), key=lambda n: int(n.split("_")[1]))
        assert names == [f"demo_{i}" for i in range(len(summary.episodes))]
        for name, key in zip(names, summary.episodes, strict=True):
            episode = handler.load_episode(name, device="cpu")
            stored = episodes[key]
            data = episode.data
            want = {
                ("actions",): stored["actions/actions"],
                ("obs", "joint_pos"): np.concatenate([stored["obs/obs/joint_pos"], stored["final_obs/obs/joint_pos"]]),
                ("obs", "joint_vel"): np.concatenate([stored["obs/obs/joint_vel"], stored["final_obs/obs/joint_vel"]]),
                ("obs", "gripper"): stored["obs/obs/gripper"],
                ("initial_state", "articulation", "robot", "joint_position"):
                    stored["initial_state/initial_state/articulation/robot/joint_position"],
                ("initial_state", "articulation", "robot", "root_pose"):
                    stored["initial_state/initial_state/articulation/robot/root_pose"],
                ("states", "articulation", "robot", "joint_position"):
                    stored["states/states/articulation/robot/joint_position"],
                ("states", "count"): stored["states/states/count"],
            }
            assert len(stored["final_obs/obs/joint_pos"]) == 1
            for path, value in want.items():
                node = data
                for part in path[:-1]:
                    node = node.get(part, {})
                if not len(value):  # Isaac Lab records no key without rows
                    assert path[-1] not in node, (name, path)
                    continue
                got = node[path[-1]].numpy()
                assert got.dtype == value.dtype, (name, path)
                np.testing.assert_array_equal(got, value, err_msg=f"{name} {path}")
            assert episode.success == success[key]
            assert episode.seed == SEED
            assert episode.env_id == ENV_NAME
            assert torch.equal(episode.get_initial_state()["articulation"]["robot"]["joint_position"],
                               torch.from_numpy(want[("initial_state", "articulation", "robot", "joint_position")]))
            np.testing.assert_array_equal(episode.get_next_action().numpy(), stored["actions/actions"][0])
    finally:
        handler.close()
    with h5py.File(out, "r") as f:  # robomimic reads these directly
        demos = f["data"]
        assert json.loads(demos.attrs["env_args"])["env_name"] == ENV_NAME
        assert demos.attrs["total"] == summary.samples == sum(len(e["actions/actions"]) for e in episodes.values())
        for i, key in enumerate(summary.episodes):
            demo = demos[f"demo_{i}"]
            actions = episodes[key]["actions/actions"]
            np.testing.assert_array_equal(demo["actions"][()], actions)
            assert demo.attrs["num_samples"] == len(actions)
            assert (demo.attrs["worldtap_world"], demo.attrs["worldtap_index"]) == key
            assert bool(demo.attrs["success"]) == success[key]


def test_filters_and_field_selection(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """``worlds``, ``min_length`` and ``limit`` pick the episodes the episode table says, in the
    order they ended; ``fields`` exports only the matching fields, and an episode with no rows
    of them is skipped as Isaac Lab skips empty episodes (world 0's first episode ended before
    its first post_step, so it has no ``states``)."""
    store, _ = recorded
    reader = RunStore(store)
    table = reader.episodes(RUN, exported=1.0)
    order = np.lexsort((table["world"], table["end_step"]))
    ended = list(zip(table["world"][order].tolist(), table["index"][order].tolist(),
                     table["length"][order].tolist(), strict=True))
    summary = export_isaaclab_hdf5(store, RUN, tmp_path / "a.hdf5", worlds=[0, 2], min_length=2, limit=3)
    candidates = [(w, i) for w, i, n in ended if w in (0, 2) and n >= 2]
    assert len(candidates) > 3  # the limit cuts
    assert any(n < 2 for w, _, n in ended if w in (0, 2))  # the length filter drops some
    assert list(summary.episodes) == candidates[:3]
    assert select_episodes(reader, RUN, worlds=[0, 2], min_length=2, limit=3).rows() == \
        [r for r in table.where(order).rows() if r["world"] in (0, 2) and r["length"] >= 2][:3]
    summary = export_isaaclab_hdf5(store, RUN, tmp_path / "b.hdf5", fields=["states/*"])
    assert (0, 0) in summary.skipped
    assert list(summary.episodes) == [(w, i) for w, i, _ in ended if (w, i) not in summary.skipped]
    with h5py.File(tmp_path / "b.hdf5", "r") as f:
        for i, key in enumerate(summary.episodes):
            demo = f[f"data/demo_{i}"]
            assert sorted(demo) == ["states"]
            assert demo.attrs["num_samples"] == 0
            np.testing.assert_array_equal(demo["states/count"][()], reader.episode(RUN, *key)["states/states/count"])


def test_paths_term_and_rename(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """``paths="term"`` keeps the term in the key path (nothing merged); ``rename`` moves one
    field, and a field renamed onto ``actions`` sets ``num_samples``."""
    store, _ = recorded
    reader = RunStore(store)
    summary = export_isaaclab_hdf5(store, RUN, tmp_path / "t.hdf5", paths="term", limit=3)
    with h5py.File(tmp_path / "t.hdf5", "r") as f:
        for i, key in enumerate(summary.episodes):
            demo = f[f"data/demo_{i}"]
            stored = reader.episode(RUN, *key)
            names: list[str] = []
            demo.visititems(lambda n, o, names=names: names.append(n) if isinstance(o, h5py.Dataset) else None)
            assert sorted(names) == sorted(k for k, v in stored.items() if len(v))
            for name in names:
                np.testing.assert_array_equal(demo[name][()], stored[name])
    summary = export_isaaclab_hdf5(store, RUN, tmp_path / "r.hdf5", fields=["states/*"], limit=3, worlds=[2],
                                   rename={"states/states/count": "actions"})
    with h5py.File(tmp_path / "r.hdf5", "r") as f:
        for i, key in enumerate(summary.episodes):
            count = reader.episode(RUN, *key)["states/states/count"]
            np.testing.assert_array_equal(f[f"data/demo_{i}/actions"][()], count)
            assert f[f"data/demo_{i}"].attrs["num_samples"] == len(count)


def test_demo_ids_name_demos_as_isaaclab_does(tmp_path: Path) -> None:
    """An episode ended with the outcome ``demo_id`` (Isaac Lab's ``export_episodes(demo_ids=...)``)
    is ``demo_<demo_id>``; the others are numbered counting only themselves, as Isaac Lab's
    handler numbers them: the export equals the handler's file written with the same ids. A
    name that repeats is refused, as Isaac Lab's handler refuses it. Catches demos numbered by
    position whatever their ids."""
    store = tmp_path / "runs.zarr"
    broker = Broker(strict=True)
    daemon = StoreDaemon(store, commit_interval=0.0)
    broker.subscribe("", daemon)
    gen = torch.Generator().manual_seed(4)

    def record(run: str, ends: dict[int, tuple[list[int], list[int] | None]]) -> None:
        """Run ``run`` (3 worlds, 10 steps), ending ``ends[step] = (worlds, demo ids)``; Isaac
        Lab's handler writes the same episodes with the same ids to ``<run>.hdf5``."""
        episodes = {w: datasets.EpisodeData() for w in range(3)}
        handler = datasets.HDF5DatasetFileHandler()
        handler.create(str(tmp_path / f"{run}.hdf5"), env_name=ENV_NAME)
        rec = Recorder(3, broker=broker, run=run, seed=SEED, metadata={"env_name": ENV_NAME})

        def actions() -> dict[str, torch.Tensor]:
            value = torch.randn(3, 2, generator=gen)
            for w in range(3):
                episodes[w].add("actions", value[w])
            return {"actions": value}

        rec.add_term("actions", FunctionTerm(pre_step=actions))
        try:
            for step in range(10):
                rec.record_pre_step()
                rec.record_post_step()
                if step in ends:
                    worlds, ids = ends[step]
                    outcomes = {"exported": 1.0, **({"demo_id": [float(i) for i in ids]} if ids else {})}
                    rec.record_pre_reset(worlds, success=True, outcomes=outcomes)
                    for k, w in enumerate(worlds):
                        episodes[w].success, episodes[w].seed = True, SEED
                        episodes[w].pre_export()
                        handler.write_episode(episodes[w], ids[k] if ids else None)
                        episodes[w] = datasets.EpisodeData()
        finally:
            rec.close()
            handler.close()

    try:
        record("ids", {2: ([0, 1], [5, 9]), 4: ([2], None), 6: ([0], None), 7: ([1], [7])})
        with pytest.raises(ValueError, match="'demo_0' already exists"):
            record("clash", {2: ([0], [0]), 4: ([1], None)})
    finally:
        daemon.close()
        broker.close()
    summary = export_isaaclab_hdf5(store, "ids", tmp_path / "out.hdf5")
    assert summary.names == ("demo_5", "demo_9", "demo_0", "demo_1", "demo_7")
    assert_same_as_isaaclab(tmp_path / "out.hdf5", tmp_path / "ids.hdf5", run="ids")
    with pytest.raises(ExportError, match="demo 'demo_0' exists already"):
        export_isaaclab_hdf5(store, "clash", tmp_path / "clash-out.hdf5")
    assert not (tmp_path / "clash-out.hdf5").exists()


def test_mapping_errors_name_the_fields(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """Fields that cannot share a key path are refused before anything is written, naming the
    fields: a dataset that is also a group, rows of different shapes, two fields of one term
    (their rows cannot be interleaved); so are patterns and renames that name nothing, and bad
    filters."""
    store, _ = recorded
    out = tmp_path / "x.hdf5"
    cases: list[tuple[dict[str, Any], str]] = [
        ({"rename": {"actions/actions": "obs"}}, "'obs' (actions/actions) is also the group of 'obs/"),
        ({"rename": {"states/states/count": "obs/joint_pos"}}, "differ in dtype or shape"),
        ({"rename": {"obs/obs/joint_pos": "x", "obs/obs/joint_vel": "x"}}, "are fields of one term"),
        ({"fields": ["nope/*"]}, "'nope/*' matches no field"),
        ({"rename": {"nope/x": "y"}}, "'nope/x' is not a selected field"),
        ({"rename": {"actions/actions": "a//b"}}, "empty or '.' component"),
        ({"rename": {"actions/actions": "a\x00b"}}, "holds a NUL character, which HDF5 names cannot"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ExportError, match=re.escape(message)):
            export_isaaclab_hdf5(store, RUN, out, **kwargs)
        assert not out.exists()
    for kwargs, message in [({"episodes": "won"}, "episodes: expected one of all"),
                            ({"worlds": [WORLDS]}, r"worlds: expected ints in \[0, 4\)"),
                            ({"limit": -1}, "limit: expected an int >= 0"),
                            ({"paths": "both"}, "paths: expected")]:
        with pytest.raises(ValueError, match=message):
            export_isaaclab_hdf5(store, RUN, out, **kwargs)
    assert not out.exists()


def test_output_is_atomic_and_never_overwritten_unasked(recorded: tuple[Path, Path], tmp_path: Path) -> None:
    """An existing OUT is refused (byte-identical afterwards); an export that fails midway (here
    interrupted from its progress callback, as Ctrl-C would) leaves no OUT, no OUT.partial, and
    an earlier OUT it was to overwrite unchanged."""
    store, _ = recorded
    out = tmp_path / "d.hdf5"
    export_isaaclab_hdf5(store, RUN, out, limit=1)
    before = out.read_bytes()
    with pytest.raises(OutputExistsError, match="exists; pass overwrite"):
        export_isaaclab_hdf5(store, RUN, out)
    assert out.read_bytes() == before

    def interrupt(done: int, total: int) -> None:
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        export_isaaclab_hdf5(store, RUN, out, overwrite=True, progress=interrupt)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.hdf5"]
    with pytest.raises(KeyboardInterrupt):
        export_isaaclab_hdf5(store, RUN, tmp_path / "new.hdf5", progress=interrupt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.hdf5"]
    summary = export_isaaclab_hdf5(store, RUN, out, overwrite=True, limit=2)
    assert len(summary.episodes) == 2
    assert out.read_bytes() != before


# The export's child: its progress report holds the export (OUT.partial open) until a signal.
_HELD_EXPORT = """
import sys, time
import storage.export as export
def held(self, done, total):
    print("held", file=sys.stderr, flush=True)
    while True:
        time.sleep(0.05)
export._Progress.__call__ = held
from storage.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("sig", "inherited"), [(signal.SIGINT, "default"), (signal.SIGINT, "ignored"),
                                                (signal.SIGTERM, "default")],
                         ids=["sigint", "sigint-inherited-ignored", "sigterm"])
def test_a_signalled_export_leaves_nothing(recorded: tuple[Path, Path], tmp_path: Path, sig: int,
                                           inherited: str) -> None:
    """``worldtap-store export`` stopped by SIGINT or SIGTERM in the middle of writing exits 130
    with one line and leaves neither OUT nor OUT.partial; also when it inherited SIGINT ignored,
    as a command a script starts in the background does. Bug caught: SIGTERM killed it (-15)
    and left OUT.partial, and with SIGINT ignored it ran on."""
    store, _ = recorded
    out = tmp_path / "out" / "d.hdf5"
    out.parent.mkdir()
    command = [sys.executable, "-c", _HELD_EXPORT, "export", str(store), str(out), "--run", RUN,
               "--format", "isaaclab-hdf5"]
    if inherited == "ignored":  # SIG_IGN survives exec: the command starts with SIGINT ignored
        command = [sys.executable, "-c", "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                   "os.execv(sys.argv[1], sys.argv[1:])", *command]
    with subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}) as proc:
        try:
            assert proc.stderr is not None
            first = proc.stderr.readline()  # the export has begun writing OUT.partial
            assert first == "held\n", first + proc.stderr.read()
            assert (out.parent / "d.hdf5.partial").exists()
            proc.send_signal(sig)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the export ran on after signal {sig}")
            err = proc.stderr.read()
            assert proc.returncode == 130, err
            assert err == "worldtap-store export: interrupted; nothing was written\n"
            assert list(out.parent.iterdir()) == []
        finally:
            if proc.poll() is None:
                proc.kill()


def test_cli(recorded: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
             monkeypatch: pytest.MonkeyPatch) -> None:
    """``worldtap-store export``: 0 and the same file as the API (progress lines and a summary
    on stderr); 2 with one line for an existing OUT (kept), an option of the other format, a
    missing h5py (naming the extra); 3 for an unknown run or a path that is no store."""
    store, reference = recorded
    out = tmp_path / "cli.hdf5"
    argv = ["export", str(store), str(out), "--run", RUN, "--format", "isaaclab-hdf5", "--episodes", "succeeded"]
    assert cli_main(argv) == 0
    err = capsys.readouterr().err
    assert "episodes (" in err
    assert f"-> {out}" in err
    assert_same_as_isaaclab(out, reference / "succeeded.hdf5")
    before = out.read_bytes()

    def fails(args: list[str], code: int, message: str) -> None:
        assert cli_main(args) == code
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert message in err, err

    fails(argv, 2, "exists; pass overwrite (--overwrite)")
    assert out.read_bytes() == before
    fails([*argv[:1], str(store), str(tmp_path / "o.hdf5"), *argv[3:], "--actions", "a/b"], 2,
          "--actions does not apply to --format isaaclab-hdf5")
    fails(["export", str(store), str(tmp_path / "o.hdf5"), "--run", "nope", "--format", "isaaclab-hdf5"], 3,
          "run 'nope' not found")
    fails(["export", str(tmp_path), str(tmp_path / "o.hdf5"), "--run", RUN, "--format", "isaaclab-hdf5"], 3,
          "no run store at")
    with monkeypatch.context() as patch:  # as if h5py were not installed
        patch.setitem(sys.modules, "h5py", None)
        fails([*argv[:2], str(tmp_path / "o.hdf5"), *argv[3:]], 2, "pip install 'worldtap[export]'")
        with pytest.raises(MissingExtraError):
            export_isaaclab_hdf5(store, RUN, tmp_path / "o.hdf5")
        assert not (tmp_path / "o.hdf5").exists()
    assert cli_main([*argv, "--overwrite", "--quiet", "--episodes", "failed"]) == 0
    assert capsys.readouterr().err.count("\n") == 1  # the summary line only
    assert_same_as_isaaclab(out, reference / "failed.hdf5")


@pytest.mark.parametrize("beside", [False, True])
def test_a_field_name_holding_nul_is_refused_unless_renamed(tmp_path: Path, beside: bool) -> None:
    """Bug: HDF5 ends a name at its first NUL, so a field ``x\\x00y`` was exported as dataset
    ``x`` with nothing said, and beside a field ``x`` the export failed with h5py's "name
    already exists". Now it is refused, naming the field, and exports under a name given with
    ``rename``, byte-exact."""
    broker = Broker(strict=True)
    daemon = StoreDaemon(tmp_path / "s.zarr", commit_interval=0.0)
    broker.subscribe("", daemon.handle)
    recorder = Recorder(2, "cpu", broker, run="r")
    x = torch.zeros(2, 1)
    recorder.add_term("t", FunctionTerm(post_step=lambda: {"x\x00y": x + 5, **({"x": x} if beside else {})}))
    for step in range(3):
        x.fill_(step)
        recorder.record_post_step()
    recorder.record_pre_reset([0, 1])
    recorder.close()
    daemon.close()
    out = tmp_path / "out.hdf5"
    with pytest.raises(ExportError, match=re.escape("'t/x\\x00y': key path 'x\\x00y' holds a NUL character")):
        export_isaaclab_hdf5(tmp_path / "s.zarr", "r", out)
    assert not out.exists()
    export_isaaclab_hdf5(tmp_path / "s.zarr", "r", out, rename={"t/x\x00y": "x_y"})
    with h5py.File(out) as f:
        assert sorted(f["data/demo_0"]) == (["x", "x_y"] if beside else ["x_y"])
        np.testing.assert_array_equal(f["data/demo_1/x_y"][:], np.array([[5.0], [6.0], [7.0]], np.float32))
