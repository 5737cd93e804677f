"""A match master restoring a departed cluster's subscriptions, without I/O: what to
read, and the read kept ready when a router only suspects the departure.

RECOVER names the departed cluster's arc and the match masters whose subscriptions to
take (:func:`restore_plan`: their store owners, each a match master of that cluster, and
over how many masters the arc is routed here).  A router that suspects a departure sends
it first with ``prepare``: the master starts the read then (:class:`Read`) and keeps it
ready for ``keep_s`` (``After``, keyed (cluster, reading): then
:meth:`ReadAhead.forget`); the RECOVER of the leave itself, for the same
plan, restores what that read found (:class:`Restore`) instead of reading again; for
another plan (the ring changed meanwhile) it reads anew.  Reads are numbered; the driver
holds each one's result.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import DeadLetter
from ..phoenix.effects import After, Count
from ..phoenix.ids import RoleId, RoleKind
from .messages import Recover

__all__ = ["Read", "ReadAhead", "Restore", "RestorePlan", "restore_plan"]


@dataclass(frozen=True, slots=True)
class RestorePlan:
    owners: tuple[str, ...]  # the departed match masters' store owners
    masters: int  # the arc is routed over this many masters here
    arc: tuple[int, int]


def restore_plan(message: Recover, *, cluster_masters: int, index: int) -> RestorePlan:
    """What RECOVER asks of match master ``index`` (its cluster has ``cluster_masters``);
    ``DeadLetter`` for an owner that is no match master of the departed cluster, or an
    arc routed over fewer masters than this one's index."""
    owners = tuple(message.owners) or tuple(
        RoleId.match(message.cluster, i).owner for i in range(message.masters)
    )
    for owner in owners:
        try:
            role = RoleId.from_owner(owner)
        except ValueError:
            role = None
        if role is None or role.kind is not RoleKind.MATCH or role.cluster != message.cluster:
            raise DeadLetter(f"recover: {owner!r} is no match master of {message.cluster}")
    masters = message.routed_over or cluster_masters
    if index >= masters:
        raise DeadLetter(f"recover: arc routed over {masters} masters, this is {index}")
    return RestorePlan(owners, masters, message.arc)


@dataclass(frozen=True, slots=True)
class Read:
    """Start reading ``plan``'s subscriptions of ``cluster`` as read number ``reading``."""

    cluster: str
    plan: RestorePlan
    reading: int


@dataclass(frozen=True, slots=True)
class Restore:
    """Restore what read ``reading`` found (read again if it failed), answer RECOVER."""

    reading: int


Effect = Read | Restore | After | Count


class ReadAhead:
    """The reads a match master keeps ready, by departed cluster."""

    def __init__(self, keep_s: float = 60.0) -> None:
        self.keep_s = keep_s
        #: cluster -> the plan read for, and the read
        self.standby: dict[str, tuple[RestorePlan, int]] = {}
        self._reads = 0

    def recover(self, cluster: str, plan: RestorePlan, *, prepare: bool) -> list[Effect]:
        ready = self.standby.pop(cluster, None)
        effects: list[Effect] = []
        if ready is not None and ready[0] == plan:
            reading = ready[1]
        else:  # not read ahead, or for another plan (the ring changed)
            self._reads += 1
            reading = self._reads
            effects.append(Read(cluster, plan, reading))
        if prepare:  # keep it ready for the leave; forget it if none comes
            self.standby[cluster] = (plan, reading)
            return [*effects, After(self.keep_s, (cluster, reading)), Count("prepared")]
        return [*effects, Restore(reading)]

    def forget(self, cluster: str, reading: int) -> list[Count]:
        ready = self.standby.get(cluster)
        if ready is None or ready[1] != reading:
            return []
        del self.standby[cluster]
        return [Count("prepared_unused")]

    def joined(self, cluster: str) -> None:
        """The cluster came back: what was read ahead for its departure is of no use."""
        self.standby.pop(cluster, None)

    def in_use(self) -> set[int]:
        """The reads still kept ready (the driver may drop the others' results)."""
        return {reading for _, reading in self.standby.values()}
