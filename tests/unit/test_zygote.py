"""``sidecar.zygote``: role processes forked from a warm process, real processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

from middleware.localcluster.manager import pid_alive
from middleware.sidecar.processes import ENTRY, PRELOAD
from middleware.sidecar.zygote import Zygote


def _until(check, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_a_forked_command_runs_in_its_own_session_with_its_output_in_the_log(
    tmp_path: Path,
) -> None:
    zygote = Zygote(ENTRY, PRELOAD)
    zygote.start()
    try:
        log = tmp_path / "role.log"
        env = {**os.environ, "QOSMQ_LOG_LEVEL": "INFO"}
        pid = zygote.spawn(["--help"], env, log)
        assert pid is not None and pid != os.getpid()
        assert _until(lambda: "usage: qosmq" in log.read_text() if log.exists() else False)
        assert _until(lambda: not pid_alive(pid))  # it ended, and was reaped
    finally:
        zygote.stop()


def test_the_zygote_ends_with_its_master_and_then_starts_nothing(tmp_path: Path) -> None:
    zygote = Zygote(ENTRY, PRELOAD)
    zygote.start()
    process = zygote._process
    assert process is not None
    try:
        process.stdin.close()  # what the master's death does to its pipe
        assert process.wait(30) == 0
        assert zygote.spawn(["--help"], dict(os.environ), tmp_path / "x.log") is None
    finally:
        zygote.stop()


def test_the_zygote_says_when_it_is_ready_and_still_forks_afterwards(
    tmp_path: Path, caplog
) -> None:
    caplog.set_level("INFO", logger="middleware.sidecar.zygote")
    zygote = Zygote(ENTRY, PRELOAD)
    zygote.start()
    try:
        assert _until(lambda: "zygote ready" in caplog.text)  # its imports are done
        log = tmp_path / "role.log"
        pid = zygote.spawn(["--help"], dict(os.environ), log)
        assert pid is not None
        assert _until(lambda: "usage: qosmq" in log.read_text() if log.exists() else False)
    finally:
        zygote.stop()


def test_the_zygote_runs_the_entry_point_it_is_told(tmp_path: Path) -> None:
    zygote = Zygote("builtins:print")  # any ``module:function`` taking the arguments
    zygote.start()
    try:
        log = tmp_path / "entry.log"
        pid = zygote.spawn(["told", "this"], dict(os.environ), log)
        assert pid is not None
        assert _until(lambda: "['told', 'this']" in log.read_text() if log.exists() else False)
        assert _until(lambda: not pid_alive(pid))
    finally:
        zygote.stop()


def test_the_entry_modules_warm_up_runs_once_in_the_zygote_before_any_fork(
    tmp_path: Path, monkeypatch
) -> None:
    """``warm()`` of the entry's module (the CLI builds its parser there): run in the
    zygote, so what it made is in every child without the child making it."""
    (tmp_path / "warmed_entry.py").write_text(
        "import os\n"
        "WARMED = []\n"
        "def warm():\n"
        "    WARMED.append(os.getpid())\n"
        "def main(argv):\n"
        "    print('warmed in', WARMED, 'child', os.getpid(), flush=True)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    zygote = Zygote("warmed_entry:main")
    zygote.start()
    try:
        process = zygote._process
        assert process is not None
        logs = [tmp_path / f"child-{i}.log" for i in range(2)]
        pids = [zygote.spawn([], dict(os.environ), log) for log in logs]
        for log, pid in zip(logs, pids, strict=True):
            assert _until(lambda log=log: log.exists() and "child" in log.read_text())
            assert log.read_text().split() == [
                "warmed", "in", f"[{process.pid}]", "child", str(pid)
            ]  # fmt: skip
    finally:
        zygote.stop()
