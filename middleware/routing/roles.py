"""Phoenix roles over RabbitMQ (drivers): routing master, match master, and the client.

Every role has an inbox queue with ``x-max-priority`` (latency levels become
priorities) and talks to other roles only by publishing to their inboxes.  A
routing master forwards along the Chord ring (finger tables) until the owning
cluster's routing master, which hands the message to the match master its
routing table names (hash of the event type over the cluster's match masters).
Match masters keep subscriptions in a :class:`SubscriptionIndex`, persist them to
the state store on change and reload them at start, and deliver matched events
to each subscriber's own queue.

Masters replicate their state to their slaves (routing master -> routing
slaves: the latencyMap table; match master -> match slaves: subscriptions).
Every write carries a version, is persisted by the master and each slave in
the state store, and counts as written once W of the N = slaves + 1 replicas
acknowledged it; a master that starts reads its table back from R of N replicas
(its own store and R - 1 slaves' snapshots), keeps the newest version per key
and repairs its own copy (W + R > N: the read meets every acknowledged write).
Acks, snapshots and heartbeats travel on a master's control queue, never behind
the data backlog of its inbox.

Match slaves match what the master dispatches to them and report their
predicted processing time T by heartbeat; the master sends each event to the
broker with the smallest T (the inner mechanism; ``inner = false``: round robin over
the master and its live slaves, blind to load, or with ``blind_dispatch = "master"``
the master matches everything itself).  Inboxes are consumed with a small prefetch so a
backlog waits in RabbitMQ's priority queue and urgent events overtake it (the
outer mechanism; ``outer = false``: every event has priority 0).

A cluster that joins at run time is added by every routing master; the one
whose arc shrank has its match masters hand exactly that arc's subscriptions to
the joiner.  Masters beat to their slaves; slaves that stop hearing their master
elect a successor (``middleware/recovery``), whose process then serves the master's
role (``node.py``).  Names come from ``ids.py``, messages from ``messages.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge, Histogram
from pydantic import ValidationError

from .. import heap, tracing
from ..errors import DeadLetter, LinkDown, MiddlewareError, RetryableError, Unroutable
from ..recovery import FailureDetector
from ..recovery.capacity import Adoption, CapacityPlan, plan_takeover, running_masters
from ..recovery.fencing import (
    Refused,
    Reign,
    RivalOutcome,
    SendFence,
    Stale,
    StepDown,
    Trust,
    fenced,
    rival_beat,
)
from ..recovery.provisioner import Provisioner
from ..settings import Settings
from ..transport import AsyncClient, Delivery, OutgoingMessage, QueueKind, QueueSpec
from ..transport.delivery import outcome_of
from .batching import Batcher, PriorityGate, split
from .beats import Beater, LeaseWatch
from .delivery import CopySender, Outcome, event_content
from .detours import LINK_ERRORS, Detours
from .follower import (
    Counted,
    Elected,
    FenceMaster,
    Follower,
    Leader,
    NameLease,
    Promote,
    SignalVote,
    Suspected,
)
from .follower import Effect as FollowerEffect
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
    handover_plan,
)
from .joining import Effect as JoinEffect
from .matching import FilterError
from .messages import (
    HOME_LEFT,
    MAYBE_DELIVERED,
    Ack,
    Advertise,
    Answer,
    Beat,
    Configure,
    Confirmation,
    Copy,
    Fence,
    Found,
    HandedOver,
    Handover,
    Heartbeat,
    Join,
    Leave,
    Matched,
    Message,
    Probe,
    Publish,
    Read,
    Recover,
    Recovered,
    Replicate,
    Retire,
    Routed,
    RoutedMessage,
    Snapshot,
    Subscribe,
    Takeover,
    Unsubscribe,
    Unsubscribed,
    Vote,
    encode,
    heartbeat_value,
    parse,
)
from .protocol import MAX_PRIORITY, Kind, PhoenixTopology
from .records import LatencyEntry, RecordError, SubscriptionRecord
from .registry import Registry
from .replicas import (
    TOMBSTONE,
    Effect,
    GaveUp,
    Persist,
    ReplicaLog,
    ToReplica,
    Written,
    live,
)
from .ring import ChordRing, ring_id
from .ring import Handover as Arc
from .router import Forward, KeptEvents, RouterLogic
from .store import StateStore, open_store, ring_owner
from .supervision import After, Note, Provision, Supervision
from .supervision import Effect as SupervisionEffect
from .supervision import Retire as RetireProcess
from .takeover import Adopt, ArcTakeover, AskRestore, MakePlan, ReadTable, Released, RestoreBound
from .takeover import Effect as TakeoverEffect
from .timeliness import Dispatch, QueuePredictor

__all__ = [
    "MatchMaster",
    "MatchSlave",
    "RouterMaster",
    "RouterSlave",
    "cluster_settings",
    "reconfigure",
]

log = logging.getLogger(__name__)
#: a promoted master warms its provisioner this long after it serves (beats.py, zygote.py)
WARM_AFTER_PROMOTION_S = 1.0
#: removals of departed arcs' subscriptions a match master remembers for the hand-over
MAX_REMOVED_ADOPTED = 100_000
ROLE_EVENTS = PromCounter(
    "qosmq_phoenix_events_total",
    "Phoenix messages by role and outcome",
    ["cluster", "role", "outcome"],
)
INBOX_LENGTH = Gauge(
    "qosmq_phoenix_inbox_length",
    "AMQP messages waiting in a role's inbox, as the broker counts them (a batch is one)",
    ["cluster", "role", "inbox"],
)
PREDICTED_T = Gauge(
    "qosmq_phoenix_predicted_seconds",
    "a match broker's predicted mean processing time T = (q + 1) / (2 mu)",
    ["cluster", "broker"],
)
RECOVERY_S = Histogram(
    "qosmq_phoenix_recovery_seconds",
    "A failed master's recovery: detection (from the last beat its slaves heard to the "
    "election's start), election (its start to the winner's win, observed by the winner) "
    "and recovery (from the last beat heard to the winner serving the master's role)",
    ["cluster", "kind", "phase"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0),
)
LEAVE_S = Histogram(
    "qosmq_phoenix_leave_recovery_seconds",
    "a departed cluster's arc taken over: from the leave to every match master restored",
    ["cluster"],
    buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
)
HOPS = Histogram(
    "qosmq_phoenix_hops",
    "ring hops of delivered events",
    ["cluster"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)


def cluster_settings(
    settings: Settings, topology: PhoenixTopology, cluster: str, source: str | None = None
) -> tuple[str, Settings]:
    """The settings for a cluster's RabbitMQ (its own ``amqp_urls`` and ``vhost``, else
    the process's; reached from cluster ``source`` over the link's own addresses when the
    topology gives that link some), and a key that is the same for clusters sharing one
    RabbitMQ vhost and path (one connection each)."""
    spec = topology.cluster(cluster)
    link = topology.link(source, cluster)
    urls = link.amqp_urls if link else (spec.amqp_urls or settings.amqp_urls)
    vhost = spec.vhost or settings.vhost
    if (urls, vhost) == (settings.amqp_urls, settings.vhost):
        return "default", settings
    return f"{','.join(urls)}|{vhost}", settings.model_copy(
        update={"amqp_urls": urls, "vhost": vhost}
    )


def outgoing(message: Message, queue: str, **options: Any) -> OutgoingMessage:
    """A Phoenix message as every role and client publishes it: JSON, straight to ``queue``."""
    return OutgoingMessage(encode(message), "", queue, content_type="application/json", **options)


#: a role's handler for one kind of message
Handler = Callable[[Any], Awaitable[None]]


def inbox_spec(name: str, kind: str = "classic") -> QueueSpec:
    """Every role inbox is declared alike (the topology's ``role_queues``), so any role
    may declare any inbox first: classic with priorities, or quorum (no broker
    priorities on RabbitMQ 3.x, which refuses ``x-max-priority`` on quorum queues)."""
    if kind == "quorum":
        return QueueSpec(name, kind=QueueKind.QUORUM)
    return QueueSpec(name, kind=QueueKind.CLASSIC, max_priority=9)


def role_inbox_spec(name: str, topology: PhoenixTopology, client: Any) -> QueueSpec:
    """A role inbox or control queue as ``client``'s broker takes it (the topology's
    ``role_queues``; ``auto`` by what the broker reported at connect)."""
    server = getattr(client, "server", None)
    mirroring = None if server is None else server.classic_mirroring
    return inbox_spec(name, topology.role_queue_kind(mirroring))


def process_queue_spec(name: str) -> QueueSpec:
    """A process's own queue: it lives exactly as long as the process's connection."""
    return QueueSpec(name, kind=QueueKind.CLASSIC, durable=False, exclusive=True, auto_delete=True)


class Connections:
    """A role process's connections: one per RabbitMQ and vhost, shared by the clusters on
    it.  They belong to the process, not to the role it serves: a switch keeps them."""

    def __init__(
        self, settings: Settings, topology: PhoenixTopology, home: str | None = None
    ) -> None:
        self.settings, self.topology = settings, topology
        self.home = home  # the process's cluster: other clusters are reached over its links
        #: the process's own queue (exclusive: gone with its connection), where a master
        #: serving from this process hears that a newer reign fenced it
        self.process_queue = f"{topology.prefix}.process.{uuid.uuid4().hex[:16]}"
        self._clients: dict[str, AsyncClient] = {}  # one per RabbitMQ and vhost
        self._cluster_clients: dict[str, AsyncClient] = {}  # cluster -> its client
        self._connecting: dict[str, asyncio.Future[AsyncClient]] = {}  # key -> first connect

    async def client_for(self, cluster: str) -> AsyncClient:
        client = self._cluster_clients.get(cluster)  # the hot path: every forward, delivery
        if client is not None:
            return client
        key, settings = cluster_settings(self.settings, self.topology, cluster, self.home)
        if key not in self._connecting:  # one connection per RabbitMQ and vhost, however
            self._connecting[key] = asyncio.ensure_future(self._connect(key, settings))
        client = await asyncio.shield(self._connecting[key])  # many sends ask at once
        self._cluster_clients[cluster] = client
        return client

    async def _connect(self, key: str, settings: Settings) -> AsyncClient:
        """The first connection to a RabbitMQ: when no node answers (a link cut before
        this process ever used it), the client is kept and goes on connecting in the
        background, so that later sends find it (not ``ready`` until it connects) instead
        of each starting a connection of its own; this first caller hears why."""
        client = AsyncClient(settings=settings)
        try:
            await client.connect()
        except RetryableError:
            client.reconnect_in_background()
            self._clients[key] = client
            self._cluster_clients.update(
                (c.id, client)
                for c in self.topology.clusters
                if cluster_settings(self.settings, self.topology, c.id, self.home)[0] == key
            )
            raise
        except BaseException:
            del self._connecting[key]  # a permanent error (refused): the next asks again
            raise
        self._clients[key] = client
        return client

    async def close(self) -> None:
        clients, self._clients, self._cluster_clients = self._clients, {}, {}
        for connecting in self._connecting.values():
            connecting.cancel()
        self._connecting = {}
        for client in clients.values():
            await client.close()


def _short(name: str) -> str:
    """A queue name in 16 characters (a copy's message id must stay within 255)."""
    return hashlib.blake2b(name.encode(), digest_size=8).hexdigest()


class _Role:
    GAUGE_S = 1.0  # how often a role reads its inbox length for the metric
    observes_inbox = False  # match brokers read it every window themselves

    id: RoleId  # set by each role before it serves

    def __init__(
        self,
        *,
        settings: Settings,
        topology: PhoenixTopology,
        cluster: str,
        connections: Connections | None = None,
        promoted_from: RoleId | None = None,
        reign: Reign | None = None,
        provisioner: Provisioner | None = None,
        failed_at: float | None = None,
    ) -> None:
        self.topology, self.cluster = topology, cluster
        self.settings = settings
        self.connections = connections or Connections(settings, topology, cluster)
        #: the slave this master was until it took over (its tables are read back as one
        #: replica, its old inbox is drained, it is not one of the master's slaves)
        self.promoted_from = promoted_from
        #: a master's reign (recovery/fencing.py); a slave's first trusted one
        self.reign = reign or Reign()
        #: the reign a slave serves its master under once it won (set when it wins)
        self.next_reign: Reign | None = None
        #: where a master asks for a replacement of a slave it no longer hears
        self.provisioner = provisioner
        #: an elected master: when (monotonic) its slave last heard the failed one
        self.failed_at = failed_at
        # a master's slaves, by number, as their beats and load reports say: the one
        # liveness rule for dispatch (match masters) and for replacements
        self.live = FailureDetector[int](
            topology.slave_beat_interval_s, topology.heartbeat_misses, topology.suspect_ceiling_s
        )
        #: which process serves each slave, second processes, replacements (pure)
        self.supervision = Supervision(
            topology.replace_after_s, topology.replace_retry_s, provisioner is not None
        )
        #: each slave's lease as this master watches it (beats.py)
        self.slave_watches: dict[int, LeaseWatch] = {}
        self.side_tasks: set[asyncio.Future[Any]] = set()  # held, not awaited by anyone
        #: set when told to take over its master: the driver serves that role next
        self.switch_to: RoleId | None = None
        self.takeover_reply: Takeover | None = None  # answered once serving
        self.serving = asyncio.Event()  # consumers started
        self.on_serving: Callable[[], None] | None = None  # the driver's, called then
        self._stop: asyncio.Event | None = None
        self._began = 0.0  # when serve() began (monotonic), for the recovery log
        self.retired = False  # told by its master that another process serves its role
        self.fenced = False  # a master that learnt of a newer reign: it steps down
        self.beater: Beater | None = None
        self._former_control: str | None = None  # its consumer tag (a promoted master)
        self.counters: Counter[str] = Counter()
        self.role = type(self).__name__
        self.batcher = Batcher(self._publish_body, max_messages=topology.batch_max)
        self.received = [0, 0]  # AMQP messages, Phoenix messages in them (since last read)
        # inbox messages handled at once: the prefetch, however the deliveries are batched
        self.gate = PriorityGate(topology.inbox_prefetch)

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] += n
        ROLE_EVENTS.labels(self.cluster, self.role, outcome).inc(n)

    async def client_for(self, cluster: str) -> AsyncClient:
        """One connection per cluster's RabbitMQ (the process's own when not configured),
        shared by the clusters on the same RabbitMQ and vhost."""
        return await self.connections.client_for(cluster)

    async def send(self, cluster: str, inbox: str, message: Message, priority: int = 0) -> None:
        client = await self.client_for(cluster)
        # a process queue (a reply: ack, snapshot) is its process's: never declared here
        if inbox not in client.topology.queues and not self._is_process_queue(inbox):
            if cluster != self.cluster and not client.ready:  # fail fast, as a send would:
                raise LinkDown(f"no connection to cluster {cluster}'s RabbitMQ")  # (detours)
            await client.declare_queue(role_inbox_spec(inbox, self.topology, client))
        # with the others sent to the same inbox and priority in this loop turn
        self.count("sent")
        await self.batcher.send(cluster, inbox, encode(message), priority)

    def _is_process_queue(self, queue: str) -> bool:
        return queue.startswith(f"{self.topology.prefix}.process.")

    async def _publish_body(self, cluster: str, inbox: str, body: bytes, priority: int) -> None:
        self.count("amqp_sent")  # sent / amqp_sent: the mean batch size
        client = await self.client_for(cluster)
        try:
            await client.publish(
                OutgoingMessage(body, "", inbox, content_type="application/json", priority=priority)
            )
        except Unroutable:
            if not self._is_process_queue(inbox):
                raise
            self.count("replies_unroutable")  # its process is gone: nobody waits for it

    def inbox_of(self, role: RoleId) -> str:
        return role.inbox(self.topology.prefix)

    def control_of(self, role: RoleId) -> str:
        return role.control(self.topology.prefix)

    async def serve(self, stop: asyncio.Event) -> None:
        """Consume the control queue, ``prepare``, then the inbox, until ``stop``; then
        stop consuming (by tag: the process may go on serving another role)."""
        self._stop = stop
        self._began = time.monotonic()
        client = await self.client_for(self.cluster)
        inbox = self.inbox_of(self.id)
        control = self.control_of(self.id)
        await client.declare_queue(role_inbox_spec(control, self.topology, client))
        tags = [await client.consume(control, self._on_control)]
        # where a FENCE (masters) or a RETIRE (slaves) finds this process
        await client.declare_queue(process_queue_spec(self.connections.process_queue))
        tags.append(await client.consume(self.connections.process_queue, self._on_control))
        if self.promoted_from is not None:
            # the control queue it had as a slave: a master of another reign beats there
            # (it is judged like the slaves judge it), a late ELECTION is answered
            old = self.control_of(self.promoted_from)
            await client.declare_queue(role_inbox_spec(old, self.topology, client))
            self._former_control = await client.consume(old, self._on_control)
            tags.append(self._former_control)
        recovery = asyncio.create_task(self.recovery(stop))
        try:
            await self._serve_inbox(client, inbox, stop, tags)
        finally:
            recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recovery
            # a master that stepped down lets nothing it still handles finish: what it holds
            # goes back to the inbox for the master it yielded to (a subscribe waiting for
            # replicas that follow that master now would hold the step-down for
            # ``close_grace``)
            grace = 0.0 if self.fenced else None
            for tag in tags:
                with contextlib.suppress(Exception):
                    await client.cancel(tag, grace=grace)
            await self.finish()

    async def recovery(self, stop: asyncio.Event) -> None:
        """Beside serving: a master beats to its slaves every heartbeat interval (its
        slaves elect a successor when the beats stop); a slave watches its master."""
        if self.id.is_slave:
            return
        every = self.id.slaves(self.topology.cluster(self.cluster))
        if not every:
            return
        # the one a promoted master left beats to it once served again (admitted then)
        slaves = [r for r in every if r != self.promoted_from]
        if self.promoted_from is None:
            # from the first beat on its slaves watch it: a master that starts beating
            # only once it serves is never suspected for the pauses of loading its tables
            # (a full collection of a large heap holds every thread for ~0.5 s; a bench
            # start saw one).  A promoted master beats at once: its slaves watch already.
            await self.serving.wait()
        self.live.watch([r.slave for r in every], time.monotonic())  # silent from now on
        if self.provisioner is not None:
            # a promoted master warms once the switch is behind it: the zygote's imports
            # (0.7 s of CPU) made the switch itself 0.3 s slower on 2 cores
            delay = WARM_AFTER_PROMOTION_S if self.promoted_from is not None else 0.0
            asyncio.get_running_loop().call_later(delay, self._warm)
        beat = Beat(
            broker=self.id.owner,
            epoch=self.reign.epoch,
            by=self.reign.by,
            reply_to=self.connections.process_queue,
        )
        if self.promoted_from is not None:
            # its slaves trusted it at its COORDINATOR and wait for its beats from then:
            # the first goes over the connection it has, before the beat thread connects
            for slave in slaves:
                await self.signal(slave, beat)

        async def replacing() -> None:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.topology.heartbeat_interval_s)
                await self.replace_silent(time.monotonic())

        try:
            await self.beating(
                [self.control_of(r) for r in slaves],
                lambda: beat,
                replacing(),
                self.topology.heartbeat_interval_s,
            )
        finally:
            for watch in self.slave_watches.values():
                await watch.stop()

    def _warm(self) -> None:
        if self.provisioner is None:
            return
        try:
            self.provisioner.warm()
        except Exception as exc:  # a provisioner's failure is not the master's
            log.warning("%s: provisioner not warmed: %s", self.id, exc)

    async def beating(
        self,
        queues: list[str],
        beat: Callable[[], Beat],
        meanwhile: Awaitable[None],
        interval_s: float,
    ) -> None:
        """Beat to ``queues`` from a thread of its own while ``meanwhile`` runs (``beat``
        is read at each beat); the thread's connection holds this process's lease, which
        every beat names (beats.py)."""

        def body() -> bytes:
            return encode(beat().model_copy(update={"lease": beater.lease}))

        beater = self.beater = Beater(
            cluster_settings(self.settings, self.topology, self.cluster)[1],
            queues,
            body,
            interval_s=interval_s,
            ttl_ms=self._signal_ttl_ms(),
            priority=MAX_PRIORITY,
            name=str(self.id),
            lease=f"{self.connections.process_queue}.lease" if self.topology.leases else None,
        ).start()
        try:
            await meanwhile
        finally:
            await asyncio.to_thread(beater.stop)
            self.count("beats", beater.sent)

    def _signal_ttl_ms(self) -> int:
        """How long a beat or vote stays worth reading: the detection timeout."""
        topology = self.topology
        return max(1, int(topology.heartbeat_interval_s * topology.heartbeat_misses * 1000))

    async def signal(self, role: RoleId, message: Message) -> None:
        """A control message to ``role``'s control queue (see :meth:`tell`)."""
        await self.tell(self.control_of(role), message, role.cluster)

    async def tell(self, queue: str, message: Message, cluster: str | None = None) -> None:
        """A control message to ``queue``, ahead of any backlog, that expires when it
        would be stale (beats and votes of a dead peer do not pile up); a queue nobody
        declared yet (a role not started) or gone (a process queue of a process that
        died) is not an error."""
        try:
            client = await self.client_for(cluster or self.cluster)
            await client.publish(
                outgoing(message, queue, priority=MAX_PRIORITY, expiration_ms=self._signal_ttl_ms())
            )
        except Unroutable:
            pass
        except MiddlewareError as exc:
            log.info("%s to %s not sent: %s", message.kind.value, queue, exc)

    async def _serve_inbox(
        self, client: AsyncClient, inbox: str, stop: asyncio.Event, tags: list[str]
    ) -> None:
        preparing = asyncio.create_task(self.prepare())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({preparing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not preparing.done():  # fenced or stopped while reading its tables back
            preparing.cancel()
            with contextlib.suppress(asyncio.CancelledError, MiddlewareError):
                await preparing
            log.warning("%s stopped before serving (it was still reading its tables)", self.id)
            return
        preparing.result()
        prepared = time.monotonic()
        if self.settings.gc_freeze:  # what it loaded is never traversed again (heap.py)
            heap.settle(f"{self.role} of {self.cluster}")
        inboxes = []
        if self.promoted_from is not None:  # what was dispatched to it as a slave
            # consumed first: once the inbox's backlog flows in, each further round trip
            # waits behind its deliveries (0.1-0.2 s at 1000 events/s)
            inboxes.append((self.inbox_of(self.promoted_from), self._on_former_inbox))
        inboxes.append((inbox, self._on_message))
        with heap.FullCollections() as collections:
            for name, on_message in inboxes:
                await client.declare_queue(role_inbox_spec(name, self.topology, client))
                tags.append(
                    await client.consume(name, on_message, prefetch=self.topology.inbox_prefetch)
                )
            self.serving.set()
            if self.on_serving is not None:
                self.on_serving()
            if self.failed_at is not None:
                now = time.monotonic()
                took = now - self.failed_at
                RECOVERY_S.labels(self.cluster, self.id.kind.value, "recovery").observe(took)
                log.warning(
                    "%s served again %.2f s after its last beat (this role began %.3f s, "
                    "tables read back %.3f s, inboxes consumed %.3f s after it)",
                    self.id,
                    took,
                    self._began - self.failed_at,
                    prepared - self.failed_at,
                    now - self.failed_at,
                )
            log.info("%s serving %s as %s", type(self).__name__, inbox, self.id)
            if self.observes_inbox:
                await stop.wait()
            else:
                watch = asyncio.create_task(self._watch_inbox(client, inbox, stop))
                await stop.wait()
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        log.info(
            "%s of %s stopped; counters: %s; %s",
            self.role,
            self.cluster,
            dict(self.counters),
            collections.summary(),
        )

    async def finish(self) -> None:
        """Runs once the role stopped consuming (match brokers close their publishers)."""

    async def run(self, stop: asyncio.Event) -> None:  # pragma: no cover - abstract
        """Serve this role until ``stop`` (set by the process, or by a take-over)."""
        raise NotImplementedError

    async def prepare(self) -> None:
        """Runs before the inbox is consumed (masters read their replicas back here)."""

    async def _watch_inbox(self, client: AsyncClient, inbox: str, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                INBOX_LENGTH.labels(self.cluster, self.role, inbox).set(
                    await client.queue_length(inbox)
                )
            except Exception as exc:  # a metric is not worth a role
                log.info("could not read the length of %s: %s", inbox, exc)
            await asyncio.sleep(self.GAUGE_S)

    async def _each(
        self,
        delivery: Delivery,
        handle: Callable[[Message], Awaitable[None]],
        gate: PriorityGate | None = None,
    ) -> None:
        """Handle every message a delivery carries (one, or a batch: concurrently, so
        their onward sends batch again), each through ``gate`` when given.  In a batch, a
        malformed element or one whose handling failed is dead-lettered alone, with its
        reason; the rest are handled."""
        messages, malformed = split(delivery.body)
        self.received[0] += 1
        self.received[1] += len(messages) + len(malformed)

        async def gated(message: Message) -> None:
            if gate is None:
                await handle(message)
                return
            async with gate.slot(self.urgency(message)):
                await handle(message)

        if len(messages) == 1 and not malformed:
            await gated(messages[0])  # errors settle the delivery, as for any consumer
            return
        results = await asyncio.gather(*map(gated, messages), return_exceptions=True)
        failed = [*malformed]
        for message, result in zip(messages, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                failed.append((encode(message), outcome_of(result).reason))
        if failed:
            client = await self.client_for(self.cluster)
            for body, reason in failed:
                log.warning("dead-lettering one of a batch from %s: %s", delivery.queue, reason)
                await client.dead_letter(dataclasses.replace(delivery, body=body), reason)
        self.count("batches_received")

    def urgency(self, message: Message) -> int:
        """Where a message waits in the gate: its priority (routers: the one they give it)."""
        return message.priority if isinstance(message, Routed) else 0

    async def _on_message(self, delivery: Delivery) -> None:
        await self._each(delivery, self.handle, self.gate)

    async def _on_former_inbox(self, delivery: Delivery) -> None:
        await self._each(delivery, self._former_inbox, self.gate)

    async def _on_control(self, delivery: Delivery) -> None:
        async def one(message: Message) -> None:
            if isinstance(message, Configure):
                await self._configure(message, delivery.queue)
                return
            sender = getattr(message, "broker", None)
            if (
                self.promoted_from is not None
                and sender == self.promoted_from.owner
                and not isinstance(message, Beat)  # own beats are known by their process
                and self.promoted_from not in getattr(self.replica_set, "replicas", ())
            ):
                self.count("own_stale")  # sent by this process before it took over
                return
            await self.control(message)

        await self._each(delivery, one)

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        """What the role does with each kind that may come to its inbox."""
        return {}

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        """What the role does with each kind that may come to its control queue
        (``configure`` is every role's, handled before this table)."""
        return {
            Takeover: self._take_over,
            Fence: self._on_fence,
            Beat: self._on_other_beat,
            Vote: self._on_late_vote,
        }

    async def handle(self, message: Message) -> None:
        """Dispatch an inbox message by kind; a kind this role does not take is
        dead-lettered with the reason."""
        handler = self.inbox_handlers.get(type(message))
        if handler is None:
            raise DeadLetter(f"{message.kind.value} is not for a {self.role}'s inbox")
        await handler(message)

    async def answer_read(self, store: StateStore, owner: str, message: Read) -> None:
        """The whole table ``owner`` holds of the kind asked for, in pages, to the
        reader's queue."""
        table = await asyncio.to_thread(store.load, owner, message.state_kind)
        entries = list(table.items())
        pages = [
            entries[i : i + _ReplicaSet.PAGE] for i in range(0, len(entries), _ReplicaSet.PAGE)
        ] or [[]]
        for n, page in enumerate(pages):
            await self.send(
                self.cluster,
                message.reply_to,
                Snapshot(
                    request=message.request,
                    state_kind=message.state_kind,
                    entries=dict(page),
                    last=n == len(pages) - 1,
                    broker=owner,
                ),
            )

    async def _former_inbox(self, message: Message) -> None:
        """What reaches the inbox a promoted master had as a slave and drains: its
        events are handled; a READ (a master of another reign reading its replicas) is
        answered from the replica it held, as the slave would; a replicated entry is
        not this reign's and is dropped."""
        replicas = self.replica_set
        if isinstance(message, Read) and replicas is not None and self.promoted_from:
            await self.answer_read(replicas.store, self.promoted_from.owner, message)
            self.count("former_reads_answered")
            return
        if isinstance(message, Replicate):
            self.count("former_replicas_dropped")
            return
        await self.handle(message)

    async def control(self, message: Message) -> None:
        handler = self.control_handlers.get(type(message))
        if handler is None:
            raise DeadLetter(f"{message.kind.value} is not for a {self.role}'s control queue")
        await handler(message)

    async def _take_over(self, message: Takeover) -> None:
        """Told to serve its master's role: stop serving this role; the driver starts the
        master's with the tables this replica holds."""
        if not self.id.is_slave or message.master != self.id.master.owner:
            raise DeadLetter(
                f"takeover of {message.master!r} sent to {self.id}, which is not its slave"
            )
        if self.switch_to is not None:
            return  # told twice
        self.switch_to = self.id.master
        self.takeover_reply = message if message.reply_to else None
        self.count("takeovers")
        log.warning("%s taking over %s", self.id, self.switch_to)
        if self._stop is not None:
            self._stop.set()

    async def _on_other_beat(self, message: Beat) -> None:
        """A master's beat that reached this master (at the control queue it had as a
        slave): another process serving the same role.  The older reign steps down: that
        one is fenced, or this one steps down itself."""
        if message.reply_to == self.connections.process_queue:
            return  # its own (sent before it switched role)
        if self.id.is_slave:
            raise DeadLetter(f"beat from {message.broker!r} at {self.id}'s master handler")
        if message.broker != self.id.owner:
            await self._on_slave_beat(message)
            return
        theirs = Reign(message.epoch, message.by)
        outcome = rival_beat(self.reign, theirs, message.reply_to, **self._lineage())
        await self._rival(outcome, message.broker)

    async def _on_slave_beat(self, message: Beat) -> None:
        """A slave's beat: it is alive (the live set that dispatch and replication use);
        a slave the replica set does not hold (the one a promoted master left, served
        again by a fenced master or a replacement) is caught up and admitted."""
        replicas = self.replica_set
        try:
            slave = RoleId.from_owner(message.broker)
        except ValueError:
            slave = None
        if (
            replicas is None
            or slave is None
            or slave not in self.id.slaves(self.topology.cluster(self.cluster))
        ):
            raise DeadLetter(f"beat from {message.broker!r}, not a slave of {self.id}")
        watch = self._slave_watch(slave)
        if watch.stale(message.lease):
            return  # sent before its connection closed: no sign of life
        serving, effects = self.supervision.beat(slave.slave, message.reply_to, time.monotonic())
        await self._supervise(effects)
        if not serving:
            return  # a second process: no sign of life of the one serving the role
        if slave not in replicas.replicas:
            await replicas.admit(slave, message.version)
            if self.beater is not None:
                self.beater.add(self.control_of(slave))
            if slave == self.promoted_from and self._former_control is not None:
                # its slave is served again: its control queue is that slave's
                client = await self.client_for(self.cluster)
                with contextlib.suppress(Exception):
                    await client.cancel(self._former_control)
                self._former_control = None
        self.slave_heard(slave.slave)
        if message.lease is not None:
            await watch.named(message.lease)

    async def _supervise(self, effects: list[SupervisionEffect]) -> None:
        """Perform what the supervision machine returned (supervision.py)."""
        for effect in effects:
            if isinstance(effect, Note):
                log.warning("%s: %s", self.id, effect.text.format(slave=self._slave(effect.slave)))
            elif isinstance(effect, RetireProcess):
                self.count("retires_sent")
                retire = Retire(
                    broker=self.id.owner,
                    slave=self._slave(effect.slave).owner,
                    epoch=self.reign.epoch,
                    by=self.reign.by,
                )
                await self.tell(effect.process, retire)
            elif isinstance(effect, After):
                self._after(effect)
            else:
                self._background(self._replacement(effect))

    def _slave(self, number: int) -> RoleId:
        return next(
            r for r in self.id.slaves(self.topology.cluster(self.cluster)) if r.slave == number
        )

    def _after(self, effect: After) -> None:
        def fire() -> None:
            now = time.monotonic()
            alive = effect.slave in self.live.alive(now)
            self._background(self._supervise(self.supervision.timer(effect.slave, alive, now)))

        asyncio.get_running_loop().call_later(effect.delay_s, fire)

    def _background(self, work: Awaitable[Any]) -> None:
        """Run ``work`` beside serving (stores, recoveries, replacements), held until it
        ends."""
        task = asyncio.ensure_future(work)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)

    async def _replacement(self, effect: Provision) -> None:
        """Ask the provisioner for a process serving the slave; tell the machine."""
        slave = self._slave(effect.slave)
        started = None
        assert self.provisioner is not None  # the machine asks only where one is
        try:
            started = await asyncio.to_thread(self.provisioner.start, slave)
        except Exception as exc:  # a provisioner's failure is not the master's
            log.warning("%s: no replacement for %s: %s", self.id, slave, exc)
        else:
            if started is None:
                log.info("%s: %s %s; nothing to start", self.id, slave, effect.why)
            else:
                self.count("replacements")
                log.warning(
                    "%s: %s %s: replacement started (%s)", self.id, slave, effect.why, started
                )
        await self._supervise(self.supervision.provisioned(effect.slave, started is not None))

    def _slave_watch(self, slave: RoleId) -> LeaseWatch:
        watch = self.slave_watches.get(slave.slave)
        if watch is None:

            async def lost() -> None:
                await self._slave_lease_returned(slave)

            watch = self.slave_watches[slave.slave] = LeaseWatch(
                self.topology.prefix,
                lambda: self.client_for(self.cluster),
                lost,
                name=str(slave),
            )
        return watch

    async def _slave_lease_returned(self, slave: RoleId) -> None:
        """A slave's process died: no more dispatch to it, and a replacement now."""
        self.live.lost(slave.slave)
        self.count("slave_lease_returned")
        log.warning("%s: lease of %s returned (its connection closed)", self.id, slave)
        await self._supervise(self.supervision.lease_returned(slave.slave))

    @property
    def replica_set(self) -> _ReplicaSet | None:
        """A master's replicas of the table its slaves hold (None for a slave)."""
        replicas = getattr(self, "replicas", None)
        return replicas if isinstance(replicas, _ReplicaSet) else None

    def slave_heard(self, slave: int) -> None:
        """A slave's beat or load report arrived."""
        now = time.monotonic()
        self.live.watch([slave], now)
        self.live.heard(slave, now)
        self.supervision.heard(slave)

    async def replace_silent(self, now: float) -> None:
        """Every beat interval: a replacement for every slave silent past the rule."""
        silences = {
            slave.slave: self.live.silent_for(slave.slave, now)
            for slave in self.id.slaves(self.topology.cluster(self.cluster))
        }
        await self._supervise(self.supervision.silences(silences, self.live.timeout_s, now))

    async def _on_late_vote(self, message: Vote) -> None:
        """A slave still electing after this master took over: tell it who won."""
        if self.id.is_slave:  # slaves have their own handler; this is a master's
            raise DeadLetter(f"vote at master-only handler of {self.id}")
        if message.kind is not Kind.ELECTION or self.promoted_from is None:
            self.count("late_votes")
            return
        with contextlib.suppress(ValueError):
            sender = RoleId.from_owner(message.broker)
            if sender in self.id.slaves(self.topology.cluster(self.cluster)):
                coordinator = Vote(
                    kind=Kind.COORDINATOR,
                    broker=self.promoted_from.owner,
                    epoch=self.reign.epoch,
                    by=self.reign.by,
                )
                await self.signal(sender, coordinator)

    async def _on_fence(self, message: Fence) -> None:
        """A slave trusts a newer reign than this master's: step down to the slave role
        this process left when it took over, or (the master as started) the one the newer
        master left.  An older or equal reign, or one no slave can have, changes nothing
        (``fencing.fenced`` decides)."""
        reign = Reign(message.epoch, message.by)
        if self.id.is_slave:
            raise DeadLetter(f"fence from {message.broker!r} of {reign}: not for {self.id}")
        await self._rival(fenced(self.reign, reign, **self._lineage()), message.broker)

    def _lineage(self) -> dict[str, Any]:
        """What the fencing decisions need of this master: the slave it was, its slaves."""
        spec = self.topology.cluster(self.cluster)
        return {
            "promoted_from": None if self.promoted_from is None else self.promoted_from.slave,
            "slaves": frozenset(r.slave for r in self.id.slaves(spec)),
        }

    async def _rival(self, outcome: RivalOutcome, sender: str) -> None:
        """Perform a fencing decision (recovery/fencing.py)."""
        if isinstance(outcome, SendFence):
            self.count("fences_sent")
            fence = Fence(broker=self.id.owner, epoch=outcome.reign.epoch, by=outcome.reign.by)
            await self.tell(outcome.to, fence)
        elif isinstance(outcome, Refused):
            raise DeadLetter(f"{outcome.why} from {sender!r}: not for {self.id}")
        elif isinstance(outcome, Stale):
            self.count("stale_fences")
        elif isinstance(outcome, StepDown) and self.switch_to is None:  # else told twice
            back = self.promoted_from or self._slave(outcome.slave)
            log.warning(
                "%s (%s) fenced by %s, which trusts %s: stepping down to %s",
                self.id,
                self.reign,
                sender,
                outcome.reign,
                back,
            )
            self.count("fenced")
            self.fenced = True
            self.switch_to, self.reign = back, outcome.reign  # the slave trusts it
            if self._stop is not None:
                self._stop.set()

    async def _configure(self, message: Configure, control: str) -> None:
        """Switch the mechanisms live (``outer`` for routers, ``inner`` for match masters)
        and how many messages a batch may carry (``batch_max``); the topology file is not
        changed, so a restart goes back to it."""
        switches = {k: v for k, v in message.switches.items() if k in SWITCHES}
        try:
            self.topology = PhoenixTopology.model_validate(
                {**self.topology.model_dump(), **switches}, strict=True
            )
        except ValidationError as exc:
            raise DeadLetter(f"configure: {exc.errors(include_url=False)}") from None
        self.batcher.max_messages = self.topology.batch_max
        self.reconfigured()
        self.count("configured")
        log.info("%s of %s configured live: %s", self.role, self.cluster, switches)
        if message.reply_to:  # the operator's own queue: published to, never declared here
            reply = Answer(request=message.request, broker=control)
            client = await self.client_for(self.cluster)
            with contextlib.suppress(Unroutable):  # the operator gave up and left
                await client.publish(outgoing(reply, message.reply_to))

    def reconfigured(self) -> None:
        """The switches changed (``self.topology`` is a new object): logic that holds the
        topology takes the new one."""


#: what ``qosmq phoenix configure`` may switch live on the running masters
SWITCHES = ("outer", "inner", "blind_dispatch", "batch_max")


class ReplicaTimeout(RetryableError, TimeoutError):
    """A replica write was given up before W of N replicas acknowledged it."""


class _ReplicaSet:
    """The driver of a master's replicated table (``replicas.ReplicaLog`` decides): its
    own store plus one replica per slave (over RabbitMQ).

    ``write`` persists locally and sends the versioned entry to every slave; the
    entry counts as written once W of N acknowledged it (the future resolves then).
    ``read`` asks the slaves for snapshots and merges R of N replies, newest version
    per key, repairing the master's own copy.  ``persist_loop`` also writes the whole
    table to the store periodically (besides every change), off the event loop.
    """

    PAGE = 5000

    def __init__(self, role: _Role, store: StateStore, kind: str) -> None:
        self.role, self.store, self.kind, self.owner = role, store, kind, role.id.owner
        spec = role.topology.cluster(role.cluster)
        self.log = ReplicaLog(
            owner=self.owner,
            kind=kind,
            # the slaves the topology gives this master, less the one it was promoted from
            replicas=[r for r in role.id.slaves(spec) if r != role.promoted_from],
            # N as the topology has it: a promoted master's read still needs R of those N
            n=len(role.id.slaves(spec)) + 1,
            # where acks and snapshots come back: this process's own queue, not the
            # master's control queue, which a frozen master replaced by this one may
            # still consume
            reply_to=role.connections.process_queue,
        )
        self.written: dict[int, asyncio.Future[None]] = {}  # versions waiting for W
        self._reads: dict[str, asyncio.Event] = {}
        self._dirty = False

    @property
    def entries(self) -> dict[str, tuple[int, dict[str, Any]]]:
        return self.log.entries

    async def _apply(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Persist):
                # in a thread: the store may be busy (a snapshot, another process's
                # transaction), and the loop goes on meanwhile; stores keep the newest
                # version whatever the order
                await asyncio.to_thread(
                    self.store.save,
                    self.owner,
                    self.kind,
                    effect.key,
                    effect.document,
                    effect.version,
                )
                self._dirty = True
            elif isinstance(effect, ToReplica):  # ahead of any event backlog in its inbox
                inbox = self.role.inbox_of(effect.replica)
                await self.role.send(self.role.cluster, inbox, effect.message, MAX_PRIORITY)
            else:
                self._resolve(effect)

    def _resolve(self, effect: Written | GaveUp) -> None:
        future = self.written.pop(effect.version, None)
        if isinstance(effect, Written):
            self.role.count("replicated")
            if future is not None and not future.done():
                future.set_result(None)
            return
        self.role.count("unacknowledged")
        if future is not None and not future.done():
            future.set_exception(ReplicaTimeout(f"{self.owner}: entry v{effect.version} below W"))
            future.exception()  # retrieved: nobody has to await it

    async def persist_once(self) -> bool:
        """Snapshot the table to the store (in a thread); False when nothing changed."""
        if not self._dirty:
            return False
        self._dirty = False
        copy = dict(self.entries)
        await asyncio.to_thread(self.store.snapshot, self.owner, self.kind, copy)
        for key, (version, document) in list(self.entries.items()):  # changed meanwhile
            if copy.get(key, (None, None))[0] != version:
                await asyncio.to_thread(
                    self.store.save, self.owner, self.kind, key, document, version
                )
        self.role.count("snapshots")
        return True

    async def persisting(self, serving: Awaitable[None], stop: asyncio.Event) -> None:
        """Run a master's ``serving`` with the periodic snapshots beside it; close the store."""
        persist = asyncio.create_task(
            self.persist_loop(self.role.topology.persist_interval_s, stop)
        )
        try:
            await serving
        finally:
            stop.set()  # ends the persist loop after one last snapshot
            await persist
            self.store.close()

    async def persist_loop(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            try:
                await self.persist_once()
            except Exception as exc:
                log.warning("%s: periodic snapshot failed: %s", self.owner, exc)

    async def read(self, timeout_s: float) -> dict[str, tuple[int, dict[str, Any]]]:
        own = self.store.load(self.owner, self.kind)
        promoted = self.role.promoted_from
        # the replica it held as a slave is the read's first reply, with the master's
        # own copy (if this store has one) merged in
        held = self.store.load(promoted.owner, self.kind) if promoted is not None else None
        request = uuid.uuid4().hex
        changed = self._reads[request] = asyncio.Event()
        try:
            await self._apply(self.log.begin_read(request, own, held))
            async with asyncio.timeout(timeout_s):
                while not self.log.complete(request):
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            pass
        finally:
            del self._reads[request]
        result = self.log.finish_read(request, own)
        if result.degraded:
            self.role.count("degraded_reads")
            log.warning(
                "%s: read quorum R=%d not reached in %.0f s (%d replies); "
                "starting from what answered",
                self.owner,
                self.log.quorum.read,
                timeout_s,
                result.replies,
            )
        for repair in result.repairs:  # read repair of the master's copy
            self.store.save(self.owner, self.kind, repair.key, repair.document, repair.version)
            self.role.count("read_repairs")
        return result.entries

    async def adopt(self, documents: dict[str, dict[str, Any]]) -> None:
        """Entries taken over from a departed cluster: this master's own from now on,
        persisted in one snapshot (a leave may bring 200 000 of them: one write and one
        replication round each would hold the master for minutes).  They are not
        replicated to its slaves: a slave promoted later reads them back from this
        master's persisted copy (``read``), which a store shared by the host holds."""
        self.log.adopt(documents)
        self._dirty = True
        await self.persist_once()

    async def write(self, key: str, document: dict[str, Any] | None) -> asyncio.Future[None]:
        """Persist and replicate one entry (None: delete, as a tombstone); the future
        resolves once W of N replicas hold it."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        version, effects = self.log.write(key, document)
        self.written[version] = written
        await self._apply(effects)
        return written

    async def admit(self, slave: RoleId, held: int | None) -> None:
        """Replicate to ``slave`` from now on, after sending it the whole table, ahead of
        any event in its inbox."""
        log.warning(
            "%s: admitting %s (it holds up to v%s): %d entries to catch up",
            self.owner,
            slave,
            held,
            len(self.entries),
        )
        await self._apply(self.log.admit(slave))
        self.role.count("slaves_admitted")

    @property
    def replicas(self) -> list[RoleId]:
        return self.log.replicas

    def slave(self, message: Heartbeat | Ack | Snapshot) -> int:
        """The slave number of the sender (``DeadLetter`` for one not in the set)."""
        return self.log.sender(message).slave

    async def on_ack(self, message: Ack) -> None:
        for effect in self.log.on_ack(message):
            self._resolve(effect)

    async def on_snapshot(self, message: Snapshot) -> None:
        if self.log.page(message):
            changed = self._reads.get(message.request)
            if changed is not None:
                changed.set()

    def handlers(self) -> dict[type, Handler]:
        """The master's control-queue handlers for its replicas' answers."""
        return {Ack: self.on_ack, Snapshot: self.on_snapshot}


class _ReplicaHolder(_Role):
    """A slave's side of a replica set: store entries, acknowledge, answer reads; watch
    the master's beats and, when they stop, elect with the other slaves who takes over."""

    replica_owner = ""
    master_control = ""
    store: StateStore
    #: the master watched and elected against (follower.py), from the first look on
    follower: Follower | None = None

    @functools.cached_property
    def trust(self) -> Trust:
        """Which reign of its master this slave follows (recovery/fencing.py)."""
        return Trust(self.reign)

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {
            **super().control_handlers,
            Beat: self._on_beat,
            Vote: self._on_vote,
            Retire: self._on_retire,
        }

    async def _on_retire(self, message: Retire) -> None:
        """Its master hears another process beating as this slave, the one it counts as
        serving the role: this process stops (a clean stop: its lease is given back, so
        nobody elects or replaces).  From another sender, for another role or from an
        older reign than the one it trusts: dead-lettered, nothing stops."""
        if message.broker != self.id.master.owner or message.slave != self.id.owner:
            raise DeadLetter(
                f"retire of {message.slave!r} from {message.broker!r}: not {self.id}'s master"
            )
        if Reign(message.epoch, message.by) < self.trust.reign:
            raise DeadLetter(f"retire from an older reign of {message.broker!r}: stale")
        if self._stop is None or self.switch_to is not None:
            return
        log.warning(
            "%s: retired by %s: another process serves this role now; stopping",
            self.id,
            message.broker,
        )
        self.count("retired")
        self.retired = True
        self._stop.set()

    held_version = 0  # the newest replica entry it stored

    def _beat(self) -> Beat:
        """What this slave's beats to its master say (read by the beat thread each time)."""
        reign = self.trust.reign
        return Beat(
            broker=self.id.owner,
            epoch=reign.epoch,
            by=reign.by,
            version=self.held_version,
            reply_to=self.connections.process_queue,  # who it is: no reply is sent
        )

    @functools.cached_property
    def master_watch(self) -> LeaseWatch:
        """The master's lease as this slave watches it (beats.py)."""
        return LeaseWatch(
            self.topology.prefix,
            lambda: self.client_for(self.cluster),
            self._master_lost,
            name=str(self.id.master),
        )

    async def recovery(self, stop: asyncio.Event) -> None:
        try:
            await self.beating(
                [self.master_control],
                self._beat,
                self._watch_master(stop),
                self.topology.slave_beat_interval_s,
            )
        finally:
            await self.master_watch.stop()

    async def _master_lost(self) -> None:
        """The master's connection closed: it is gone (a frozen master keeps it)."""
        if self.follower is not None:
            await self._follow(self.follower.lease_returned(time.monotonic()))

    async def _watch_master(self, stop: asyncio.Event) -> None:
        topology, master = self.topology, self.id.master
        interval = topology.heartbeat_interval_s
        self.follower = Follower(
            self.id,
            master.slaves(topology.cluster(self.cluster)),
            interval_s=interval,
            misses=topology.heartbeat_misses,
            ceiling_s=topology.suspect_ceiling_s,
            trust=self.trust,
            failed_at=self.failed_at,
        )
        step = interval / 2
        woke = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(step)
            now = time.monotonic()
            late, woke = now - woke - step, now
            await self._follow(self.follower.look(now, late))

    async def _follow(self, effects: list[FollowerEffect]) -> None:
        """Perform what the follower machine returned (follower.py)."""
        assert self.follower is not None
        master = self.id.master
        self.failed_at = self.follower.failed_at  # handed to the master it may become
        for effect in effects:
            if isinstance(effect, SignalVote):
                await self.signal(effect.to, self._vote(effect.kind, effect.reign))
            elif isinstance(effect, Suspected):
                if effect.by == "lease":
                    log.warning(
                        "%s: lease of %s returned (its connection closed): electing",
                        self.id,
                        master,
                    )
                    self.count("master_lease_returned")
                else:
                    log.warning(
                        "%s: no beat from %s for %.2f s: electing", self.id, master, effect.silent_s
                    )
                    self.count("master_suspected")
                RECOVERY_S.labels(self.cluster, master.kind.value, "detection").observe(
                    effect.silent_s
                )
            elif isinstance(effect, Elected):
                RECOVERY_S.labels(self.cluster, master.kind.value, "election").observe(
                    effect.took_s
                )
            elif isinstance(effect, Promote):
                self.next_reign = effect.reign
                self._promote(effect.why)
            elif isinstance(effect, FenceMaster):
                fence = Fence(broker=self.id.owner, epoch=effect.reign.epoch, by=effect.reign.by)
                await self.tell(effect.to, fence)
            elif isinstance(effect, Counted):
                self.count(effect.name)
            elif isinstance(effect, Leader):
                log.warning("%s: %s serves %s now", self.id, effect.slave, master)
            elif isinstance(effect, NameLease):
                await self.master_watch.named(effect.lease)
            else:
                raise DeadLetter(effect.why)

    async def _take_over(self, message: Takeover) -> None:
        """The operator's take-over: as an election's winner, tell the other slaves
        first, so none of them elects against this one once the old master is silent."""
        await super()._take_over(message)
        if self.switch_to is None:
            return
        if self.follower is None:
            self._winning_reign()
            return
        effects = self.follower.take_over()
        self.next_reign = self.follower.next_reign
        await self._follow(effects)

    def _winning_reign(self) -> Reign:
        if self.follower is not None:
            self.next_reign = self.follower.winning_reign()
        elif self.next_reign is None:
            self.next_reign = self.trust.successor(self.id.slave)
        return self.next_reign

    def _vote(self, kind: Kind, reign: Reign | None = None) -> Vote:
        if kind is not Kind.COORDINATOR:
            return Vote(kind=kind, broker=self.id.owner)
        reign = reign or self._winning_reign()
        return Vote(kind=kind, broker=self.id.owner, epoch=reign.epoch, by=reign.by)

    def _promote(self, why: str) -> None:
        if self.switch_to is not None:
            return
        self._winning_reign()
        self.switch_to = self.id.master
        self.count("takeovers")
        log.warning("%s taking over %s (%s)", self.id, self.switch_to, why)
        if self._stop is not None:
            self._stop.set()

    async def _on_beat(self, message: Beat) -> None:
        if self.follower is None:
            return
        effects = self.follower.beat(
            message.broker,
            Reign(message.epoch, message.by),
            message.reply_to,
            message.lease,
            stale=self.master_watch.stale(message.lease),
            now=time.monotonic(),
        )
        await self._follow(effects)

    async def _on_vote(self, message: Vote) -> None:
        if self.follower is None:
            return
        effects = self.follower.vote(
            message.broker, message.kind, Reign(message.epoch, message.by), time.monotonic()
        )
        await self._follow(effects)

    def apply(self, key: str, document: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        return self.replica_handlers()

    def replica_handlers(self) -> dict[type, Handler]:
        """A slave's inbox handlers for its master's replication."""
        return {Replicate: self._store_entry, Read: self._read}

    async def _store_entry(self, message: Replicate) -> None:
        await asyncio.to_thread(
            self.store.save,
            self.replica_owner,
            message.state_kind,
            message.key,
            message.table,
            message.version,
        )
        self.held_version = max(self.held_version, message.version)
        self.apply(message.key, message.table)
        self.count("replicas")
        await self.send(
            self.cluster,
            message.reply_to or self.master_control,  # to the master that wrote it
            Ack(key=message.key, version=message.version, broker=self.replica_owner),
        )

    async def _read(self, message: Read) -> None:
        with heap.paused():  # a second copy of the table, no cycles: heap.py
            await self._answer_read(message)
        self.count("reads_answered")

    async def _answer_read(self, message: Read) -> None:
        await self.answer_read(self.store, self.replica_owner, message)


class RouterMaster(_Role):
    """Forwards along the ring; at the owner, hands over to a match master.

    Its routing table (latencyMap entries) is replicated to the routing slaves
    (W of N acks) and read back from R of N replicas when it starts.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.id = RoleId.router(self.cluster)
        self.store = open_store(self.topology.state_store)
        self.replicas = _ReplicaSet(self, self.store, "routing_table")
        self.ring = ChordRing(
            c.id for c in self.topology.clusters if c.joined or c.id == self.cluster
        )
        self.logic = RouterLogic(self.cluster, self.topology, self.ring)
        self.latency = self.logic.latency
        self.detours = Detours(
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

    async def _on_join(self, message: Join) -> None:
        await self._join(message.cluster)

    async def _route(self, message: RoutedMessage, *, held: bool = True) -> None:
        """``RouterLogic`` decides; this writes the latencyMap entries it names, waits
        for an arc being restored, and sends (again, when a next hop left meanwhile)."""
        if message.via:  # on a detour: pass it on toward the next hop of its path
            await self._relay(message)
            return
        if isinstance(message, Publish) and message.entered_at is None:
            message = message.model_copy(update={"entered_at": time.time()})  # its entry
        writes, forwarded = self.logic.accept(message)
        for write in writes:
            entry = None if write.entry is None else write.entry.to_document()
            await self.replicas.write(write.event_type, entry)
        if forwarded is None:
            if not writes:
                self.count("duplicates_dropped")
            return
        while True:
            step = self.logic.step(forwarded)
            if isinstance(step, Forward):
                self.count("forwarded")
                path = await self.detours.forward(step.cluster, step.message, step.priority)
                if path:
                    # the clusters it passes: if one leaves, so may the event (in its inbox)
                    through = {*path, *self.ring.route(step.cluster, forwarded.event_type)}
                    owner = self.ring.owner(forwarded.event_type)
                    if self.kept.keep(forwarded, owner, time.monotonic(), through=through):
                        self.count("kept_until_matched")
                    return
                self.count("rerouted")  # the next hop left the ring meanwhile: route again
            elif not held or not await self._taken_over(forwarded.event_type):
                break  # (after waiting for an arc's restore: its plan routes it, ask again)
        self.count("routed")
        match = self.inbox_of(RoleId.match(self.cluster, step.index))
        await self.send(self.cluster, match, step.message, step.priority)

    async def _on_matched(self, message: Matched) -> None:
        if message.by not in {c.id for c in self.topology.clusters}:
            raise DeadLetter(f"matched: cluster {message.by!r} is not in the topology")
        self.kept.matched(message.ids)

    def _route_kept(self, cluster: str) -> None:
        """``cluster`` left: what this router kept for it is routed again (``KeptEvents``)."""
        again = self.kept.left(cluster)
        if not again:
            return
        self.count("rerouted_after_leave", len(again))
        log.warning("%s: %d events kept for %s routed again", self.id, len(again), cluster)

        async def route_again() -> None:
            for message in again:
                try:
                    await self._route(message)
                except Exception as exc:  # one that cannot go is said, the others go on
                    log.warning("%s: event %s not routed again: %s", self.id, message.id, exc)

        self._background(route_again())

    async def _on_copy(self, message: Copy) -> None:
        """A copy for a subscriber queue: put it in the queue when its home is this
        cluster, else carry it toward the home's routing master (over a detour when the
        direct link failed, as routed events are).  Acked only once it is on."""
        if message.via:
            await self._relay(message)
            return
        if message.home == self.cluster:
            body = encode(message.publish)
            result = await self.copies.put(
                message.home,
                message.queue,
                message.confirm,
                body,
                message.copy_id,
                local=True,
                content=event_content(message.publish.event.model_dump_json()),
            )
            self.count(f"carried_copies_{result.outcome.value}")
            return
        self.count("copies_carried")
        if message.unreachable and not message.hops:  # from a match broker of this cluster
            self.detours.reported_down(message.home)
        onward = message.model_copy(update={"hops": [self.cluster]})
        if not await self.detours.forward(message.home, onward, message.priority):
            maybe = message.unreachable or message.publish.again
            raise DeadLetter(
                f"{HOME_LEFT}: {message.queue} (cluster {message.home})"
                + (f"; {MAYBE_DELIVERED}" if maybe else "")
            )

    async def _relay(self, message: RoutedMessage | Copy) -> None:
        step = self.logic.relay(message)
        if not isinstance(step, Forward):  # a path naming this cluster again: on from here
            if isinstance(step, Copy):
                await self._on_copy(step)
            else:
                await self._route(step)
            return
        self.count("relayed")
        if not await self.detours.forward(step.cluster, step.message, step.priority):
            self.count("rerouted")  # the hop left the ring: the ring goes on from here
            again = message.model_copy(update={"via": []})
            if isinstance(again, Copy):
                await self._on_copy(again)
            else:
                await self._route(again)

    async def _taken_over(self, event_type: str) -> bool:
        """An event type of an arc this router took over from a departed cluster waits
        until its match masters restored that arc's subscriptions (the paper's buffer:
        the waiting handlers and the inbox behind them); whether it waited."""
        holds = list(self._recovering.values())
        if self._joining is not None:
            holds.append(self._joining)
        for arc, restored in holds:
            if not restored.is_set() and arc.covers(event_type):
                self.count("held_for_recovery")
                await restored.wait()
                return True
        return False

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
        """No flood reached ``cluster`` for ``leave_after_s``: tell every other routing
        master (one bounded try each: one that misses it finds out by itself), then act."""
        message = Leave(cluster=cluster, by=self.cluster)
        for other in self.ring.clusters:
            if other in (cluster, self.cluster):
                continue
            try:
                await asyncio.wait_for(
                    self.send(other, self.control_of(RoleId.router(other)), message, MAX_PRIORITY),
                    2 * self.topology.link_timeout_s,
                )
            except LINK_ERRORS as exc:
                log.warning("%s: could not tell %s that %s left: %s", self.id, other, cluster, exc)
        await self._leave(cluster, self.cluster)

    async def _on_leave(self, message: Leave) -> None:
        await self._leave(message.cluster, message.by)

    def _departure(self, cluster: str) -> tuple[Arc, str]:
        """The arc ``cluster`` owns and who would take it over."""
        start = ring_id(self.ring.predecessor(cluster))
        return Arc(cluster, cluster, start, ring_id(cluster)), self.ring.successors(cluster, 1)[0]

    async def _suspect(self, cluster: str) -> None:
        """A flood for ``cluster`` found no way: its successor's match masters read its
        subscriptions now (prepare), so that a leave declared ``leave_after_s`` later
        finds them read.  One bounded try each; a miss only costs the leave that time."""
        if cluster not in self.ring.clusters or len(self.ring) < 3:
            return
        arc, successor = self._departure(cluster)
        plan = await self._plan(cluster, successor)
        for restore in plan.restores:
            if restore.master.is_added(self.topology):
                continue  # not started yet: it reads when the leave's RECOVER comes
            ask = Recover(
                cluster=cluster,
                arc=(arc.start, arc.end),
                masters=plan.departed_masters,
                request=f"prepare-{uuid.uuid4().hex}",
                reply_to=self.connections.process_queue,
                prepare=True,
                owners=list(restore.owners),
                routed_over=plan.masters,
            )
            queue = self.control_of(restore.master)
            try:
                await asyncio.wait_for(
                    self.send(successor, queue, ask, MAX_PRIORITY), 2 * self.topology.link_timeout_s
                )
            except LINK_ERRORS as exc:
                log.info("%s: prepare for %s not sent to %s: %s", self.id, cluster, queue, exc)
        self.count("suspected")

    async def _leave(self, cluster: str, by: str) -> None:
        """``cluster`` left: drop it from the ring; this cluster's match roles stop
        delivering to its subscribers (dead-lettered with why); the successor's match
        masters restore its arc from the persisted state."""
        if not self._ring_applied.is_set():
            self._background(self._leave_when_ring_applied(cluster, by))
            return
        if cluster == self.cluster or cluster not in self.ring.clusters or len(self.ring) < 2:
            return
        arc, _ = self._departure(cluster)
        successor = self.ring.leave(cluster)
        self._record_ring_change(cluster, "left")
        if successor == self.cluster:  # before anything awaits: the arc's events wait
            self._recovering[cluster] = (arc, asyncio.Event())
            started = self.takeover.left(cluster, uuid.uuid4().hex, time.monotonic())
            self._background(self._take_over_arc(started))
        self.detours.left(cluster)
        self._route_kept(cluster)
        self.count("leaves")
        log.warning("%s left the ring (found by %s); its arc goes to %s", cluster, by, successor)
        told = Leave(cluster=cluster, by=by)
        for role in self._match_roles():
            await self.send(self.cluster, self.control_of(role), told, MAX_PRIORITY)

    async def _leave_when_ring_applied(self, cluster: str, by: str) -> None:
        await self._ring_applied.wait()
        await self._leave(cluster, by)

    async def _restore_routing_table(self, cluster: str, arc: Arc) -> dict[str, dict[str, Any]]:
        """RECOVERY(RT): the departed router's latencyMap entries of its arc, from the
        persisted state.  As the owner it had counted every subscription of those types
        (each passed it last), so its entry replaces whatever this router counted."""
        owner = RoleId.router(cluster).owner
        table = await asyncio.to_thread(self.replicas.store.load, owner, "routing_table")
        taken: dict[str, dict[str, Any]] = {}
        for event_type, (_, doc) in live(table).items():
            try:
                entry = LatencyEntry.from_document(doc)
            except RecordError:
                continue  # an entry an older version kept: its subscriptions still match
            if arc.covers(event_type) and entry.count > 0:
                self.latency.entries[event_type] = (entry.level_sum, entry.count)
                taken[event_type] = entry.to_document()
        self.count("routing_entries_restored", len(taken))
        log.info("%s: %d routing-table entries of %s restored", self.cluster, len(taken), cluster)
        return taken

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
        plan: CapacityPlan = effect.plan
        arc = self._recovering[effect.cluster][0]
        for restore in plan.restores:
            ask = Recover(
                cluster=effect.cluster,
                arc=(arc.start, arc.end),
                masters=plan.departed_masters,
                request=effect.request,
                reply_to=self.connections.process_queue,
                owners=list(restore.owners),
                routed_over=plan.masters,
            )
            await self.send(self.cluster, self.control_of(restore.master), ask, MAX_PRIORITY)

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
                if effect.after_s:
                    again: list[HandBackEffect] = [dataclasses.replace(effect, after_s=0.0)]
                    self._after_hand_back(effect.after_s, functools.partial(list, again))
                    continue
                done = HandedOver(cluster=effect.cluster, by=self.cluster, count=effect.count)
                try:
                    await self.send(
                        effect.cluster, self.control_of(RoleId.router(effect.cluster)), done
                    )
                except MiddlewareError as exc:
                    await self._hand_back(
                        self.hand_back.tell_failed(effect.request, str(exc), time.monotonic())
                    )
                    continue
                log.info(
                    "%s: %d subscriptions of %s's arc handed over",
                    self.id,
                    effect.count,
                    effect.cluster,
                )
                await self._hand_back(self.hand_back.told(effect.request))
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


class RouterSlave(_ReplicaHolder):
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


class _MatchBroker(_Role):
    """Matching and delivery shared by match masters and match slaves."""

    HEARTBEAT_S = 0.5
    observes_inbox = True

    def __init__(self, *, index: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.id = RoleId.match(self.cluster, index)  # a slave's is set by MatchSlave
        self.owner = self.id.owner  # subscriptions are the master's
        self.registry = Registry(self.cluster)  # records, indexed; where matches go
        self.predictor = QueuePredictor(window_s=self.HEARTBEAT_S)
        self.copies = CopySender(topology=self.topology, client_for=self.client_for)
        #: clusters that left the ring: deliveries to their subscribers are dead-lettered
        self.departed: set[str] = set()
        #: ids of events matched here, by the cluster they entered the ring at, until
        #: the next ``Matched`` to that cluster's router goes (every ``MATCHED_EVERY_S``)
        self._matched: dict[str, list[str]] = {}
        self._receipts: set[asyncio.Future[None]] = set()

    def index_type(self, event_type: str, limit: int | None = None) -> None:
        """Index the restored subscriptions of one type (match masters restore them),
        at most ``limit`` of them (None: all)."""
        for refused in self.registry.index_some(event_type, limit):
            log.warning("%s: restored subscription left out: %s", self.name, refused)
            self.count("refused")

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {**super().control_handlers, Leave: self._on_leave, Join: self._on_join_back}

    async def _on_join_back(self, message: Join) -> None:
        self.departed.discard(message.cluster)
        standby = getattr(self, "standby", None)
        if standby is not None:
            standby.pop(message.cluster, None)

    async def _on_leave(self, message: Leave) -> None:
        self.departed.add(message.cluster)
        log.warning(
            "%s: %s left the ring; its subscribers' deliveries dead-lettered",
            self.name,
            message.cluster,
        )

    def _held(self, sid: str, document: dict[str, Any]) -> bool:
        """Hold a stored or replicated subscription; one the registry cannot hold (kept
        by an older version) is logged and left out, never stopping the role."""
        refused = self.registry.hold(sid, document)
        if refused is not None:
            log.warning("%s: subscription %s left out: %s", self.name, sid, refused)
            self.count("refused")
        return refused is None

    MATCHED_EVERY_S = 0.02  # a Matched lost with its cluster: its events come twice

    async def _match(self, message: Publish) -> None:
        self.predictor.arrived(now=time.monotonic())
        if message.event_type in self.registry.unindexed:
            self.index_type(message.event_type)  # restored from a departed cluster
        try:
            matched = self.registry.match(message.event_type, message.event.attributes)
            self.count("matched", len(matched))
            HOPS.labels(self.cluster).observe(max(0, len(message.hops) - 1))
            try:
                if matched:
                    await self._deliver(message, matched)
            except DeadLetter:  # handled: the others' copies went out
                self._done(message)
                raise
            self._done(message)
        finally:
            self.predictor.completed(now=time.monotonic())

    def _done(self, message: Publish) -> None:
        """The event's copies are confirmed: tell the router it entered the ring at
        (another cluster's; it keeps the event until then), batched."""
        entry = message.hops[0] if message.hops else self.cluster
        if entry == self.cluster or message.id is None:
            return
        waiting = self._matched.setdefault(entry, [])
        waiting.append(message.id)
        if len(waiting) == 1:
            asyncio.get_running_loop().call_later(self.MATCHED_EVERY_S, self._send_matched, entry)

    def _send_matched(self, entry: str) -> None:
        ids = self._matched.pop(entry, [])
        if not ids:
            return

        async def send() -> None:
            router = self.control_of(RoleId.router(entry))
            for start in range(0, len(ids), 4096):
                matched = Matched(by=self.cluster, ids=ids[start : start + 4096])
                try:
                    await self.send(entry, router, matched, MAX_PRIORITY)
                except Exception as exc:  # the entry router keeps them a while longer
                    log.info("%s: matched receipts to %s not sent: %s", self.name, entry, exc)
                    return

        task = asyncio.ensure_future(send())
        self._receipts.add(task)
        task.add_done_callback(self._receipts.discard)

    async def _deliver(self, message: Publish, matched: set[str]) -> None:
        """One copy per subscriber queue, however many of its subscriptions matched, on
        the RabbitMQ of the subscriber's own cluster, each with its own outcome
        (``delivery.py``): a copy whose home cannot be reached now is handed to this
        cluster's routing master, which carries it there over the ring; one subscriber
        never costs another its copy."""
        stamped = message.model_copy(update={"broker": self.name})
        body = encode(stamped)
        copies = self.registry.copies(matched, self.departed)
        queues, gone = copies.queues, copies.departed
        content = event_content(message.event.model_dump_json()) if queues else None

        def copy_id(queue: str) -> str | None:
            # one id per (event, queue): a copy sent again (the event handled again after
            # a match master's death) is suppressed by the subscriber's filter
            return None if message.id is None else f"{message.id}:{_short(queue)}"

        with tracing.span(
            f"{message.event_type} match",
            {
                "qosmq.phoenix.broker": self.name,
                "qosmq.phoenix.matched": sorted(matched)[:50],
                "qosmq.phoenix.copies": len(queues),
            },
        ):
            outcomes = await asyncio.gather(
                *(
                    self.copies.put(home, queue, confirm, body, copy_id(queue), content=content)
                    for (home, queue), confirm in queues.items()
                )
            )
        for ((home, queue), confirm), result in zip(queues.items(), outcomes, strict=True):
            self.count(f"copies_{result.outcome.value}")
            if result.outcome is Outcome.GONE:
                log.warning("subscriber queue %s of cluster %s is gone", queue, home)
            elif result.outcome is Outcome.UNREACHABLE:
                carried = Copy(
                    event_type=message.event_type,
                    home=home,
                    queue=queue,
                    confirm="e2e" if confirm == "e2e" else "broker",
                    copy_id=copy_id(queue),
                    publish=stamped,
                    priority=message.priority,
                    unreachable=True,
                )
                # this cluster's own RabbitMQ: a failure here leaves the event unacked
                router = self.inbox_of(RoleId.router(self.cluster))
                await self.send(self.cluster, router, carried, message.priority)
                log.info(
                    "%s: copy for %s at %s carried by the ring (%s)",
                    self.name,
                    queue,
                    home,
                    result.reason,
                )
            if result.outcome in (Outcome.DELIVERED, Outcome.TAKEN):
                self.count("delivered")
        refusals = [r.reason for r in outcomes if r.outcome is Outcome.REFUSED]
        why = [f"{HOME_LEFT}: {', '.join(gone)}"] if gone else []
        if gone and message.again:  # the departed cluster may have delivered it first
            why[0] += f"; {MAYBE_DELIVERED}"
        if gone:
            self.count("home_departed", len(gone))
        if why or refusals:  # after the others' copies went out: kept with why
            raise DeadLetter("; ".join(why + refusals))

    @property
    def name(self) -> str:
        return self.id.owner

    async def finish(self) -> None:
        await self.copies.close()

    async def _observe(self, inbox: str, stop: asyncio.Event) -> None:
        """Every window: read the inbox backlog from the broker, close the predictor's
        window with it (q = the events waiting in the broker; the ones in progress are
        being served, several at a time, and do not delay a new one by a service time
        each), and ``report``."""
        while not stop.is_set():
            await asyncio.sleep(self.HEARTBEAT_S)
            try:
                client = await self.client_for(self.cluster)
                waiting = await client.queue_length(inbox)
                INBOX_LENGTH.labels(self.cluster, self.role, inbox).set(waiting)
                # the broker counts AMQP messages, and under load each carries a batch;
                # the events held here beyond the gate wait too
                amqp, messages = self.received
                backlog = waiting * (messages / amqp if amqp else 1.0) + self.gate.waiting
            except Exception as exc:
                log.info("could not read the backlog of %s: %s", inbox, exc)
                backlog = None
            self.received = [0, 0]
            t = self.predictor.close_window(time.monotonic(), backlog)
            PREDICTED_T.labels(self.cluster, self.name).set(t)
            try:
                await self.report(t)
            except Exception as exc:
                log.info("heartbeat of %s failed: %s", self.name, exc)

    async def report(self, t: float) -> None:
        """Masters keep their T; slaves send it to the master."""

    async def _serve_observed(self, stop: asyncio.Event) -> None:
        observe = asyncio.create_task(self._observe(self.inbox_of(self.id), stop))
        try:
            await self.serve(stop)
        finally:
            observe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observe


#: restored subscriptions: event type -> {subscription id: document}
Restorable = dict[str, dict[str, dict[str, Any]]]


def _restorable(
    store: StateStore, owners: list[str], arc: Arc, masters: int, index: int
) -> Restorable:
    """(In a thread) the subscriptions of ``owners`` in ``arc`` that the router sends to
    match master ``index`` of ``masters``: event type -> {sid: doc}."""
    by_type: Restorable = {}
    mine: dict[str, bool] = {}
    for owner in owners:
        for sid, (_, doc) in live(store.load(owner, "subscription")).items():
            event_type = doc.get("event_type")
            if not isinstance(event_type, str):
                continue
            if event_type not in mine:
                mine[event_type] = arc.covers(event_type) and ring_id(event_type) % masters == index
            if mine[event_type]:
                by_type.setdefault(event_type, {})[sid] = doc
    return by_type


def _subscription_record(message: Subscribe) -> SubscriptionRecord:
    return SubscriptionRecord(
        event_type=message.event_type,
        filter=message.filter,
        queue=message.queue,
        latency_level=message.latency_level,
        confirm=message.confirm,
        home=message.home,
        path=message.hops,  # the routing masters that counted its latency level
    )


class MatchMaster(_MatchBroker):
    """Keeps subscriptions (indexed, persisted, replicated to its slaves by quorum) and
    sends each event to the broker with the smallest predicted processing time T,
    itself included."""

    STANDBY_S = 60.0  # how long subscriptions read ahead for a suspected leave are kept
    INDEX_STEP = 256  # restored subscriptions indexed per event-loop turn in the background

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store = open_store(self.topology.state_store)
        self.dispatch = Dispatch()  # the slaves' load reports; predicted-T and blind choice
        self._confirming: set[asyncio.Task[None]] = set()  # subscribe confirmations in flight
        self.replicas = _ReplicaSet(self, self.store, "subscription")
        #: event types restored from a departed cluster: matched here, never dispatched
        #: (the restored subscriptions are not replicated to the slaves, see ``adopt``)
        self.local_types: set[str] = set()
        #: when this cluster last left the ring (``prepare``): see ``_matched_elsewhere``
        self.left_at: float | None = None
        #: departed clusters' subscriptions read ahead (a router suspected the departure),
        #: with the plan they were read for (``_restore_plan``)
        self.standby: dict[str, tuple[tuple[Any, ...], asyncio.Future[Restorable]]] = {}
        #: subscriptions of a departed cluster's arc removed here (id -> event type):
        #: its own persisted copy would match again at its rejoin, so the hand-over
        #: carries the removals too (in memory: a master replaced meanwhile forgets them)
        self.removed_adopted: dict[str, str] = {}

    async def run(self, stop: asyncio.Event) -> None:
        await self.replicas.persisting(self._serve_observed(stop), stop)

    async def prepare(self) -> None:
        for sid, (_, doc) in (await self.replicas.read(self.topology.read_timeout_s)).items():
            self._held(sid, doc)
        log.info("%s: %d subscriptions read back", self.owner, len(self.registry))
        self.left_at = await asyncio.to_thread(self._own_departure)
        if self.left_at is not None:
            log.warning(
                "%s: this cluster left the ring at %.3f: what its inbox held from before "
                "that and entered elsewhere was matched by its successor, and is dropped",
                self.owner,
                self.left_at,
            )

    def _own_departure(self) -> float | None:
        """When this cluster last left the ring, as the routers recorded it (None: it
        never did, or a new deployment forgot it)."""
        records = self.store.load(ring_owner(self.topology.prefix), "ring")
        _, record = records.get(self.cluster, (0, {}))
        if not isinstance(record, dict):
            return None
        at = record.get("at") if record.get("state") == "left" else record.get("left_at")
        return float(at) if isinstance(at, int | float) else None

    def _matched_elsewhere(self, message: Publish) -> bool:
        """An event from before this cluster left, that entered at another cluster: its
        entry router routed it again when this one left, and the successor matched it."""
        return (
            self.left_at is not None
            and message.entered_at is not None
            and message.entered_at < self.left_at
            and bool(message.hops)
            and message.hops[0] != self.cluster
        )

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {
            **super().control_handlers,
            **self.replicas.handlers(),
            Heartbeat: self._on_heartbeat,
            Recover: self._on_recover,
        }

    async def _on_recover(self, message: Recover) -> None:
        """RECOVERY: take the departed match masters' subscriptions of the arc that this
        cluster's router sends to this match master, read from the persisted state (or
        already read, when a router suspected the departure: ``prepare``), and answer at
        once: an event type is indexed when its first event comes (or by the background
        indexer, type after type, whichever is first); then they are written as this
        master's own."""
        plan = self._restore_plan(message)
        ready = self.standby.pop(message.cluster, None)
        reading = ready[1] if ready is not None and ready[0] == plan else None
        if reading is None:  # not read ahead, or for another plan (the ring changed)
            reading = self._read_departed(message)
        if message.prepare:  # keep it ready for the leave; forget it if none comes
            self.standby[message.cluster] = (plan, reading)
            loop = asyncio.get_running_loop()
            loop.call_later(self.STANDBY_S, self._forget_standby, message.cluster, reading)
            self.count("prepared")
            return
        with heap.paused():  # no cycles among them; the index task keeps it so (heap.py)
            await self._restore(message, reading)

    async def _restore(self, message: Recover, reading: asyncio.Future[Restorable]) -> None:
        try:
            by_type = await reading
        except Exception as exc:  # the read ahead failed: read now
            log.warning("%s: reading %s's state ahead failed (%s)", self.name, message.cluster, exc)
            by_type = await self._read_departed(message)
        self.departed.add(message.cluster)
        found, refused = self.registry.restore(by_type)
        self.local_types.update(by_type)
        for why in refused:
            log.warning("%s: restored subscription left out: %s", self.name, why)
        self.count("refused", len(refused))
        self.count("restored", len(found))
        await asyncio.to_thread(self._take_advertisements, message, set(by_type))
        log.warning("%s: %d subscriptions of %s restored", self.name, len(found), message.cluster)
        done = Recovered(request=message.request, broker=self.owner, restored=len(found))
        await self.send(self.cluster, message.reply_to, done, MAX_PRIORITY)
        task = asyncio.create_task(self._index_restored(found))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    def _restore_plan(self, message: Recover) -> tuple[tuple[str, ...], int, tuple[int, int]]:
        """What to read (the departed masters' store owners), over how many masters the
        arc is routed here, the arc; ``DeadLetter`` for owners not of the departed cluster."""
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
        masters = message.routed_over or self.topology.cluster(self.cluster).match_masters
        if self.index >= masters:
            raise DeadLetter(f"recover: arc routed over {masters} masters, this is {self.index}")
        return owners, masters, message.arc

    def _take_advertisements(self, message: Recover, types: set[str]) -> None:
        """(In a thread) the departed match masters' advertisements of the arc's types
        this master now holds, kept as its own."""
        arc = Arc(message.cluster, message.cluster, *message.arc)
        owners, masters, _ = self._restore_plan(message)
        for owner in owners:
            for event_type, (version, doc) in live(self.store.load(owner, "advertisement")).items():
                if event_type in types or (
                    arc.covers(event_type) and ring_id(event_type) % masters == self.index
                ):
                    self.store.save(self.owner, "advertisement", event_type, doc, version)

    def _read_departed(self, message: Recover) -> asyncio.Future[Restorable]:
        arc = Arc(message.cluster, message.cluster, *message.arc)
        owners, masters, _ = self._restore_plan(message)

        async def read() -> Restorable:
            # 200 000 documents, no cycles: without the pause, full collections of the
            # growing heap (0.3-1.2 s each, eight of them) doubled the read (heap.py)
            with heap.paused():
                return await asyncio.to_thread(
                    _restorable, self.store, list(owners), arc, masters, self.index
                )

        return asyncio.ensure_future(read())

    def _forget_standby(self, cluster: str, reading: asyncio.Future[Restorable]) -> None:
        if self.standby.get(cluster, (None, None))[1] is reading:
            del self.standby[cluster]
            self.count("prepared_unused")

    async def _index_restored(self, found: dict[str, dict[str, Any]]) -> None:
        """Index the restored types one by one between other work, then adopt them.
        Full collections stay off meanwhile and the tables are frozen after: with
        200 000 subscriptions each full collection took about a second, four of them
        between the leave and the arc served again (heap.py)."""
        started = time.monotonic()
        with heap.paused():
            while self.registry.unindexed:  # small steps: the arc's events go between
                self.index_type(next(iter(self.registry.unindexed)), self.INDEX_STEP)
                await asyncio.sleep(0)
            if self.settings.gc_freeze:
                heap.freeze(f"{self.name} after restoring")
        log.info(
            "%s: restored subscriptions indexed in %.2f s", self.name, time.monotonic() - started
        )
        await self.replicas.adopt(found)  # this master's own from now on

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        return {
            Handover: self._on_handover,
            Subscribe: self._on_subscribe,
            Unsubscribe: self._unsubscribe,
            Advertise: self._on_advertise,
            Publish: self._on_publish,
        }

    async def _on_heartbeat(self, message: Heartbeat) -> None:
        """A slave's load report (finite and not negative: the message's model says so)."""
        j = self.replicas.slave(message)
        if self.supervision.is_gone(j):
            # sent before its process died (it was in flight): only a beat of the
            # process serving the role now brings the role back into the live set
            self.count("stale_load_reports")
            return
        self.slave_heard(j)
        self.dispatch.reported(j, message.queue, message.service_rate, time.monotonic())

    async def _hand_over(self, joiner: str, arc: tuple[int, int]) -> int:
        """Send the subscriptions of the arc's event types to the joining cluster, and the
        removals of the arc this master remembers (joining.handover_plan)."""
        covers = Arc(joiner, self.cluster, *arc).covers
        plan = handover_plan(self.registry.in_arc(covers), self.removed_adopted, covers)
        # to its control queue: the joiner holds the arc's events in its inbox until
        # these are there (its ``handover_wait_s``)
        control = self.control_of(RoleId.router(joiner))
        for sid, record in plan.subscriptions:
            subscribe = Subscribe(
                subscription_id=sid,
                event_type=record.event_type,
                filter=record.filter,
                queue=record.queue,
                latency_level=record.latency_level,
                confirm=record.confirm,
                # deliveries still go home; the routers that counted its level so far
                # stay on its path, so an unsubscribe reaches them too
                home=record.homed(self.cluster),
                hops=record.path,
            )
            await self.send(joiner, control, subscribe)
            self.registry.remove(sid)
            await self.replicas.write(sid, None)
        for sid, event_type in plan.removals:
            removal = Unsubscribe(event_type=event_type, subscription_id=sid, handed_over=True)
            await self.send(joiner, control, removal)
            del self.removed_adopted[sid]
        self.count("handed_over", len(plan.subscriptions))
        self.count("removals_handed_over", len(plan.removals))
        return len(plan.subscriptions) + len(plan.removals)

    async def _on_handover(self, message: Handover) -> None:
        moved = await self._hand_over(message.cluster, message.arc)
        if message.reply_to and message.request:  # a router waits to retire this master
            done = Recovered(request=message.request, broker=self.owner, restored=moved)
            await self.send(self.cluster, message.reply_to, done, MAX_PRIORITY)

    async def _on_subscribe(self, message: Subscribe) -> None:
        record = _subscription_record(message)
        try:
            self.registry.add(message.subscription_id, record)
        except FilterError as exc:  # sent by something other than the layer's client
            self._confirm(message, None, {"error": str(exc), "refused": "filter"})
            raise DeadLetter(f"subscription {message.subscription_id}: {exc}") from None
        written = await self.replicas.write(message.subscription_id, record.to_document())
        await self._replicated(written)
        self._confirm(message, written, {})

    async def _on_advertise(self, message: Advertise) -> None:
        await asyncio.to_thread(
            self.store.save, self.owner, "advertisement", message.event_type, {}, 1
        )

    async def _on_publish(self, message: Publish) -> None:
        if self._matched_elsewhere(message):
            if not self.counters["dropped_after_rejoin"]:
                log.warning(
                    "%s: dropping events from before the departure (first: %s)",
                    self.owner,
                    message.id,
                )
            self.count("dropped_after_rejoin")
            return
        if message.event_type in self.local_types:  # its slaves do not hold them
            await self._match(message)
            return
        now = time.monotonic()
        live = self.live.alive(now)
        if self.topology.inner:
            target = self.dispatch.choose(self.predictor, live, now)
        else:
            target = self.dispatch.choose_blind(live, self.topology.blind_dispatch)
        if target is None:
            await self._match(message)
            return
        self.count("dispatched")
        started = time.monotonic()
        await self.send(
            self.cluster,
            self.inbox_of(RoleId.match_slave(self.cluster, self.index, target)),
            message,
            message.priority,
        )
        self.dispatch.dispatched(target, time.monotonic() - started)

    async def _unsubscribe(self, message: Unsubscribe) -> None:
        """Forget the subscription here and in the replicas (a tombstone), and tell the
        routing masters that counted its latency level to take it out of latencyMap."""
        sid = message.subscription_id
        record = self.registry.get(sid)
        if record is None or record.event_type != message.event_type:  # unknown here
            self._confirm(message, None, {"removed": False})
            return
        self.registry.remove(sid)
        written = await self.replicas.write(sid, None)
        await self._replicated(written)
        self.count("unsubscribed")
        if message.handed_over:  # removed at the previous owner, the routers told then
            return
        if record.event_type in self.local_types:
            self.removed_adopted[sid] = record.event_type
            while len(self.removed_adopted) > MAX_REMOVED_ADOPTED:
                del self.removed_adopted[next(iter(self.removed_adopted))]
        taken_out = Unsubscribed(event_type=record.event_type, latency_level=record.latency_level)
        for cluster in dict.fromkeys(record.path):
            if cluster in self.departed:  # a cluster that left counts nothing
                continue
            try:  # one router out of reach costs its count, not the unsubscribe
                await asyncio.wait_for(
                    self.send(
                        cluster, self.inbox_of(RoleId.router(cluster)), taken_out, MAX_PRIORITY
                    ),
                    self.topology.link_timeout_s,
                )
            except (MiddlewareError, TimeoutError) as exc:
                self.count("unsubscribed_not_told")
                log.warning(
                    "%s: %s's router not told of unsubscribe %s (its latency level stays "
                    "counted): %s",
                    self.name,
                    cluster,
                    sid,
                    exc,
                )
        self._confirm(message, written, {"removed": True})

    @staticmethod
    async def _replicated(written: asyncio.Future[None]) -> None:
        """The inbox delivery of an (un)subscribe is acked only once W of N replicas
        hold it: a master superseded while frozen never reaches W (its slaves follow its
        successor), steps down with the delivery unacked, and the successor handles it.
        A write given up below W is the client's to hear (``_confirm``)."""
        with contextlib.suppress(ReplicaTimeout):
            await asyncio.shield(written)

    def _confirm(
        self,
        message: Subscribe | Unsubscribe,
        written: asyncio.Future[None] | None,
        result: dict[str, Any],
    ) -> None:
        """Answer a client's (un)subscribe once W of N replicas hold it (``written``;
        None: nothing was written), if it asked; the inbox goes on meanwhile."""
        if message.reply_to:
            task = asyncio.create_task(self._confirm_written(message, written, result))
            self._confirming.add(task)
            task.add_done_callback(self._confirming.discard)

    async def _confirm_written(
        self,
        message: Subscribe | Unsubscribe,
        written: asyncio.Future[None] | None,
        result: dict[str, Any],
    ) -> None:
        assert message.reply_to
        try:
            if written is not None:
                await written
            outcome: dict[str, Any] = result
        except ReplicaTimeout as exc:
            outcome = {"error": str(exc)}
        reply = Confirmation(
            event_type=message.event_type,
            subscription_id=message.subscription_id,
            broker=self.owner,
            outcome=outcome,
        )
        try:
            client = await self.client_for(message.home or self.cluster)
            await client.publish(outgoing(reply, message.reply_to))
        except Unroutable:
            log.info("subscriber of %s left before its confirmation", message.subscription_id)
        except MiddlewareError as exc:  # the subscriber times out and says so
            log.warning("confirmation of %s not sent: %s", message.subscription_id, exc)


class MatchSlave(_MatchBroker, _ReplicaHolder):
    """Holds a replica of its master's subscriptions (persisted, acknowledged), matches
    what the master sends it, and reports its predicted T to the master every heartbeat."""

    def __init__(self, *, slave: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slave = slave
        self.id = RoleId.match_slave(self.cluster, self.index, slave)
        self.replica_owner = self.id.owner
        self.master_control = self.control_of(self.id.master)

    async def run(self, stop: asyncio.Event) -> None:
        self.store = open_store(self.topology.state_store)
        held = self.store.load(self.replica_owner, "subscription")
        self.held_version = max((v for v, _ in held.values()), default=0)
        for sid, (_, doc) in live(held).items():
            self._held(sid, doc)
        try:
            await self._serve_observed(stop)
        finally:
            self.store.close()

    def apply(self, key: str, document: dict[str, Any]) -> None:
        if document == TOMBSTONE:
            self.registry.remove(key)
        else:
            self._held(key, document)

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        return {**self.replica_handlers(), Publish: self._match}

    async def report(self, t: float) -> None:
        await self.send(
            self.cluster,
            self.master_control,
            Heartbeat(  # finite: JSON has no infinity
                broker=self.name,
                predicted_t=heartbeat_value(t),
                queue=heartbeat_value(self.predictor.queue),
                service_rate=heartbeat_value(self.predictor.service_rate),
            ),
        )


async def reconfigure(
    settings: Settings,
    topology: PhoenixTopology,
    clusters: Iterable[str],
    *,
    outer: bool | None = None,
    inner: bool | None = None,
    blind_dispatch: str | None = None,
    batch_max: int | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Switch ``outer``/``inner``/``blind_dispatch`` (and ``batch_max``) live on the
    routing and match masters of ``clusters`` (through their control queues, ahead of
    any backlog); return the control queues of the masters that confirmed. Raises
    :class:`MiddlewareError` naming the ones that did not answer in ``timeout_s``."""
    asked = (
        ("outer", outer),
        ("inner", inner),
        ("blind_dispatch", blind_dispatch),
        ("batch_max", batch_max),
    )
    switches = {k: v for k, v in asked if v is not None}
    request = uuid.uuid4().hex
    expected: set[str] = set()
    confirmed: set[str] = set()
    done = asyncio.Event()
    clients: dict[str, AsyncClient] = {}
    tags: dict[str, str] = {}

    async def on_reply(delivery: Delivery) -> None:
        reply = parse(delivery.body, "configure answer")
        if isinstance(reply, Answer) and reply.request == request:
            confirmed.add(reply.broker)
            if expected <= confirmed:
                done.set()

    reply_queue = f"{topology.prefix}.configure.{request}"
    message = Configure(switches=switches, request=request, reply_to=reply_queue)
    try:
        targets: list[tuple[AsyncClient, str]] = []
        for cluster in clusters:  # every master expected before any is asked (replies race)
            spec = topology.cluster(cluster)
            key, cluster_conf = cluster_settings(settings, topology, cluster)
            if key not in clients:
                client = await AsyncClient(settings=cluster_conf).connect()
                clients[key] = client
                await client.declare_queue(inbox_spec(reply_queue))
                tags[key] = await client.consume(reply_queue, on_reply)
            masters = [RoleId.router(cluster)]
            masters += [RoleId.match(cluster, i) for i in range(spec.match_masters)]
            for master in masters:  # each master answers with the queue it was asked on
                targets.append((clients[key], master.control(topology.prefix)))
                expected.add(master.control(topology.prefix))
        for client, control in targets:
            # not declared: a master that never ran has no control queue (unroutable),
            # and one that is down does not apply a stale switch when it comes back
            with contextlib.suppress(Unroutable):
                await client.publish(
                    outgoing(
                        message, control, priority=MAX_PRIORITY, expiration_ms=int(timeout_s * 1000)
                    )
                )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s if expected else 0):
                await done.wait()
    finally:
        for key, client in clients.items():
            with contextlib.suppress(Exception):
                if key in tags:  # first: a queue deleted under its consumer logs a warning
                    await client.cancel(tags[key])
                await client.delete_queue(reply_queue)
            await client.close()
    missing = expected - confirmed
    if missing:
        raise MiddlewareError(
            f"no confirmation of {switches} in {timeout_s:.0f} s from {', '.join(sorted(missing))}"
        )
    return sorted(confirmed)
