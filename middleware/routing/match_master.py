"""The match master (driver): subscriptions and their confirmation (``subscribing.py``
decides), dispatch of each event to the broker with the smallest predicted T (or
blind), and the hand-over of an arc's subscriptions to a cluster that joins.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

from ..errors import MiddlewareError, Unroutable
from ..phoenix.effects import Count, Send
from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY
from ..phoenix.ring import Handover as Arc
from . import subscribing
from .dispatching import Drop, MatchHere, on_publish
from .joining import HandedArcs, handover_plan
from .match_restore import RestoringMatcher
from .messages import (
    Advertise,
    Confirmation,
    Handover,
    Heartbeat,
    Leave,
    Publish,
    Recover,
    Recovered,
    Subscribe,
    Unsubscribe,
)
from .performing import Performer
from .replica_set import ReplicaTimeout
from .wiring import Handler, outgoing

__all__ = ["MatchMaster"]

log = logging.getLogger(__name__)


class MatchMaster(RestoringMatcher):
    """Keeps subscriptions (indexed, persisted, replicated to its slaves by quorum) and
    sends each event to the broker with the smallest predicted processing time T,
    itself included."""

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {
            **super().control_handlers,
            **self.replicas.handlers(),
            Heartbeat: self._on_heartbeat,
            Recover: self._on_recover,
        }

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
        self.handed_arcs.handed(joiner, covers)  # what reaches this master late goes on
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
            # behind the events of the arc dispatched to the slaves before now: a
            # tombstone ahead of them in a slave's inbox would have it match them
            # without the subscription, and nothing else carries them to it
            await self.replicas.write(sid, None, behind=True)
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

    @functools.cached_property
    def handed_arcs(self) -> HandedArcs:
        return HandedArcs()

    async def _on_leave(self, message: Leave) -> None:
        await super()._on_leave(message)
        self.handed_arcs.left(message.cluster)

    async def _on_subscribe(self, message: Subscribe) -> None:
        if moved := self.handed_arcs.pass_on(message):
            await self.enact(moved)  # routed here after its arc was handed over
            return
        await self._subscribing(message, self.book.subscribe(message))

    async def _subscribing(
        self, message: Subscribe | Unsubscribe, effects: list[subscribing.Effect]
    ) -> None:
        """Perform the book's effects in order (subscribing.py): a confirmation waits
        for the write before it."""
        written: asyncio.Future[None] | None = None

        async def persist(effect: subscribing.Persist) -> None:
            nonlocal written
            document = effect.document  # tagged with its type: see _owing
            tag = document.get("event_type") if document is not None else None
            written = await self.replicas.write(effect.key, document, tag)
            await self._replicated(written)

        def confirm(effect: subscribing.Confirm) -> None:
            self._confirm(message, written if effect.after_write else None, effect.outcome)

        await self.enact(effects, here={subscribing.Persist: persist, subscribing.Confirm: confirm})

    async def _on_advertise(self, message: Advertise) -> None:
        await asyncio.to_thread(
            self.store.save, self.owner, "advertisement", message.event_type, {}, 1
        )

    async def _on_publish(self, message: Publish) -> None:
        """Drop it, match it here or dispatch it to a slave (``dispatching.py``)."""
        now = time.monotonic()
        effects = self.handed_arcs.pass_on(message) or on_publish(
            message,
            self.id,
            stale=self._matched_elsewhere(message),
            local=message.event_type in self.book.local_types,
            dispatch=self.dispatch,
            predictor=self.predictor,
            live=self.live.alive(now),
            now=now,
            inner=self.topology.inner,
            blind=self.topology.blind_dispatch,
            owing=self._owing(message.event_type),
            reign=(self.reign.epoch, self.reign.by),
        )
        here: dict[type, Performer] = {
            Count: functools.partial(self._publish_count, message),
            MatchHere: lambda _: self._match(message),
            Send: self._dispatch,
        }
        await self.enact(effects, here=here)

    def _owing(self, event_type: str) -> set[int]:
        """The slaves that have not acknowledged a subscription of ``event_type`` yet."""
        log_ = self.replicas.log
        if not log_.unacked:  # most events: nothing written lately
            return set()
        return {slave.slave for slave in log_.owing(event_type)}

    def _publish_count(self, message: Publish, effect: Count) -> None:
        first = not self.counters[effect.name]
        self.count(effect.name, effect.n)
        if first and effect.name == "dropped_after_rejoin":
            log.warning(
                "%s: dropping events from before the departure (first: %s)", self.owner, message.id
            )

    async def _dispatch(self, effect: Send) -> None:
        """An event to the slave chosen; how long the send took goes to the choice (or
        on to the joiner its arc was handed to)."""
        if not effect.to.is_slave:
            await self.perform(effect)
            return
        started = time.monotonic()
        await self.perform(effect)
        self.dispatch.dispatched(effect.to.slave, time.monotonic() - started)

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {**super().performers, Drop: lambda _: None}

    async def _unsubscribe(self, message: Unsubscribe) -> None:
        """Forget the subscription here and in the replicas (a tombstone), and tell the
        routing masters that counted its latency level to take it out of latencyMap."""
        if moved := self.handed_arcs.pass_on(message):
            await self.enact(moved)
            return
        await self._subscribing(message, self.book.unsubscribe(message))

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
