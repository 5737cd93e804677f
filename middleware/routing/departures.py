"""A routing master's part in a cluster's departure, without I/O.

- ``announce``: no flood reached a cluster for ``leave_after_s``: tell every other
  routing master (a ``Send`` to its control queue: one bounded try each; one that
  misses it finds out by itself), then leave it here (``LeaveHere``).
- ``suspect``: a flood for a cluster found no way: the successor's match masters read
  its subscriptions now (``PlanPrepare``; the driver makes the capacity plan, which
  reads the store, and answers with :meth:`Departures.prepare`: a bounded ``Send`` of
  RECOVER to each master of the plan that runs already), so that a leave declared
  later finds them read.
- ``leave``: drop the cluster from the ring; its arc is taken over here when this is its
  successor (``TakeOverArc``); the detours forget it, what this router kept for it goes
  round again (``RouteKept``), this cluster's match roles are told (``TellMatchRoles``).
  A leave told before the recorded leaves and joins were applied waits for them
  (``AfterRingApplied``), or a promoted router would take a recorded departure's arc
  over a second time.
- ``entries_of_arc``: RECOVERY(RT): the departed router's latencyMap entries of its
  arc, from its persisted table.

The driver (``router_roles.RouterMaster``) performs the effects in order.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..phoenix.effects import Count, Send
from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..phoenix.ring import ChordRing, ring_id
from ..phoenix.ring import Handover as Arc
from ..recovery.capacity import CapacityPlan
from .messages import Leave, Recover
from .records import LatencyEntry, RecordError

__all__ = [
    "AfterRingApplied",
    "Count",
    "Departures",
    "Effect",
    "LeaveHere",
    "PlanPrepare",
    "RecordLeft",
    "RouteKept",
    "Send",
    "TakeOverArc",
    "TellMatchRoles",
    "entries_of_arc",
    "recover_asks",
]


@dataclass(frozen=True, slots=True)
class LeaveHere:
    """Leave ``cluster`` at this router (answer: :meth:`Departures.leave`)."""

    cluster: str
    by: str


@dataclass(frozen=True, slots=True)
class PlanPrepare:
    """Make the capacity plan for ``successor`` taking over ``cluster``'s ``arc``; answer
    with :meth:`Departures.prepare`."""

    cluster: str
    arc: Arc
    successor: str


@dataclass(frozen=True, slots=True)
class AfterRingApplied:
    """Leave ``cluster`` once the recorded leaves and joins are applied."""

    cluster: str
    by: str


@dataclass(frozen=True, slots=True)
class RecordLeft:
    """Persist that ``cluster`` left (the ring record every router reads)."""

    cluster: str


@dataclass(frozen=True, slots=True)
class TakeOverArc:
    """This router is ``cluster``'s successor: its events of ``arc`` wait until the arc
    is restored here (``takeover.ArcTakeover``)."""

    cluster: str
    arc: Arc


@dataclass(frozen=True, slots=True)
class RouteKept:
    """The detours forget ``cluster``; what this router kept for it is routed again."""

    cluster: str


@dataclass(frozen=True, slots=True)
class TellMatchRoles:
    """Tell this cluster's match roles (``message``); ``successor`` takes the arc."""

    message: Leave
    successor: str | None


Effect = (
    Send
    | LeaveHere
    | PlanPrepare
    | AfterRingApplied
    | RecordLeft
    | TakeOverArc
    | RouteKept
    | TellMatchRoles
    | Count
)


def recover_asks(
    plan: CapacityPlan,
    arc: Arc,
    *,
    request: str,
    reply_to: str,
    prepare: bool = False,
    topology: PhoenixTopology | None = None,
) -> list[Send]:
    """RECOVER to each master of ``plan``'s control queue, at the successor's RabbitMQ
    (``prepare``: only to the ones that run already, given ``topology``: an added one
    reads when the leave's RECOVER comes; one bounded try each: a miss only costs
    time)."""
    asks = []
    for restore in plan.restores:
        if prepare and topology is not None and restore.master.is_added(topology):
            continue
        ask = Recover(
            cluster=plan.departed,
            arc=(arc.start, arc.end),
            masters=plan.departed_masters,
            request=request,
            reply_to=reply_to,
            prepare=prepare,
            owners=list(restore.owners),
            routed_over=plan.masters,
        )
        bound = 2 * topology.link_timeout_s if prepare and topology is not None else None
        asks.append(Send(restore.master, ask, via=plan.successor, bound_s=bound))
    return asks


def entries_of_arc(arc: Arc, table: Mapping[str, tuple[int, Any]]) -> dict[str, LatencyEntry]:
    """The departed router's live latencyMap entries of ``arc`` (event type -> entry).
    As the owner it had counted every subscription of those types (each passed it last),
    so its entry replaces whatever this router counted.  An entry an older version kept
    is left out (its subscriptions still match)."""
    taken = {}
    for event_type, (_, document) in table.items():
        try:
            entry = LatencyEntry.from_document(document)
        except RecordError:
            continue
        if arc.covers(event_type) and entry.count > 0:
            taken[event_type] = entry
    return taken


class Departures:
    """One routing master's view of clusters leaving its ring."""

    def __init__(
        self,
        cluster: str,
        ring: ChordRing,
        topology: PhoenixTopology,
        new_id: Callable[[], str],
    ) -> None:
        self.cluster, self.ring, self.topology, self.new_id = cluster, ring, topology, new_id

    def departure(self, cluster: str) -> tuple[Arc, str]:
        """The arc ``cluster`` owns and who would take it over."""
        start = ring_id(self.ring.predecessor(cluster))
        return Arc(cluster, cluster, start, ring_id(cluster)), self.ring.successors(cluster, 1)[0]

    def announce(self, cluster: str) -> list[Effect]:
        message = Leave(cluster=cluster, by=self.cluster)
        bound = 2 * self.topology.link_timeout_s
        effects: list[Effect] = [
            Send(RoleId.router(other), message, bound_s=bound)
            for other in self.ring.clusters
            if other not in (cluster, self.cluster)
        ]
        effects.append(LeaveHere(cluster, self.cluster))
        return effects

    def suspect(self, cluster: str) -> list[Effect]:
        if cluster not in self.ring.clusters or len(self.ring) < 3:
            return []
        arc, successor = self.departure(cluster)
        return [PlanPrepare(cluster, arc, successor)]

    def prepare(self, effect: PlanPrepare, plan: CapacityPlan, reply_to: str) -> list[Effect]:
        """The plan made: the masters that run already read the suspect's state now."""
        request = f"prepare-{self.new_id()}"
        asks = recover_asks(
            plan,
            effect.arc,
            request=request,
            reply_to=reply_to,
            prepare=True,
            topology=self.topology,
        )
        return [*asks, Count("suspected")]

    def leave(self, cluster: str, by: str, ring_applied: bool) -> list[Effect]:
        """``cluster`` left: dropped from the ring here (the ring is changed now)."""
        if not ring_applied:
            return [AfterRingApplied(cluster, by)]
        if cluster == self.cluster or cluster not in self.ring.clusters or len(self.ring) < 2:
            return []
        arc, _ = self.departure(cluster)
        successor = self.ring.leave(cluster)
        effects: list[Effect] = [RecordLeft(cluster)]
        if successor == self.cluster:  # before anything awaits: the arc's events wait
            effects.append(TakeOverArc(cluster, arc))
        effects += [
            RouteKept(cluster),
            Count("leaves"),
            TellMatchRoles(Leave(cluster=cluster, by=by), successor),
        ]
        return effects
