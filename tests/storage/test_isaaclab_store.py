"""Isaac Lab's episodes through the real storage daemon: a stand-in Isaac Lab environment
records with ``capture.isaaclab.IsaacLabRecorderManager`` in Isaac Lab's
``EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES`` mode, published over ZeroMQ to a ``worldtap-store
--export split`` process, into a store written before the physics-rate hook existed (its root
lists four hooks). What the two stores
hold must be what Isaac Lab's manager (the reference, ``isaaclab_standin``) writes to its two
dataset files, byte for byte, and the old run must read back unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr
from procs import Proc

from broker import Broker, ZmqPublisher
from capture import FunctionTerm, Recorder
from capture.isaaclab import IsaacLabRecorderManager
from storage import RunStore, StoreDaemon, failed_store_location

sys.path.insert(0, str(Path(__file__).parents[1] / "capture"))  # the Isaac Lab stand-in

from isaaclab_standin import (
    DatasetExportMode,
    ReferenceRecorderManager,
    StandInRLEnv,
    Tee,
    actions,
    stock_cfg,
)

pytestmark = pytest.mark.timeout(90)

OLD_HOOKS = ["pre_step", "post_step", "pre_reset", "post_reset"]


def old_store(path: Path) -> dict[tuple[int, int], dict[str, np.ndarray]]:
    """A store as the writer made it before the physics-rate hook: one run, root hooks
    ``OLD_HOOKS``. Returns its episodes as read back."""
    daemon = StoreDaemon(path, commit_interval=0.0)
    broker = Broker()
    broker.subscribe("", daemon)
    recorder = Recorder(3, broker=broker, run="old")
    state = torch.zeros(3, 2)
    recorder.add_term("s", FunctionTerm(post_step=lambda: {"x": state}))
    for step in range(6):
        state.add_(step)
        recorder.record_post_step()
        if step % 2:
            recorder.record_pre_reset([step % 3], success=True)
    recorder.close()
    daemon.close()
    root = zarr.open_group(path, mode="a")
    root.update_attributes({"worldtap": {**root.attrs["worldtap"], "hooks": OLD_HOOKS}})
    reader = RunStore(path)
    return {(int(r["world"]), int(r["index"])): reader.episode("old", int(r["world"]), int(r["index"]))
            for r in reader.episodes("old").rows()}


def by_episode(reference: ReferenceRecorderManager) -> dict[tuple[int, int], dict[str, Any]]:
    """The reference's written episodes keyed ``(env, k)``, its ``k``-th export of that env
    (both files, in the order they were written): worldtap's ``(world, index)``."""
    written = sorted(reference.files[0] + reference.files[1], key=lambda e: e["order"])
    count: dict[int, int] = defaultdict(int)
    out = {}
    for episode in written:
        out[(episode["env_id"], count[episode["env_id"]])] = episode
        count[episode["env_id"]] += 1
    return out


def check_store(reader: RunStore, want: dict[tuple[int, int], dict[str, Any]], decimation: int) -> None:
    table = reader.episodes("isaac")
    assert {(int(w), int(i)) for w, i in zip(table["world"], table["index"], strict=True)} == set(want)
    assert table["exported"].tolist() == [1.0] * len(table)
    for row in table.rows():
        key = (int(row["world"]), int(row["index"]))
        assert row["success"] == want[key]["success"]
        stored = reader.episode("isaac", *key)
        # field "<term>/<hook>/<key>": the key is Isaac Lab's dataset path
        fields = {name.split("/", 2)[2]: value for name, value in stored.items() if len(value)}
        assert sorted(fields) == sorted(want[key]["data"])
        for name, value in want[key]["data"].items():
            assert fields[name].dtype == value.numpy().dtype, name
            assert fields[name].tobytes() == value.numpy().tobytes(), (key, name)
        rows = reader.episode_rows("isaac", *key)["record_physics_joint_velocity/post_physics_decimation_step"]
        assert len(rows["hook"]) == decimation * int(row["length"])  # every physics step of each step
        assert set(rows["hook"].tolist()) <= {"post_physics_decimation_step"}
        assert set(np.unique(rows["step"], return_counts=True)[1].tolist()) <= {decimation}
    assert table["length"].max() > 0


def test_split_export_into_a_store_older_than_the_hook(spawn: Callable[..., Proc], tmp_path: Path) -> None:
    """Catches: a daemon, wire codec or writer that refuses the physics-rate hook; an old store
    whose root hook list is not extended (code 4 would name nothing) or whose old run changes;
    Isaac Lab's succeeded/failed split not reproduced by ``--export split``; a value, key or
    success flag that differs from Isaac Lab's dataset files; the export mode missing from the
    run's metadata."""
    store = tmp_path / "runs.zarr"
    old = old_store(store)
    broker = Broker(strict=True)
    publisher = ZmqPublisher("tcp://127.0.0.1:*", send_timeout=20.0)
    try:
        broker.subscribe("", publisher)
        daemon = spawn("-m", "storage", str(store), "--connect", publisher.endpoints[0], "--export", "split",
                       "--exit-after-runs", "1", "--status-interval", "0.2")
        daemon.wait_line("worldtap-store ready")
        publisher.wait_for_subscribers(1, timeout=30.0)
        env = StandInRLEnv(num_envs=4, decimation=3, max_episode_length=5, seed=1)
        cfg = stock_cfg(DatasetExportMode.EXPORT_SUCCEEDED_FAILED_IN_SEPARATE_FILES)
        reference = ReferenceRecorderManager(cfg, env)
        manager = IsaacLabRecorderManager(cfg, env, broker=broker, run="isaac")
        env.recorder_manager = Tee(reference, manager)
        env.reset()
        for i, action in enumerate(actions(env.num_envs, 12, seed=2)):
            env.step(action)
            if i == 6:
                env.reset(env_ids=[0, 3])
        manager.close()
        publisher.close(timeout=30.0)  # returns once the daemon confirmed RunEnd, after its commit
    finally:
        with contextlib.suppress(Exception):  # after a failure: the test's error is the one to see
            publisher.close(timeout=1.0)
        broker.close()
    assert daemon.wait(30) == 0, daemon.stderr[-3000:]

    want = by_episode(reference)
    succeeded = {k: e for k, e in want.items() if e["success"]}
    assert succeeded
    assert len(succeeded) < len(want)
    main, failed = RunStore(store), RunStore(failed_store_location(store))
    check_store(main, succeeded, env.cfg.decimation)
    check_store(failed, {k: e for k, e in want.items() if not e["success"]}, env.cfg.decimation)
    assert main.info("isaac")["metadata"]["isaaclab"]["export"] == "split"
    hooks = [*OLD_HOOKS, "post_physics_decimation_step"]
    for path in (store, Path(str(failed_store_location(store)))):
        assert zarr.open_group(path, mode="r").attrs["worldtap"]["hooks"] == hooks
    for (world, index), fields in old.items():
        again = main.episode("old", world, index)
        assert sorted(again) == sorted(fields)
        for name, value in fields.items():
            assert again[name].tobytes() == value.tobytes()
