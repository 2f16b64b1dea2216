"""broker.allocator: a receiving process keeps freed memory for the next messages.

The probe counts page faults, never time: with glibc's adaptive defaults, freeing a few large
blocks at once returns them to the system, and allocating them again faults every page in.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from broker import allocator
from broker.allocator import KEEP_FREED_BYTES, apply_malloc_choice, keep_freed_memory, malloc_is_glibc

pytestmark = pytest.mark.timeout(60)

# Four 3 MiB messages in flight, then all let go, twenty times: the page faults per page of
# what was allocated after a warm-up (glibc adapts its thresholds to the first blocks freed).
PROBE = """
import resource, sys
import numpy as np
from broker.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
SIZE = 3 << 20
def rounds(n):
    for _ in range(n):
        messages = [np.ones(SIZE, np.uint8) for _ in range(4)]
        del messages
rounds(3)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
rounds(20)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (20 * 4 * SIZE / 4096))
"""


def _faults_per_page(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=50,
                         env=env)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.skipif(not malloc_is_glibc(), reason="glibc's malloc only")
def test_kept_freed_memory_is_allocated_again_without_faulting_its_pages_in() -> None:
    system, kept = _faults_per_page("system"), _faults_per_page("keep")
    assert system > 0.5  # the probe sees the cost: glibc's defaults fault nearly every page again
    assert kept < 0.05


def test_the_environment_s_malloc_settings_stand(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(allocator, "malloc_is_glibc", lambda: True)
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *_: calls.append("mallopt"))
    for name, value in (("MALLOC_TRIM_THRESHOLD_", "1000000"), ("MALLOC_MMAP_THRESHOLD_", "65536"),
                        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000000")):
        with monkeypatch.context() as m:
            m.setenv(name, value)
            assert keep_freed_memory() is False
    assert calls == []  # never reached glibc


def test_another_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "malloc_is_glibc", lambda: False)
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda *_: pytest.fail("called mallopt"))
    assert keep_freed_memory() is False


@pytest.mark.parametrize("keep", [-1, 2**31])
def test_a_keep_out_of_range_is_refused(keep: int) -> None:
    with pytest.raises(ValueError, match="keep: expected 0 <= keep < 2\\*\\*31 bytes"):
        keep_freed_memory(keep)


def test_the_command_line_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    made = True
    monkeypatch.setattr(allocator, "keep_freed_memory",
                        lambda keep=KEEP_FREED_BYTES: calls.append(keep) or made)
    assert apply_malloc_choice("system") == "system"
    assert calls == []
    assert apply_malloc_choice("keep") == "keep"
    assert calls == [KEEP_FREED_BYTES]
    made = False  # not glibc, or the environment's settings stand: the ready line says so
    assert apply_malloc_choice("keep") == "system"
    with pytest.raises(ValueError, match="--malloc: expected 'keep' or 'system', got 'fast'"):
        apply_malloc_choice("fast")
