"""The routing master and its slaves (drivers): the ring, latencyMap, the arc take-over
and hand-back, performed from the machines of ``router.py``, ``takeover.py`` and
``joining.py``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import DeadLetter, MiddlewareError
from ..recovery.capacity import Adoption, CapacityPlan, plan_takeover, running_masters
from ..transport import OutgoingMessage
from .delivery import CopySender, event_content
from .departures import (
    AfterRingApplied,
    AskMaster,
    Departures,
    LeaveHere,
    PlanPrepare,
    RecordLeft,
    RouteKept,
    TakeOverArc,
    TellRouter,
    entries_of_arc,
    recover_asks,
)
from .departures import Effect as DepartureEffect
from .detours import LINK_ERRORS, Detours
from .forwarding import (
    JOINING,
    Count,
    Forwarding,
    LinkReported,
    Now,
    PutHere,
    RouteAgain,
    SendOn,
    ToMatch,
    WaitRestored,
    WriteEntry,
)
from .forwarding import Effect as ForwardingEffect
from .holding import ReplicaHolder
from .ids import RoleId, RoleKind
from .joining import (
    AskMasters,
    Expire,
    HandBack,
    HandBackEffect,
    Hold,
    JoinHold,
    NotHandedOver,
    Tell,
)
from .joining import Effect as JoinEffect
from .mastering import Master
from .messages import (
    Advertise,
    Copy,
    Found,
    HandedOver,
    Handover,
    Join,
    Leave,
    Matched,
    Message,
    Probe,
    Publish,
    Recovered,
    Routed,
    RoutedMessage,
    Subscribe,
    Unsubscribe,
    Unsubscribed,
    encode,
)
from .protocol import MAX_PRIORITY
from .replica_set import ReplicaSet
from .replicas import TOMBSTONE, live
from .ring import ChordRing, ring_id
from .ring import Handover as Arc
from .role_metrics import LEAVE_S
from .roles import WARM_AFTER_PROMOTION_S
from .router import KeptEvents, RouterLogic
from .store import open_store, ring_owner
from .takeover import Adopt, ArcTakeover, AskRestore, MakePlan, ReadTable, Released, RestoreBound
from .takeover import Effect as TakeoverEffect
from .wiring import Handler, cluster_settings

__all__ = ["RouterMaster", "RouterSlave"]

log = logging.getLogger(__name__)


class RouterMaster(Master):
    """Forwards along the ring; at the owner, hands over to a match master.

    Its routing table (latencyMap entries) is replicated to the routing slaves
    (W of N acks) and read back from R of N replicas when it starts.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.id = RoleId.router(self.cluster)
        self.store = open_store(self.topology.state_store)
        self.replicas = ReplicaSet(self, self.store, "routing_table")
        self.ring = ChordRing(
            c.id for c in self.topology.clusters if c.joined or c.id == self.cluster
        )
        self.logic = RouterLogic(self.cluster, self.topology, self.ring)
        self.latency = self.logic.latency
        self.detours = self._detours()
        self._spec = self.topology.cluster(self.cluster)
        #: when this router saw each departed cluster leave (its join record names it)
        self._left_at: dict[str, float] = {}
        #: copies carried here for this cluster's subscribers (``_on_copy``)
        self.copies = CopySender(topology=self.topology, client_for=self.client_for)
        #: departed clusters whose arc this router took over: (arc, restored)
        self._recovering: dict[str, tuple[Arc, asyncio.Event]] = {}
        #: RECOVERY requests: (match masters yet to answer, restored so far, all answered)
        # departed arcs being taken over here (takeover.py)
        self.takeover = ArcTakeover(self.topology.read_timeout_s)
        #: events that entered the ring here and went to another cluster, until their
        #: owner says they were matched (routed again if it leaves first)
        self.kept = KeptEvents(self.cluster, self.topology.keep_unmatched_s)
        self.forwarding = Forwarding(self.logic, self.kept)  # route, relay, carry
        #: suspect, announce and leave a departed cluster
        self.departures = Departures(
            self.cluster, self.ring, self.topology, lambda: uuid.uuid4().hex
        )
        #: set once the recorded leaves and joins are applied (``prepare``): a leave
        #: told before that (its control queue is consumed first) waits for it, or a
        #: promoted router would take a recorded departure's arc over a second time
        self._ring_applied = asyncio.Event()
        #: this cluster (re)joins the ring: its own arc, and set once the previous
        #: owner's hand-over is all routed here (or ``handover_wait_s`` passed)
        self._joining: tuple[Arc, asyncio.Event] | None = None
        self.join_hold = JoinHold()  # when to let them go (joining.py)
        # an arc handed back to a cluster that joined (joining.py)
        self.hand_back = HandBack(self.topology.read_timeout_s, self.topology.handover_wait_s)

    def _detours(self) -> Detours:
        """The links to the other clusters' routers: detours, floods, leaves (detours.py)."""
        return Detours(
            cluster=self.cluster,
            ring=self.ring,
            topology=self.topology,
            send=self.send,
            tell=self.tell,
            client_for=self.client_for,
            count=self.count,
            prefix=self.topology.prefix,
            shared=self._shares_connection,
            on_left=self._announce_leave,
            on_unreachable=self._suspect,
        )

    async def run(self, stop: asyncio.Event) -> None:
        watch = asyncio.create_task(self.detours.watch(stop))
        try:
            await self.replicas.persisting(self.serve(stop), stop)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch

    @functools.cache  # noqa: B019 - one role object per process role, a few clusters
    def _shares_connection(self, cluster: str) -> bool:
        """True when ``cluster`` is reached over this cluster's own connection."""
        own = cluster_settings(self.settings, self.topology, self.cluster)[0]
        return cluster_settings(self.settings, self.topology, cluster, self.cluster)[0] == own

    async def _publish_body(self, cluster: str, inbox: str, body: bytes, priority: int) -> None:
        if self._shares_connection(cluster):
            await super()._publish_body(cluster, inbox, body, priority)
            return
        self.count("amqp_sent")
        client = await self.client_for(cluster)
        message = OutgoingMessage(
            body, "", inbox, content_type="application/json", priority=priority
        )
        await self.detours.publish(client, lambda: client.publish(message, retry=False))

    async def finish(self) -> None:
        await self.copies.close()

    async def prepare(self) -> None:
        table = await self.replicas.read(self.topology.read_timeout_s)
        for refused in self.logic.load(table):
            log.warning("%s: routing-table entry left out: %s", self.id, refused)
        await self._apply_ring_changes()
        if self.topology.most_match_masters > self._spec.match_masters:
            # a take-over of a larger cluster's arc adds match roles: warm now, so that
            # starting them is a fork (zygote.py), not an interpreter start, in the leave
            asyncio.get_running_loop().call_later(WARM_AFTER_PROMOTION_S, self._warm)

    async def _apply_ring_changes(self) -> None:
        """The leaves and joins the routers recorded since the topology was written (a
        router that starts after a leave, e.g. a promoted slave, must not route to the
        departed cluster again and take its arc over a second time)."""
        records = await asyncio.to_thread(self.store.load, ring_owner(self.topology.prefix), "ring")
        self._hold_if_joining(live(records).get(self.cluster, (0, None))[1])
        for cluster, (_, record) in sorted(live(records).items()):
            if cluster == self.cluster or cluster not in {c.id for c in self.topology.clusters}:
                continue
            if record.get("state") == "left" and cluster in self.ring.clusters:
                self.ring.leave(cluster)
                self.detours.left(cluster)
                log.info(
                    "%s: %s left the ring before this router started (recorded)", self.id, cluster
                )
            elif record.get("state") == "joined" and cluster not in self.ring.clusters:
                self.ring.join(cluster)
                self.detours.joined(cluster)
                log.info(
                    "%s: %s joined the ring before this router started (recorded)", self.id, cluster
                )
        for cluster, adoption in (await asyncio.to_thread(self._adoptions)).items():
            if adoption.by != self.cluster or cluster in self.ring.clusters:
                continue
            arc = Arc(cluster, self.cluster, *adoption.arc)
            self.logic.adopted[cluster] = (arc, adoption.masters)
            log.info(
                "%s: routes %s's arc over %d match masters (recorded take-over)",
                self.id,
                cluster,
                adoption.masters,
            )
        self._ring_applied.set()

    def _hold_if_joining(self, record: Any) -> None:
        """This cluster joins the ring now: its arc's events wait here, as a take-over's
        do, until the previous owner's hand-over is all routed here (joining.py)."""
        state = record.get("state") if isinstance(record, dict) else None
        ring = self.ring
        self._join_effects(
            self.join_hold.start(
                recorded=state if isinstance(state, str) else None,
                listed_as_joined=self._spec.joined,
                bound_s=self.topology.handover_wait_s,
                clusters=len(ring.clusters),
                now=time.monotonic(),
            )
        )

    def _join_effects(self, effects: list[JoinEffect]) -> None:
        """Perform what the join hold returned (joining.py)."""
        for effect in effects:
            if isinstance(effect, Hold):
                ring = self.ring
                arc = Arc(
                    self.cluster,
                    ring.successors(self.cluster, 1)[0],
                    ring_id(ring.predecessor(self.cluster)),
                    ring_id(self.cluster),
                )
                self._joining = (arc, asyncio.Event())
                asyncio.get_running_loop().call_later(
                    effect.bound_s,
                    lambda: self._join_effects(self.join_hold.expired(time.monotonic())),
                )
                log.info("%s: joining the ring: the arc's events wait for its hand-over", self.id)
                continue
            if self._joining is not None:
                self._joining[1].set()
            expected = "?" if effect.expected is None else effect.expected
            if effect.timed_out:
                self.count("handover_wait_expired")
                log.warning(
                    "%s: the arc's hand-over not all here after %.1f s (%d of %s routed): "
                    "its events go on",
                    self.id,
                    effect.took_s,
                    effect.handed,
                    expected,
                )
            else:
                self.count("handovers_received")
                log.info(
                    "%s: the arc's hand-over is here (%d subscriptions); its events go on, "
                    "%.3f s after the start",
                    self.id,
                    effect.handed,
                    effect.took_s,
                )

    async def _on_handed_subscription(self, message: Subscribe | Unsubscribe) -> None:
        """One subscription of the arc this cluster joins with (or one removed while the
        previous owner held it), from the previous owner's match master (to this control
        queue, so that the arc's events held in the inbox do not keep it out): routed to
        this cluster's match master like any other."""
        await self._ring_applied.wait()
        try:
            await self._route(message, held=False)
        finally:
            self._join_effects(self.join_hold.routed(time.monotonic()))

    async def _on_handed_over(self, message: HandedOver) -> None:
        if message.cluster != self.cluster:
            raise DeadLetter(f"handed_over: for {message.cluster}, not {self.cluster}")
        self._join_effects(self.join_hold.told(message.count, time.monotonic()))

    def _record_ring_change(self, cluster: str, state: str) -> None:
        """Persist that ``cluster`` left or joined (in the state store every cluster's
        router reads; each router records what it handled, the newest record wins)."""
        document: dict[str, Any] = {"state": state, "at": time.time()}
        if state == "left":
            self._left_at[cluster] = document["at"]
        elif cluster in self._left_at:  # what the returning cluster's roles must know
            document["left_at"] = self._left_at[cluster]
        owner, version = ring_owner(self.topology.prefix), time.time_ns()

        def write() -> None:
            if state == "joined" and "left_at" not in document:  # a router started since
                _, before = self.store.load(owner, "ring").get(cluster, (0, {}))
                if isinstance(before, dict) and before.get("state") == "left":
                    document["left_at"] = before.get("at")
            self.store.save(owner, "ring", cluster, document, version)

        self._background(asyncio.to_thread(write))

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {
            **super().control_handlers,
            **self.replicas.handlers(),
            Probe: self.detours.on_probe,
            Found: self.detours.on_found,
            Leave: self._on_leave,
            Recovered: self._on_recovered,
            Matched: self._on_matched,
            Subscribe: self._on_handed_subscription,
            Unsubscribe: self._on_handed_subscription,
            HandedOver: self._on_handed_over,
        }

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        routed = (Advertise, Subscribe, Unsubscribe, Unsubscribed, Publish)
        return {Join: self._on_join, Copy: self._on_copy, **dict.fromkeys(routed, self._route)}

    def urgency(self, message: Message) -> int:
        return self.logic.priority(message) if isinstance(message, Routed) else 0

    def reconfigured(self) -> None:
        self.logic.topology = self.topology  # ``outer`` switched live
        self.departures.topology = self.topology

    async def _on_join(self, message: Join) -> None:
        await self._join(message.cluster)

    async def _route(self, message: RoutedMessage, *, held: bool = True) -> None:
        """``Forwarding`` decides (``forwarding.py``); this performs what it returns."""
        await self._forward(self.forwarding.route(message, self._now(), self._holds(), held=held))

    async def _on_copy(self, message: Copy) -> None:
        """A copy for a subscriber queue: put into the queue when its home is this
        cluster, else carried toward the home's routing master (over a detour when the
        direct link failed, as routed events are).  Acked only once it is on."""
        await self._forward(self.forwarding.copy(message, self._now(), self._holds()))

    async def _on_matched(self, message: Matched) -> None:
        clusters = [c.id for c in self.topology.clusters]
        await self._forward(self.forwarding.matched(message, clusters))

    def _route_kept(self, cluster: str) -> None:
        """``cluster`` left: what this router kept for it is routed again (``KeptEvents``)."""
        self._background(self._forward(self.forwarding.left(cluster)))

    @staticmethod
    def _now() -> Now:
        return Now(time.time(), time.monotonic())

    def _holds(self) -> list[tuple[str, Arc]]:
        """The arcs whose events wait now: taken over from a departed cluster until
        restored, this cluster's own while it joins until handed over."""
        holds = [(c, arc) for c, (arc, done) in self._recovering.items() if not done.is_set()]
        if self._joining is not None and not self._joining[1].is_set():
            holds.append((JOINING, self._joining[0]))
        return holds

    def _restored_event(self, key: str) -> asyncio.Event | None:
        held = self._joining if key == JOINING else self._recovering.get(key)
        return None if held is None else held[1]

    async def _forward(self, effects: list[ForwardingEffect]) -> None:
        """Perform the route/relay/carry effects in order; what a send or a wait gives
        back goes to the machine, and what it returns is performed next."""
        pending = collections.deque(effects)
        while pending:
            effect = pending.popleft()
            after: list[ForwardingEffect] = []
            if isinstance(effect, Count):
                self.count(effect.name, effect.n)
            elif isinstance(effect, WriteEntry):
                entry = None if effect.entry is None else effect.entry.to_document()
                await self.replicas.write(effect.event_type, entry)
            elif isinstance(effect, SendOn):
                path = await self.detours.forward(effect.cluster, effect.message, effect.priority)
                after = self.forwarding.sent(effect, path, self._now(), self._holds())
            elif isinstance(effect, ToMatch):
                match = self.inbox_of(RoleId.match(self.cluster, effect.index))
                await self.send(self.cluster, match, effect.message, effect.priority)
            elif isinstance(effect, WaitRestored):
                restored = self._restored_event(effect.key)
                if restored is not None:
                    await restored.wait()
                after = self.forwarding.restored(effect.message, self._holds())
            elif isinstance(effect, PutHere):
                await self._put_here(effect.copy)
            elif isinstance(effect, LinkReported):
                self.detours.reported_down(effect.cluster)
            elif isinstance(effect, RouteAgain):
                log.warning(
                    "%s: %d events kept for %s routed again",
                    self.id,
                    len(effect.events),
                    effect.departed,
                )
                self._background(self._route_again(effect.events))
            else:
                raise DeadLetter(effect.reason)
            pending.extendleft(reversed(after))

    async def _put_here(self, copy: Copy) -> None:
        result = await self.copies.put(
            copy.home,
            copy.queue,
            copy.confirm,
            encode(copy.publish),
            copy.copy_id,
            local=True,
            content=event_content(copy.publish.event.model_dump_json()),
        )
        self.count(f"carried_copies_{result.outcome.value}")

    async def _route_again(self, events: list[Publish]) -> None:
        for message in events:
            try:
                await self._route(message)
            except Exception as exc:  # one that cannot go is said, the others go on
                log.warning("%s: event %s not routed again: %s", self.id, message.id, exc)

    # ------------------------------------------------------------ capacity plan
    def _running_masters(self) -> int:
        """This cluster's match masters now: the topology's and the ones take-overs added."""
        return running_masters(
            self.topology, self.cluster, (p for _, p in self.logic.adopted.values())
        )

    def _match_roles(self) -> list[RoleId]:
        """This cluster's match masters and slaves, the added ones included."""
        roles = [
            r
            for r in RoleId.of_cluster(self._spec)
            if r.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE)
        ]
        for i in range(self._spec.match_masters, self._running_masters()):
            master = RoleId.match(self.cluster, i)
            roles += [master, *master.slaves(self._spec)]
        return roles

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
        for effect in effects:
            if isinstance(effect, Count):
                self.count(effect.name, effect.n)
            elif isinstance(effect, TellRouter):
                queue = self.control_of(RoleId.router(effect.cluster))
                try:
                    await asyncio.wait_for(
                        self.send(effect.cluster, queue, effect.message, MAX_PRIORITY),
                        2 * self.topology.link_timeout_s,
                    )
                except LINK_ERRORS as exc:
                    log.warning(
                        "%s: could not tell %s that %s left: %s",
                        self.id,
                        effect.cluster,
                        effect.message.cluster,
                        exc,
                    )
            elif isinstance(effect, LeaveHere):
                await self._leave(effect.cluster, effect.by)
            elif isinstance(effect, PlanPrepare):
                plan = await self._plan(effect.cluster, effect.successor)
                process = self.connections.process_queue
                await self._depart(self.departures.prepare(effect, plan, process))
            elif isinstance(effect, AskMaster):
                await self._ask_master(effect)
            elif isinstance(effect, AfterRingApplied):
                self._background(self._leave_when_ring_applied(effect.cluster, effect.by))
            elif isinstance(effect, RecordLeft):
                self._record_ring_change(effect.cluster, "left")
            elif isinstance(effect, TakeOverArc):
                self._recovering[effect.cluster] = (effect.arc, asyncio.Event())
                started = self.takeover.left(effect.cluster, uuid.uuid4().hex, time.monotonic())
                self._background(self._take_over_arc(started))
            elif isinstance(effect, RouteKept):
                self.detours.left(effect.cluster)
                self._route_kept(effect.cluster)
            else:
                told = effect.message
                log.warning(
                    "%s left the ring (found by %s); its arc goes to %s",
                    told.cluster,
                    told.by,
                    effect.successor,
                )
                for role in self._match_roles():
                    await self.send(self.cluster, self.control_of(role), told, MAX_PRIORITY)

    async def _ask_master(self, effect: AskMaster) -> None:
        queue = self.control_of(effect.master)
        send = self.send(effect.cluster, queue, effect.message, MAX_PRIORITY)
        if not effect.bounded:
            await send
            return
        try:
            await asyncio.wait_for(send, 2 * self.topology.link_timeout_s)
        except LINK_ERRORS as exc:
            log.info("%s: %s not sent to %s: %s", self.id, effect.message.request, queue, exc)

    async def _leave_when_ring_applied(self, cluster: str, by: str) -> None:
        await self._ring_applied.wait()
        await self._leave(cluster, by)

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
        for effect in effects:
            if isinstance(effect, ReadTable):
                self._background(self._read_departed_table(effect.cluster))
            elif isinstance(effect, MakePlan):
                self._background(self._make_plan(effect.cluster))
            elif isinstance(effect, Adopt):
                plan: CapacityPlan = effect.plan
                arc = self._recovering[effect.cluster][0]
                self.logic.adopted[effect.cluster] = (arc, plan.masters)
                self._record_adoption(effect.cluster, arc, plan)
                if plan.match_broker_map:
                    log.info(
                        "%s: matchBrokerMap for %s: %s",
                        self.id,
                        effect.cluster,
                        plan.match_broker_map,
                    )
            elif isinstance(effect, AskRestore):
                await self._ask_restore(effect)
            elif isinstance(effect, RestoreBound):
                asyncio.get_running_loop().call_later(
                    effect.after_s, self._restore_bound_passed, effect.request
                )
            else:
                self._released(effect)

    def _restore_bound_passed(self, request: str) -> None:
        self._background(self._take_over_arc(self.takeover.expired(request, time.monotonic())))

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

    async def _ask_restore(self, effect: AskRestore) -> None:
        arc = self._recovering[effect.cluster][0]
        process = self.connections.process_queue
        for ask in recover_asks(effect.plan, arc, request=effect.request, reply_to=process):
            await self._ask_master(ask)

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

    async def _on_recovered(self, message: Recovered) -> None:
        if message.request in self.hand_back.rounds:  # a master handed an arc back
            await self._hand_back(
                self.hand_back.answered(
                    message.request, message.broker, message.restored, time.monotonic()
                )
            )
            return
        # a master restored its share of a departed arc (late: the take-over went on)
        await self._take_over_arc(
            self.takeover.answered(
                message.request, message.broker, message.restored, time.monotonic()
            )
        )

    async def _join(self, cluster: str) -> None:
        """A cluster joined: if it took our arc, our match masters hand its subscriptions
        over; the ones a take-over of its arc had added are retired after theirs."""
        self.topology.cluster(cluster)
        roles = self._match_roles()  # before the arc it rejoins with stops being ours
        masters = self._running_masters()
        handover = self.ring.join(cluster)
        self.detours.joined(cluster)
        self._record_ring_change(cluster, "joined")
        held = self._recovering.pop(cluster, None)
        self.takeover.joined(cluster)
        if held is not None:  # back before its arc was restored here: its events go on
            held[1].set()
        if self.logic.adopted.pop(cluster, None) is not None:
            self._record_adoption(cluster, Arc(cluster, self.cluster, 0, 0), None)
        keep = self._running_masters()
        self.count("joins")
        back = Join(cluster=cluster)  # a cluster that left and came back: deliver to it again
        for role in roles:
            await self.send(self.cluster, self.control_of(role), back, MAX_PRIORITY)
        if handover is None or handover.previous_owner != self.cluster:
            return
        log.info("%s joined: handing over arc (%x, %x]", cluster, handover.start, handover.end)
        await self._hand_back(
            self.hand_back.start(
                uuid.uuid4().hex,
                cluster,
                (handover.start, handover.end),
                [RoleId.match(self.cluster, i).owner for i in range(masters)],
                [RoleId.match(self.cluster, i).owner for i in range(keep, masters)],
            )
        )

    async def _hand_back(self, effects: list[HandBackEffect]) -> None:
        """Perform what the hand-back returned (joining.HandBack)."""
        for effect in effects:
            if isinstance(effect, AskMasters):
                for owner in effect.masters:
                    # each answers how many it sent; priority 0: behind the arc's events
                    # routed here before the join (matched here with the subscriptions
                    # still held); none come after it (forwarded to the joiner from now)
                    give = Handover(
                        cluster=effect.cluster,
                        arc=effect.arc,
                        request=effect.request,
                        reply_to=self.connections.process_queue,
                    )
                    await self.send(self.cluster, self.inbox_of(RoleId.from_owner(owner)), give)
            elif isinstance(effect, Expire):
                self._after_hand_back(
                    effect.after_s, functools.partial(self.hand_back.expired, effect.request)
                )
            elif isinstance(effect, Tell):
                await self._tell_handed_over(effect)
            elif isinstance(effect, NotHandedOver):
                if effect.told:
                    log.warning(
                        "%s: hand-over count (%d) not told to %s: %s",
                        self.id,
                        effect.count,
                        effect.cluster,
                        effect.error,
                    )
                else:  # the added masters left running: nothing of theirs is lost
                    log.warning(
                        "%s: the match masters did not hand %s's arc over in time",
                        self.id,
                        effect.cluster,
                    )
            else:
                masters = [RoleId.from_owner(owner) for owner in effect.masters]
                await self._retire_added(effect.cluster, masters, effect.moved)

    async def _tell_handed_over(self, effect: Tell) -> None:
        """Tell the joiner's router how many subscriptions were handed over (later, when
        the hand-back says so); a failure goes back to the hand-back."""
        if effect.after_s:
            again: list[HandBackEffect] = [dataclasses.replace(effect, after_s=0.0)]
            self._after_hand_back(effect.after_s, functools.partial(list, again))
            return
        done = HandedOver(cluster=effect.cluster, by=self.cluster, count=effect.count)
        try:
            await self.send(effect.cluster, self.control_of(RoleId.router(effect.cluster)), done)
        except MiddlewareError as exc:
            await self._hand_back(
                self.hand_back.tell_failed(effect.request, str(exc), time.monotonic())
            )
            return
        log.info(
            "%s: %d subscriptions of %s's arc handed over", self.id, effect.count, effect.cluster
        )
        await self._hand_back(self.hand_back.told(effect.request))

    def _after_hand_back(self, delay: float, later: Callable[[], list[HandBackEffect]]) -> None:
        asyncio.get_running_loop().call_later(
            delay, lambda: self._background(self._hand_back(later()))
        )

    async def _retire_added(self, cluster: str, masters: list[RoleId], moved: int) -> None:
        """Stop the masters a take-over added, once they handed ``cluster``'s arc back."""
        if cluster in self._recovering or cluster in self.logic.adopted:
            log.warning("%s: %s left again before its added roles were retired", self.id, cluster)
            return  # taken over anew: the take-over serves from them again
        needed = self._running_masters()  # other adoptions may need some of them
        masters = [m for m in masters if m.index >= needed]
        roles = [r for m in masters for r in (m, *m.slaves(self._spec))]
        if self.provisioner is None:  # a router started by hand: they stay
            log.warning("%s: no provisioner: %s go on running", self.id, roles)
            return
        try:
            stopped = await asyncio.to_thread(self.provisioner.retire, roles)
        except Exception as exc:
            log.warning("%s: added match roles not retired: %s", self.id, exc)
            return
        self.count("match_roles_retired", len(roles))
        log.warning(
            "%s: %d match roles added for %s's arc retired (%d subscriptions handed back): %s",
            self.id,
            len(roles),
            cluster,
            moved,
            stopped,
        )


class RouterSlave(ReplicaHolder):
    """Holds a replica of its routing master's table (persisted) and acknowledges each entry."""

    def __init__(self, *, slave: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slave = slave
        self.id = RoleId.router_slave(self.cluster, slave)
        self.replica_owner = self.id.owner
        self.master_control = self.control_of(self.id.master)
        self.table: dict[str, dict[str, Any]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        self.store = open_store(self.topology.state_store)
        try:
            held = self.store.load(self.replica_owner, "routing_table")
            self.held_version = max((v for v, _ in held.values()), default=0)
            for key, (_, doc) in live(held).items():
                self.table[key] = doc
            await self.serve(stop)
        finally:
            self.store.close()

    def apply(self, key: str, document: dict[str, Any]) -> None:
        if document == TOMBSTONE:
            self.table.pop(key, None)
        else:
            self.table[key] = document
