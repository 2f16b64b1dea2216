"""Child processes for the storage tests: output collected line by line, always cleaned up."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


class Proc:
    """A child process whose stdout and stderr lines are collected by background threads."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.popen = subprocess.Popen(args, cwd=cwd, env=ENV if env is None else env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, d), daemon=True)
                         for s, d in ((self.popen.stdout, self.out), (self.popen.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream: object, into: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            into.append(line)

    def wait_line(self, text: str, *, stream: str = "err", timeout: float = 30.0) -> str:
        lines = self.err if stream == "err" else self.out
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(lines):
                if text in line:
                    return line
            if self.popen.poll() is not None and not any(text in ln for ln in lines):
                time.sleep(0.1)
                if not any(text in ln for ln in lines):
                    break
            time.sleep(0.02)
        raise AssertionError(f"{text!r} not seen from {self.args}: {''.join(self.err)[-3000:]}")

    def wait_stored(self, at_least: int, timeout: float = 60.0) -> None:
        """Wait until this daemon's status lines report ``at_least`` episodes stored."""
        deadline = time.monotonic() + timeout
        while not any(int(m[1]) >= at_least for line in list(self.err)
                      if (m := re.search(r"status episodes=(\d+)", line))):
            assert self.popen.poll() is None, self.stderr[-3000:]
            assert time.monotonic() < deadline, self.stderr[-3000:]
            time.sleep(0.02)

    def wait(self, timeout: float = 60.0) -> int:
        rc = self.popen.wait(timeout)
        for t in self._threads:
            t.join(5)
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()
        return rc

    @property
    def stderr(self) -> str:
        return "".join(self.err)
