"""Sync face of the persistent queues over :class:`SyncClient` (pika), on the same core.

Same verbs, results, errors and spool as :class:`~middleware.queues.AsyncQueues`.
pika's blocking channel confirms one publish at a time, so the producer window is
one; the spool drains inside ``recover()`` and opportunistically on each enqueue.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from .. import tracing
from ..confirms.tracking import DuplicateFilter, Receipt
from ..errors import (
    BrokerUnreachable,
    MiddlewareError,
)
from ..settings import QueueSettings
from ..transport import Action, Delivery, QueueKind, SyncClient
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
from .spool import Spool, SpoolEntry, SpoolFull

__all__ = ["SyncQueueMessage", "SyncQueues"]

log = logging.getLogger(__name__)


class SyncQueueMessage:
    """A dequeued message: call exactly one of :meth:`ack` / :meth:`reject`."""

    def __init__(
        self, delivery: Delivery, settle: Callable[[Action], None], remember: Callable[[], None]
    ) -> None:
        self.delivery, self._settle, self._remember = delivery, settle, remember

    @property
    def body(self) -> bytes:
        return self.delivery.body

    @property
    def message_id(self) -> str | None:
        return self.delivery.message_id

    def ack(self) -> None:
        self._settle(Action.ACK)
        self._remember()

    def reject(self, reason: str = "", *, requeue: bool = False) -> None:
        self._settle(Action.REQUEUE if requeue else Action.REJECT)


class SyncQueues:
    """Persistent queues on one :class:`SyncClient`, with a local spool."""

    def __init__(
        self,
        client: SyncClient,
        *,
        settings: QueueSettings | None = None,
        spool: Spool | None = None,
    ) -> None:
        self.client = client
        self.settings = settings or client.settings.queues
        self.spool = spool if spool is not None else open_spool(self.settings)
        self._dedup = DuplicateFilter(client.settings.confirms.dedup_window)
        self._next_drain = 0.0  # while unreachable, try draining at most once a second

    def start(self) -> SyncQueues:
        try:
            self.client.connect()
        except BrokerUnreachable as exc:
            log.warning("no broker reachable (%s): spooling until one answers", exc)
            self.client.connect_later()
        else:
            self.recover()
        return self

    def create_queue(
        self,
        name: str,
        *,
        kind: QueueKind = QueueKind.QUORUM,
        dead_letter_exchange: str | None = None,
        max_length: int | None = None,
        message_ttl_ms: int | None = None,
        overflow: str | None = None,
    ) -> None:
        self.client.declare_queue(
            queue_spec(
                name,
                kind=kind,
                dead_letter_exchange=dead_letter_exchange,
                max_length=max_length,
                message_ttl_ms=message_ttl_ms,
                overflow=overflow,
            )
        )

    def destroy_queue(self, name: str) -> None:
        self.client.delete_queue(name)

    def enqueue(
        self,
        queue: str,
        body: bytes,
        *,
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        schema: Callable[[bytes], Any] | None = None,
    ) -> EnqueueResult:
        clean = validate(body, headers, max_bytes=self.settings.max_message_bytes, schema=schema)
        if tracing.active():  # a spooled message is drained in the context it was accepted in
            clean = tracing.injected(clean)
        message_id = message_id or new_message_id()
        with self.client.turn():  # threads share the queues: the spool drains in one
            return self._enqueue(SpoolEntry(queue, message_id, bytes(body), clean))

    def _enqueue(self, entry: SpoolEntry) -> EnqueueResult:
        queue, message_id = entry.queue, entry.message_id
        if self.spool is not None and len(self.spool) and time.monotonic() >= self._next_drain:
            self.recover()  # keep order: what waits goes first
        message = admit(to_message(entry), self.client.limits)
        if must_spool(self.client.ready, self.spool):
            return self._to_spool(entry)
        try:
            self.client.publish(message, retry=False)
        except MiddlewareError as exc:
            spool_or_raise(queue, exc, can_spool=self.spool is not None)
            return self._to_spool(entry)
        return EnqueueResult(message_id, EnqueueStatus.CONFIRMED)

    def dequeue(self, queue: str, *, timeout: float | None = None) -> SyncQueueMessage | None:
        """The next message (None after ``timeout`` s; polls with basic.get)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            taken = self.client.take(queue)
            if taken is not None:
                delivery, settle = taken
                key = (queue, delivery.message_id or "")
                if delivery.message_id and self._dedup.get(*key) is not None:
                    settle(Action.ACK)  # a resend of a message already acked
                    continue
                receipt = Receipt(key[1], key[0])
                return SyncQueueMessage(
                    delivery, settle, functools.partial(self._dedup.remember, receipt)
                )
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def recover(self) -> RecoverReport:
        """Send the spool's entries in order; delete each once the broker confirmed it."""
        if self.spool is None:
            return RecoverReport(0, 0)
        with self.client.turn():
            return self._drain(self.spool)

    def _drain(self, spool: Spool) -> RecoverReport:
        sent = 0
        while len(spool):
            batch = spool.peek(self.settings.drain_batch)
            done: list[int] = []
            try:
                for entry in batch:
                    try:
                        with tracing.resumed(entry.headers, f"spool {entry.queue}"):
                            self.client.publish(to_message(entry), retry=False)
                    except MiddlewareError as exc:
                        reason = drain_failure(entry, exc)
                        if reason is None:
                            raise
                        # it can never be sent: out of the spool, to the dead letters
                        self.client.dead_letter(as_delivery(entry), reason)
                    done.append(entry.seq)
            except MiddlewareError as exc:
                log.info("spool drain paused: %s", exc)
                self._next_drain = time.monotonic() + 1.0
                spool.delete(done)
                sent += len(done)
                break
            spool.delete(done)
            sent += len(done)
        return RecoverReport(sent, len(spool))

    def _to_spool(self, entry: SpoolEntry) -> EnqueueResult:
        if self.spool is None:
            raise no_spool(entry.queue)
        try:
            self.spool.append([entry])
        except SpoolFull as exc:
            raise spool_full(exc) from None
        return EnqueueResult(entry.message_id, EnqueueStatus.SPOOLED)
