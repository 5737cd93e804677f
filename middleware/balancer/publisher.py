"""Replicated topics and the publisher that spreads a topic's messages over its replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Self, Unpack

from ..errors import ConfirmTimeout, EntityNotFound, MiddlewareError, PublishNacked, Unroutable
from ..settings import Settings
from ..transport import (
    AsyncClient,
    AsyncHandler,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
)
from ..transport.message import new_message_id
from . import metrics
from .choice import Choice, ChoiceOptions
from .reports import REPORT_EXCHANGE, replica_names

__all__ = ["BalancedPublisher", "declare_replicated_topic", "subscribe_replicated"]

log = logging.getLogger(__name__)


async def declare_replicated_topic(
    settings: Settings, topic: str, replicas: int, *, kind: QueueKind = QueueKind.QUORUM
) -> list[str]:
    """Declare R replica queues, replica i led by node i mod N (client-local placement)."""
    names = replica_names(topic, replicas)
    for i, name in enumerate(names):
        async with AsyncClient(settings=settings.starting_at(i)) as client:
            await client.declare_queue(QueueSpec(name, kind=kind, leader_locator="client-local"))
    return names


async def subscribe_replicated(
    client: AsyncClient,
    topic: str,
    replicas: int,
    handler: AsyncHandler,
    *,
    prefetch: int | None = None,
) -> list[str]:
    """Consume every replica of ``topic`` with ``handler``; return the consumer tags."""
    return [
        await client.consume(queue, handler, prefetch=prefetch)
        for queue in replica_names(topic, replicas)
    ]


class BalancedPublisher(Choice):
    """Sends each message of a topic to exactly one replica, chosen by ``algorithm``
    (the choice: ``Choice``; this face sends, receives the reports and looks for
    missing replicas, on the asyncio core).

    Reports older than ``stale_after`` (default 3 x the report period) are
    ignored: the publisher falls back to equal weights (round robin) until a
    fresh report arrives.

    A replica whose queue is gone leaves the choice at once: publishes are mandatory,
    and a returned one (or a report saying the queue does not exist) takes the replica
    out and sends the message to a live one, within the same ``publish_timeout``; so does
    a replica that refuses a publish (``basic.nack``: a full queue with
    ``x-overflow: reject-publish``), for ``recheck_s`` (on the last replica left the
    client's retries run as for any publish, then ``PublishNacked``).  A
    missing replica is looked for every ``recheck_s`` (a passive declare) and comes
    back once its queue exists again.  No publish outlives ``publish_timeout``: past
    it, ``ConfirmTimeout``.

    A replica that does not confirm within ``stall_s`` while the client's own node
    answers a round trip (``AsyncClient.answers``: the replica's node frozen, which the
    broker still counts as up, so nothing is returned) is *stalled*: the message goes to
    a live replica as well, and the stalled one leaves the choice until its publish is
    confirmed (or fails).  The first confirm answers the caller.  Such a message may
    then be delivered twice, from both replicas, with the same message id (at least
    once, as every confirm mode across a fault); ``resent`` counts them.
    """

    def __init__(
        self, client: AsyncClient, *, topic: str, replicas: int, **options: Unpack[ChoiceOptions]
    ) -> None:
        super().__init__(topic=topic, replicas=replicas, **options)
        self.client = client
        self._stalled_sends: dict[asyncio.Task[str], int] = {}  # stalled publishes: replica
        self._recheck: asyncio.Task[None] | None = None

    async def start(self) -> Self:
        self._recheck = asyncio.create_task(self._recheck_missing())
        if self.algorithm == "round_robin":
            return self
        exchange, queue, binding = report_topology(self.topic, report_inbox(self.topic, self))
        await self.client.declare_exchange(exchange)
        await self.client.declare_queue(queue)
        await self.client.bind(binding)
        await self.client.consume(queue.name, self._on_report, prefetch=1)
        return self

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recheck
        for task in list(self._stalled_sends):  # (their callers were answered elsewhere)
            task.cancel()
        await asyncio.gather(*self._stalled_sends, return_exceptions=True)

    async def publish(self, body: bytes, **fields: object) -> str:
        """Publish to a chosen live replica with broker confirms; return its queue."""
        limit = self.client.settings.publish_timeout
        message_id = str(fields.pop("message_id", None) or new_message_id())
        tried: set[int] = set()
        pending: dict[asyncio.Task[str], int] = {}  # this message's stalled publishes
        try:
            async with asyncio.timeout(limit):
                while True:
                    if pending and not self.choosable(tried):
                        # every other replica tried: wait for a stalled one's confirm
                        done, _ = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                        for task in done:
                            pending.pop(task)
                            if not task.cancelled() and task.exception() is None:
                                return task.result()
                        continue
                    index = self.choose(exclude=tried)
                    tried.add(index)
                    if pending:
                        self.resending()
                    message = replica_message(self.queues[index], body, message_id, fields)
                    # a nack sends it elsewhere; on the last replica the client retries it
                    last = not self.choosable(tried)
                    task = asyncio.ensure_future(self._send(index, message, retry_nacked=last))
                    done, _ = await asyncio.wait({task}, timeout=self.stall_s)
                    while not done and not await self.client.answers(self.stall_s):
                        # not the replica: the client's own node or link is silent (its
                        # failover resends this publish): sending elsewhere would only
                        # add copies
                        done, _ = await asyncio.wait({task}, timeout=self.stall_s)
                    if not task.done():
                        pending[task] = index
                        self._stall_send(index, task)
                        continue
                    try:
                        return task.result()
                    except (Unroutable, EntityNotFound):
                        self.gone(index)
                    except PublishNacked:
                        if last:
                            raise
                        self.refused(index)
        except TimeoutError:
            metrics.BALANCED_TIMEOUTS.labels(self.topic).inc()
            raise publish_timed_out(self.topic, message_id, limit) from None

    async def _send(self, index: int, message: OutgoingMessage, *, retry_nacked: bool) -> str:
        await self.client.publish(message, retry_nacked=retry_nacked)
        return self.queues[index]

    def _stall_send(self, index: int, task: asyncio.Task[str]) -> None:
        """``index`` did not confirm within ``stall_s``: out of the choice until ``task``
        (that publish, running on) ends, which the caller may no longer wait for."""
        self._stalled_sends[task] = index
        self.stall(index)
        task.add_done_callback(lambda done: self._send_ended(index, done))

    def _send_ended(self, index: int, task: asyncio.Task[str]) -> None:
        self._stalled_sends.pop(task, None)
        if not task.cancelled():
            task.exception()  # (retrieved: a stalled publish's failure is not the caller's)
        self.unstall(index)

    async def _recheck_missing(self) -> None:
        while True:
            await asyncio.sleep(self.recheck_s)
            for index in sorted(self.missing):
                try:
                    await self.client.queue_length(self.queues[index])
                except MiddlewareError as exc:
                    self.rechecked(index, exc)
                else:
                    self.rechecked(index, None)

    async def _on_report(self, delivery: Delivery) -> None:
        self.take_report(delivery.body)


def report_inbox(topic: str, publisher: object) -> str:
    """A publisher's own queue of the last load report of ``topic``."""
    return f"qosmq.balancer.inbox.{topic}.{id(publisher):x}"


def report_topology(topic: str, inbox: str) -> tuple[ExchangeSpec, QueueSpec, BindingSpec]:
    """The report exchange, a publisher's inbox (exclusive, holding the last report
    only) and the binding between them: what a publisher of either face declares."""
    return (
        ExchangeSpec(REPORT_EXCHANGE, ExchangeType.DIRECT),
        QueueSpec(inbox, kind=QueueKind.CLASSIC, durable=False, exclusive=True, max_length=1),
        BindingSpec(inbox, REPORT_EXCHANGE, topic),
    )


def replica_message(
    queue: str, body: bytes, message_id: str, fields: dict[str, object]
) -> OutgoingMessage:
    """The message to one replica: mandatory, so a queue that is gone returns it."""
    return OutgoingMessage(
        body,
        "",
        queue,
        message_id=message_id,
        mandatory=True,
        **fields,  # type: ignore[arg-type]
    )


def publish_timed_out(topic: str, message_id: str, limit: float) -> ConfirmTimeout:
    return ConfirmTimeout(
        f"topic {topic!r}: message {message_id} not confirmed within publish_timeout = {limit} s"
    )
