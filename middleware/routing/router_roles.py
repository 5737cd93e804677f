"""The routing master and its slaves (drivers).  The master is built in layers:
``ring_router.RingRouter`` (state, links, the route/relay/carry loop),
``router_leave.LeavingRouter`` (departures and an arc's take-over), and here what a
join takes: the recorded ring read back, this cluster's own join hold, and the hand-back
of an arc to a cluster that joined (``joining.py`` decides).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from ..errors import DeadLetter
from ..phoenix.effects import After, Send, Sent
from ..phoenix.ids import RoleId
from ..phoenix.protocol import JOIN_SERVING_TIMEOUT_S, MAX_PRIORITY
from ..phoenix.ring import Handover as Arc
from ..phoenix.ring import ring_id
from .handback import HandBackEffect, HandedBack, NotHandedOver, OpenRound
from .handback import Retire as RetireAdded
from .holding import ReplicaHolder
from .joining import Effect as JoinEffect
from .joining import Hold, Release
from .messages import (
    Advertise,
    Copy,
    Found,
    HandedOver,
    Join,
    Leave,
    Matched,
    Probe,
    Publish,
    Recovered,
    Subscribe,
    Unsubscribe,
    Unsubscribed,
)
from .peer import WARM_AFTER_PROMOTION_S
from .performing import Inputs, Performer
from .replicas import TOMBSTONE, live
from .ring_records import RingRecords, hold_open, open_hand_backs
from .router_leave import LeavingRouter
from .store import open_store, ring_owner
from .wiring import SEND_FAILURES, Handler

__all__ = ["RouterMaster", "RouterSlave"]

log = logging.getLogger(__name__)


class RouterMaster(LeavingRouter):
    """Forwards along the ring; at the owner, hands over to a match master.

    Its routing table (latencyMap entries) is replicated to the routing slaves
    (W of N acks) and read back from R of N replicas when it starts.
    """

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
        await self._hold_if_joining(
            live(records).get(self.cluster, (0, None))[1],
            hold_open(records, self.cluster),
        )
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
        self._resume_hand_backs(records)
        self._ring_applied.set()

    def _resume_hand_backs(self, records: dict[str, tuple[int, Any]]) -> None:
        """The hand-backs a router of this cluster did not end: asked again (handback.py)."""
        rounds, refused = open_hand_backs(records, self.ring.clusters, self.cluster)
        for reason in refused:
            log.warning("%s: %s left out", self.id, reason)
        for joiner, round_ in rounds.items():
            log.warning("%s: the hand-back of %s's arc was open: asked again", self.id, joiner)
            again = (uuid.uuid4().hex, joiner, round_.arc, round_.masters, round_.retiring)
            self._background(self._hand_back(self.hand_back.start(*again, resumed=True)))

    async def _hold_if_joining(self, record: Any, resumed: bool) -> None:
        """The arc's events wait (as a take-over's) until the hand-over is routed here
        (joining.py): this cluster joins now, or a router before this one held and did
        not let go (``resumed``: its record, written before the inbox is consumed, is
        still open)."""
        state = record.get("state") if isinstance(record, dict) else None
        effects = self.join_hold.start(
            recorded=state if isinstance(state, str) else None,
            listed_as_joined=self._spec.joined,
            bound_s=self.topology.handover_wait_s,
            clusters=len(self.ring.clusters),
            now=time.monotonic(),
            announce_s=JOIN_SERVING_TIMEOUT_S + self.topology.handover_wait_s,
            resumed=resumed,
        )
        if self.join_hold.holding:
            if resumed and not self.join_hold.joins(state, self._spec.joined):
                log.warning("%s: the join's hold was open: resumed", self.id)
            await asyncio.to_thread(self.ring_records.hold, self.cluster, "holding")
        await self._join_effects(effects)

    @functools.cached_property
    def ring_records(self) -> RingRecords:
        """This cluster's join hold and hand-backs, recorded while open."""
        return RingRecords(self.store, self.topology.prefix)

    async def _join_effects(self, effects: list[JoinEffect]) -> None:
        """Perform what the join hold returned (joining.py)."""
        await self.enact(effects, self.joining)

    @functools.cached_property
    def joining(self) -> Inputs:
        """The join hold's timer input: its bound passed."""
        return Inputs(timer=lambda _: self.join_hold.expired(time.monotonic()))

    def _hold(self, effect: Hold) -> list[After]:
        ring = self.ring
        arc = Arc(
            self.cluster,
            ring.successors(self.cluster, 1)[0],
            ring_id(ring.predecessor(self.cluster)),
            ring_id(self.cluster),
        )
        self._joining = (arc, asyncio.Event())
        log.info("%s: joining the ring: the arc's events wait for its hand-over", self.id)
        return [After(effect.bound_s, "join")]

    def _release(self, effect: Release) -> None:
        if self._joining is not None:
            self._joining[1].set()
        self._background(asyncio.to_thread(self.ring_records.hold, self.cluster, "released"))
        self.count("handover_wait_expired" if effect.timed_out else "handovers_received")
        level, words = effect.said()
        log.log(level, "%s: %s", self.id, words)

    async def _on_handed_subscription(self, message: Subscribe | Unsubscribe) -> None:
        """One subscription of the arc this cluster joins with (or one removed while the
        previous owner held it), from the previous owner's match master (to this control
        queue, so that the arc's events held in the inbox do not keep it out): routed to
        this cluster's match master like any other (``Forwarding.handed``).  One whose
        send failed for a reason that passes (the match master's inbox on a node that is
        down) comes again (``serving.HANDED``): counted routed for the join's hold when
        it was, or failed for good."""
        await self._ring_applied.wait()
        routed = True
        try:
            await self._forward(self.forwarding.handed(message, self._now(), self._holds()))
        except SEND_FAILURES:
            routed = False
            raise
        finally:
            if routed:
                await self._join_effects(self.join_hold.routed(time.monotonic()))

    async def _on_handed_over(self, message: HandedOver) -> None:
        if message.cluster != self.cluster:
            raise DeadLetter(f"handed_over: for {message.cluster}, not {self.cluster}")
        now = time.monotonic()
        if message.count is None:  # still under way at the previous owner
            await self._join_effects(self.join_hold.noted(now))
            return
        await self._join_effects(self.join_hold.told(message.count, now))

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
            Join: self._on_join,  # its own, announced (beside the hand-over it waits for)
        }

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        routed = (Advertise, Subscribe, Unsubscribe, Unsubscribed, Publish)
        return {Join: self._on_join, Copy: self._on_copy, **dict.fromkeys(routed, self._route)}

    async def _on_join(self, message: Join) -> None:
        if message.cluster == self.cluster:  # this cluster's own join, announced
            if self.join_hold.holding:
                log.info("%s: the join is announced: the hold's bound runs from now", self.id)
            await self._join_effects(self.join_hold.announce(time.monotonic()))
            return
        await self._join(message.cluster)

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
        round_ = OpenRound(
            self.cluster,
            (handover.start, handover.end),
            tuple(RoleId.match(self.cluster, i).owner for i in range(masters)),
            tuple(RoleId.match(self.cluster, i).owner for i in range(keep, masters)),
        )
        await asyncio.to_thread(self.ring_records.hand_back, cluster, round_)
        await self._hand_back(
            self.hand_back.start(
                uuid.uuid4().hex, cluster, round_.arc, round_.masters, round_.retiring
            )
        )

    async def _hand_back(self, effects: list[HandBackEffect]) -> None:
        """Perform what the hand-back returned (handback.HandBack)."""
        await self.enact(effects, self.handing_back)

    @functools.cached_property
    def handing_back(self) -> Inputs:
        """The hand-back's inputs: its timers (a request's bound, a retry) and how the
        count told to the joiner went."""
        return Inputs(timer=self.hand_back.expired, sent=self._count_told)

    def _count_told(self, effect: Send, sent: Sent) -> list[HandBackEffect]:
        told = effect.message
        if sent.error is None and told.count is None:  # a resumed round's last word
            log.info("%s: %s's arc handed over (a resumed round: no count)", self.id, told.cluster)
        elif sent.error is None:
            log.info(
                "%s: %d subscriptions of %s's arc handed over", self.id, told.count, told.cluster
            )
        return self.hand_back.sent(sent.then, sent.error, time.monotonic())

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {
            **super().performers,
            Hold: self._hold,
            Release: self._release,
            NotHandedOver: self._not_handed_over,
            HandedBack: lambda effect: self._background(
                asyncio.to_thread(self.ring_records.hand_back, effect.cluster, None)
            ),
            RetireAdded: lambda effect: self._retire_added(
                effect.cluster, [RoleId.from_owner(owner) for owner in effect.masters], effect.moved
            ),
        }

    def _not_handed_over(self, effect: NotHandedOver) -> None:
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
                "%s: the match masters did not hand %s's arc over in time", self.id, effect.cluster
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

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While served: the replica it holds, loaded first."""
        self.store = open_store(self.topology.state_store)
        try:
            held = self.store.load(self.replica_owner, "routing_table")
            self.held_version = max((v for v, _ in held.values()), default=0)
            for key, (_, doc) in live(held).items():
                self.table[key] = doc
            async with super().lifetime(stop):
                yield
        finally:
            self.store.close()

    def apply(self, key: str, document: dict[str, Any]) -> None:
        if document == TOMBSTONE:
            self.table.pop(key, None)
        else:
            self.table[key] = document
