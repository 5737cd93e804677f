"""Sync face of the confirm modes over :class:`SyncClient` (pika), on the same core."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .. import tracing
from ..errors import MessageRefused
from ..settings import ConfirmSettings
from ..transport.delivery import Action, Delivery, Outcome
from ..transport.message import OutgoingMessage
from ..transport.sync import SyncClient, SyncHandler
from . import metrics
from .core import ConsumerCore, PublisherCore
from .modes import ConfirmMode

__all__ = ["SyncConfirmConsumer", "SyncConfirmPublisher"]

_PUMP_S = 0.005


class SyncConfirmPublisher:
    """Blocking publisher; ``publish`` returns once the mode's confirm arrived."""

    def __init__(
        self,
        client: SyncClient,
        *,
        mode: ConfirmMode | str = ConfirmMode.E2E,
        confirms: ConfirmSettings | None = None,
    ) -> None:
        self.client = client
        self.mode = ConfirmMode(mode)
        self.core = PublisherCore(
            mode=self.mode,
            confirms=confirms or client.settings.confirms,
            retry=client.settings.retry,
            topology=client.topology,
        )
        self._results: dict[str, BaseException | None] = {}
        self._sent_at: dict[str, float] = {}  # message id -> monotonic, for the metrics
        self._refused_seen = client.refused_closes
        self._reconnects_seen = client.reconnects
        if self.core.profile.receipts:
            client.listen_replies(self._on_reply)

    def publish(
        self,
        body: bytes,
        *,
        exchange: str = "",
        routing_key: str = "",
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        expect: Iterable[str] | None = None,
    ) -> None:
        self.publish_many(
            [body],
            exchange=exchange,
            routing_key=routing_key,
            headers=headers,
            message_ids=[message_id] if message_id else None,
            expect=expect,
        )

    def publish_many(
        self,
        bodies: Iterable[bytes],
        *,
        exchange: str = "",
        routing_key: str = "",
        headers: Mapping[str, Any] | None = None,
        message_ids: Iterable[str] | None = None,
        expect: Iterable[str] | None = None,
    ) -> None:
        """Send a batch (e2e: up to the window before waiting), then wait for every confirm.

        Raises the first failure (``NegativeReceipt``, ``ReceiptTimeout``, ...) after
        every message of the batch has settled.
        """
        ids = iter(message_ids) if message_ids is not None else None
        waiting: list[str] = []
        in_flight = self.core.in_flight
        window = self.client.settings.publish_window
        for body in bodies:
            with self.client.turn():  # threads share the publisher: its core with its client
                message = self.core.prepare(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    headers=headers,
                    message_id=next(ids) if ids else None,
                    expect=expect,
                )
                self._sent_at[message.message_id] = time.monotonic()
                if not self.core.profile.receipts:
                    self._publish_confirmed(message)
                    continue
                waiting.append(message.message_id)
                self._publish_watched(message)
            if len(in_flight) >= window:
                self._wait(lambda: len(in_flight) < window)
        self._wait(lambda: all(m not in in_flight for m in waiting))
        errors = [self._results.pop(m, None) for m in waiting]
        first_error = next((e for e in errors if e is not None), None)
        if first_error is not None:
            raise first_error

    def _publish_confirmed(self, message: OutgoingMessage) -> None:
        """A mode without receipts: the broker's confirm (or none) settles it at once."""
        try:
            self.client.publish(message, confirm=self.core.profile.broker_confirm)
        except BaseException as exc:
            self._count([(message.message_id, exc)])
            raise
        self._count([(message.message_id, None)])

    def _publish_watched(self, message: OutgoingMessage) -> None:
        """A mode with receipts: sent unconfirmed, settled by its receipts (``_wait``)."""
        try:
            self.client.publish(message, confirm=False)
        except MessageRefused as exc:
            self._record([self.core.refused(message.message_id, exc)])
        except BaseException as exc:
            self._count([(message.message_id, exc)])
            raise
        self._resend_after_failover()

    def _wait(self, done: Callable[[], bool]) -> None:
        """Pump deliveries, resends and timeouts until ``done()``; results go to _results.
        Each round in a turn of its own, so threads sharing the publisher pump in turn
        (whoever pumps settles every thread's messages)."""
        while True:
            with self.client.turn():
                if done():
                    return
                self.client.run(_PUMP_S)
                self._resend_after_failover()
                resend, failed = self.core.due()
                self._record(failed)
                for message in resend:
                    metrics.RESENDS.labels(self.mode.value).inc()
                    self.client.publish(message, confirm=False)
                self._resend_after_failover()

    def _resend_after_failover(self) -> None:
        """As the asyncio face: after a failover the reply address changed, so everything
        still waiting goes again at once (not after ``receipt_timeout``).  When the broker
        closed the lost connection in answer to a frame, each goes alone, known taken
        before the next; the one it closes the connection at again fails with
        ``MessageRefused``."""
        while (
            self.client.refused_closes != self._refused_seen
            or self.client.reconnects != self._reconnects_seen
        ):
            suspect = self.client.refused_closes != self._refused_seen
            self._refused_seen = self.client.refused_closes
            self._reconnects_seen = self.client.reconnects
            for message in list(self.core.in_flight.values()):
                if message.message_id not in self.core.in_flight:
                    continue
                metrics.RESENDS.labels(self.mode.value).inc()
                try:
                    if suspect:
                        self.client.resend_alone(message, confirm=False)
                    else:
                        self.client.publish(message, confirm=False)
                except MessageRefused as exc:
                    self._record([self.core.refused(message.message_id, exc)])

    def _on_reply(self, delivery: Delivery) -> None:
        self._record(self.core.on_reply(delivery))

    def _count(self, settled: list[tuple[str, BaseException | None]]) -> None:
        metrics.settled(self.mode.value, settled, self._sent_at, time.monotonic())

    def _record(self, settled: list[tuple[str, BaseException | None]]) -> None:
        self._count(settled)
        for message_id, error in settled:
            self._results[message_id] = error


class SyncConfirmConsumer:
    """Blocking consumer wrapper: duplicate suppression and batched receipts."""

    def __init__(self, client: SyncClient, *, confirms: ConfirmSettings | None = None) -> None:
        self.client = client
        self.core = ConsumerCore(confirms or client.settings.confirms)
        # receipt batches leave on time whoever pumps the client (a Phoenix client's run,
        # a publisher waiting on the same client), not only inside this consumer's run
        client.every_step(self._flush_due, within=self.core.batcher.linger_s or _PUMP_S)

    def consume(self, queue: str, handler: SyncHandler, *, prefetch: int | None = None) -> str:
        def wrapped(delivery: Delivery) -> None:
            if self.core.should_handle(delivery):
                handler(delivery)
            else:
                metrics.DUPLICATES_SUPPRESSED.labels(delivery.queue).inc()

        return self.client.consume(queue, wrapped, prefetch=prefetch, on_settled=self._on_settled)

    def run(self, seconds: float | None = None, *, until: Callable[[], bool] | None = None) -> None:
        """Handle deliveries and flush receipt batches on time."""
        self.client.run(seconds, until=until)
        self._send(self.core.batcher.drain())

    def _flush_due(self) -> None:
        self._send(self.core.batcher.due())

    def _on_settled(self, delivery: Delivery, outcome: Outcome) -> None:
        if self.core.handled_e2e(delivery):
            metrics.E2E_SETTLED.labels(delivery.queue, outcome.action.value).inc()
        if tracing.active() and self.core.owes_receipt(delivery, outcome):
            tracing.receipt(delivery, outcome.action is Action.ACK)
        self._send(self.core.settled(delivery, outcome))

    def _send(self, batches: list[tuple[str, list[Any]]]) -> None:
        for reply_to, receipts in batches:
            self.client.publish(self.core.message(reply_to, receipts), confirm=False)
