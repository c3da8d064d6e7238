"""A test's engine or rank process, driven by JSON lines on its stdin and stdout (its other output, NIXL's
log lines, is skipped)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class JsonProcess:
    """``python -m module`` with the repository on its path (and ``env`` added), sent ``cmd`` first."""

    def __init__(self, module: str, cmd: dict, log, *, env: dict | None = None, what: str = "process") -> None:
        self.what = what
        self.p = subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=log, text=True,
                                  env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
        self._buf = b""
        self.send(cmd)

    def send(self, obj) -> None:
        self.p.stdin.write(json.dumps(obj) + "\n")
        self.p.stdin.flush()

    def read(self, timeout: float = 300.0) -> dict:
        """The next JSON line. Lines are split here from raw reads: a buffered reader would hide lines from
        select()."""
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while time.monotonic() < deadline:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(b"{"):
                    return json.loads(line)
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # end of output: every line it printed was read above
                    raise AssertionError(f"{self.what} exited with {self.p.wait(10)}")
                self._buf += chunk
        raise AssertionError(f"no answer from a {self.what} in {timeout} s")

    def close(self, timeout: float = 20.0) -> None:
        """Wait for it to end (it was told to), killed past ``timeout``."""
        try:
            self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait(5)
