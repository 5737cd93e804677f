"""Phoenix roles over RabbitMQ (drivers): routing master, match master, and the client.

Every role has an inbox queue with ``x-max-priority`` (latency levels become
priorities) and talks to other roles only by publishing to their inboxes.  A
routing master forwards along the Chord ring (finger tables) until the owning
cluster's routing master, which hands the message to the match master its
routing table names (hash of the event type over the cluster's match masters).
Match masters keep subscriptions in a :class:`SubscriptionIndex`, persist them to
the state store on change and reload them at start, and deliver matched events
to each subscriber's own queue.

Match slaves hold replicas of their master's subscriptions, match what the
master dispatches to them, and report their predicted processing time T by
heartbeat; the master sends each event to the broker with the smallest T.

A cluster that joins at run time is added by every routing master; the one
whose arc shrank has its match masters hand exactly that arc's subscriptions to
the joiner.

Not built yet (issue #7 stays open): routing slaves, quorum acks for replica
writes, recovery from failures (the later issue).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Histogram

from ..errors import DeadLetter, Unroutable
from ..settings import Settings
from ..transport import AsyncClient, Delivery, OutgoingMessage, QueueKind, QueueSpec
from .matching import Event, Filter, FilterError, SubscriptionIndex
from .protocol import (
    Kind,
    PhoenixMessage,
    PhoenixTopology,
    match_inbox,
    router_inbox,
    router_slave_inbox,
)
from .replicas import Quorum
from .ring import ChordRing, Handover
from .store import open_store
from .timeliness import LatencyMap, QueuePredictor, choose_broker

__all__ = ["MatchMaster", "MatchSlave", "PhoenixClient", "RouterMaster", "RouterSlave"]

log = logging.getLogger(__name__)
ROLE_EVENTS = PromCounter(
    "qosmq_phoenix_events_total",
    "Phoenix messages by role and outcome",
    ["cluster", "role", "outcome"],
)
HOPS = Histogram(
    "qosmq_phoenix_hops",
    "ring hops of delivered events",
    ["cluster"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)


def inbox_spec(name: str) -> QueueSpec:
    """Every role inbox is declared alike, so any role may declare any inbox first."""
    return QueueSpec(name, kind=QueueKind.CLASSIC, max_priority=9)


class _Role:
    def __init__(self, *, settings: Settings, topology: PhoenixTopology, cluster: str) -> None:
        self.topology, self.cluster = topology, cluster
        self.settings = settings
        self._clients: dict[str, AsyncClient] = {}
        self.counters: Counter[str] = Counter()
        self.role = type(self).__name__

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] += n
        ROLE_EVENTS.labels(self.cluster, self.role, outcome).inc(n)

    async def client_for(self, cluster: str) -> AsyncClient:
        """One connection per cluster's RabbitMQ (the process's own when not configured)."""
        spec = self.topology.cluster(cluster)
        key = ",".join(spec.amqp_urls) or "default"
        if key not in self._clients:
            settings = (
                self.settings.model_copy(update={"amqp_urls": spec.amqp_urls})
                if spec.amqp_urls
                else self.settings
            )
            self._clients[key] = await AsyncClient(settings=settings).connect()
        return self._clients[key]

    async def send(
        self, cluster: str, inbox: str, message: PhoenixMessage, priority: int = 0
    ) -> None:
        client = await self.client_for(cluster)
        if inbox not in client.topology.queues:
            await client.declare_queue(inbox_spec(inbox))
        await client.publish(
            OutgoingMessage(
                message.model_dump_json().encode(),
                "",
                inbox,
                priority=priority,
                content_type="application/json",
            )
        )

    async def serve(self, inbox: str, stop: asyncio.Event) -> None:
        client = await self.client_for(self.cluster)
        await client.declare_queue(inbox_spec(inbox))
        await client.consume(inbox, self._on_message)
        log.info("%s serving %s", type(self).__name__, inbox)
        await stop.wait()
        for c in self._clients.values():
            await c.close()

    async def _on_message(self, delivery: Delivery) -> None:
        try:
            message = PhoenixMessage.model_validate_json(delivery.body)
        except ValueError as exc:
            raise DeadLetter(f"malformed Phoenix message: {exc}") from None
        await self.handle(message)

    async def handle(self, message: PhoenixMessage) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class RouterMaster(_Role):
    """Forwards along the ring; at the owner, hands over to a match master.

    Its routing table (latencyMap entries) is replicated to the routing slaves; an
    entry counts as written once W of the N = slaves + 1 replicas (itself included)
    hold it (``Quorum.majority``).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slaves = self.topology.cluster(self.cluster).routing_slaves
        self.quorum = Quorum.majority(self.slaves + 1)
        self.version = 0
        self.acks: dict[int, set[str]] = {}
        self.ring = ChordRing(
            c.id for c in self.topology.clusters if c.joined or c.id == self.cluster
        )
        self.latency = LatencyMap()

    async def run(self, stop: asyncio.Event) -> None:
        await self.serve(router_inbox(self.topology, self.cluster), stop)

    async def handle(self, message: PhoenixMessage) -> None:
        if message.kind is Kind.JOIN and message.cluster:
            await self._join(message.cluster)
            return
        if message.kind is Kind.ACK and message.version is not None and message.broker:
            self._acknowledged(message.version, message.broker)
            return
        et = message.event_type
        if message.kind is Kind.SUBSCRIBE:
            self.latency.add(et, message.latency_level)
            await self._replicate(et)
        forwarded = message.model_copy(update={"hops": [*message.hops, self.cluster]})
        priority = self.latency.priority(et)
        owner = self.ring.owner(et)
        if owner != self.cluster:
            next_hop = self.ring.route(self.cluster, et)[1]
            self.count("forwarded")
            await self.send(next_hop, router_inbox(self.topology, next_hop), forwarded, priority)
            return
        masters = self.topology.cluster(self.cluster).match_masters
        index = int(hashlib.sha1(et.encode()).hexdigest(), 16) % masters  # routing table
        self.count("routed")
        await self.send(
            self.cluster, match_inbox(self.topology, self.cluster, index), forwarded, priority
        )

    async def _replicate(self, event_type: str) -> None:
        if not self.slaves:
            return
        self.version += 1
        self.acks[self.version] = {"master"}
        total, count = self.latency.entries[event_type]
        entry = PhoenixMessage(
            kind=Kind.REPLICATE,
            event_type=event_type,
            version=self.version,
            table={"level_sum": total, "count": count},
        )
        for j in range(self.slaves):
            await self.send(self.cluster, router_slave_inbox(self.topology, self.cluster, j), entry)

    def _acknowledged(self, version: int, slave: str) -> None:
        acks = self.acks.get(version)
        if acks is None:
            return
        acks.add(slave)
        if self.quorum.written(acks):
            del self.acks[version]  # W of N hold it: the entry is durable
            self.count("replicated")

    async def _join(self, cluster: str) -> None:
        """A cluster joined: if it took our arc, our match masters hand its subscriptions over."""
        self.topology.cluster(cluster)
        handover = self.ring.join(cluster)
        self.count("joins")
        if handover is None or handover.previous_owner != self.cluster:
            return
        log.info("%s joined: handing over arc (%x, %x]", cluster, handover.start, handover.end)
        for i in range(self.topology.cluster(self.cluster).match_masters):
            await self.send(
                self.cluster,
                match_inbox(self.topology, self.cluster, i),
                PhoenixMessage(
                    kind=Kind.HANDOVER,
                    event_type="-",
                    cluster=cluster,
                    arc=(handover.start, handover.end),
                ),
            )


class RouterSlave(_Role):
    """Holds a replica of its routing master's table (persisted) and acknowledges each entry."""

    def __init__(self, *, slave: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slave = slave
        self.owner = f"{self.cluster}/router-slave-{slave}"
        self.table: dict[str, dict[str, Any]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        store = open_store(self.topology.state_store)
        self.table = {k: doc for k, (_, doc) in store.load(self.owner, "routing_table").items()}
        self.store = store
        await self.serve(router_slave_inbox(self.topology, self.cluster, self.slave), stop)
        store.close()

    async def handle(self, message: PhoenixMessage) -> None:
        if message.kind is not Kind.REPLICATE or message.table is None or message.version is None:
            return
        self.table[message.event_type] = message.table
        self.store.save(
            self.owner, "routing_table", message.event_type, message.table, message.version
        )
        self.count("replicas")
        await self.send(
            self.cluster,
            router_inbox(self.topology, self.cluster),
            PhoenixMessage(
                kind=Kind.ACK,
                event_type=message.event_type,
                version=message.version,
                broker=f"slave-{self.slave}",
            ),
        )


class _MatchBroker(_Role):
    """Matching and delivery shared by match masters and match slaves."""

    HEARTBEAT_S = 0.5

    def __init__(self, *, index: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.owner = f"{self.cluster}/match-{index}"  # subscriptions are the master's
        self.indexes: dict[str, SubscriptionIndex] = {}
        self.queues: dict[str, str] = {}
        self.predictor = QueuePredictor(window_s=self.HEARTBEAT_S)

    def _add(self, sid: str, event_type: str, flt: Filter, queue: str) -> None:
        self.indexes.setdefault(event_type, SubscriptionIndex()).add(sid, flt)
        self.queues[sid] = queue

    def _load(self) -> None:
        store = open_store(self.topology.state_store)
        try:
            for sid, (_, doc) in store.load(self.owner, "subscription").items():
                self._add(sid, doc["event_type"], Filter.parse(doc["filter"]), doc["queue"])
        finally:
            store.close()

    async def _match(self, message: PhoenixMessage) -> None:
        assert message.event is not None
        self.predictor.arrived()
        index = self.indexes.get(message.event_type)
        matched = index.match(message.event.attributes) if index else set()
        self.count("matched", len(matched))
        HOPS.labels(self.cluster).observe(max(0, len(message.hops) - 1))
        client = await self.client_for(self.cluster)
        body = message.model_copy(update={"broker": self.name}).model_dump_json().encode()
        for sid in matched:
            try:
                await client.publish(
                    OutgoingMessage(body, "", self.queues[sid], content_type="application/json")
                )
                self.count("delivered")
            except Unroutable:
                log.warning("subscriber queue %s is gone", self.queues[sid])
        self.predictor.completed()

    @property
    def name(self) -> str:
        return self.owner


class MatchMaster(_MatchBroker):
    """Keeps subscriptions (indexed, persisted, copied to its slaves); sends each event
    to the broker with the smallest predicted processing time T, itself included."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store = open_store(self.topology.state_store)
        self.slaves = self.topology.cluster(self.cluster).match_slaves
        self.slave_t: dict[int, tuple[float, float]] = {}  # slave -> (T, received at)
        self.subscriptions: dict[str, PhoenixMessage] = {}  # as received, for hand-over

    async def run(self, stop: asyncio.Event) -> None:
        for sid, (_, doc) in self.store.load(self.owner, "subscription").items():
            self._subscribe(PhoenixMessage(kind=Kind.SUBSCRIBE, subscription_id=sid, **doc))
        await self.serve(match_inbox(self.topology, self.cluster, self.index), stop)
        self.store.close()

    def _subscribe(self, message: PhoenixMessage) -> None:
        assert message.subscription_id and message.queue
        self._add(
            message.subscription_id, message.event_type, Filter.parse(message.filter), message.queue
        )
        self.subscriptions[message.subscription_id] = message

    async def _hand_over(self, joiner: str, arc: tuple[int, int]) -> None:
        """Send the subscriptions of the arc's event types to the joining cluster."""
        handover = Handover(joiner, self.cluster, *arc)
        moving = [m for m in self.subscriptions.values() if handover.covers(m.event_type)]
        for message in moving:
            sid = str(message.subscription_id)
            await self.send(
                joiner,
                router_inbox(self.topology, joiner),
                message.model_copy(update={"hops": [], "replica": False}),
            )
            index = self.indexes[message.event_type]
            index.remove(sid)
            if not len(index):
                del self.indexes[message.event_type]
            del self.subscriptions[sid], self.queues[sid]
            self.store.delete(self.owner, "subscription", sid)
        self.count("handed_over", len(moving))

    async def handle(self, message: PhoenixMessage) -> None:
        if message.kind is Kind.HANDOVER and message.cluster and message.arc:
            await self._hand_over(message.cluster, message.arc)
        elif message.kind is Kind.SUBSCRIBE and message.subscription_id and message.queue:
            self._subscribe(message)
            self.store.save(
                self.owner,
                "subscription",
                message.subscription_id,
                {
                    "event_type": message.event_type,
                    "filter": message.filter,
                    "queue": message.queue,
                    "latency_level": message.latency_level,
                },
                1,
            )
            replica = message.model_copy(update={"replica": True})
            for j in range(self.slaves):
                await self.send(self.cluster, self._slave_inbox(j), replica)
        elif message.kind is Kind.ADVERTISE:
            self.store.save(self.owner, "advertisement", message.event_type, {}, 1)
        elif message.kind is Kind.HEARTBEAT and message.broker and message.predicted_t is not None:
            self.slave_t[int(message.broker.rsplit("-", 1)[1])] = (
                message.predicted_t,
                time.monotonic(),
            )
        elif message.kind is Kind.PUBLISH and message.event is not None:
            target = self.choose()
            if target is None:
                await self._match(message)
            else:
                self.count("dispatched")
                await self.send(
                    self.cluster,
                    self._slave_inbox(target),
                    message.model_copy(update={"replica": True}),
                )

    def choose(self) -> int | None:
        """None for itself, else the slave with the smallest fresh predicted T."""
        now = time.monotonic()
        if now - self.predictor.last_close >= self.HEARTBEAT_S:
            self.predictor.close_window(now)
        predicted = {"self": self.predictor.predict(now)}
        for j, (t, at) in self.slave_t.items():
            if now - at <= 3 * self.HEARTBEAT_S:  # a silent slave gets nothing
                predicted[f"slave-{j}"] = t
        chosen = choose_broker(predicted)
        return None if chosen == "self" else int(chosen.split("-")[1])

    def _slave_inbox(self, j: int) -> str:
        return match_inbox(self.topology, self.cluster, self.index, j)


class MatchSlave(_MatchBroker):
    """Holds a replica of its master's subscriptions, matches what the master sends it,
    and reports its predicted T to the master every heartbeat."""

    def __init__(self, *, slave: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slave = slave

    @property
    def name(self) -> str:
        return f"{self.owner}/slave-{self.slave}"

    async def run(self, stop: asyncio.Event) -> None:
        self._load()  # the replica starts from the master's persisted state
        beat = asyncio.create_task(self._heartbeat(stop))
        await self.serve(match_inbox(self.topology, self.cluster, self.index, self.slave), stop)
        beat.cancel()

    async def handle(self, message: PhoenixMessage) -> None:
        if message.kind is Kind.SUBSCRIBE and message.subscription_id and message.queue:
            self._add(
                message.subscription_id,
                message.event_type,
                Filter.parse(message.filter),
                message.queue,
            )
        elif message.kind is Kind.PUBLISH and message.event is not None:
            await self._match(message)

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        master = match_inbox(self.topology, self.cluster, self.index)
        while not stop.is_set():
            await asyncio.sleep(self.HEARTBEAT_S)
            t = self.predictor.close_window(time.monotonic())
            try:
                await self.send(
                    self.cluster,
                    master,
                    PhoenixMessage(
                        kind=Kind.HEARTBEAT,
                        event_type="-",
                        broker=f"slave-{self.slave}",
                        predicted_t=t if t != float("inf") else 1e9,
                    ),
                )
            except Exception as exc:
                log.info("heartbeat to %s failed: %s", master, exc)


class PhoenixClient:
    """The wrapped publisher/subscriber: talks to one cluster's routing master."""

    def __init__(self, client: AsyncClient, *, topology: PhoenixTopology, cluster: str) -> None:
        topology.cluster(cluster)
        self.client, self.topology, self.cluster = client, topology, cluster
        self.inbox = router_inbox(topology, cluster)

    async def _send(self, message: PhoenixMessage) -> None:
        if self.inbox not in self.client.topology.queues:
            await self.client.declare_queue(inbox_spec(self.inbox))
        await self.client.publish(
            OutgoingMessage(
                message.model_dump_json().encode(), "", self.inbox, content_type="application/json"
            )
        )

    async def advertise(self, event_type: str) -> None:
        await self._send(PhoenixMessage(kind=Kind.ADVERTISE, event_type=event_type))

    async def subscribe(
        self,
        event_type: str,
        filter: Iterable[Sequence[Any]] | None,
        latency_level: int,
        queue: str,
    ) -> str:
        """Subscribe ``queue`` (declared here) to matching events; return the id."""
        flt = Filter.parse(filter)  # refuses a malformed filter before anything is sent
        if not 1 <= latency_level <= 5:
            raise FilterError(f"latency level must be 1..5, got {latency_level}")
        await self.client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))
        sid = uuid.uuid4().hex
        await self._send(
            PhoenixMessage(
                kind=Kind.SUBSCRIBE,
                event_type=event_type,
                latency_level=latency_level,
                queue=queue,
                subscription_id=sid,
                filter=[
                    [
                        p.attribute,
                        p.op.value,
                        *(
                            []
                            if p.value is None
                            else [list(p.value) if isinstance(p.value, tuple) else p.value]
                        ),
                    ]
                    for p in flt.predicates
                ],
            )
        )
        return sid

    async def publish(self, event: Event | dict[str, Any]) -> None:
        event = event if isinstance(event, Event) else Event.parse(event)
        await self._send(
            PhoenixMessage(kind=Kind.PUBLISH, event_type=event.event_type, event=event)
        )
