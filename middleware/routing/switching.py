"""What a role process serves next when its role stops to switch (pure): up to its
master's role (a take-over or an election it won), or down to a slave (a master fenced
by a newer reign).  ``node.RoleNode`` builds the next role from it, in the same process,
with the same connections.  Also the operator's two requests every role answers: a
take-over (``take_over``) and a live configure (``configured``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..errors import DeadLetter
from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..recovery.fencing import Reign
from .messages import Configure, Takeover

__all__ = ["SWITCHES", "Become", "become", "configured", "take_over"]

#: what ``qosmq phoenix configure`` may switch live on the running masters
SWITCHES = ("outer", "inner", "blind_dispatch", "batch_max", "batch_linger_ms")


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


def take_over(
    current: RoleId, message: Takeover, *, switching: bool
) -> tuple[RoleId, Takeover | None] | None:
    """A take-over told to ``current``: the master's role it serves next and the request
    to answer once it does (None: told twice, or it switches already).  Only a slave
    of the master named takes over."""
    if not current.is_slave or message.master != current.master.owner:
        raise DeadLetter(
            f"takeover of {message.master!r} sent to {current}, which is not its slave"
        )
    if switching:
        return None
    return current.master, message if message.reply_to else None


def configured(
    topology: PhoenixTopology, message: Configure
) -> tuple[PhoenixTopology, dict[str, Any]]:
    """The topology with the switches a configure names (the others are ignored) and
    those switches; switches the topology refuses dead-letter the request, with why."""
    switches = {k: v for k, v in message.switches.items() if k in SWITCHES}
    try:
        changed = PhoenixTopology.model_validate({**topology.model_dump(), **switches}, strict=True)
    except ValidationError as exc:
        raise DeadLetter(f"configure: {exc.errors(include_url=False)}") from None
    return changed, switches
