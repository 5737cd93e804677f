"""Helper processes of the tests: started until they say ``ready``, stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]


def spawn_ready(
    module: str, *args: str, env: dict[str, str], stderr: IO[str] | None = None
) -> subprocess.Popen[str]:
    """``python -m module args…`` from the project root, returned once it printed
    ``ready`` (its first line); its stderr goes to ``stderr`` (default: the test's)."""
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def stop(proc: subprocess.Popen[str]) -> None:
    """SIGKILL ``proc`` if it still runs (resumed first, should it be stopped), reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
