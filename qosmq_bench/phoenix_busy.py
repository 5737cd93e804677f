"""``qosmq bench phoenix --experiment busy``: elections on a machine that is busy.

The paper's deployment (3 clusters, each a routing master with 2 routing slaves and a
match master with 2 match slaves: 18 role processes) started and run while ``hogs``
processes spin on the same cores (2 cores here: 2 hogs oversubscribe them about 2x with
the brokers and roles), events at ``rate``/s for ``duration_s``, nothing killed.  Every
election counted is false.  Then, still under the hogs, two real faults: B's match
master frozen (SIGSTOP, found by its beats) and B's routing master SIGKILLed (found by its
lease), each with the time from the fault to the first election.  Counted from the
roles' own logs and the benchmark's own consumer, not from the roles' counters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.routing import RoleId
from middleware.settings import Settings

from .phoenix_deploy import Deployment
from .phoenix_recovery import (
    CLUSTER,
    _log_lines_after,
    _serving,
    _Stream,
    _subscribe,
    _wait_all_served,
)

__all__ = ["run_busy"]

HOG = "import time\nwhile True:\n    pass\n"


def spin(n: int) -> list[subprocess.Popen[bytes]]:
    """``n`` processes spinning on the cores (a busy machine), to be killed by PID."""
    return [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n)]


def run_busy(
    settings: Settings,
    *,
    directory: Path,
    hogs: int,
    rate: float,
    duration_s: float,
    fields: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Start and run under ``hogs`` spinning processes; the elections nobody caused, the
    events lost, and the detection of a freeze and of a kill (see the module doc)."""
    hogging = spin(hogs)
    prefix = f"bench-busy-{int(time.time())}"
    deployment = Deployment(
        directory / prefix, prefix=prefix, amqp_urls=settings.amqp_urls, fields=fields
    )
    event_type = next(
        f"busy{i}" for i in range(10_000) if deployment.ring.owner(f"busy{i}") == CLUSTER
    )
    queue = f"{prefix}.sub"
    try:
        started = time.time()
        with deployment.running():
            phoenix = deployment.phoenix()
            _wait_all_served(phoenix, 180)
            runtime.run(_subscribe(settings, deployment, event_type, queue))
            up_elections = len(_log_lines_after(phoenix, started, ": electing", cluster=None))
            steady_from = time.time()
            stream = _Stream(settings, deployment, event_type, queue, 0)
            runtime.run(stream.run_actions(rate, duration_s, []))
            steady = _log_lines_after(phoenix, steady_from, ": electing", cluster=None)
            lost = len(set(stream.sent) - {n for n, _ in stream.got})
            print(
                f"busy: {up_elections} elections at start, {len(steady)} in "
                f"{duration_s:.0f} s of steady load, {lost} of {len(stream.sent)} events lost",
                file=sys.stderr,
                flush=True,
            )
            try:
                freeze_s, kill_s = _detections(phoenix)
            except RuntimeError as exc:  # roles left unserved by the elections: said
                freeze_s = kill_s = None
                print(f"busy: no fault detection measured: {exc}", file=sys.stderr)
    finally:
        for hog in hogging:
            hog.kill()
            hog.wait(10)
    return {
        "hogs": hogs,
        "rate": rate,
        "duration_s": duration_s,
        "elections_at_start": up_elections,
        "elections_steady": len(steady),
        "events": len(stream.sent),
        "lost": lost,
        "freeze_detected_s": freeze_s,
        "kill_detected_s": kill_s,
        "steady_election_lines": [line for _, line in steady][:10],
    }


def _detections(phoenix: Any) -> tuple[float | None, float | None]:
    """A freeze of B's match master (2.5 s) and a SIGKILL of B's routing master: the
    seconds from each to the first election line naming it."""
    out: list[float | None] = []
    for target, how in ((RoleId.match(CLUSTER, 0), "stop"), (RoleId.router(CLUSTER), "kill")):
        _wait_all_served(phoenix, 180)
        _, pid = _serving(phoenix)[target]
        at = time.time()
        os.kill(pid, signal.SIGSTOP if how == "stop" else signal.SIGKILL)
        needle = f"no beat from {target} " if how == "stop" else f"lease of {target} "
        deadline = time.monotonic() + 10
        found: list[tuple[float, str]] = []
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
            found = _log_lines_after(phoenix, at, needle)
        if how == "stop":
            time.sleep(max(0.0, 2.5 - (time.time() - at)))
            os.kill(pid, signal.SIGCONT)
        out.append(round(found[0][0] - at, 3) if found else None)
    return out[0], out[1]
