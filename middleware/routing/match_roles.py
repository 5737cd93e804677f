"""Match brokers and match slaves (drivers): matching and delivery (a matched event's
copies: ``copies.py`` decides), the load reports, a slave's replica of its master's
subscriptions.  The match master: ``match_restore.py`` (its state, start and the
restore of a departed arc) and ``match_master.py`` (subscriptions, dispatch, hand-over).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from .. import tracing
from ..errors import DeadLetter
from ..phoenix.ids import RoleId
from .copies import Carry, Gone, MatchedReceipts, copy_id, event_content, settle
from .delivery import CopySender
from .dispatching import from_older_reign
from .holding import ReplicaHolder
from .messages import (
    Copy,
    Heartbeat,
    Join,
    Leave,
    Publish,
    encode,
    heartbeat_value,
)
from .peer import Role
from .performing import Inputs, Performer
from .registry import Registry
from .replicas import TOMBSTONE, live
from .role_metrics import HOPS, INBOX_LENGTH, PREDICTED_T
from .store import open_store
from .timeliness import QueuePredictor, QuietReads
from .wiring import Handler

__all__ = ["MatchBroker", "MatchSlave"]

log = logging.getLogger(__name__)


class MatchBroker(Role):
    """Matching and delivery shared by match masters and match slaves."""

    HEARTBEAT_S = 0.5
    MATCHED_EVERY_S = 0.02
    observes_inbox = True

    def __init__(self, *, index: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.index = index
        self.id = RoleId.match(self.cluster, index)  # a slave's is set by MatchSlave
        self.owner = self.id.owner  # subscriptions are the master's
        self.registry = Registry(self.cluster)  # records, indexed; where matches go
        self.predictor = QueuePredictor(window_s=self.HEARTBEAT_S)
        self.copies = CopySender.for_role(self)
        #: clusters that left the ring: deliveries to their subscribers are dead-lettered
        self.departed: set[str] = set()
        #: ids of events matched here, by the cluster they entered the ring at, until
        #: the next ``Matched`` to that cluster's router goes (copies.py; a Matched lost
        #: with its cluster: its events come twice)
        self.receipts = MatchedReceipts(self.cluster, every_s=self.MATCHED_EVERY_S)

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

    async def _match(self, message: Publish) -> None:
        self.predictor.arrived(now=time.monotonic())
        if message.event_type in self.registry.unindexed:
            self.index_type(message.event_type)  # restored from a departed cluster
        try:
            matched = self.registry.match(message.event_type, message.event.attributes)
            self.count("matched", len(matched))
            self._hops.observe(max(0, len(message.hops) - 1))
            try:
                if matched:
                    await self._deliver(message, matched)
            except DeadLetter:  # handled: the others' copies went out
                self._done(message)
                raise
            self._done(message)
        finally:
            self.predictor.completed(now=time.monotonic())

    @functools.cached_property
    def _hops(self) -> Any:
        return HOPS.labels(self.cluster)  # looked up once, not per event

    def _done(self, message: Publish) -> None:
        """The event's copies are confirmed: tell the router it entered the ring at
        (another cluster's; it keeps the event until then), batched (copies.py)."""
        for timer in self.receipts.matched(message.hops, message.id):
            self.set_timer(timer, self.receipting)

    @functools.cached_property
    def receipting(self) -> Inputs:
        """The receipts' inputs: an entry cluster's timer, how a chunk's send went."""
        return Inputs(
            timer=self.receipts.due, sent=lambda _, sent: self.receipts.sent(sent.then, sent.error)
        )

    async def _deliver(self, message: Publish, matched: set[str]) -> None:
        """One copy per subscriber queue, however many of its subscriptions matched, on
        the RabbitMQ of the subscriber's own cluster, each with its own outcome
        (``delivery.py``); what the outcomes take is decided in ``copies.settle``: a copy
        whose home cannot be reached now is handed to this cluster's routing master,
        which carries it there over the ring; one subscriber never costs another its
        copy."""
        stamped = message.model_copy(update={"broker": self.name, "reign": None})
        body = encode(stamped)
        copies = self.registry.copies(matched, self.departed)
        queues = copies.queues
        # the event's name only where an e2e subscriber checks duplicates by it
        e2e = any(confirm == "e2e" for confirm in queues.values())
        content = event_content(message.event.model_dump_json()) if e2e else None
        put = functools.partial(self.copies.put, content=content, priority=message.priority)
        puts = [
            put(home, queue, confirm, body, copy_id(message.id, queue))
            for (home, queue), confirm in queues.items()
        ]
        if tracing.active():
            attributes = {
                "qosmq.phoenix.broker": self.name,
                "qosmq.phoenix.matched": sorted(matched)[:50],
                "qosmq.phoenix.copies": len(queues),
            }
            with tracing.span(f"{message.event_type} match", attributes):
                outcomes = await asyncio.gather(*puts)
        elif len(puts) == 1:  # the common case: no task for it
            outcomes = [await puts[0]]
        else:
            outcomes = await asyncio.gather(*puts)
        settled = [
            (key, confirm, result)
            for (key, confirm), result in zip(queues.items(), outcomes, strict=True)
        ]
        # a refusal comes after the others' copies went out: kept with why
        carry = functools.partial(self._carry, stamped)
        await self.enact(settle(settled, copies.departed, message.again), here={Carry: carry})

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {**super().performers, Gone: self._gone}

    @staticmethod
    def _gone(effect: Gone) -> None:
        log.warning("subscriber queue %s of cluster %s is gone", effect.queue, effect.home)

    async def _carry(self, stamped: Publish, effect: Carry) -> None:
        carried = Copy(
            event_type=stamped.event_type,
            home=effect.home,
            queue=effect.queue,
            confirm="e2e" if effect.confirm == "e2e" else "broker",
            copy_id=copy_id(stamped.id, effect.queue),
            publish=stamped,
            priority=stamped.priority,
            unreachable=effect.link,
        )
        # this cluster's own RabbitMQ: a failure here leaves the event unacked
        router = self.inbox_of(RoleId.router(self.cluster))
        await self.send(self.cluster, router, carried, stamped.priority)
        log.info(
            "%s: copy for %s at %s carried by the ring (%s)",
            self.name,
            effect.queue,
            effect.home,
            effect.reason,
        )

    @property
    def name(self) -> str:
        return self.id.owner

    async def finish(self) -> None:
        await self.copies.close()

    async def _observe(self, inbox: str, stop: asyncio.Event) -> None:
        """Every window: read the inbox backlog from the broker, close the predictor's
        window with it (q = the events waiting in the broker; the ones in progress are
        being served, several at a time, and do not delay a new one by a service time
        each), and ``report``.  A quiet window after a read that found nothing waiting
        (``QuietReads``) closes without the read and without the report."""
        reads = QuietReads()
        while not stop.is_set():
            await asyncio.sleep(self.HEARTBEAT_S)
            amqp, messages = self.received
            self.received = [0, 0]
            if not reads.due(bool(amqp) or not self.predictor.quiet or bool(self.gate.waiting)):
                self.predictor.close_window(time.monotonic(), 0.0)
                self.count("quiet_windows")
                continue
            try:
                client = await self.client_for(self.cluster)
                waiting = await client.queue_length(inbox)
                INBOX_LENGTH.labels(self.cluster, self.role, inbox).set(waiting)
                # the broker counts AMQP messages, and under load each carries a batch;
                # the events held here beyond the gate wait too
                backlog = waiting * (messages / amqp if amqp else 1.0) + self.gate.waiting
            except Exception as exc:
                log.info("could not read the backlog of %s: %s", inbox, exc)
                backlog = None
            reads.read(backlog)
            t = self.predictor.close_window(time.monotonic(), backlog)
            PREDICTED_T.labels(self.cluster, self.name).set(t)
            try:
                await self.report(t)
            except Exception as exc:
                log.info("heartbeat of %s failed: %s", self.name, exc)

    async def report(self, t: float) -> None:
        """Masters keep their T; slaves send it to the master."""

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While served: the inbox observed every window."""
        observe = asyncio.create_task(self._observe(self.inbox_of(self.id), stop))
        try:
            async with super().lifetime(stop):
                yield
        finally:
            observe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await observe


class MatchSlave(MatchBroker, ReplicaHolder):
    """Holds a replica of its master's subscriptions (persisted, acknowledged), matches
    what the master sends it, and reports its predicted T to the master every heartbeat."""

    def __init__(self, *, slave: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.slave = slave
        self.id = RoleId.match_slave(self.cluster, self.index, slave)
        self.replica_owner = self.id.owner
        self.master_control = self.control_of(self.id.master)

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While served: the replica it holds, loaded first (and the inbox observed)."""
        self.store = open_store(self.topology.state_store)
        held = self.store.load(self.replica_owner, "subscription")
        self.held_version = max((v for v, _ in held.values()), default=0)
        for sid, (_, doc) in live(held).items():
            self._held(sid, doc)
        try:
            async with super().lifetime(stop):
                yield
        finally:
            self.store.close()

    def apply(self, key: str, document: dict[str, Any]) -> None:
        if document == TOMBSTONE:
            self.registry.remove(key)
        else:
            self._held(key, document)

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        return {**self.replica_handlers(), Publish: self._dispatched}

    async def _dispatched(self, message: Publish) -> None:
        """An event its master sent: matched here, or (``from_older_reign``) passed to the
        master reigning now."""
        if from_older_reign(message.reign, self.trust.reign):
            self.count("older_reign_dispatch_passed_on")
            back = message.model_copy(update={"reign": None})
            await self.send(self.cluster, self.inbox_of(self.id.master), back, message.priority)
            return
        await self._match(message)

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
