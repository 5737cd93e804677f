"""The CPU meter attributes a cell's CPU to the right processes (real processes, /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from qosmq_bench.cpu import CpuMeter, busiest_by_kind, role_kind

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs Linux /proc")


def test_role_kinds_from_phoenix_up_names() -> None:
    assert role_kind("A/router") == "router"
    assert role_kind("A/router-slave-1") == "router_slave"
    assert role_kind("B/matcher-0") == "match_master"
    assert role_kind("C/matcher-2-slave-0") == "match_slave"
    assert role_kind("client") == "client"
    processes = {"A/router": 10.0, "B/router": 30.0, "A/matcher-0": None, "client": 5.0}
    assert busiest_by_kind(processes) == {"router": 30.0, "client": 5.0}


def test_a_spinning_process_is_told_from_a_sleeping_one() -> None:
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)  # both started (interpreter start-up is not the sleeper's idle)
        with CpuMeter({"spin": spin.pid, "sleep": sleep.pid, "gone": 2**22 + 1}) as meter:
            time.sleep(1.0)
    finally:
        spin.kill()
        sleep.kill()
        spin.wait()
        sleep.wait()
    processes = meter.result["processes"]
    assert processes["gone"] is None
    assert processes["sleep"] < 5.0
    assert processes["spin"] > 25.0  # one core, shared with whatever else runs
    assert meter.result["machine_pct"] is not None and meter.result["machine_pct"] > 0
    assert meter.result["cores"] == os.cpu_count()


def test_run_delay_shows_a_process_waiting_for_a_core() -> None:
    """More spinners than cores: each waits for a core part of the time (its run delay);
    a sleeping process waits for none."""
    cores = os.cpu_count() or 1
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores + 1)
    ]
    sleep = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        named = {f"spin{i}": p.pid for i, p in enumerate(spinners)}
        with CpuMeter({**named, "sleep": sleep.pid, "gone": 2**22 + 1}) as meter:
            time.sleep(1.5)
    finally:
        for p in [*spinners, sleep]:
            p.kill()
            p.wait()
    waiting = meter.result["waiting"]
    assert waiting["gone"] is None
    assert waiting["sleep"] < 2.0
    # cores + 1 spinners on `cores` cores: together they wait at least one core's worth
    assert sum(waiting[name] for name in named) > 50.0, waiting
    for name in named:  # a spinner is always running or waiting: the two fill the wall time
        running = meter.result["processes"][name]
        assert 70.0 <= running + waiting[name] <= 115.0, (name, running, waiting[name])
