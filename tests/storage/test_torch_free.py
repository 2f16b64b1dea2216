"""The storage daemon without torch: it decodes to numpy (``arrays="numpy"``), stores exactly the
bytes the torch decoder's messages store (every wire dtype, bfloat16 included), and runs as a
real process in which importing torch fails."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procs import ENV
from storage_sim import expected_sim

from broker import Batch, BFloat16Bits, EpisodeEnd, Message, RunEnd, RunStart, VariationSample, decode, encode
from storage import RunStore, StoreDaemon

pytestmark = pytest.mark.timeout(90)

SIM = Path(__file__).with_name("storage_sim.py")
NO_TORCH = "import sys; sys.modules['torch'] = None  # importing torch now fails\n"
"""The start of every torch-less child: an import of torch raises ImportError."""
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64]
WORLDS = 3


def _values(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Values of ``dtype`` spread over its range (bits that a lossy path would change)."""
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -(2**40)), min(info.max, 2**40), shape, generator=gen).to(dtype)


def _run() -> tuple[list[Message], dict[tuple[int, int], dict[str, list[torch.Tensor]]]]:
    """A run whose batches hold a field of every wire dtype (``all``: every world each step;
    ``some``: the worlds that end an episode), with episode outcomes and variation values of
    several dtypes; and the rows each complete episode must store."""
    gen = torch.Generator().manual_seed(11)
    decl = {"kind": "normal", "phase": "runtime", "shape": [2], "seed": 1, "mean": 0.0, "std": 1.0}
    messages: list[Message] = [RunStart("run-t", 0, 0, WORLDS, "cpu", metadata={"task": "dtypes"},
                                        variations={"gain": decl}, seed=7, wall_time=1_700_000_000.5)]
    episode = [0] * WORLDS
    rows: dict[tuple[int, int], dict[str, list[torch.Tensor]]] = {}

    def add(cls: Any, *args: Any, **kw: Any) -> None:
        messages.append(cls("run-t", len(messages), step, *args, **kw))

    for step in range(1, 7):
        worlds = torch.arange(WORLDS)
        fields = {str(d).removeprefix("torch."): _values(gen, d, (WORLDS, 2)) for d in DTYPES}
        add(Batch, "batch/all", worlds, torch.tensor(episode), fields)
        for w in range(WORLDS):
            for name, t in fields.items():
                rows.setdefault((w, episode[w]), {}).setdefault(f"all/{name}", []).append(t[w])
        ended = [w for w in range(WORLDS) if (w + step) % 3 == 0]
        if not ended:
            continue
        idx = torch.tensor(ended)
        n = len(ended)
        some = {str(d).removeprefix("torch."): _values(gen, d, (n,)) for d in DTYPES}
        add(Batch, "batch/some", idx, torch.tensor([episode[w] for w in ended]), some, "pre_reset")
        for i, w in enumerate(ended):
            for name, t in some.items():
                rows[(w, episode[w])].setdefault(f"some/{name}", []).append(t[i])
        outcomes = {f"o_{str(d).removeprefix('torch.')}": _values(gen, d, (n,)) for d in DTYPES}
        add(EpisodeEnd, idx, torch.tensor([episode[w] for w in ended]), _values(gen, torch.bool, (n,)),
            torch.zeros(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool), torch.full((n,), step),
            outcomes=outcomes)
        for w in ended:
            episode[w] += 1
        add(VariationSample, "gain", "runtime", idx, torch.tensor([episode[w] for w in ended]),
            _values(gen, torch.bfloat16, (n, 2)))
        add(VariationSample, "tilt", "runtime", idx, torch.tensor([episode[w] for w in ended]),
            _values(gen, torch.int8, (n,)))
    step = 7
    add(RunEnd, WORLDS, "cpu", metadata={"task": "dtypes"}, variations={"gain": decl}, seed=7,
        wall_time=1_700_000_100.25)
    return messages, rows


def _store(path: Path, arrays: str) -> None:
    """Store the run through ``StoreDaemon.handle`` from its wire frames decoded to ``arrays``.
    One commit, at the run's end (no timing decides what a commit holds)."""
    messages, _ = _run()
    with StoreDaemon(path, commit_interval=3600.0) as daemon:
        for m in messages:
            decoded = decode([bytes(f) for f in encode(m)], arrays=arrays)  # type: ignore[call-overload]
            if arrays == "numpy" and isinstance(decoded, Batch):
                assert isinstance(decoded.fields["bfloat16"], BFloat16Bits)
                assert all(isinstance(v, np.ndarray) for v in decoded.fields.values())
            daemon.handle(decoded)
        assert daemon.statistics().rejected == {}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_numpy_decoded_messages_store_the_bytes_torch_decoded_ones_store(tmp_path: Path) -> None:
    """Every file of the store (chunks, array metadata, run attributes) is byte-identical whether
    the daemon was fed torch tensors or numpy arrays, and what is stored is what was published."""
    _store(tmp_path / "torch.zarr", "torch")
    _store(tmp_path / "numpy.zarr", "numpy")
    by_torch, by_numpy = _files(tmp_path / "torch.zarr"), _files(tmp_path / "numpy.zarr")
    assert sorted(by_numpy) == sorted(by_torch)
    for name, data in by_torch.items():
        assert by_numpy[name] == data, name

    messages, rows = _run()
    ended = {(w, e) for m in messages if isinstance(m, EpisodeEnd)
             for w, e in zip(m.worlds.tolist(), m.episodes.tolist(), strict=True)}
    reader = RunStore(tmp_path / "numpy.zarr")
    stored = reader.episodes("run-t").rows()
    assert {(int(r["world"]), int(r["index"])) for r in stored} == ended
    for row in stored:
        key = (int(row["world"]), int(row["index"]))
        got = reader.episode("run-t", *key)
        for name, values in rows[key].items():
            want = torch.stack(values)
            if want.dtype == torch.bfloat16:  # read back as float32, exactly
                want = want.to(torch.float32)
            assert got[name].dtype == want.numpy().dtype, name
            np.testing.assert_array_equal(got[name], want.numpy(), err_msg=name)
    fields = reader.info("run-t")["fields"]
    assert fields["all"]["bfloat16"]["dtype"] == "bfloat16"
    assert fields["some"]["bool"]["dtype"] == "bool"


def test_storage_imports_leave_torch_out() -> None:
    """``import storage`` and the daemon's modules (and ``broker``'s transport) import no torch."""
    code = ("import sys\nimport storage, storage.cli, storage.daemon, storage.info\n"
            "from broker import Subscriber, ZmqPublisher, decode\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr


def test_a_daemon_that_cannot_import_torch_stores_a_run_byte_exact(spawn: Any, tmp_path: Path) -> None:
    """A real ``worldtap-store`` process in which importing torch fails stores what a normal
    publisher process (with torch) published, value for value; ``info`` reads it without torch."""
    store = tmp_path / "runs.zarr"
    pub = spawn(str(SIM), "--steps", "40")
    endpoint = pub.wait_line("tcp://", stream="out").strip()
    argv = [str(store), "--connect", endpoint, "--exit-after-runs", "1"]
    daemon = spawn("-c", f"{NO_TORCH}from storage.cli import main\nsys.exit(main({argv!r}))")
    assert daemon.wait() == 0, daemon.stderr
    assert pub.wait() == 0, pub.stderr

    sim = expected_sim(0, 40, 6)
    reader = RunStore(store)
    stored = reader.episodes("run-a").rows()
    assert len(stored) == len(sim.outcome)
    for row in stored:
        key = (int(row["world"]), int(row["index"]))
        assert row["success"] == sim.outcome[key]
        got, want = reader.episode("run-a", *key), sim.arrays(key)
        for name, values in want.items():
            assert got[name].dtype == values.dtype, name
            np.testing.assert_array_equal(got[name], values, err_msg=name)

    info = subprocess.run([sys.executable, "-c", f"{NO_TORCH}from storage.cli import main\n"
                           f"sys.exit(main(['info', {str(store)!r}]))"],
                          capture_output=True, text=True, env=ENV, timeout=60, check=False)
    assert info.returncode == 0, info.stderr
    assert "run-a" in info.stdout


def test_an_unknown_array_kind_is_refused_naming_the_argument() -> None:
    from broker import Subscriber

    frames = [bytes(f) for f in encode(RunStart("r", 0, 0, 1, "cpu", wall_time=1.0))]
    with pytest.raises(ValueError, match="arrays: expected 'torch' or 'numpy', got 'jax'"):
        decode(frames, arrays="jax")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="arrays: expected 'torch' or 'numpy', got 'jax'"):
        Subscriber("tcp://127.0.0.1:9", arrays="jax")  # type: ignore[arg-type]
