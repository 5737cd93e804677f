"""EMQ-style persistent queues over RabbitMQ (asyncio face).

The paper's verbs: :meth:`create_queue`, :meth:`destroy_queue`, :meth:`enqueue`,
:meth:`dequeue` (and :meth:`messages`, a consumer iterator), :meth:`recover`.

* ``enqueue`` returns once the message is safe: confirmed by the broker (a quorum
  queue's majority has it on disk), or, while no node is reachable, appended to
  the local spool; the result says which.  Once anything is spooled, later
  enqueues queue up behind it, so a producer's order holds.
* The spool drains in order when a node comes back (failover hook) and on
  ``recover()``; an entry is deleted only after the broker confirmed it.
* Windows: ``publish_window`` unconfirmed enqueues per producer (a full window
  delays the caller, or raises ``WindowExceeded`` with ``block=False``) and
  ``prefetch`` unacked deliveries per consumer.
* Consumers drop copies of a message id they already acked (a resend after a
  lost confirm), with the confirms package's bounded duplicate filter.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from .. import tracing
from ..confirms.tracking import DuplicateFilter, Receipt
from ..errors import (
    BrokerUnreachable,
    MiddlewareError,
    Reject,
    Requeue,
    WindowExceeded,
)
from ..settings import QueueSettings
from ..transport import AsyncClient, Delivery, QueueKind
from ..transport.message import new_message_id
from .core import (
    EnqueueResult,
    EnqueueStatus,
    RecoverReport,
    admit,
    as_delivery,
    drain_failure,
    must_spool,
    no_spool,
    open_spool,
    queue_spec,
    spool_full,
    spool_or_raise,
    to_message,
    validate,
)
from .sharing import NodePool
from .spool import Spool, SpoolEntry, SpoolFull

__all__ = ["AsyncQueues", "QueueMessage"]

log = logging.getLogger(__name__)
RETRY_DRAIN_S = 1.0


class QueueMessage:
    """A dequeued message: call exactly one of :meth:`ack` / :meth:`reject`."""

    def __init__(self, delivery: Delivery, decision: asyncio.Future[BaseException | None]) -> None:
        self.delivery = delivery
        self._decision = decision

    @property
    def body(self) -> bytes:
        return self.delivery.body

    @property
    def message_id(self) -> str | None:
        return self.delivery.message_id

    async def ack(self) -> None:
        if not self._decision.done():
            self._decision.set_result(None)

    async def reject(self, reason: str = "", *, requeue: bool = False) -> None:
        if not self._decision.done():
            self._decision.set_result(Requeue(reason) if requeue else Reject(reason))


class AsyncQueues:
    """Persistent queues on one :class:`AsyncClient`, with a local spool."""

    def __init__(
        self,
        client: AsyncClient,
        *,
        settings: QueueSettings | None = None,
        spool: Spool | None = None,
        pool: NodePool | None = None,
    ) -> None:
        self.client = client
        self.pool = pool  # opt-in load sharing over nodes (gives up per-producer order)
        self.settings = settings or client.settings.queues
        self.spool = spool if spool is not None else open_spool(self.settings)
        self._window = asyncio.Semaphore(client.settings.publish_window)
        self._drain_lock = asyncio.Lock()
        self._drain_task: asyncio.Task[int] | None = None
        self._dedup = DuplicateFilter(client.settings.confirms.dedup_window)
        self._inboxes: dict[str, asyncio.Queue[QueueMessage]] = {}
        # (queue, message id) handed to the application and not yet decided: a copy
        # arriving meanwhile (a redelivery after a lost connection, a resend) waits
        self._in_hand: dict[tuple[str, str], asyncio.Future[BaseException | None]] = {}
        self._pending_spool: list[tuple[SpoolEntry, asyncio.Future[None]]] = []
        client.on_reconnect(self._on_reconnect)

    async def start(self) -> AsyncQueues:
        """Connect if needed and drain what an earlier process left in the spool."""
        if not self.client.ready:
            try:
                await self.client.connect()
            except BrokerUnreachable as exc:
                log.warning("no broker reachable (%s): spooling until one answers", exc)
                self.client.reconnect_in_background()
        if self.pool is not None:
            await self.pool.start()
        self._kick()
        return self

    # ------------------------------------------------------------ the verbs
    async def create_queue(
        self,
        name: str,
        *,
        kind: QueueKind = QueueKind.QUORUM,
        dead_letter_exchange: str | None = None,
        max_length: int | None = None,
        message_ttl_ms: int | None = None,
        overflow: str | None = None,
    ) -> None:
        """Declare a durable queue (quorum by default); idempotent with the same options."""
        await self.client.declare_queue(
            queue_spec(
                name,
                kind=kind,
                dead_letter_exchange=dead_letter_exchange,
                max_length=max_length,
                message_ttl_ms=message_ttl_ms,
                overflow=overflow,
            )
        )

    async def destroy_queue(self, name: str) -> None:
        await self.client.delete_queue(name)

    async def enqueue(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        block: bool = True,
        schema: Callable[[bytes], Any] | None = None,
    ) -> EnqueueResult:
        """Make the message safe; return whether the broker confirmed it or the spool holds it."""
        clean = validate(body, headers, max_bytes=self.settings.max_message_bytes, schema=schema)
        if tracing.active():  # a spooled message is drained in the context it was accepted in
            clean = tracing.injected(clean)
        message_id = message_id or new_message_id()
        if not block and self._window.locked():
            raise WindowExceeded(
                f"{self.client.settings.publish_window} enqueues unconfirmed "
                f"(code 5: {WindowExceeded.hint})"
            )
        entry = SpoolEntry(queue, message_id, bytes(body), clean)
        message = admit(to_message(entry), self.client.limits)
        async with self._window:
            if must_spool(self.client.ready, self.spool):
                return await self._to_spool(entry)
            picked = self.pool.pick() if self.pool is not None else None
            publisher = picked[1] if picked is not None else self.client
            try:
                await publisher.publish(message, retry=False)
            except MiddlewareError as exc:
                spool_or_raise(queue, exc, can_spool=self.spool is not None)
                return await self._to_spool(entry)
        return EnqueueResult(message_id, EnqueueStatus.CONFIRMED)

    async def dequeue(
        self,
        queue: str,
        *,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> QueueMessage | None:
        """The next message (None after ``timeout`` s); ack or reject it explicitly."""
        inbox = await self._inbox(queue)
        try:
            return await asyncio.wait_for(inbox.get(), timeout)
        except TimeoutError:
            return None

    async def messages(self, queue: str) -> AsyncIterator[QueueMessage]:
        """Consumer iterator: ``async for m in queues.messages(q): ...; await m.ack()``."""
        inbox = await self._inbox(queue)
        while True:
            yield await inbox.get()

    async def recover(self) -> RecoverReport:
        """Replay everything the spool holds, in order; report what was sent and what is left."""
        replayed = await self._drain()
        return RecoverReport(replayed, len(self.spool) if self.spool is not None else 0)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self._drain_task is not None:
            self._drain_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, MiddlewareError):
                await self._drain_task

    # -------------------------------------------------------------- spool
    async def _to_spool(self, entry: SpoolEntry) -> EnqueueResult:
        """Append to the spool; enqueues arriving in the same loop turn share one commit."""
        if self.spool is None:
            raise no_spool(entry.queue)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._pending_spool.append((entry, done))
        if len(self._pending_spool) == 1:
            loop.call_soon(self._commit_spool)
        await done
        return EnqueueResult(entry.message_id, EnqueueStatus.SPOOLED)

    def _commit_spool(self) -> None:
        batch, self._pending_spool = self._pending_spool, []
        assert self.spool is not None
        try:
            self.spool.append(entry for entry, _ in batch)
        except SpoolFull as exc:
            error = spool_full(exc)
            for _, done in batch:
                done.set_exception(error)
            return
        for _, done in batch:
            done.set_result(None)
        self._kick()

    async def _on_reconnect(self) -> None:
        self._kick()

    def _kick(self) -> None:
        if self.spool is None or not len(self.spool) or not self.client.ready:
            return
        if self._drain_task is None or self._drain_task.done():
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> int:
        """Send spool entries in order with a sliding window; delete each once confirmed.

        A broken connection fails a suffix of what is in flight (one channel keeps
        order), so the confirmed entries are exactly those deleted and the rest are
        resent later in order; a resent copy of a message the broker already had is
        dropped by the consumers' duplicate filter.
        """
        if self.spool is None:
            return 0
        spool, window = self.spool, self.client.settings.publish_window
        sent, after, failed = 0, 0, False
        flight: collections.deque[tuple[SpoolEntry, asyncio.Task[None]]] = collections.deque()
        done: list[int] = []
        async with self._drain_lock:
            while self.client.ready and not failed:
                if len(flight) < window // 2:
                    for entry in spool.peek(window - len(flight), after=after):
                        with tracing.resumed(entry.headers, f"spool {entry.queue}"):
                            task = asyncio.ensure_future(
                                self.client.publish(to_message(entry), retry=False)
                            )
                        flight.append((entry, task))
                        after = entry.seq
                if not flight:
                    break
                entry, task = flight.popleft()
                try:
                    await task
                    done.append(entry.seq)
                except MiddlewareError as exc:
                    reason = drain_failure(entry, exc)
                    if reason is None:
                        log.info("spool drain paused: %s", exc)
                        failed = True
                    else:  # it can never be sent: out of the spool, to the dead letters
                        await self.client.dead_letter(as_delivery(entry), reason)
                        done.append(entry.seq)
                if len(done) >= self.settings.drain_batch or failed or not flight:
                    spool.delete(done)
                    sent += len(done)
                    done = []
            for _, task in flight:  # let the rest finish; they are resent if unconfirmed
                with contextlib.suppress(Exception):
                    await task
        spool.delete(done)
        sent += len(done)
        if failed:
            asyncio.get_running_loop().call_later(RETRY_DRAIN_S, self._kick)
        if sent:
            log.info("drained %d spooled message(s); %d left", sent, len(spool))
        return sent

    # ----------------------------------------------------------- consumer
    def _copy_settled(self, key: tuple[str, str], first: BaseException | None) -> None:
        """A copy of a message in hand, settled as the application settled the first:
        acked silently, or dead-lettered with the same reason (a requeued first lets
        the copy through to the application)."""
        if first is not None:
            raise first
        self._dedup.remember(Receipt(key[1], key[0]))

    async def _inbox(self, queue: str) -> asyncio.Queue[QueueMessage]:
        inbox = self._inboxes.get(queue)
        if inbox is None:
            inbox = self._inboxes[queue] = asyncio.Queue()

            async def handler(delivery: Delivery) -> None:
                key = (delivery.queue, delivery.message_id or "")
                if delivery.message_id:
                    earlier = self._in_hand.get(key)
                    while earlier is not None:
                        # a copy of a message the application holds: one decision
                        # for both (a redelivery after the connection of the first
                        # was lost, or a resend, comes while the first is in hand)
                        first = await asyncio.shield(earlier)
                        if first is None or isinstance(first, Reject):
                            return self._copy_settled(key, first)
                        following = self._in_hand.get(key)  # requeued: the next copy's
                        earlier = following if following is not earlier else None
                    if self._dedup.get(*key) is not None:
                        return  # a resend of a message already acked: ack it again, silently
                decision: asyncio.Future[BaseException | None] = (
                    asyncio.get_running_loop().create_future()
                )
                if delivery.message_id:
                    self._in_hand[key] = decision
                try:
                    await inbox.put(QueueMessage(delivery, decision))
                    error = await asyncio.shield(decision)
                finally:
                    if self._in_hand.get(key) is decision:
                        del self._in_hand[key]
                if error is not None:
                    raise error
                if delivery.message_id:
                    self._dedup.remember(Receipt(key[1], key[0]))

            await self.client.consume(queue, handler)
        return inbox
