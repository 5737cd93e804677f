"""A warm process that forks role processes: a replacement without an interpreter start.

Starting a role process costs a Python start and its imports (0.6-0.7 s of CPU on this
project's machine, more under load), which made a slave's replacement take 1.1-1.8 s
after its death was known.  A master's provisioner therefore keeps one *zygote*: a
process started in the background once the master serves, which imports what a role
needs (and calls its entry module's ``warm()``, if it has one: the CLI builds its
command parser there) and then waits, single-threaded and without an event loop, for commands on its
standard input.  Each command (one JSON line: the ``qosmq`` arguments, the environment,
the log file) is answered with the PID of a forked child, which starts a session of its
own, points its output at the log file and runs ``qosmq`` there: imports already done.

The zygote ignores SIGCHLD (its children are reaped by the kernel) and exits when its
standard input closes: when the master's process ends, however it ends.  Its children
are in sessions of their own and outlive it, tracked by PID like any role process.
Anything that fails here falls back to a plain process start (``spawn_daemon``).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["Zygote"]

log = logging.getLogger(__name__)

#: how long a command may wait for its PID (the first also waits for the imports)
ANSWER_S = 15.0


class Zygote:
    """The master's side: start the zygote, ask it for processes (thread-safe)."""

    def __init__(self, entry: str, preload: tuple[str, ...] = ()) -> None:
        """``entry``: what a forked child runs (``module:function``); ``preload``: the
        modules the zygote imports before it forks anything."""
        self.entry, self.preload = entry, preload
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._pending = b""  # read from the zygote, not yet a whole line
        self._ready = False

    def start(self) -> None:
        """Start the zygote (its imports run in it, not here); idempotent."""
        with self._lock:
            if self._process is not None and self._process.poll() is None:
                return
            self._process = subprocess.Popen(
                [sys.executable, "-m", __name__, self.entry, *self.preload],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                bufsize=0,
            )
            self._pending = b""
            self._ready = False  # its "ready" line read
        threading.Thread(target=self._await_ready, name="zygote-ready", daemon=True).start()

    def _await_ready(self) -> None:
        """Read the zygote's "ready" (its imports done) and log it once: until then a
        spawn waits for it (the lock is held meanwhile); one that never comes stops it."""
        started = time.monotonic()
        with self._lock:
            process = self._process
            if process is None or process.stdout is None or self._ready:
                return  # stopped, or a spawn read it first
            try:
                answer = self._line(process, started + ANSWER_S)
            except (OSError, ValueError, TimeoutError) as exc:
                log.warning("zygote not ready (%s): replacements start plainly", exc)
                answer = ""
            if answer == "ready":
                self._ready = True
                log.info(
                    "zygote ready (pid %d) %.2f s after its start",
                    process.pid,
                    time.monotonic() - started,
                )
                return
        self.stop()

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path) -> int | None:
        """A process running ``qosmq argv`` (without the program), forked by the zygote;
        its PID, or None when the zygote is not there or did not answer."""
        with self._lock:
            process = self._process
            if process is None or process.poll() is not None:
                return None
            assert process.stdin is not None and process.stdout is not None
            command = {"argv": argv, "env": env, "log": str(log_path)}
            deadline = time.monotonic() + ANSWER_S
            try:
                process.stdin.write((json.dumps(command) + "\n").encode())
                answer = self._line(process, deadline)
                while answer == "ready":  # its imports are done (read by the first spawn)
                    self._ready = True
                    answer = self._line(process, deadline)
                return int(answer)
            except (OSError, ValueError, TimeoutError) as exc:
                log.info("zygote did not start a process (%s): a plain start instead", exc)
        self.stop()  # a zygote that did not answer is not asked again
        return None

    def _line(self, process: subprocess.Popen[bytes], deadline: float) -> str:
        """The zygote's next answer line, or ``TimeoutError`` at ``deadline``."""
        assert process.stdout is not None
        fd = process.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no answer in {ANSWER_S:.0f} s")
            chunk = os.read(fd, 4096)
            if not chunk:
                raise OSError("the zygote ended")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode().strip()

    def stop(self) -> None:
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            with contextlib.suppress(Exception):
                process.kill()
                process.wait(5)
            for pipe in (process.stdin, process.stdout):
                if pipe is not None:
                    with contextlib.suppress(Exception):
                        pipe.close()


def _serve(entry: str, preload: list[str]) -> None:
    """The zygote: preload, then fork one child per command line until stdin closes;
    each child runs ``entry`` (``module:function``) with the command's arguments."""
    for module in preload:
        importlib.import_module(module)
    # the entry's own warm-up (the CLI builds its command parser: with the commands
    # other packages contribute, whose imports it makes, 60-80 ms of each child's start)
    warm = getattr(importlib.import_module(entry.partition(":")[0]), "warm", None)
    if callable(warm):
        warm()
    # what the imports made is never freed: frozen here, a child's settle (heap.py) does
    # not traverse it again (0.2-0.3 s of each replacement's start on this machine), and
    # collections in the children do not touch (and so copy) the pages it sits on
    gc.collect()
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            command = json.loads(line)
            pid = os.fork()
        except (ValueError, OSError) as exc:
            print(f"error {exc}", flush=True)
            continue
        if pid == 0:
            _child(command, entry)  # never returns
        print(pid, flush=True)


def _child(command: dict[str, object], entry: str) -> None:
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(str(command["log"]), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(devnull)
        os.close(out)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the zygote's pipe is not ours
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        env = command["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update(env)
        argv = command["argv"]
        assert isinstance(argv, list)
        sys.argv = ["qosmq", *argv]
        module, _, function = entry.partition(":")
        result = getattr(importlib.import_module(module), function)(argv)
        code = result if isinstance(result, int) else 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2:])
