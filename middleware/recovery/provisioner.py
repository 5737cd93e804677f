"""The provisioner seam: how a master gets a replacement for a slave it no longer hears,
and how a routing master adds match roles when it takes over a larger cluster's arc.

A master asks for a role id (never a process): the replacement serves the same role,
named by the same queues, so nothing else has to be told.  ``start`` may block (it runs
in a thread) and returns what it started, for the log, or None when it started nothing
(the role is served again already, the deployment is going down, nowhere to start it).

``sidecar.processes.LocalProvisioner`` starts role processes on this machine.  For
another scheduler, implement ``start`` with its API, e.g. ``systemctl start
qosmq-role@<key>`` for systemd units or a patch to a Kubernetes Deployment's replicas;
the role id's ``key`` names the unit or pod.

``add`` starts roles the topology does not list (a take-over's plan: match masters
beyond the cluster's own and their slaves, ``recovery/capacity.py``), returning once
each serves; ``retire`` stops them again when the departed cluster rejoins.  Both block
(they run in a thread) and raise a ``MiddlewareError`` naming what could not be done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ..phoenix.ids import RoleId

__all__ = ["Provisioner"]


class Provisioner(Protocol):
    def start(self, role: RoleId) -> str | None:
        """Start a process serving ``role``; what was started (for the log), or None."""
        ...

    def warm(self) -> None:
        """Called once a master serves: prepare so that ``start`` is quick (the local
        one forks from a process with its imports done); may do nothing."""
        ...

    def add(self, roles: Sequence[RoleId]) -> str:
        """Start a process for each of ``roles`` that none serves; return once every
        one serves (what was started, for the log)."""
        ...

    def retire(self, roles: Sequence[RoleId]) -> str:
        """Stop the processes serving ``roles`` for good (not replaced); what stopped."""
        ...
