"""A routing master when a cluster leaves the ring (driver): suspect, announce and leave
(``departures.py`` decides), and, at the departed cluster's successor, the arc's
take-over: the capacity plan (``recovery/capacity.py``), RECOVER to its match masters,
the departed router's table (``takeover.py`` decides).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from typing import Any

from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY
from ..phoenix.ring import Handover as Arc
from ..recovery.capacity import Adoption, CapacityPlan, plan_takeover, running_masters
from .departures import (
    AfterRingApplied,
    LeaveHere,
    PlanPrepare,
    RecordLeft,
    RouteKept,
    TakeOverArc,
    TellMatchRoles,
    entries_of_arc,
)
from .departures import Effect as DepartureEffect
from .messages import (
    Leave,
)
from .performing import Inputs, Performer
from .replicas import live
from .ring_router import RingRouter
from .role_metrics import LEAVE_S
from .store import ring_owner
from .takeover import Adopt, MakePlan, ReadTable, Released
from .takeover import Effect as TakeoverEffect

__all__ = ["LeavingRouter"]

log = logging.getLogger(__name__)


class LeavingRouter(RingRouter):
    """The ring router's part in a departure and an arc's take-over."""

    async def _announce_leave(self, cluster: str) -> None:
        """No flood reached ``cluster`` for ``leave_after_s`` (``departures.py``)."""
        await self._depart(self.departures.announce(cluster))

    async def _on_leave(self, message: Leave) -> None:
        await self._leave(message.cluster, message.by)

    async def _suspect(self, cluster: str) -> None:
        """A flood for ``cluster`` found no way (``departures.py``)."""
        await self._depart(self.departures.suspect(cluster))

    async def _leave(self, cluster: str, by: str) -> None:
        """``cluster`` left (``departures.py``)."""
        await self._depart(self.departures.leave(cluster, by, self._ring_applied.is_set()))

    async def _depart(self, effects: list[DepartureEffect]) -> None:
        """Perform what ``Departures`` returned, in order."""
        await self.enact(effects)

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {
            **super().performers,
            LeaveHere: lambda effect: self._leave(effect.cluster, effect.by),
            PlanPrepare: self._plan_prepare,
            AfterRingApplied: lambda effect: self._background(
                self._leave_when_ring_applied(effect.cluster, effect.by)
            ),
            RecordLeft: lambda effect: self._record_ring_change(effect.cluster, "left"),
            TakeOverArc: self._start_take_over,
            RouteKept: self._route_kept_of,
            TellMatchRoles: self._tell_match_roles,
            ReadTable: lambda effect: self._background(self._read_departed_table(effect.cluster)),
            MakePlan: lambda effect: self._background(self._make_plan(effect.cluster)),
            Adopt: self._adopt,
            Released: self._released,
        }

    async def _plan_prepare(self, effect: PlanPrepare) -> list[DepartureEffect]:
        plan = await self._plan(effect.cluster, effect.successor)
        return self.departures.prepare(effect, plan, self.connections.process_queue)

    def _start_take_over(self, effect: TakeOverArc) -> None:
        self._recovering[effect.cluster] = (effect.arc, asyncio.Event())
        request, now = uuid.uuid4().hex, time.monotonic()
        started = self.takeover.left(effect.cluster, request, now, effect.arc)
        self._background(self._take_over_arc(started))

    def _route_kept_of(self, effect: RouteKept) -> None:
        self.detours.left(effect.cluster)
        self._route_kept(effect.cluster)

    async def _tell_match_roles(self, effect: TellMatchRoles) -> None:
        told = effect.message
        log.warning(
            "%s left the ring (found by %s); its arc goes to %s",
            told.cluster,
            told.by,
            effect.successor,
        )
        for role in self._match_roles():
            await self.send(self.cluster, self.control_of(role), told, MAX_PRIORITY)

    async def _leave_when_ring_applied(self, cluster: str, by: str) -> None:
        await self._ring_applied.wait()
        await self._leave(cluster, by)

    def _adoptions(self) -> dict[str, Adoption]:
        """(In a thread) every router's take-overs still in force, by departed cluster
        (a record no version wrote is logged and left out)."""
        recorded = self.store.load(ring_owner(self.topology.prefix), "adopted")
        adoptions = {}
        for cluster, (_, doc) in live(recorded).items():
            try:
                adoptions[cluster] = Adoption.from_document(doc)
            except ValueError as exc:
                log.warning("%s: %s left out", self.id, exc)
        return adoptions

    async def _plan(self, cluster: str, successor: str) -> CapacityPlan:
        """The capacity plan for ``successor`` taking over ``cluster``'s arc: N is what
        ``cluster`` ran (its topology's masters, or more while it held adopted arcs)."""
        adoptions = await asyncio.to_thread(self._adoptions)
        held = [a.masters for a in adoptions.values() if a.by == cluster]
        return plan_takeover(
            self.topology,
            cluster,
            successor,
            departed_masters=running_masters(self.topology, cluster, held),
            departed_plain=not held,
            can_add=self.provisioner is not None,
        )

    async def _provision(self, plan: CapacityPlan) -> CapacityPlan:
        """Start the match roles ``plan`` adds that do not run yet (their stored state
        wiped first: nothing of an earlier take-over is read back); the plan without
        additions when they could not be started (S's own masters share the arc)."""
        running = self._running_masters()
        fresh = [r for r in plan.added if r.index >= running]
        if not fresh:
            return plan
        assert self.provisioner is not None

        def wipe() -> None:
            for role in fresh:
                for kind in ("subscription", "advertisement"):
                    self.store.snapshot(role.owner, kind, {})

        began = time.monotonic()
        try:
            await asyncio.to_thread(wipe)
            started = await asyncio.wait_for(
                asyncio.to_thread(self.provisioner.add, fresh), self.topology.read_timeout_s
            )
        except Exception as exc:  # no capacity added: S's own masters share the arc
            log.warning(
                "%s: %d match roles for %s's arc not started (%s); its %d masters share it",
                self.id,
                len(fresh),
                plan.departed,
                exc,
                self._spec.match_masters,
            )
            self.count("provision_failed")
            return plan_takeover(
                self.topology,
                plan.departed,
                plan.successor,
                departed_masters=plan.departed_masters,
                departed_plain=plan.departed_plain,
                can_add=False,
            )
        self.count("match_roles_added", len(fresh))
        log.warning(
            "%s: added %d match roles for %s's arc (%d masters, as it had) in %.3f s: %s",
            self.id,
            len(fresh),
            plan.departed,
            plan.masters,
            time.monotonic() - began,
            started,
        )
        return plan

    def _record_adoption(self, cluster: str, arc: Arc, plan: CapacityPlan | None) -> None:
        """Persist (or, ``plan`` None, drop) the plan in force for ``cluster``'s arc, so a
        routing master that starts later routes it the same and a later take-over of
        this cluster knows how many masters it ran."""
        owner = ring_owner(self.topology.prefix)
        if plan is None:
            write = asyncio.to_thread(self.store.delete, owner, "adopted", cluster)
        else:
            document = plan.to_document((arc.start, arc.end))
            write = asyncio.to_thread(
                self.store.save, owner, "adopted", cluster, document, time.time_ns()
            )
        self._background(write)

    async def _restore_routing_table(self, cluster: str, arc: Arc) -> dict[str, dict[str, Any]]:
        """RECOVERY(RT): the departed router's latencyMap entries of its arc, from the
        persisted state (``departures.entries_of_arc``), counted here from now."""
        owner = RoleId.router(cluster).owner
        table = await asyncio.to_thread(self.replicas.store.load, owner, "routing_table")
        taken = entries_of_arc(arc, live(table))
        self.logic.take_entries(taken)
        self.count("routing_entries_restored", len(taken))
        log.info("%s: %d routing-table entries of %s restored", self.cluster, len(taken), cluster)
        return {event_type: entry.to_document() for event_type, entry in taken.items()}

    async def _write_entries(self, entries: dict[str, dict[str, Any]]) -> None:
        for event_type, document in entries.items():
            await self.replicas.write(event_type, document)

    async def _take_over_arc(self, effects: list[TakeoverEffect]) -> None:
        """Perform what the arc take-over returned (takeover.ArcTakeover): the capacity
        plan (``recovery/capacity.py``: match masters added when the departed cluster had
        more), RECOVERY to each master it names; the arc's events wait until every one
        answered (or ``read_timeout_s``) and the departed router's table was read."""
        await self.enact(effects, self.taking_over)

    @functools.cached_property
    def taking_over(self) -> Inputs:
        """The arc take-over's timer input: a request's restore bound passed."""
        return Inputs(timer=lambda key: self.takeover.expired(str(key), time.monotonic()))

    def _adopt(self, effect: Adopt) -> None:
        plan: CapacityPlan = effect.plan
        arc = self._recovering[effect.cluster][0]
        self.logic.adopted[effect.cluster] = (arc, plan.masters)
        self._record_adoption(effect.cluster, arc, plan)
        if plan.match_broker_map:
            log.info(
                "%s: matchBrokerMap for %s: %s", self.id, effect.cluster, plan.match_broker_map
            )

    async def _read_departed_table(self, cluster: str) -> None:
        held = self._recovering.get(cluster)
        if held is None:  # joined again already
            return
        arc = held[0]
        try:
            entries, error = await self._restore_routing_table(cluster, arc), None
        except Exception as exc:  # priorities fall back to defaults; matching goes on
            entries, error = None, str(exc)
        await self._take_over_arc(
            self.takeover.table_read(cluster, entries, error, time.monotonic())
        )

    async def _make_plan(self, cluster: str) -> None:
        try:
            plan = await self._provision(await self._plan(cluster, self.cluster))
        except Exception as exc:  # the store unreadable: the topology's masters share it
            log.warning("%s: no capacity plan for %s's arc: %s", self.id, cluster, exc)
            plan = plan_takeover(
                self.topology,
                cluster,
                self.cluster,
                departed_masters=self.topology.cluster(cluster).match_masters,
                departed_plain=False,
                can_add=False,
            )
        masters = [r.master.owner for r in plan.restores]
        await self._take_over_arc(self.takeover.planned(cluster, plan, masters, time.monotonic()))

    def _released(self, effect: Released) -> None:
        cluster = effect.cluster
        if not effect.complete:
            log.warning("%s: not every match master restored %s's arc in time", self.id, cluster)
        if effect.table_error is not None:
            log.warning(
                "%s: %s's routing table not restored: %s", self.id, cluster, effect.table_error
            )
        holding = self._recovering.get(cluster)
        if holding is not None:
            holding[1].set()
        if effect.entries:  # persisted and replicated as this router's own, after
            self._background(self._write_entries(dict(effect.entries)))
        LEAVE_S.labels(self.cluster).observe(effect.took_s)
        self.count("leaves_recovered")
        log.warning(
            "%s took over the arc of %s: %d subscriptions restored in %.3f s",
            self.cluster,
            cluster,
            effect.restored,
            effect.took_s,
        )
