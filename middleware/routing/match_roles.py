"""Match masters and match slaves (drivers): matching and delivery, the subscriptions
(``subscribing.py``), dispatch by predicted T, restore of a departed arc, hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from .. import heap, tracing
from ..errors import DeadLetter, MiddlewareError, Unroutable
from . import copies as copies_plan
from . import subscribing
from .copies import Carry, Gone, MatchedReceipts, copy_id, event_content, settle
from .delivery import CopySender
from .holding import ReplicaHolder
from .ids import RoleId
from .joining import handover_plan
from .mastering import Master
from .messages import (
    Advertise,
    Confirmation,
    Copy,
    Handover,
    Heartbeat,
    Join,
    Leave,
    Matched,
    Publish,
    Recover,
    Recovered,
    Subscribe,
    Unsubscribe,
    Unsubscribed,
    encode,
    heartbeat_value,
)
from .protocol import MAX_PRIORITY
from .registry import Registry
from .replica_set import ReplicaSet, ReplicaTimeout
from .replicas import TOMBSTONE, live
from .restoring import ForgetAfter, Read, ReadAhead, Restore, RestorePlan, restore_plan
from .ring import Handover as Arc
from .ring import master_index
from .role_metrics import HOPS, INBOX_LENGTH, PREDICTED_T
from .roles import Role
from .store import StateStore, open_store, ring_owner
from .subscribing import SubscriptionBook, TellRouters
from .timeliness import Dispatch, QueuePredictor
from .wiring import Handler, outgoing

__all__ = ["MatchMaster", "MatchSlave"]

log = logging.getLogger(__name__)


class _MatchBroker(Role):
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
        self.copies = CopySender(topology=self.topology, client_for=self.client_for)
        #: clusters that left the ring: deliveries to their subscribers are dead-lettered
        self.departed: set[str] = set()
        #: ids of events matched here, by the cluster they entered the ring at, until
        #: the next ``Matched`` to that cluster's router goes (copies.py; a Matched lost
        #: with its cluster: its events come twice)
        self.receipts = MatchedReceipts(self.cluster, every_s=self.MATCHED_EVERY_S)
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
        read_ahead = getattr(self, "read_ahead", None)
        if read_ahead is not None:
            read_ahead.joined(message.cluster)

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
        (another cluster's; it keeps the event until then), batched (copies.py)."""
        for timer in self.receipts.matched(message.hops, message.id):
            asyncio.get_running_loop().call_later(timer.after_s, self._send_matched, timer.entry)

    def _send_matched(self, entry: str) -> None:
        chunks = self.receipts.due(entry)
        if not chunks:
            return

        async def send() -> None:
            router = self.control_of(RoleId.router(entry))
            for chunk in chunks:
                matched = Matched(by=self.cluster, ids=list(chunk.ids))
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
        (``delivery.py``); what the outcomes take is decided in ``copies.settle``: a copy
        whose home cannot be reached now is handed to this cluster's routing master,
        which carries it there over the ring; one subscriber never costs another its
        copy."""
        stamped = message.model_copy(update={"broker": self.name})
        body = encode(stamped)
        copies = self.registry.copies(matched, self.departed)
        queues = copies.queues
        content = event_content(message.event.model_dump_json()) if queues else None
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
                    self.copies.put(
                        home, queue, confirm, body, copy_id(message.id, queue), content=content
                    )
                    for (home, queue), confirm in queues.items()
                )
            )
        settled = [
            (key, confirm, result)
            for (key, confirm), result in zip(queues.items(), outcomes, strict=True)
        ]
        for effect in settle(settled, copies.departed, message.again):
            if isinstance(effect, copies_plan.Count):
                self.count(effect.name, effect.n)
            elif isinstance(effect, Gone):
                log.warning("subscriber queue %s of cluster %s is gone", effect.queue, effect.home)
            elif isinstance(effect, Carry):
                await self._carry(stamped, effect)
            else:  # after the others' copies went out: kept with why
                raise DeadLetter(effect.reason)

    async def _carry(self, stamped: Publish, effect: Carry) -> None:
        carried = Copy(
            event_type=stamped.event_type,
            home=effect.home,
            queue=effect.queue,
            confirm="e2e" if effect.confirm == "e2e" else "broker",
            copy_id=copy_id(stamped.id, effect.queue),
            publish=stamped,
            priority=stamped.priority,
            unreachable=True,
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
                mine[event_type] = (
                    arc.covers(event_type) and master_index(event_type, masters) == index
                )
            if mine[event_type]:
                by_type.setdefault(event_type, {})[sid] = doc
    return by_type


class MatchMaster(_MatchBroker, Master):
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
        self.replicas = ReplicaSet(self, self.store, "subscription")
        #: subscribe and unsubscribe decided (subscribing.py); its ``local_types``: event
        #: types restored from a departed cluster, matched here, never dispatched (the
        #: restored subscriptions are not replicated to the slaves, see ``adopt``)
        self.book = SubscriptionBook(self.registry, self.departed)
        #: when this cluster last left the ring (``prepare``): see ``_matched_elsewhere``
        self.left_at: float | None = None
        #: departed clusters' subscriptions read ahead (a router suspected the departure),
        #: kept by the reads they were read by (restoring.py): read number -> result
        self.read_ahead = ReadAhead(self.STANDBY_S)
        self._readings: dict[int, asyncio.Future[Restorable]] = {}

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
        effects = self.read_ahead.recover(message.cluster, plan, prepare=message.prepare)
        restore: asyncio.Future[Restorable] | None = None
        for effect in effects:
            if isinstance(effect, Read):
                self._readings[effect.reading] = self._read_departed(message)
            elif isinstance(effect, ForgetAfter):
                loop = asyncio.get_running_loop()
                loop.call_later(effect.after_s, self._forget_read, effect.cluster, effect.reading)
            elif isinstance(effect, Restore):
                restore = self._readings.pop(effect.reading)
            else:
                self.count(effect.name, effect.n)
        self._drop_unused_reads()
        if restore is not None:
            with heap.paused():  # no cycles among them; the index task keeps it so (heap.py)
                await self._restore(message, restore)

    def _forget_read(self, cluster: str, reading: int) -> None:
        for effect in self.read_ahead.forget(cluster, reading):
            self.count(effect.name, effect.n)
        self._drop_unused_reads()

    def _drop_unused_reads(self) -> None:
        kept = self.read_ahead.in_use()
        for reading in [r for r in self._readings if r not in kept]:
            del self._readings[reading]

    async def _restore(self, message: Recover, reading: asyncio.Future[Restorable]) -> None:
        try:
            by_type = await reading
        except Exception as exc:  # the read ahead failed: read now
            log.warning("%s: reading %s's state ahead failed (%s)", self.name, message.cluster, exc)
            by_type = await self._read_departed(message)
        self.departed.add(message.cluster)
        found, refused = self.registry.restore(by_type)
        self.book.local_types.update(by_type)
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

    def _restore_plan(self, message: Recover) -> RestorePlan:
        """restoring.restore_plan for this master (``DeadLetter`` for a RECOVER it
        cannot take)."""
        return restore_plan(
            message,
            cluster_masters=self.topology.cluster(self.cluster).match_masters,
            index=self.index,
        )

    def _take_advertisements(self, message: Recover, types: set[str]) -> None:
        """(In a thread) the departed match masters' advertisements of the arc's types
        this master now holds, kept as its own."""
        arc = Arc(message.cluster, message.cluster, *message.arc)
        plan = self._restore_plan(message)
        owners, masters = plan.owners, plan.masters
        for owner in owners:
            for event_type, (version, doc) in live(self.store.load(owner, "advertisement")).items():
                if event_type in types or (
                    arc.covers(event_type) and master_index(event_type, masters) == self.index
                ):
                    self.store.save(self.owner, "advertisement", event_type, doc, version)

    def _read_departed(self, message: Recover) -> asyncio.Future[Restorable]:
        arc = Arc(message.cluster, message.cluster, *message.arc)
        plan = self._restore_plan(message)
        owners, masters = plan.owners, plan.masters

        async def read() -> Restorable:
            # 200 000 documents, no cycles: without the pause, full collections of the
            # growing heap (0.3-1.2 s each, eight of them) doubled the read (heap.py)
            with heap.paused():
                return await asyncio.to_thread(
                    _restorable, self.store, list(owners), arc, masters, self.index
                )

        return asyncio.ensure_future(read())

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
        plan = handover_plan(self.registry.in_arc(covers), self.book.removed_adopted, covers)
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
            self.book.removal_handed(sid)
        self.count("handed_over", len(plan.subscriptions))
        self.count("removals_handed_over", len(plan.removals))
        return len(plan.subscriptions) + len(plan.removals)

    async def _on_handover(self, message: Handover) -> None:
        moved = await self._hand_over(message.cluster, message.arc)
        if message.reply_to and message.request:  # a router waits to retire this master
            done = Recovered(request=message.request, broker=self.owner, restored=moved)
            await self.send(self.cluster, message.reply_to, done, MAX_PRIORITY)

    async def _on_subscribe(self, message: Subscribe) -> None:
        await self._subscribing(message, self.book.subscribe(message))

    async def _subscribing(
        self, message: Subscribe | Unsubscribe, effects: list[subscribing.Effect]
    ) -> None:
        """Perform the book's effects in order (subscribing.py)."""
        written: asyncio.Future[None] | None = None
        for effect in effects:
            if isinstance(effect, subscribing.Persist):
                written = await self.replicas.write(effect.key, effect.document)
                await self._replicated(written)
            elif isinstance(effect, TellRouters):
                await self._tell_unsubscribed(effect)
            elif isinstance(effect, subscribing.Count):
                self.count(effect.name, effect.n)
            elif isinstance(effect, subscribing.Confirm):
                self._confirm(message, written if effect.after_write else None, effect.outcome)
            else:
                raise DeadLetter(effect.reason)

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
        if message.event_type in self.book.local_types:  # its slaves do not hold them
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
        await self._subscribing(message, self.book.unsubscribe(message))

    async def _tell_unsubscribed(self, effect: TellRouters) -> None:
        taken_out = Unsubscribed(event_type=effect.event_type, latency_level=effect.latency_level)
        for cluster in effect.clusters:
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
                    effect.subscription_id,
                    exc,
                )

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


class MatchSlave(_MatchBroker, ReplicaHolder):
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
