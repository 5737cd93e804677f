"""Asyncio face of the confirm modes: a publisher and a consumer over :class:`AsyncClient`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import weakref
from asyncio import FIRST_COMPLETED
from collections.abc import Iterable, Mapping
from typing import Any, Self

from .. import tracing
from ..errors import LinkDown, MessageRefused, MiddlewareError
from ..settings import ConfirmSettings
from ..transport.aio import AsyncClient, AsyncHandler
from ..transport.delivery import Action, Delivery, Outcome
from ..transport.message import OutgoingMessage
from ..transport.translate import translate_aio
from . import metrics
from .core import ConsumerCore, PublisherCore, Settled, new_batcher
from .modes import ConfirmMode
from .tracking import Receipt

__all__ = ["AsyncConfirmConsumer", "AsyncConfirmPublisher"]

log = logging.getLogger(__name__)


class AsyncConfirmPublisher:
    """Publishes in one :class:`ConfirmMode`; ``await publish(...)`` returns once confirmed.

    In the e2e modes "confirmed" means a receipt came from every expected queue's
    consumer; a rejecting handler fails the publish with ``NegativeReceipt``, and
    silence past every resend with ``ReceiptTimeout`` naming the queues.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        mode: ConfirmMode | str = ConfirmMode.E2E,
        confirms: ConfirmSettings | None = None,
    ) -> None:
        self.client = client
        self.mode = ConfirmMode(mode)
        settings = client.settings
        self.core = PublisherCore(
            mode=self.mode,
            confirms=confirms or settings.confirms,
            retry=settings.retry,
            topology=client.topology,
        )
        self._window = asyncio.Semaphore(settings.publish_window)
        self._futures: dict[str, asyncio.Future[None]] = {}
        self._sent_at: dict[str, float] = {}  # message id -> monotonic, for the metrics
        self._ticker: asyncio.Task[None] | None = None
        self._refused_seen = client.refused_closes
        self._resending = asyncio.Lock()  # timeout resends wait while suspects are resent

    async def start(self) -> Self:
        if self.core.profile.receipts:
            await self.client.listen_replies(self._on_reply)
            self._ticker = asyncio.create_task(self._tick())
            self.client.on_reconnect(self._resend_all)
        return self

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(
        self,
        body: bytes,
        *,
        exchange: str = "",
        routing_key: str = "",
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        expect: Iterable[str] | None = None,
        priority: int | None = None,
    ) -> None:
        """Publish and wait for the mode's confirm (a full window waits first)."""
        profile = self.core.profile

        def prepare() -> OutgoingMessage:
            return self.core.prepare(
                body,
                exchange=exchange,
                routing_key=routing_key,
                headers=headers,
                message_id=message_id,
                expect=expect,
                priority=priority,
            )

        if not profile.receipts:
            # broker confirms are windowed by the client itself
            message = prepare()
            self._sent_at[message.message_id] = time.monotonic()
            try:
                await self.client.publish(message, confirm=profile.broker_confirm)
            except BaseException as exc:
                self._count([(message.message_id, exc)])
                raise
            self._count([(message.message_id, None)])
            return
        async with self._window:
            message = prepare()  # starts the receipt clock: only once it may really leave
            future = asyncio.get_running_loop().create_future()
            self._futures[message.message_id] = future
            self._sent_at[message.message_id] = time.monotonic()
            try:
                await self.client.publish(message, confirm=False)
                await future
            except Exception as exc:
                self._count([(message.message_id, exc)])  # unless settled (counted) already
                raise
            finally:
                self._futures.pop(message.message_id, None)
                self._sent_at.pop(message.message_id, None)
                self.core.forget(message.message_id)

    async def publish_held(
        self,
        body: bytes,
        *,
        hold_s: float,
        taken_within: float,
        exchange: str = "",
        routing_key: str = "",
        message_id: str | None = None,
        expect: Iterable[str] | None = None,
        headers: Mapping[str, Any] | None = None,
    ) -> bool:
        """An e2e publish whose receipts are waited for ``hold_s`` at most (``pace.py``):
        True when every expected queue answered in time; False when the time passed and
        the broker holds the message (within ``taken_within`` seconds), which is then
        neither resent nor waited for.  Raises ``NegativeReceipt`` for a refusal in time,
        ``LinkDown`` when the broker did not take it within ``taken_within``,
        ``Unroutable`` when it returned it (published mandatory: no queue took it), or
        the publish's own error."""
        if not self.core.profile.receipts:
            raise ValueError(f"publish_held needs an e2e mode, not {self.mode}")
        async with self._window:
            message = self.core.prepare(
                body,
                exchange=exchange,
                routing_key=routing_key,
                headers=headers,
                message_id=message_id,
                expect=expect,
                priority=None,
            )
            # mandatory: a copy its queue could not take (gone, or its node down: the
            # broker acks what it routed nowhere) raises ``Unroutable`` (its ``taken``)
            message = dataclasses.replace(message, mandatory=True)
            future = asyncio.get_running_loop().create_future()
            self._futures[message.message_id] = future
            self._sent_at[message.message_id] = time.monotonic()
            try:
                taken = await self.client.publish_watched(message)
                if hold_s > 0:
                    await _receipt_or_return(future, taken, hold_s)
                if future.done():
                    future.result()  # a refusal raises
                    return True
                try:
                    await asyncio.wait_for(taken, taken_within)
                except TimeoutError:
                    raise LinkDown(
                        f"message {message.message_id}: the broker did not take it within "
                        f"{taken_within} s"
                    ) from None
                except MiddlewareError:
                    raise
                except Exception as exc:
                    raise translate_aio(exc) from exc
                confirmed = future.done() and future.exception() is None
                if not confirmed and self._sent_at.pop(message.message_id, None) is not None:
                    metrics.CONFIRMS.labels(self.mode.value, "held").inc()
                return confirmed
            except Exception as exc:
                self._count([(message.message_id, exc)])
                raise
            finally:
                self._futures.pop(message.message_id, None)
                self._sent_at.pop(message.message_id, None)
                self.core.forget(message.message_id)

    def publish_nowait(self, body: bytes, **kwargs: Any) -> asyncio.Future[None]:
        """Start a publish; the future resolves with the mode's confirm."""
        return asyncio.ensure_future(self.publish(body, **kwargs))

    @property
    def in_flight(self) -> int:
        return len(self.core.in_flight)

    def _on_reply(self, delivery: Delivery) -> None:
        self._settle(self.core.on_reply(delivery))

    def _count(self, settled: list[Settled]) -> None:
        metrics.settled(self.mode.value, settled, self._sent_at, time.monotonic())

    def _settle(self, settled: list[Settled]) -> None:
        self._count(settled)
        for message_id, error in settled:
            future = self._futures.get(message_id)
            if future is None or future.done():
                continue
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)

    async def _tick(self) -> None:
        period = min(0.05, self.core.tracker.timeout / 4)
        while True:
            await asyncio.sleep(period)
            async with self._resending:
                resend, failed = self.core.due()
                self._settle(failed)
                for message in resend:
                    await self._resend(message)

    async def _resend(self, message: OutgoingMessage) -> None:
        metrics.RESENDS.labels(self.mode.value).inc()
        try:
            await self.client.publish(message, confirm=False)
        except Exception as exc:
            log.info("resend of %s failed (%s); the next timeout retries", message.message_id, exc)

    async def _resend_all(self) -> None:
        """After failover the reply address changed: resend everything still waiting.

        When the broker closed the lost connection in answer to a frame, everything then
        in flight is suspect: each goes again alone, known taken before the next; the
        one the broker closes the connection at again fails with ``MessageRefused``
        (one retry, not one per resend until ``ReceiptTimeout``)."""
        async with self._resending:
            suspect = self.client.refused_closes != self._refused_seen
            self._refused_seen = self.client.refused_closes
            for message in list(self.core.in_flight.values()):
                if message.message_id not in self.core.in_flight:
                    continue  # settled meanwhile
                if not suspect:
                    await self._resend(message)
                    continue
                metrics.RESENDS.labels(self.mode.value).inc()
                try:
                    await self.client.resend_alone(message, confirm=False)
                except MessageRefused as exc:
                    self._settle([self.core.refused(message.message_id, exc)])
                except Exception as exc:
                    log.info(
                        "resend of %s failed (%s); the next timeout retries",
                        message.message_id,
                        exc,
                    )


class _SharedReceipts:
    """One receipt batcher for every :class:`AsyncConfirmConsumer` of an event loop with
    the same confirm settings (``confirms.receipt_scope = "process"``): receipts owed to
    one publisher by all of them leave in one message, sent through whichever member's
    client is up.  One flush loop serves them all; the last member to leave stops it."""

    def __init__(self, confirms: ConfirmSettings) -> None:
        self.batcher = new_batcher(confirms)
        self.members: list[AsyncConfirmConsumer] = []
        self._flusher: asyncio.Task[None] | None = None
        # held while receipts taken from the batcher are being sent: a leaving member
        # waits for them before the flush loop is stopped (stopping it mid-send lost
        # them: the publisher then timed out although every handler had run)
        self._sending = asyncio.Lock()

    def join(self, member: AsyncConfirmConsumer) -> None:
        if member not in self.members:
            self.members.append(member)
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop())

    async def leave(self, member: AsyncConfirmConsumer) -> None:
        """Send every receipt still waiting (the leaver's among them) while its client is
        still open; stop the flush loop with the last member."""
        if member not in self.members:
            return
        async with self._sending:
            await self.send(self.batcher.drain(), via=member)
            self.members.remove(member)
            flusher = self._flusher if not self.members else None
            if flusher is not None:
                flusher.cancel()  # sleeping or waiting for the lock: it holds no receipt
                self._flusher = None
        if flusher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await flusher

    async def send(
        self, batches: list[tuple[str, list[Receipt]]], via: AsyncConfirmConsumer
    ) -> None:
        for reply_to, receipts in batches:
            ready = [m for m in self.members if m is not via and m.client.ready]
            for member in (via, *ready):
                if await member._send(reply_to, receipts):
                    break

    async def _flush_loop(self) -> None:
        period = max(self.batcher.linger_s, 0.001)
        while True:
            await asyncio.sleep(period)
            async with self._sending:
                due = self.batcher.due()
                if due and self.members:
                    ready = [m for m in self.members if m.client.ready] or self.members
                    await self.send(due, via=ready[0])


#: event loop -> confirm settings -> the receipts its consumers share
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, _SharedReceipts]] = (
    weakref.WeakKeyDictionary()
)


def _shared(confirms: ConfirmSettings) -> _SharedReceipts:
    pools = _SHARED.setdefault(asyncio.get_running_loop(), {})
    key = confirms.model_dump_json()
    if key not in pools:
        pools[key] = _SharedReceipts(confirms)
    return pools[key]


class AsyncConfirmConsumer:
    """Wraps handlers so layer publishers get receipts; suppresses resent duplicates.

    With ``confirms.receipt_scope = "process"`` (the default) the consumers of one event
    loop batch their receipts together per publisher; ``"consumer"``: each its own."""

    def __init__(self, client: AsyncClient, *, confirms: ConfirmSettings | None = None) -> None:
        self.client = client
        self.confirms = confirms or client.settings.confirms
        self.core = ConsumerCore(self.confirms)
        self._pool: _SharedReceipts | None = None
        self._flusher: asyncio.Task[None] | None = None
        self._sending = asyncio.Lock()  # held while a flush sends what it took
        self._tags: list[str] = []
        # closing the client alone still lets running handlers settle and sends their receipts
        client.on_close(self._drain)

    async def consume(
        self, queue: str, handler: AsyncHandler, *, prefetch: int | None = None
    ) -> str:
        self._start()

        async def wrapped(delivery: Delivery) -> None:
            if self.core.should_handle(delivery):
                await handler(delivery)
            else:
                metrics.DUPLICATES_SUPPRESSED.labels(delivery.queue).inc()

        tag = await self.client.consume(
            queue, wrapped, prefetch=prefetch, on_settled=self._on_settled
        )
        self._tags.append(tag)
        return tag

    def _start(self) -> None:
        if self.confirms.receipt_scope == "process":
            if self._pool is None:
                self._pool = _shared(self.confirms)
                self.core.batcher = self._pool.batcher
            self._pool.join(self)
        elif self._flusher is None:
            self._flusher = asyncio.create_task(self._flush_loop())

    async def close(self) -> None:
        """Stop consuming; the handlers running finish and settle (``close_grace``), and
        every receipt they owe goes out before this returns."""
        tags, self._tags = self._tags, []
        for tag in tags:
            await self.client.cancel(tag)
        await self._drain()

    async def _drain(self) -> None:
        if self._pool is not None:
            await self._pool.leave(self)
            return
        async with self._sending:  # a flush in progress keeps what it took
            if self._flusher is not None:
                self._flusher.cancel()
                flusher, self._flusher = self._flusher, None
                with contextlib.suppress(asyncio.CancelledError):
                    await flusher
            for reply_to, receipts in self.core.batcher.drain():
                await self._send(reply_to, receipts)

    async def _on_settled(self, delivery: Delivery, outcome: Outcome) -> None:
        if self.core.handled_e2e(delivery):
            metrics.E2E_SETTLED.labels(delivery.queue, outcome.action.value).inc()
        if tracing.active() and self.core.owes_receipt(delivery, outcome):
            tracing.receipt(delivery, outcome.action is Action.ACK)
        full = self.core.settled(delivery, outcome)
        if self._pool is not None:
            await self._pool.send(full, via=self)
            return
        for reply_to, receipts in full:
            await self._send(reply_to, receipts)

    async def _flush_loop(self) -> None:
        period = max(self.core.batcher.linger_s, 0.001)
        while True:
            await asyncio.sleep(period)
            async with self._sending:
                for reply_to, receipts in self.core.batcher.due():
                    await self._send(reply_to, receipts)

    async def _send(self, reply_to: str, receipts: list[Receipt]) -> bool:
        try:
            await self.client.publish(self.core.message(reply_to, receipts), confirm=False)
        except Exception as exc:
            # the publisher resends after its timeout and we answer the duplicate again
            log.info("could not send %d receipts: %s", len(receipts), exc)
            return False
        return True


async def _receipt_or_return(
    receipt: asyncio.Future[Any], taken: asyncio.Future[None], hold_s: float
) -> None:
    """Wait ``hold_s`` at most for the receipt, but not past a return: a message the
    broker returned (``taken`` raises) reached no queue, and no receipt can come."""
    until = asyncio.get_running_loop().time() + hold_s
    done, _ = await asyncio.wait({receipt, taken}, timeout=hold_s, return_when=FIRST_COMPLETED)
    if receipt.done() or taken not in done or taken.exception() is not None:
        return
    left = until - asyncio.get_running_loop().time()
    if left > 0:
        await asyncio.wait({receipt}, timeout=left)
