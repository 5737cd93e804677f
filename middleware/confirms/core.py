"""The confirm state machines both faces drive (httpx's BaseClient split): no I/O here.

:class:`PublisherCore` turns a publish request into an :class:`OutgoingMessage`
(with the receipt header and reply address in e2e modes), knows which queues
must answer, and turns receipt batches and timeouts into settled message ids.
:class:`ConsumerCore` decides whether a delivery is a duplicate, what receipt
it earns once settled, and when receipts leave in a batch.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import DuplicateMessageId, NegativeReceipt, NoRoute, ReceiptTimeout
from ..settings import ConfirmSettings, RetrySettings
from ..transport.delivery import Action, Delivery, Outcome
from ..transport.message import OutgoingMessage, new_message_id
from ..transport.policy import backoff_delay
from ..transport.topology import TopologyRecord
from .modes import ConfirmMode
from .tracking import (
    PROCESS_RECEIPT_LOAD,
    RECEIPT_HEADER,
    ConfirmTracker,
    DuplicateFilter,
    Receipt,
    ReceiptBatcher,
    Resolution,
    content_digest,
    decode_receipts,
    encode_receipts,
    published_age,
    wants_receipt,
)

__all__ = ["REPLY_TO", "ConsumerCore", "PublisherCore", "Settled", "new_batcher"]

log = logging.getLogger(__name__)
REPLY_TO = "amq.rabbitmq.reply-to"
RECEIPT_CONTENT_TYPE = "application/x-qosmq-receipts"
#: (message id, None when confirmed or the error that failed it)
Settled = tuple[str, BaseException | None]


class PublisherCore:
    """What a publisher of one confirm mode sends, waits for, resends and reports."""

    def __init__(
        self,
        *,
        mode: ConfirmMode,
        confirms: ConfirmSettings,
        retry: RetrySettings,
        topology: TopologyRecord,
    ) -> None:
        self.mode, self.profile = mode, mode.profile
        self.topology = topology
        self.tracker = ConfirmTracker(
            timeout=confirms.receipt_timeout,
            max_attempts=confirms.max_attempts,
            backoff=backoff_delay(retry),
        )
        self.in_flight: dict[str, OutgoingMessage] = {}
        self.malformed_receipts = 0
        self.resent = 0

    def prepare(
        self,
        body: bytes,
        *,
        exchange: str = "",
        routing_key: str = "",
        headers: Mapping[str, Any] | None = None,
        message_id: str | None = None,
        expect: Iterable[str] | None = None,
        priority: int | None = None,
    ) -> OutgoingMessage:
        """The message to send; in e2e modes also start waiting for its receipts."""
        headers = dict(headers or {})
        message_id = message_id or new_message_id()
        if message_id in self.in_flight:
            raise DuplicateMessageId(
                f"message id {message_id!r} is already in flight on this publisher: "
                "an id names one message (resends reuse it); give each message its own"
            )
        if not self.profile.receipts:
            return OutgoingMessage(
                body,
                exchange,
                routing_key,
                message_id,
                headers,
                persistent=self.profile.persistent,
                mandatory=self.profile.broker_confirm,
                priority=priority,
            )
        expected = (
            frozenset(expect)
            if expect is not None
            else self.topology.route(exchange, routing_key, headers)
        )
        if not expected:
            raise NoRoute(
                f"exchange {exchange!r} with key {routing_key!r} routes to no queue "
                "the layer knows: declare the bindings through the client, or pass "
                "expect=[queue, ...]"
            )
        headers[RECEIPT_HEADER] = int(time.time() * 1000)  # wanted; its value: sent at
        message = OutgoingMessage(
            body,
            exchange,
            routing_key,
            message_id,
            headers,
            persistent=self.profile.persistent,
            mandatory=False,
            reply_to=REPLY_TO,
            priority=priority,
        )
        self.tracker.track(message_id, expected)
        self.in_flight[message_id] = message
        return message

    def on_reply(self, delivery: Delivery) -> list[Settled]:
        """Apply a receipt batch; return the messages it settles.  Malformed: logged, dropped."""
        try:
            receipts = decode_receipts(delivery.body)
        except ValueError as exc:
            self.malformed_receipts += 1
            log.warning("dropping malformed receipt batch: %s", exc)
            return []
        settled: list[Settled] = []
        for receipt in receipts:
            result = self.tracker.on_receipt(receipt)
            if result is None:
                continue
            resolution, pending = result
            self.in_flight.pop(pending.message_id, None)
            if resolution is Resolution.CONFIRMED:
                settled.append((pending.message_id, None))
            else:
                settled.append(
                    (
                        pending.message_id,
                        NegativeReceipt(
                            f"queue {receipt.queue!r} rejected message {receipt.message_id}: "
                            f"{receipt.reason}",
                            message_id=receipt.message_id,
                            queue=receipt.queue,
                            reason=receipt.reason,
                        ),
                    )
                )
        return settled

    def due(self) -> tuple[list[OutgoingMessage], list[Settled]]:
        """(messages to resend now, messages that failed for good)."""
        resend, failed = self.tracker.due()
        self.resent += len(resend)
        out = [self.in_flight[p.message_id] for p in resend if p.message_id in self.in_flight]
        errors: list[Settled] = []
        for p in failed:
            self.in_flight.pop(p.message_id, None)
            errors.append(
                (
                    p.message_id,
                    ReceiptTimeout(
                        f"message {p.message_id}: no receipt from queue(s) "
                        f"{sorted(p.missing)} after "
                        f"{p.attempts} attempt(s) (is a layer consumer running on each?)",
                        message_id=p.message_id,
                        missing=p.missing,
                        attempts=p.attempts,
                    ),
                )
            )
        return out, errors

    def forget(self, message_id: str) -> None:
        self.tracker.discard(message_id)
        self.in_flight.pop(message_id, None)

    def refused(self, message_id: str, error: BaseException) -> Settled:
        """A message the broker refused (``MessageRefused``): failed now, never resent."""
        self.forget(message_id)
        return message_id, error


def new_batcher(confirms: ConfirmSettings) -> ReceiptBatcher:
    """A receipt batcher as the settings describe it (one per consumer, or one shared)."""
    return ReceiptBatcher(
        max_batch=confirms.receipt_batch,
        linger_s=confirms.receipt_linger_ms / 1000,
        busy_linger_s=confirms.receipt_linger_busy_ms / 1000,
        busy_rate=confirms.receipt_busy_rate,
        load=PROCESS_RECEIPT_LOAD,
        age_fraction=confirms.receipt_linger_age_fraction,
        max_linger_s=confirms.receipt_linger_max_ms / 1000,
    )


class ConsumerCore:
    """Duplicate suppression and receipt batching for layer consumers.

    A resend of a message this queue already handled is acked without running
    the handler, and answered with the first copy's receipt.  A resend that
    arrives while the first copy is still in its handler is acked silently: the
    first copy's receipt answers both.
    """

    def __init__(self, confirms: ConfirmSettings, *, batcher: ReceiptBatcher | None = None) -> None:
        self.dedup = DuplicateFilter(confirms.dedup_window)
        self.batcher = batcher if batcher is not None else new_batcher(confirms)
        self._in_progress: dict[tuple[str, str], bytes] = {}  # key -> body digest
        # per delivery object (handler and settle hook see the same one): the answer to repeat
        self._skipped: dict[int, Receipt | None] = {}
        # elements refused for reusing a handled id, by (queue, id, digest): refused once
        self._refused: OrderedDict[tuple[str, str, bytes], None] = OrderedDict()
        self.receipts_sent = 0
        self.batches_sent = 0
        self.suppressed = 0

    def should_handle(self, delivery: Delivery) -> bool:
        """False for a copy of a message this queue handled or is handling (ack, don't run)."""
        if not wants_receipt(delivery.headers, delivery.reply_to, delivery.message_id):
            return True
        key = (delivery.queue, str(delivery.message_id))
        digest = content_digest(delivery.headers, delivery.body)
        earlier = self.dedup.get(*key)
        first = earlier.digest if earlier is not None else self._in_progress.get(key)
        if first is None:
            self._in_progress[key] = digest
            return True
        self.suppressed += 1
        if first != digest:  # not a resend: another message reusing the id
            log.warning("message id %s reused on %s by another message: refused", *key[::-1])
            earlier = Receipt(
                key[1],
                key[0],
                ok=False,
                reason="duplicate message id: a different message with this id was already "
                "handled here; this one was not handled",
            )
        self._skipped[id(delivery)] = earlier
        return False

    def element_earlier(self, queue: str, element_id: str, digest: bytes) -> Receipt | None:
        """One element of a delivery that carries several (``ELEMENTS_HEADER``): the
        receipt of the message with its id this queue handled already (as an element or
        alone; skip it), or None (handle it, then :meth:`element_handled`).  An earlier
        message with this id and other content makes a refusing receipt: this element is
        another message reusing the id, never handled as if it were the first."""
        earlier = self.dedup.get(queue, element_id)
        if earlier is None:
            return None
        self.suppressed += 1
        if earlier.digest == digest:
            return earlier
        log.warning("message id %s reused on %s by another element: refused", element_id, queue)
        return Receipt(element_id, queue, ok=False, reason="duplicate message id")

    def first_refusal(self, queue: str, element_id: str, digest: bytes) -> bool:
        """Whether this element (refused by :meth:`element_earlier`) is refused for the
        first time: a batch that comes back whole (another of its elements asked
        ``Requeue``), or a resend of the same element, is not refused again."""
        key = (queue, element_id, digest)
        if key in self._refused:
            return False
        self._refused[key] = None
        if len(self._refused) > self.dedup.capacity:
            self._refused.popitem(last=False)
        return True

    def element_handled(self, queue: str, element_id: str, digest: bytes) -> None:
        """An element was handled: a later copy of it (alone or in another message) is
        a duplicate.  (Its receipt is its message's: nothing is sent for it.)"""
        self.dedup.remember(Receipt(element_id, queue, digest=digest))

    def handled_e2e(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` is an e2e copy its handler ran for (not a duplicate
        answered without it): asked before :meth:`settled`."""
        return id(delivery) not in self._skipped and wants_receipt(
            delivery.headers, delivery.reply_to, delivery.message_id
        )

    @staticmethod
    def owes_receipt(delivery: Delivery, outcome: Outcome) -> bool:
        """Whether settling ``delivery`` so answers its publisher (a requeue does not)."""
        return outcome.action is not Action.REQUEUE and wants_receipt(
            delivery.headers, delivery.reply_to, delivery.message_id
        )

    def settled(self, delivery: Delivery, outcome: Outcome) -> list[tuple[str, list[Receipt]]]:
        """Record the receipt a settled delivery earns; return batches that are full."""
        if not wants_receipt(delivery.headers, delivery.reply_to, delivery.message_id):
            return []
        if id(delivery) in self._skipped:
            earlier = self._skipped.pop(id(delivery))
            if earlier is None:
                return []
            return self.batcher.add(str(delivery.reply_to), earlier, self._age(delivery))
        key = (delivery.queue, str(delivery.message_id))
        digest = self._in_progress.pop(key, b"")
        # an ack the channel lost: the handler ran and succeeded all the same, so the
        # receipt is owed and the broker's redelivery meets the duplicate filter, not the
        # handler.  (A lost reject or dead-letter is handled again: acking its
        # redelivery as a duplicate would keep it from the dead letters.)
        decided = Action.ACK if outcome.unsent is Action.ACK else outcome.action
        if decided is Action.REQUEUE:
            return []  # it will come back and be handled again
        ok = decided is Action.ACK
        reason = outcome.reason if decided is outcome.action else ""  # not the lost channel
        receipt = Receipt(key[1], key[0], ok, reason, digest)
        self.dedup.remember(receipt)
        return self.batcher.add(str(delivery.reply_to), receipt, self._age(delivery))

    @staticmethod
    def _age(delivery: Delivery) -> float | None:
        return published_age(delivery.headers, time.time())

    def message(self, reply_to: str, receipts: list[Receipt]) -> OutgoingMessage:
        self.receipts_sent += len(receipts)
        self.batches_sent += 1
        return OutgoingMessage(
            encode_receipts(receipts),
            "",
            reply_to,
            mandatory=False,
            content_type=RECEIPT_CONTENT_TYPE,
        )
