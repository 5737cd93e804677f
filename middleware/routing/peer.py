"""A role as its process serves it (driver side): :class:`Peer`, what a role says to
others (its connections, batched sends to inboxes, control messages that expire when
stale, beats from the process's beat thread, counters and background work), and
:class:`Role`, what it does with what it hears (handler tables per kind, the take-over
and live configure every role answers, what it holds while served, what its process
serves next).  ``serving.py`` consumes a role's queues; ``mastering.py`` is what a
master adds, ``holding.py`` a slave; the routing roles ``router_roles.py``, the match
roles ``match_roles.py``; connections and queues ``wiring.py``.  The whole picture:
``docs/phoenix-roles.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from ..errors import DeadLetter, LinkDown, MiddlewareError, Unroutable
from ..phoenix.effects import Box, Send, Sent, Signal
from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY, PhoenixTopology
from ..recovery.fencing import Reign
from ..recovery.provisioner import Provisioner
from ..settings import Settings
from ..transport import AsyncClient, Delivery
from .batching import Batcher, PriorityGate
from .beating import Beating
from .beats import Beater, signal_ttl_ms
from .messages import Answer, Beat, Configure, Fence, Message, Routed, Takeover, encode
from .parked import ParkedPace
from .performing import Performing
from .replica_set import ReplicaSet
from .role_metrics import ROLE_EVENTS
from .switching import Become, become, configured, take_over
from .wiring import (
    SEND_FAILURES,
    Connections,
    Handler,
    outgoing,
    outgoing_body,
    role_inbox_spec,
)

__all__ = ["QUIET_AFTER_S", "WARM_AFTER_PROMOTION_S", "Peer", "Role"]

log = logging.getLogger(__name__)
#: a promoted master warms its provisioner this long after it serves (beats.py, zygote.py)
WARM_AFTER_PROMOTION_S = 1.0
#: a master whose inbox took nothing for this long beats at ``quiet_beat_interval_s``
#: (when that is set), and its slaves with it
QUIET_AFTER_S = 5.0


class Peer(Beating, Performing):
    """One role's voice: sends, tells and beats over its process's connections."""

    id: RoleId  # set by each role before it serves

    def __init__(
        self,
        *,
        settings: Settings,
        topology: PhoenixTopology,
        cluster: str,
        connections: Connections | None = None,
        beater: Beater | None = None,
    ) -> None:
        """``beater``: the process's beat thread (``RoleNode``: it stays, with its
        connection and lease, when the process serves another role); None: the role
        starts its own while it beats."""
        self.topology, self.cluster = topology, cluster
        self.settings = settings
        self.connections = connections or Connections(settings, topology, cluster)
        self.side_tasks: set[asyncio.Future[Any]] = set()  # held, not awaited by anyone
        self.process_beater = beater
        self.beater: Beater | None = None  # beating for this role (while it beats)
        self.counters: Counter[str] = Counter()
        self._counted: dict[str, tuple[str, str, str]] = {}  # outcome -> its metric labels
        self.role = type(self).__name__
        self.batcher = Batcher.of(self._publish_body, topology)

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] += n
        key = self._counted.get(outcome)
        if key is None:
            key = self._counted[outcome] = (self.cluster, self.role, outcome)
        ROLE_EVENTS.counts[key] += n

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
            persistent = self.topology.persistent
            await client.publish(
                outgoing_body(body, inbox, priority=priority, persistent=persistent)
            )
        except Unroutable:
            if not self._is_process_queue(inbox):
                raise
            self.count("replies_unroutable")  # its process is gone: nobody waits for it

    def inbox_of(self, role: RoleId) -> str:
        return role.inbox(self.topology.prefix)

    def control_of(self, role: RoleId) -> str:
        return role.control(self.topology.prefix)

    def _signal_ttl_ms(self) -> int:
        """How long a beat or vote stays worth reading: the detection timeout."""
        return signal_ttl_ms(self.topology)

    async def perform(self, effect: Send | Signal) -> Sent | None:
        """A machine's message to another role (``phoenix/effects.py``): addressed and
        published here, as the effect says; a send with ``then`` answers how it ended
        (the input to give back to its machine) instead of raising."""
        if isinstance(effect, Signal):
            if isinstance(effect.to, RoleId):
                await self.signal(effect.to, effect.message)
            else:
                await self.tell(effect.to, effect.message)
            return None
        to = effect.to
        queue = self.inbox_of(to) if effect.box is Box.INBOX else self.control_of(to)
        send = self.send(effect.via or to.cluster, queue, effect.message, effect.priority)
        if effect.bound_s is None and effect.then is None:
            await send
            return None
        try:
            await asyncio.wait_for(send, effect.bound_s)
        except (MiddlewareError, TimeoutError) as exc:
            if effect.missed is not None:
                self.count(effect.missed)
            kind = effect.message.kind.value
            if effect.then is not None:  # its machine decides what a miss means
                log.info("%s: %s to %s not sent: %s", self.id, kind, queue, exc)
                lasting = not isinstance(exc, SEND_FAILURES)
                return Sent(effect.then, str(exc) or repr(exc), lasting)
            log.warning("%s: %s to %s not sent: %s", self.id, kind, queue, exc)
            return None
        return None if effect.then is None else Sent(effect.then)

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

    def _background(self, work: Awaitable[Any]) -> None:
        """Run ``work`` beside serving (stores, recoveries, replacements), held until it
        ends."""
        task = asyncio.ensure_future(work)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)


class Role(Peer):
    """One role as its process serves it (``serving.Serving`` consumes its queues): what
    it does with each kind of message (its handler tables, filled by each kind's
    module), what it holds while it serves (``lifetime``), the take-over and the live
    configure every role answers, and what its process serves next (``after``)."""

    observes_inbox = False  # match brokers read its length every window themselves

    def __init__(
        self,
        *,
        promoted_from: RoleId | None = None,
        reign: Reign | None = None,
        provisioner: Provisioner | None = None,
        failed_at: float | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
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
        #: set when told to take over its master: the driver serves that role next
        self.switch_to: RoleId | None = None
        self.takeover_reply: Takeover | None = None  # answered once serving
        self.serving = asyncio.Event()  # consumers started
        self.on_serving: Callable[[], None] | None = None  # the driver's, called then
        self.stop_event: asyncio.Event | None = None  # set by the driver when it serves
        #: when its parked-queue consumer tries a parked message again (``serving``)
        self.parked_pace = ParkedPace()
        self.retired = False  # told by its master that another process serves its role
        self.fenced = False  # a master that learnt of a newer reign: it steps down
        #: consumer tags of the queues a promoted master had as a slave (control, inbox)
        self.former_tags: list[str] = []
        self.received = [0, 0]  # AMQP messages, Phoenix messages in them (since last read)
        self.inbox_at = time.monotonic()  # when the inbox last gave it a message
        # inbox messages handled at once, however the deliveries are batched
        self.gate = PriorityGate(self.topology.inbox_concurrency)

    def quiet_beats(self) -> bool:
        """Its inbox gave it nothing for ``QUIET_AFTER_S`` (a slave: and its master's
        beats are quiet too, ``holding.py``)."""
        return time.monotonic() - self.inbox_at >= QUIET_AFTER_S

    def stop_serving(self) -> None:
        """The driver stops serving this role (its consumers are cancelled by tag)."""
        if self.stop_event is not None:
            self.stop_event.set()

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """What the role holds while it is served (stores, snapshots, watches): each
        kind adds its own around its base's."""
        yield

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

    async def finish(self) -> None:
        """Runs once the role stopped consuming (match brokers close their publishers)."""

    def after(self) -> Become | None:
        """What this process serves once this role stopped (``switching.become``): up to
        its master's role, down to a slave (fenced), or nothing (it stopped for good)."""
        return become(
            self.id,
            self.switch_to,
            won=self.next_reign,
            trusted=self.reign,
            failed_at=self.failed_at,
            reply=self.takeover_reply,
            topology=self.topology,
        )

    async def prepare(self) -> None:
        """Runs before the inbox is consumed (masters read their replicas back here)."""

    def urgency(self, message: Message) -> int:
        """Where a message waits in the gate: its priority (routers: the one they give it)."""
        return message.priority if isinstance(message, Routed) else 0

    async def park(self, message: Message, *, again: bool = False) -> None:
        """An inbox message this role could not pass on, into its parked queue
        (``serving``): once the broker confirmed it there, the inbox delivery is settled
        and what comes behind it is handled; the parked queue's consumer tries it again.
        ``again``: a parked one still not passed on, back to the queue's tail."""
        queue = self.id.parked(self.topology.prefix)
        await self.send(self.cluster, queue, message, self.urgency(message))
        self.count("parked_again" if again else "parked")

    def former_inbox_handler(self) -> Callable[[Delivery], Awaitable[None]]:
        """A promoted master's consumer of the inbox it had as a slave (``mastering``)."""
        raise NotImplementedError

    async def from_control(self, message: Message, queue: str) -> None:
        """A message from a control queue: a live configure (every role's), or what
        ``control`` does with it; one this process sent before it took over is dropped."""
        if isinstance(message, Configure):
            await self._configure(message, queue)
            return
        sender = getattr(message, "broker", None)
        if (
            self.promoted_from is not None
            and sender == self.promoted_from.owner
            and not isinstance(message, Beat)  # own beats are known by their process
            and (self.replica_set is None or self.promoted_from not in self.replica_set.replicas)
        ):
            self.count("own_stale")  # sent by this process before it took over
            return
        await self.control(message)

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        """What the role does with each kind that may come to its inbox."""
        return {}

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        """What the role does with each kind that may come to its control queue
        (``configure`` is every role's, handled before this table)."""
        return {Takeover: self._take_over, Fence: self._on_fence}

    async def handle(self, message: Message) -> None:
        """Dispatch an inbox message by kind; a kind this role does not take is
        dead-lettered with the reason."""
        handler = self.inbox_handlers.get(type(message))
        if handler is None:
            raise DeadLetter(f"{message.kind.value} is not for a {self.role}'s inbox")
        await handler(message)

    async def control(self, message: Message) -> None:
        handler = self.control_handlers.get(type(message))
        if handler is None:
            raise DeadLetter(f"{message.kind.value} is not for a {self.role}'s control queue")
        await handler(message)

    async def _take_over(self, message: Takeover) -> None:
        """Told to serve its master's role: stop serving this role; the driver starts the
        master's with the tables this replica holds (``switching.take_over`` decides)."""
        switch = take_over(self.id, message, switching=self.switch_to is not None)
        if switch is None:
            return  # told twice
        self.switch_to, self.takeover_reply = switch
        self.count("takeovers")
        log.warning("%s taking over %s", self.id, self.switch_to)
        self.stop_serving()

    async def _configure(self, message: Configure, control: str) -> None:
        """Switch the mechanisms live (``switching.configured`` decides) and answer the
        operator; the topology file is not changed, so a restart goes back to it."""
        self.topology, switches = configured(self.topology, message)
        self.batcher.configure(self.topology)
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
