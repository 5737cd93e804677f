"""Prometheus series for the confirm promises, counted by both faces from what the pure
cores return (``core.py`` reads no clock for them and imports no metrics library).

Publisher side, by confirm mode: how long a publish took to its mode's confirm, how each
publish ended, resends; by queue, the e2e refusals and the queues that stayed silent.
Consumer side, by queue: the copies answered without running the handler (duplicates
suppressed), and how e2e deliveries were settled (acked, rejected, dead-lettered).
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping

from prometheus_client import Counter, Histogram

from ..errors import MessageRefused, NegativeReceipt, ReceiptTimeout

__all__ = [
    "CONFIRMS",
    "CONFIRM_SECONDS",
    "DUPLICATES_SUPPRESSED",
    "E2E_SETTLED",
    "NEGATIVE_RECEIPTS",
    "RECEIPT_TIMEOUTS",
    "RESENDS",
    "outcome_of",
    "settled",
]

CONFIRM_SECONDS = Histogram(
    "qosmq_confirm_seconds",
    "publish to its mode's confirm (e2e: every expected queue's receipt)",
    ["mode"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CONFIRMS = Counter(
    "qosmq_confirms_total",
    "publishes settled, by how: confirmed, negative, receipt_timeout, refused, error",
    ["mode", "outcome"],
)
RESENDS = Counter(
    "qosmq_e2e_resends_total",
    "e2e messages sent again (receipt timeout, failover)",
    ["mode"],
)
NEGATIVE_RECEIPTS = Counter(
    "qosmq_e2e_negative_receipts_total",
    "e2e publishes a consumer refused (its handler rejected or dead-lettered it)",
    ["queue"],
)
RECEIPT_TIMEOUTS = Counter(
    "qosmq_e2e_receipt_timeouts_total",
    "e2e publishes given up for lack of this queue's receipt after every resend",
    ["queue"],
)
DUPLICATES_SUPPRESSED = Counter(
    "qosmq_e2e_duplicates_suppressed_total",
    "copies of a message this queue handled or was handling: answered, handler not run",
    ["queue"],
)
E2E_SETTLED = Counter(
    "qosmq_e2e_settled_total",
    "e2e deliveries settled by a consumer, by action (ack, reject, dead-letter, requeue)",
    ["queue", "action"],
)


def outcome_of(error: BaseException | None) -> str:
    if error is None:
        return "confirmed"
    if isinstance(error, NegativeReceipt):
        return "negative"
    if isinstance(error, ReceiptTimeout):
        return "receipt_timeout"
    if isinstance(error, MessageRefused):
        return "refused"
    return "error"


def settled(
    mode: str,
    results: Iterable[tuple[str, BaseException | None]],
    sent_at: MutableMapping[str, float],
    now: float,
) -> None:
    """Count what a core settled, each publish once: only ids still in ``sent_at``
    (message id -> monotonic send time, kept by the face), which loses them."""
    for message_id, error in results:
        started = sent_at.pop(message_id, None)
        if started is None:
            continue
        outcome = outcome_of(error)
        CONFIRMS.labels(mode, outcome).inc()
        if error is None:
            CONFIRM_SECONDS.labels(mode).observe(now - started)
        elif isinstance(error, NegativeReceipt):
            NEGATIVE_RECEIPTS.labels(error.queue or "").inc()
        elif isinstance(error, ReceiptTimeout):
            for queue in sorted(error.missing or ()):
                RECEIPT_TIMEOUTS.labels(queue).inc()
