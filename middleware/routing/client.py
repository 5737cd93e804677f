"""The wrapped Phoenix publisher/subscriber: one core without I/O, two faces.

:class:`PhoenixClient` (asyncio, on :class:`~middleware.transport.AsyncClient`) and
:class:`SyncPhoenixClient` (pika, on :class:`~middleware.transport.SyncClient`) talk to
one cluster's routing master through its inbox, on that cluster's RabbitMQ and vhost.
They build the same messages and read the same confirmations through
:class:`ClientCore`, so the two faces cannot drift apart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from ..confirms import AsyncConfirmConsumer, SyncConfirmConsumer
from ..confirms.core import ConsumerCore
from ..errors import Requeue
from ..phoenix.protocol import PhoenixTopology
from ..settings import Settings
from ..transport import (
    Action,
    AsyncClient,
    Delivery,
    Outcome,
    QueueSpec,
    SyncClient,
)
from .batching import Batcher
from .client_core import ClientCore, SubscriptionUnconfirmed
from .matching import Event
from .messages import (
    Confirmation,
    Message,
    Publish,
    Subscribe,
    Unsubscribe,
    encode,
)
from .wiring import outgoing, outgoing_body, role_inbox_spec

__all__ = ["ClientCore", "PhoenixClient", "SubscriptionUnconfirmed", "SyncPhoenixClient"]


class PhoenixClient:
    """The asyncio face: talks to one cluster's routing master."""

    def __init__(self, client: AsyncClient, *, topology: PhoenixTopology, cluster: str) -> None:
        self.core = ClientCore(client.settings, topology, cluster)
        self.client, self.topology, self.cluster = client, topology, cluster
        self._listening = False
        self._awaited: dict[str, asyncio.Future[Confirmation]] = {}
        self._receipts: AsyncConfirmConsumer | None = None  # e2e subscriptions' consumer
        # what is sent in one loop turn (a gather of publishes) leaves in one AMQP message
        self._batcher = Batcher.of(self._publish_body, topology)

    @classmethod
    async def connect(
        cls, settings: Settings, *, topology: PhoenixTopology, cluster: str
    ) -> PhoenixClient:
        """A client of ``cluster`` on its own RabbitMQ and vhost (``close`` it when done)."""
        wanted = ClientCore.settings_for(settings, topology, cluster)
        return cls(await AsyncClient(settings=wanted).connect(), topology=topology, cluster=cluster)

    async def close(self) -> None:
        if self._receipts is not None:
            await self._receipts.close()
        await self.client.close()

    async def consume(
        self,
        queue: str,
        handler: Callable[[Event, Publish], Awaitable[None]],
        *,
        e2e: bool = False,
        prefetch: int | None = None,
    ) -> str:
        """Handle the events delivered into ``queue``: ``handler(event, message)`` (the
        message carries the hops and the broker that matched it); returns the consumer
        tag.  ``e2e=True`` for a ``confirm="e2e"`` subscription: the receipt goes back
        once the handler returned (``Reject`` from it: a negative receipt).  A body that
        is not a Phoenix event is dead-lettered with the reason.  A delivery that carries
        a batch of copies (``copy_batch_max``) is handed over one event at a time, in
        order; an event whose handler raised is put back alone (``Requeue``) or
        dead-lettered alone, and the delivery is acknowledged once each is settled."""

        async def on_delivery(delivery: Delivery) -> None:
            batch = self.core.batch_of(delivery)
            if batch is None:
                await handler(*self.core.delivered(delivery))
                return
            events, failed = batch
            for message in events:
                try:
                    await handler(message.event, message)
                except Exception as exc:  # this event alone; the batch's others go on
                    failed.append(self.core.failed(message, exc))
            for body, outcome in failed:
                await self._settle_one(delivery, body, outcome)

        if not e2e:
            return await self.client.consume(queue, on_delivery, prefetch=prefetch)
        if self._receipts is None:
            self._receipts = AsyncConfirmConsumer(self.client)
        on_e2e = functools.partial(self._on_e2e, handler, self._receipts.core)
        return await self._receipts.consume(queue, on_e2e, prefetch=prefetch)

    async def _on_e2e(
        self,
        handler: Callable[[Event, Publish], Awaitable[None]],
        receipts: ConsumerCore,
        delivery: Delivery,
    ) -> None:
        """An e2e delivery: a lone event, or a batch whose events are each checked
        against the duplicate filter as the message it would be alone; a ``Requeue``
        of one sends the whole delivery back (no receipt), whose events handled already
        are skipped when it comes again."""
        batch = self.core.e2e_batch_of(delivery)
        if batch is None:
            await handler(*self.core.delivered(delivery))
            return
        events, failed = batch
        queue, again = delivery.queue, False
        for message, name in events:
            if name and self.core.handled_before(receipts, queue, message, name, failed):
                continue
            error = None
            try:
                await handler(message.event, message)
            except Exception as exc:  # this event alone; the batch's others go on
                error = exc
            again |= self.core.element_settled(receipts, queue, message, name, error, failed)
        for body, outcome in failed:
            await self._settle_one(delivery, body, outcome)
        if again:
            raise Requeue("an event of the batch asked to be handled again")

    async def _settle_one(self, delivery: Delivery, body: bytes, outcome: Outcome) -> None:
        if outcome.action is Action.REQUEUE:
            await self.client.publish(outgoing_body(body, delivery.queue))
        else:
            await self.client.dead_letter(dataclasses.replace(delivery, body=body), outcome.reason)

    async def _on_reply(self, delivery: Delivery) -> None:
        reply = self.core.reply(delivery)
        waiter = self._awaited.get(reply.subscription_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(reply)

    async def _send(self, message: Message) -> None:
        if self.core.inbox not in self.client.topology.queues:
            await self.client.declare_queue(
                role_inbox_spec(self.core.inbox, self.topology, self.client)
            )
        body = encode(message)
        await self._batcher.send(self.cluster, self.core.inbox, body, 0)

    async def _publish_body(self, cluster: str, queue: str, body: bytes, priority: int) -> None:
        persistent = self.topology.persistent
        await self.client.publish(
            outgoing_body(body, queue, priority=priority, persistent=persistent)
        )

    async def _request(self, request: Subscribe | Unsubscribe, wait_s: float | None) -> bool:
        """Send an (un)subscribe; with ``wait_s``, wait for the owner's confirmation."""
        if wait_s is None:
            await self._send(request)
            return self.core.outcome(request, None)
        if not self._listening:
            await self.client.declare_queue(self.core.reply_spec())
            await self.client.consume(self.core.reply_queue, self._on_reply)
            self._listening = True
        sid = request.subscription_id
        waiter = self._awaited[sid] = asyncio.get_running_loop().create_future()
        try:
            await self._send(request)
            try:
                async with asyncio.timeout(wait_s):
                    reply = await waiter
            except TimeoutError:
                raise self.core.unconfirmed(request, wait_s) from None
        finally:
            self._awaited.pop(sid, None)
        return self.core.outcome(request, reply)

    async def advertise(self, event_type: str) -> None:
        await self._send(self.core.advertisement(event_type))

    async def subscribe(
        self,
        event_type: str,
        filter: Iterable[Sequence[Any]] | None,
        latency_level: int,
        queue: str,
        *,
        confirm: str = "broker",
        wait_s: float | None = 30.0,
        queue_spec: QueueSpec | None = None,
    ) -> str:
        """Subscribe ``queue`` (declared here) to matching events; return the id.

        Returns once the event type's owner has the subscription in place (matched from
        then on, held by W of N replicas); raises :class:`SubscriptionUnconfirmed` when
        that is not confirmed in ``wait_s`` (it may still take effect).  ``wait_s=None``
        returns as soon as the subscription is sent.

        ``confirm="e2e"``: the match broker counts an event delivered only once the
        subscriber's handler took it (``consume(queue, handler, e2e=True)``); a rejection
        or silence past every resend dead-letters the event with the reason.

        ``queue_spec``: how ``queue`` is declared (named ``queue``): a quorum queue that
        outlives its node, a bound, arguments.  Default: a durable classic queue.  A
        queue that exists with other arguments fails with ``PreconditionFailed``.
        """
        spec = self.core.subscriber_queue(queue, queue_spec)
        request = self.core.subscription(event_type, filter, latency_level, queue, confirm, wait_s)
        await self.client.declare_queue(spec)
        await self._request(request, wait_s)
        return request.subscription_id

    async def unsubscribe(
        self, event_type: str, subscription_id: str, *, wait_s: float | None = 30.0
    ) -> bool:
        """Remove a subscription (made through any cluster) of ``event_type``; the routing
        masters that counted its latency level take it out of latencyMap.

        Returns once the owner removed it and W of N replicas hold the removal: True, or
        False when the owner does not know it (removed before, or never made).  Raises
        :class:`SubscriptionUnconfirmed` like :meth:`subscribe`; ``wait_s=None`` only
        sends it (and returns True)."""
        return await self._request(
            self.core.unsubscription(event_type, subscription_id, wait_s), wait_s
        )

    async def publish(self, event: Event | dict[str, Any]) -> None:
        await self._send(self.core.publication(event))


class SyncPhoenixClient:
    """The sync face (pika): the same verbs, messages and confirmations, blocking.

    Confirmations are read inside the call that waits for them (the client's
    :meth:`~middleware.transport.SyncClient.run`), as pika's blocking connection does
    everything on the caller's thread."""

    def __init__(self, client: SyncClient, *, topology: PhoenixTopology, cluster: str) -> None:
        self.core = ClientCore(client.settings, topology, cluster)
        self.client, self.topology, self.cluster = client, topology, cluster
        self._listening = False
        self._replies: dict[str, Confirmation] = {}
        self._receipts: SyncConfirmConsumer | None = None  # e2e subscriptions' consumer

    @classmethod
    def connect(
        cls, settings: Settings, *, topology: PhoenixTopology, cluster: str
    ) -> SyncPhoenixClient:
        """A client of ``cluster`` on its own RabbitMQ and vhost (``close`` it when done)."""
        wanted = ClientCore.settings_for(settings, topology, cluster)
        return cls(SyncClient(settings=wanted).connect(), topology=topology, cluster=cluster)

    def close(self) -> None:
        self.client.close()

    def consume(
        self,
        queue: str,
        handler: Callable[[Event, Publish], None],
        *,
        e2e: bool = False,
        prefetch: int | None = None,
    ) -> str:
        """As :meth:`PhoenixClient.consume`; the events are handled inside :meth:`run`."""

        def on_delivery(delivery: Delivery) -> None:
            batch = self.core.batch_of(delivery)
            if batch is None:
                handler(*self.core.delivered(delivery))
                return
            events, failed = batch
            for message in events:
                try:
                    handler(message.event, message)
                except Exception as exc:  # this event alone; the batch's others go on
                    failed.append(self.core.failed(message, exc))
            for body, outcome in failed:
                self._settle_one(delivery, body, outcome)

        if not e2e:
            return self.client.consume(queue, on_delivery, prefetch=prefetch)
        if self._receipts is None:
            self._receipts = SyncConfirmConsumer(self.client)
        on_e2e = functools.partial(self._on_e2e, handler, self._receipts.core)
        return self._receipts.consume(queue, on_e2e, prefetch=prefetch)

    def _on_e2e(
        self, handler: Callable[[Event, Publish], None], receipts: ConsumerCore, delivery: Delivery
    ) -> None:
        """As :meth:`PhoenixClient._on_e2e`."""
        batch = self.core.e2e_batch_of(delivery)
        if batch is None:
            handler(*self.core.delivered(delivery))
            return
        events, failed = batch
        queue, again = delivery.queue, False
        for message, name in events:
            if name and self.core.handled_before(receipts, queue, message, name, failed):
                continue
            error = None
            try:
                handler(message.event, message)
            except Exception as exc:  # this event alone; the batch's others go on
                error = exc
            again |= self.core.element_settled(receipts, queue, message, name, error, failed)
        for body, outcome in failed:
            self._settle_one(delivery, body, outcome)
        if again:
            raise Requeue("an event of the batch asked to be handled again")

    def _settle_one(self, delivery: Delivery, body: bytes, outcome: Outcome) -> None:
        if outcome.action is Action.REQUEUE:
            self.client.publish(outgoing_body(body, delivery.queue))
        else:
            self.client.dead_letter(dataclasses.replace(delivery, body=body), outcome.reason)

    def run(self, seconds: float | None = None, *, until: Callable[[], bool] | None = None) -> None:
        """Handle deliveries for ``seconds`` (forever if None) or until ``until()``."""
        self.client.run(seconds, until=until)

    def __enter__(self) -> SyncPhoenixClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_reply(self, delivery: Delivery) -> None:
        reply = self.core.reply(delivery)
        self._replies[reply.subscription_id] = reply

    def _send(self, message: Message) -> None:
        with self.client.turn():  # threads share the client: one declares the inbox
            if self.core.inbox not in self.client.topology.queues:
                spec = role_inbox_spec(self.core.inbox, self.topology, self.client)
                self.client.declare_queue(spec)
            self.client.publish(
                outgoing(message, self.core.inbox, persistent=self.topology.persistent)
            )

    def _request(self, request: Subscribe | Unsubscribe, wait_s: float | None) -> bool:
        if wait_s is None:
            self._send(request)
            return self.core.outcome(request, None)
        with self.client.turn():  # threads share the client: one starts the listening
            if not self._listening:
                self.client.declare_queue(self.core.reply_spec())
                self.client.consume(self.core.reply_queue, self._on_reply)
                self._listening = True
        sid = request.subscription_id
        self._send(request)
        self.client.run(wait_s, until=lambda: sid in self._replies)
        reply = self._replies.pop(sid, None)
        if reply is None:
            raise self.core.unconfirmed(request, wait_s)
        return self.core.outcome(request, reply)

    def advertise(self, event_type: str) -> None:
        self._send(self.core.advertisement(event_type))

    def subscribe(
        self,
        event_type: str,
        filter: Iterable[Sequence[Any]] | None,
        latency_level: int,
        queue: str,
        *,
        confirm: str = "broker",
        wait_s: float | None = 30.0,
        queue_spec: QueueSpec | None = None,
    ) -> str:
        """As :meth:`PhoenixClient.subscribe`."""
        spec = self.core.subscriber_queue(queue, queue_spec)
        request = self.core.subscription(event_type, filter, latency_level, queue, confirm, wait_s)
        self.client.declare_queue(spec)
        self._request(request, wait_s)
        return request.subscription_id

    def unsubscribe(
        self, event_type: str, subscription_id: str, *, wait_s: float | None = 30.0
    ) -> bool:
        """As :meth:`PhoenixClient.unsubscribe`."""
        return self._request(self.core.unsubscription(event_type, subscription_id, wait_s), wait_s)

    def publish(self, event: Event | dict[str, Any]) -> None:
        self._send(self.core.publication(event))
