"""A received message as the layer hands it to handlers, and what to do after the handler.

Pure: the same decision serves the async core and the sync face.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import DeadLetter, HandlerInstruction, Reject, Requeue
from .topology import BindingSpec, ExchangeSpec, ExchangeType, QueueSpec

__all__ = [
    "DEAD_LETTER_EXCHANGE",
    "DEAD_LETTER_QUEUE",
    "DEAD_LETTER_TOPOLOGY",
    "Action",
    "Delivery",
    "Outcome",
    "dead_letter_headers",
    "outcome_of",
]

DEAD_LETTER_EXCHANGE = "qosmq.dead-letter"
DEAD_LETTER_QUEUE = "qosmq.dead-letter"
#: Declared (and recorded) by a client the first time it dead-letters a message.
DEAD_LETTER_TOPOLOGY = (
    ExchangeSpec(DEAD_LETTER_EXCHANGE, ExchangeType.FANOUT),
    QueueSpec(DEAD_LETTER_QUEUE),
    BindingSpec(DEAD_LETTER_QUEUE, DEAD_LETTER_EXCHANGE),
)


@dataclass(frozen=True, slots=True)
class Delivery:
    """One message delivered to a consumer; no pika or aio-pika type leaks through it."""

    body: bytes
    queue: str
    exchange: str = ""
    routing_key: str = ""
    message_id: str | None = None
    correlation_id: str | None = None
    reply_to: str | None = None
    content_type: str | None = None
    priority: int | None = None
    timestamp: float | None = None
    redelivered: bool = False
    delivery_tag: int = 0
    persistent: bool = False
    headers: Mapping[str, Any] = field(default_factory=dict)

    def text(self, encoding: str = "utf-8") -> str:
        return self.body.decode(encoding)

    def json(self) -> Any:
        return json.loads(self.body)


class Action(StrEnum):
    ACK = "ack"
    REJECT = "reject"
    REQUEUE = "requeue"
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True, slots=True)
class Outcome:
    action: Action
    reason: str = ""


ACKED = Outcome(Action.ACK)


def outcome_of(error: BaseException | None) -> Outcome:
    """Map how a handler ended to what the consumer does with the delivery.

    A handler that raises anything other than a :class:`HandlerInstruction`
    has its message dead-lettered with the exception as the reason: requeueing
    a poison message would loop forever, dropping it would lose it.
    """
    match error:
        case None:
            return ACKED
        case Reject():
            return Outcome(Action.REJECT, error.reason)
        case Requeue():
            return Outcome(Action.REQUEUE, error.reason)
        case DeadLetter():
            return Outcome(Action.DEAD_LETTER, error.reason or "dead-lettered by handler")
        case HandlerInstruction():
            return Outcome(Action.DEAD_LETTER, error.reason)
        case _:
            return Outcome(Action.DEAD_LETTER, f"handler raised {type(error).__name__}: {error}")


def dead_letter_headers(delivery: Delivery, reason: str) -> dict[str, Any]:
    """Headers of the copy sent to the layer's dead-letter queue."""
    return {
        **delivery.headers,
        "x-qosmq-reason": reason[:1000],
        "x-qosmq-queue": delivery.queue,
        "x-qosmq-exchange": delivery.exchange,
        "x-qosmq-routing-key": delivery.routing_key,
    }
