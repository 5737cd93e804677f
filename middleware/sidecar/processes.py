"""The processes of a Phoenix deployment on this machine (driver): what a role process
runs and preloads, the provisioner that starts replacements and added roles in a
deployment's slots (``LocalProvisioner``), and stopping processes by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from ..localcluster.manager import pid_alive
from ..phoenix.ids import RoleId, RoleKind
from .zygote import Zygote

if TYPE_CHECKING:
    from .deployment import PhoenixDeployment

__all__ = [
    "ENTRY",
    "PRELOAD",
    "LocalProvisioner",
    "after_retire",
    "reap",
    "role_argv",
    "terminate",
    "wait_dead",
]

#: the program a forked child runs (``module:function``, called with the argument list)
#: and what it imports, loaded once in the zygote (zygote.py): a role process's
ENTRY = "middleware.cli:main"
PRELOAD = (
    "middleware.cli",
    "middleware.sidecar.commands",
    "middleware.sidecar.phoenix",
    "middleware.sidecar.deployment",
    "middleware.routing.node",
    "middleware.routing.router_roles",
    "middleware.routing.match_master",
    "middleware.routing.match_roles",
)


class LocalProvisioner:
    """The recovery package's provisioner for a deployment on this machine: a master
    that hears nothing from one of its slaves asks it for a replacement, which starts
    in the slot of a dead process (``PhoenixDeployment.replace``).  Another scheduler
    (systemd, Kubernetes) is one more class with this ``start``: see
    ``docs/phoenix-recovery.md``."""

    def __init__(self, deployment: PhoenixDeployment) -> None:
        self.deployment = deployment

    def warm(self) -> None:
        """Start a zygote that forks replacements with their imports done (zygote.py):
        a replacement then serves in a fraction of a process start."""
        if self.deployment.zygote is None:
            self.deployment.zygote = Zygote(ENTRY, PRELOAD)
        self.deployment.zygote.start()

    def start(self, role: RoleId) -> str | None:
        """Start a process serving ``role``; what was started (for the log), or None."""
        started = self.deployment.replace(role)
        if started is None:
            return None
        slot, pid = started
        # the new process is this one's child: reaped when it ends, never a zombie
        threading.Thread(target=reap, args=(pid,), name=f"reaper of {pid}", daemon=True).start()
        return f"pid {pid} in the slot of {slot.key}"

    def add(self, roles: Sequence[RoleId]) -> str:
        """Start the roles a take-over adds, each in a slot of its own; once they serve."""
        started = self.deployment.add(roles)
        return ", ".join(f"{r.key} (pid {p})" for r, p in sorted(started.items())) or "none"

    def retire(self, roles: Sequence[RoleId]) -> str:
        """Stop the roles a take-over added (their cluster rejoined) and forget their slots."""
        stopped = self.deployment.retire(roles)
        return ", ".join(f"pid {p}" for p in stopped) or "none"


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def role_argv(role: RoleId) -> list[str]:
    """The ``qosmq sidecar`` arguments that run ``role``."""
    argv = ["router" if role.kind in (RoleKind.ROUTER, RoleKind.ROUTER_SLAVE) else "matcher"]
    argv += ["--cluster", role.cluster]
    if role.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE):
        argv += ["--index", str(role.index)]
    if role.is_slave:
        argv += ["--role", "slave", "--slave", str(role.slave)]
    return argv


def after_retire(now: Mapping[RoleId, int], stopped: Mapping[RoleId, int]) -> dict[RoleId, int]:
    """The slots left once ``stopped`` (role -> the PID ``retire`` stopped) are gone: a
    slot whose process was replaced meanwhile (an ``add`` for the same role: its cluster
    left again right after it rejoined) keeps its new process, which ``status`` and
    ``down`` must go on seeing."""
    return {role: pid for role, pid in now.items() if stopped.get(role) != pid}


def terminate(pids: Iterable[int], timeout: float) -> None:
    """SIGTERM each process (a role stops consuming and closes), SIGKILL what is left
    after ``timeout``."""
    pids = list(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    if not wait_dead(pids, timeout):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_dead(pids, 5.0)


def wait_dead(pids: Iterable[int], timeout: float) -> bool:
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, os.WNOHANG)  # our own children (a role started here) are reaped
        time.sleep(0.05)
    return True
