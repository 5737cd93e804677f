"""Phoenix roles over RabbitMQ (drivers): what every role does (:class:`Role`): serve its
control queue, prepare, then its inbox (priority queue, small prefetch, batches split
and each message gated by its urgency, a bad one dead-lettered alone), answer a
take-over and a live configure.  What a role says to others is ``peer.py``; what a
master does ``mastering.py``, a slave ``holding.py``; the routing roles
``router_roles.py``, the match roles ``match_roles.py``; connections and queues
``wiring.py``.  The whole picture: ``docs/phoenix-roles.md``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import ValidationError

from .. import heap
from ..errors import DeadLetter, MiddlewareError, Requeue, Unroutable
from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..recovery.fencing import Reign
from ..recovery.provisioner import Provisioner
from ..transport import AsyncClient, Delivery
from ..transport.delivery import outcome_of
from .batching import PriorityGate, split
from .messages import (
    Answer,
    Beat,
    Configure,
    Fence,
    Message,
    Routed,
    Takeover,
    encode,
)
from .peer import Peer
from .replica_set import ReplicaSet
from .role_metrics import INBOX_LENGTH, served_again
from .switching import Become, become
from .wiring import Handler, outgoing, process_queue_spec, role_inbox_spec

__all__ = ["SWITCHES", "WARM_AFTER_PROMOTION_S", "Role"]

log = logging.getLogger(__name__)
#: a promoted master warms its provisioner this long after it serves (beats.py, zygote.py)
WARM_AFTER_PROMOTION_S = 1.0


class Role(Peer):
    GAUGE_S = 1.0  # how often a role reads its inbox length for the metric
    observes_inbox = False  # match brokers read it every window themselves

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
        topology = self.topology
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
        self._stop: asyncio.Event | None = None
        self._began = 0.0  # when serve() began (monotonic), for the recovery log
        self.retired = False  # told by its master that another process serves its role
        self.fenced = False  # a master that learnt of a newer reign: it steps down
        self._former_control: str | None = None  # its consumer tag (a promoted master)
        self._former_inbox_tag: str | None = None  # the same, of the inbox it drains
        self.received = [0, 0]  # AMQP messages, Phoenix messages in them (since last read)
        # inbox messages handled at once, however the deliveries are batched
        self.gate = PriorityGate(topology.inbox_concurrency)

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
        if self.promoted_from is not None:  # what was dispatched to it as a slave, first:
            # behind the inbox's backlog each round trip waits (0.1-0.2 s at 1000 events/s)
            inboxes.append((self.inbox_of(self.promoted_from), self._on_former_inbox))
        inboxes.append((inbox, self._on_message))
        with heap.FullCollections() as collections:
            for name, on_message in inboxes:
                await client.declare_queue(role_inbox_spec(name, self.topology, client))
                tag = await client.consume(name, on_message, prefetch=self.topology.inbox_prefetch)
                tags.append(tag)
                if on_message == self._on_former_inbox:
                    self._former_inbox_tag = tag
            self.serving.set()
            if self.on_serving is not None:
                self.on_serving()
            if self.failed_at is not None:  # an elected master: its recovery's phases
                served_again(self.id, self.failed_at, self._began, prepared)
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
            await gate.acquire(self.urgency(message))  # (no context manager: per message)
            try:
                if self.fenced:  # stepped down while it waited: not this process's now
                    raise Requeue(f"{self.id} stepped down")
                await handle(message)
            finally:
                gate.release()

        if len(messages) == 1 and not malformed:
            await gated(messages[0])  # errors settle the delivery, as for any consumer
            return
        results = await asyncio.gather(*map(gated, messages), return_exceptions=True)
        failed = [*malformed]
        for message, result in zip(messages, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, Requeue):  # stepped down: the whole batch goes back (what
                raise result  # was handled of it, the new master's dedup and e2e drop)
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

    async def _on_former_inbox(self, delivery: Delivery) -> None:  # a promoted master's
        raise NotImplementedError  # (mastering.Master)

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
                and (
                    self.replica_set is None or self.promoted_from not in self.replica_set.replicas
                )
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


#: what ``qosmq phoenix configure`` may switch live on the running masters
SWITCHES = ("outer", "inner", "blind_dispatch", "batch_max", "batch_linger_ms")
