"""Where the CPU went during a benchmark cell, read from Linux ``/proc``.

A response time measured on a shared machine means little without what limited
it: :class:`CpuMeter` reads the machine's busy and steal time (``/proc/stat``) and
the CPU seconds of named processes (``/proc/PID/stat``) at the start and end of a
cell, and reports each as a percentage (machine: of all cores; a process: of one
core).  It also reads each process's run delay (``/proc/PID/schedstat``: time its main
thread was ready to run but waited for a core) as a percentage of the cell's wall time:
a process at 20 % CPU that waits another 30 % is held back by the machine, not by its
own work.  And the run queue: runnable threads (``procs_running``, the reader not
counted) sampled every 0.2 s, averaged; above the core count, work waits for a core.
Where ``/proc`` is missing (not Linux) the readings are ``None``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from middleware.routing import RoleId, RoleKind

__all__ = [
    "CLIENT_BOUND_PCT",
    "MACHINE_BOUND_PCT",
    "RUNNABLE_PCT",
    "CpuMeter",
    "busiest_by_kind",
    "limit",
    "role_kind",
]

#: A benchmark cell is bound by a process at this % of one core (Python runs a
#: process's event loop on one), by the machine at this % of all its cores.
CLIENT_BOUND_PCT, MACHINE_BOUND_PCT = 85.0, 90.0
#: ... or by a client process runnable (running or waiting for a core) this % of the time
RUNNABLE_PCT = 95.0

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _process_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _run_delay_seconds(pid: int) -> float | None:
    """Seconds the process's main thread spent runnable on a run queue, not running."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _machine() -> tuple[int, int, int] | None:
    """(busy, steal, total) jiffies over all cores."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    steal = values[7] if len(values) > 7 else 0
    total = sum(values[:8])  # guest time is already counted in user
    return total - idle - steal, steal, total


def _running() -> int | None:
    """Runnable threads now, this reader excluded."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("procs_running"):
                    return max(0, int(line.split()[1]) - 1)
    except (OSError, ValueError):
        return None
    return None


class CpuMeter:
    """``with CpuMeter({"client": os.getpid(), ...}) as cpu: ...`` then ``cpu.result``."""

    def __init__(self, processes: Mapping[str, int]) -> None:
        self.processes = dict(processes)
        self.result: dict[str, Any] = {}

    def __enter__(self) -> CpuMeter:
        self._wall = time.monotonic()
        self._machine = _machine()
        self._seconds = {name: _process_seconds(pid) for name, pid in self.processes.items()}
        self._delays = {name: _run_delay_seconds(pid) for name, pid in self.processes.items()}
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, name="run-queue", daemon=True)
        self._sampler.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.2):
            value = _running()
            if value is None:
                return
            self._samples.append(value)

    def __exit__(self, *exc: object) -> None:
        wall = max(1e-9, time.monotonic() - self._wall)
        self._stop.set()
        self._sampler.join()
        samples = self._samples
        self.result["run_queue"] = round(sum(samples) / len(samples), 2) if samples else None
        machine = _machine()
        if machine and self._machine and machine[2] > self._machine[2]:
            busy, steal, total = (
                after - before for after, before in zip(machine, self._machine, strict=True)
            )
            self.result["machine_pct"] = round(100 * busy / total, 1)
            self.result["steal_pct"] = round(100 * steal / total, 1)
        else:
            self.result["machine_pct"] = self.result["steal_pct"] = None
        self.result["cores"] = os.cpu_count()
        processes: dict[str, float | None] = {}
        waiting: dict[str, float | None] = {}
        for name, pid in self.processes.items():  # None: not running at one end of the cell
            processes[name] = _percent(self._seconds[name], _process_seconds(pid), wall)
            waiting[name] = _percent(self._delays[name], _run_delay_seconds(pid), wall)
        self.result["processes"] = processes
        self.result["waiting"] = waiting


def _percent(before: float | None, after: float | None, wall: float) -> float | None:
    if before is None or after is None:
        return None
    return round(100 * (after - before) / wall, 1)


_LABELS = {
    RoleKind.ROUTER: "router",
    RoleKind.ROUTER_SLAVE: "router_slave",
    RoleKind.MATCH: "match_master",
    RoleKind.MATCH_SLAVE: "match_slave",
}


def role_kind(name: str) -> str:
    """``A/router`` -> router, ``A/matcher-0-slave-1`` -> match_slave; else the name."""
    try:
        return _LABELS[RoleId.from_key(name).kind]
    except ValueError:
        return name


def busiest_by_kind(processes: Mapping[str, float | None]) -> dict[str, float]:
    """The busiest process of each kind, % of one core."""
    out: dict[str, float] = {}
    for name, pct in processes.items():
        if pct is not None:
            kind = role_kind(name)
            out[kind] = max(out.get(kind, 0.0), pct)
    return out


def limit(
    client_pct: float | None,
    machine_pct: float | None,
    others: Mapping[str, float | None] | None = None,
    client_wait_pct: float | None = None,
) -> str:
    """What limited a benchmark cell, from the CPU read around it: ``client`` (the
    busiest client process near a whole core, or always runnable, running or waiting
    for a core, while the machine still had room), the name of another process (or
    group) near a whole core (``others``: a role kind, the brokers as % of one core each),
    ``cores`` (the machine's cores all busy: what runs on them shares them), else
    ``none`` (nothing saturated: windows, rates and round trips set the pace);
    ``unknown`` without readings."""
    if client_pct is None and machine_pct is None:
        return "unknown"
    if client_pct is not None and client_pct >= CLIENT_BOUND_PCT:
        return "client"
    busy = [(pct, name) for name, pct in (others or {}).items() if pct is not None]
    if busy and max(busy)[0] >= CLIENT_BOUND_PCT:
        return max(busy)[1]
    if machine_pct is not None and machine_pct >= MACHINE_BOUND_PCT:
        return "cores"
    if client_pct is not None and client_pct + (client_wait_pct or 0.0) >= RUNNABLE_PCT:
        return "client"
    return "none"
