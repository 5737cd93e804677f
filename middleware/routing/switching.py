"""What a role process serves next when its role stops to switch (pure): up to its
master's role (a take-over or an election it won), or down to a slave (a master fenced
by a newer reign).  ``node.RoleNode`` builds the next role from it, in the same process,
with the same connections.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..recovery.fencing import Reign
from .messages import Takeover

__all__ = ["Become", "become"]


@dataclass(frozen=True, slots=True)
class Become:
    """Serve ``role`` next."""

    role: RoleId
    #: the slave it was, when it goes up to its master's role (None: down to a slave)
    promoted_from: RoleId | None
    #: up: the reign it won; down: the reign that fenced it (its new master's)
    reign: Reign | None
    #: up after an election: when its predecessor was last heard (the recovery's start)
    failed_at: float | None
    #: the operator's take-over request, answered once the new role serves
    reply: Takeover | None
    #: the topology with the switches configured live (they stay with the process)
    topology: PhoenixTopology


def become(
    current: RoleId,
    switch_to: RoleId | None,
    *,
    won: Reign | None,
    trusted: Reign,
    failed_at: float | None,
    reply: Takeover | None,
    topology: PhoenixTopology,
) -> Become | None:
    """What ``current`` serves next (None: it stopped for good).  ``won``: the reign it
    won as a slave; ``trusted``: the reign a fenced master's slave trusts."""
    if switch_to is None:
        return None
    if switch_to.is_slave:  # fenced: down to a slave, following the reign that fenced it
        return Become(switch_to, None, trusted, None, reply, topology)
    return Become(switch_to, current, won, failed_at, reply, topology)
