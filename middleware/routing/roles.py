"""Phoenix roles over RabbitMQ (drivers): what every role does (:class:`Role`); what a
master does in ``mastering.py``, what a slave does in ``holding.py``; the routing roles
in ``router_roles.py``, the match roles in ``match_roles.py``, the connections and
queues in ``wiring.py``.

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
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from .. import heap
from ..errors import DeadLetter, LinkDown, MiddlewareError, Unroutable
from ..recovery.fencing import Reign
from ..recovery.provisioner import Provisioner
from ..settings import Settings
from ..transport import AsyncClient, Delivery, OutgoingMessage
from ..transport.delivery import outcome_of
from .batching import Batcher, PriorityGate, split
from .beats import Beater
from .ids import RoleId
from .messages import (
    Answer,
    Beat,
    Configure,
    Fence,
    Message,
    Read,
    Replicate,
    Routed,
    Snapshot,
    Takeover,
    encode,
)
from .protocol import MAX_PRIORITY, PhoenixTopology
from .replica_set import ReplicaSet
from .role_metrics import INBOX_LENGTH, RECOVERY_S, ROLE_EVENTS
from .store import StateStore
from .wiring import (
    Connections,
    Handler,
    cluster_settings,
    outgoing,
    process_queue_spec,
    role_inbox_spec,
)

__all__ = ["SWITCHES", "WARM_AFTER_PROMOTION_S", "Role"]

log = logging.getLogger(__name__)
#: a promoted master warms its provisioner this long after it serves (beats.py, zygote.py)
WARM_AFTER_PROMOTION_S = 1.0


class Role:
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
        self._counted: dict[str, Any] = {}  # outcome -> its labelled metric child
        self.role = type(self).__name__
        self.batcher = Batcher(self._publish_body, max_messages=topology.batch_max)
        self.received = [0, 0]  # AMQP messages, Phoenix messages in them (since last read)
        # inbox messages handled at once: the prefetch, however the deliveries are batched
        self.gate = PriorityGate(topology.inbox_prefetch)

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] += n
        child = self._counted.get(outcome)
        if child is None:  # the labelled child looked up once per outcome (py-spy: the
            # lookup was 3-4 % of a loaded router's CPU)
            child = self._counted[outcome] = ROLE_EVENTS.labels(self.cluster, self.role, outcome)
        child.inc(n)

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
                self._served_again(self.failed_at, prepared)
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

    async def recovery(self, stop: asyncio.Event) -> None:
        """Beside serving: a master beats to its slaves (``mastering.Master``), a slave
        watches its master (``holding.ReplicaHolder``)."""

    @property
    def replica_set(self) -> ReplicaSet | None:
        """A master's replicas of the table its slaves hold (None: not a master)."""
        return None

    async def _on_fence(self, message: Fence) -> None:
        """A FENCE is for masters (``mastering.Master``)."""
        reign = Reign(message.epoch, message.by)
        raise DeadLetter(f"fence from {message.broker!r} of {reign}: not for {self.id}")

    def _served_again(self, failed_at: float, prepared: float) -> None:
        """An elected master serves: how long after its predecessor's last beat."""
        now = time.monotonic()
        took = now - failed_at
        RECOVERY_S.labels(self.cluster, self.id.kind.value, "recovery").observe(took)
        log.warning(
            "%s served again %.2f s after its last beat (this role began %.3f s, "
            "tables read back %.3f s, inboxes consumed %.3f s after it)",
            self.id,
            took,
            self._began - failed_at,
            prepared - failed_at,
            now - failed_at,
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
            entries[i : i + ReplicaSet.PAGE] for i in range(0, len(entries), ReplicaSet.PAGE)
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

    def _background(self, work: Awaitable[Any]) -> None:
        """Run ``work`` beside serving (stores, recoveries, replacements), held until it
        ends."""
        task = asyncio.ensure_future(work)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)

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
