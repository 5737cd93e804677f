"""A routing master on the ring (driver): its state, its links to the other clusters'
routers (``detours.py``), and the route/relay/carry loop performed from the machine of
``forwarding.py``.  Departures are ``router_leave.py``, joins and the hand-back
``router_roles.py``.
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

from ..phoenix.ids import RoleId, RoleKind
from ..phoenix.ring import ChordRing
from ..phoenix.ring import Handover as Arc
from ..recovery.capacity import running_masters
from .delivery import CopySender, event_content
from .departures import (
    Departures,
)
from .detours import Detours
from .forwarding import (
    JOINING,
    Forwarding,
    LinkReported,
    Now,
    PutHere,
    RouteAgain,
    SendOn,
    WaitRestored,
    WriteEntry,
)
from .forwarding import Effect as ForwardingEffect
from .handback import HandBack
from .joining import JoinHold
from .mastering import Master
from .messages import (
    Copy,
    Matched,
    Message,
    Publish,
    Routed,
    RoutedMessage,
    encode,
)
from .performing import Inputs, Performer
from .replica_set import ReplicaSet
from .router import KeptEvents, RouterLogic
from .store import open_store, ring_owner
from .takeover import ArcTakeover
from .wiring import cluster_settings, outgoing_body

__all__ = ["RingRouter"]

log = logging.getLogger(__name__)


class RingRouter(Master):
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
        self.copies = CopySender.for_role(self)
        #: departed clusters whose arc this router took over: (arc, restored)
        self._recovering: dict[str, tuple[Arc, asyncio.Event]] = {}
        #: RECOVERY requests: (match masters yet to answer, restored so far, all answered)
        # departed arcs being taken over here (takeover.py)
        self.takeover = ArcTakeover(
            self.topology.read_timeout_s, reply_to=self.connections.process_queue
        )
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
        self.hand_back = HandBack(
            self.topology.read_timeout_s,
            self.topology.handover_wait_s,
            cluster=self.cluster,
            reply_to=self.connections.process_queue,
        )

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

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While served: the links watched, the table snapshotted."""
        watch = asyncio.create_task(self.detours.watch(stop))
        try:
            async with super().lifetime(stop), self.replicas.persisting(stop):
                yield
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
        message = outgoing_body(body, inbox, priority=priority, persistent=self.topology.persistent)
        await self.detours.publish(client, lambda: client.publish(message, retry=False))

    async def finish(self) -> None:
        await self.copies.close()

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

    def urgency(self, message: Message) -> int:
        return self.logic.priority(message) if isinstance(message, Routed) else 0

    def reconfigured(self) -> None:
        self.logic.topology = self.topology  # ``outer`` switched live
        self.departures.topology = self.topology

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
        await self.enact(effects, self._forwarding_inputs)

    @functools.cached_property
    def _forwarding_inputs(self) -> Inputs:
        return Inputs(sent=lambda _effect, sent: self.forwarding.to_match(sent))

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {
            **super().performers,
            WriteEntry: self._write_entry,
            SendOn: self._send_on,
            WaitRestored: self._wait_restored,
            PutHere: lambda effect: self._put_here(effect.copy),
            LinkReported: lambda effect: self.detours.reported_down(effect.cluster),
            RouteAgain: self._routed_again,
        }

    async def _write_entry(self, effect: WriteEntry) -> None:
        entry = None if effect.entry is None else effect.entry.to_document()
        await self.replicas.write(effect.event_type, entry)

    async def _send_on(self, effect: SendOn) -> list[ForwardingEffect]:
        """Over the direct link or a detour; the path it went back to the machine."""
        path = await self.detours.forward(effect.cluster, effect.message, effect.priority)
        return self.forwarding.sent(effect, path, self._now(), self._holds())

    async def _wait_restored(self, effect: WaitRestored) -> list[ForwardingEffect]:
        restored = self._restored_event(effect.key)
        if restored is not None:
            await restored.wait()
        return self.forwarding.restored(effect.message, self._holds())

    def _routed_again(self, effect: RouteAgain) -> None:
        log.warning(
            "%s: %d events kept for %s routed again", self.id, len(effect.events), effect.departed
        )
        self._background(self._route_again(effect.events))

    async def _put_here(self, copy: Copy) -> None:
        result = await self.copies.put(
            copy.home,
            copy.queue,
            copy.confirm,
            encode(copy.publish),
            copy.copy_id,
            local=True,
            content=event_content(copy.publish.event.model_dump_json()),
            priority=copy.priority,
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

    async def _announce_leave(self, cluster: str) -> None:
        """No flood reached ``cluster`` for ``leave_after_s`` (``router_leave.py``)."""
        raise NotImplementedError

    async def _suspect(self, cluster: str) -> None:
        """A flood for ``cluster`` found no way (``router_leave.py``)."""
        raise NotImplementedError
