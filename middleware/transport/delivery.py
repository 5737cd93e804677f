"""A received message as the layer hands it to handlers, and what to do after the handler.

Pure: the same decision serves the async core and the sync face.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..errors import DeadLetter, HandlerInstruction, MalformedMessage, Reject, Requeue
from .codec import raw_bytes
from .message import OutgoingMessage, new_message_id
from .outbound import Limits, check_message
from .topology import BindingSpec, ExchangeSpec, ExchangeType, QueueSpec

__all__ = [
    "DEAD_LETTER_EXCHANGE",
    "DEAD_LETTER_QUEUE",
    "DEAD_LETTER_TOPOLOGY",
    "Action",
    "Delivery",
    "Outcome",
    "dead_letter_headers",
    "dead_letter_message",
    "outcome_of",
    "unreadable",
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
    """What became of a delivery.  ``unsent``: the handler's own decision, when the
    channel closed before it reached the broker (``action`` is then REQUEUE: the broker
    gives the delivery back, although the handler ran)."""

    action: Action
    reason: str = ""
    unsent: Action | None = None


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


_LAST_SECOND = 253_402_300_799  # 9999-12-31T23:59:59Z: the last time a datetime holds
_SHORT_STRINGS = ("message_id", "correlation_id", "reply_to", "content_type")


def _text_ok(value: Any) -> bool:
    """A short string as decoded: str of valid UTF-8 (no surrogate escapes) or None."""
    if value is None:
        return True
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _keys_ok(value: Any) -> bool:
    if isinstance(value, Mapping):
        return all(_text_ok(k) and _keys_ok(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_keys_ok(v) for v in value)
    return True


def unreadable(delivery: Delivery) -> str | None:
    """Why a delivery cannot be handed to a handler (it is dead-lettered instead), or None.

    Other AMQP clients can send what the broker passes through but this layer cannot
    represent: short strings that are not UTF-8, a timestamp past the year 9999."""
    bad = [
        name
        for name in (*_SHORT_STRINGS, "exchange", "routing_key")
        if not _text_ok(getattr(delivery, name))
    ]
    if not _keys_ok(delivery.headers):
        bad.append("headers (a header name)")
    if bad:
        return f"undecodable delivery: {', '.join(bad)} not UTF-8 text"
    stamp = delivery.timestamp
    if stamp is not None and not 0 <= stamp <= _LAST_SECOND:
        return f"undecodable delivery: timestamp {int(stamp)} is past the year 9999"
    return None


def _readable(value: Any) -> Any:
    """``value`` with every header name made valid text (invalid bytes as \\xNN escapes)."""
    if isinstance(value, Mapping):
        return {_escaped(k): _readable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_readable(v) for v in value]
    return value


def _escaped(text: Any) -> str:
    return raw_bytes(text).decode("utf-8", "backslashreplace") if text is not None else ""


def dead_letter_headers(delivery: Delivery, reason: str) -> dict[str, Any]:
    """Headers of the copy sent to the layer's dead-letter queue.

    Undecodable properties travel as their raw bytes (``x-qosmq-raw-<property>``)."""
    headers: dict[str, Any] = {
        **_readable(delivery.headers),
        "x-qosmq-reason": reason[:1000],
        "x-qosmq-queue": _escaped(delivery.queue),
        "x-qosmq-exchange": _escaped(delivery.exchange),
        "x-qosmq-routing-key": _escaped(delivery.routing_key),
    }
    for name in _SHORT_STRINGS:
        value = getattr(delivery, name)
        if not _text_ok(value):
            headers[f"x-qosmq-raw-{name.replace('_', '-')}"] = raw_bytes(value)
    if delivery.timestamp is not None and not 0 <= delivery.timestamp <= _LAST_SECOND:
        # unsigned 64 bits do not fit a signed table integer: decimal text
        headers["x-qosmq-raw-timestamp"] = str(int(delivery.timestamp))
    return headers


def dead_letter_message(
    delivery: Delivery, reason: str, *, exchange: str, limits: Limits | None = None
) -> OutgoingMessage:
    """The copy of ``delivery`` for the dead-letter queue: always publishable.

    Headers the broker would refuse (too large for a frame once the reason is added,
    values it cannot carry) are left out, and ``x-qosmq-headers-dropped`` says why:
    a copy that cannot be published would send the original back to its handler."""

    def decoded(value: str | None) -> str | None:  # every property that decodes travels on
        return value if _text_ok(value) else None

    stamp = delivery.timestamp
    reply_to = decoded(delivery.reply_to)
    copy = OutgoingMessage(
        body=delivery.body,
        exchange=exchange,
        routing_key=_escaped(delivery.queue)[:255],
        message_id=decoded(delivery.message_id) or new_message_id(),
        headers=dead_letter_headers(delivery, reason),
        persistent=True,
        priority=delivery.priority,
        # the bare pseudo-queue would ask the broker for this channel's own reply address
        reply_to=None if reply_to == "amq.rabbitmq.reply-to" else reply_to,
        correlation_id=decoded(delivery.correlation_id),
        content_type=decoded(delivery.content_type),
        timestamp=stamp if stamp is not None and 0 <= stamp <= _LAST_SECOND else None,
    )
    try:
        check_message(copy, limits)
        return copy
    except MalformedMessage as exc:
        kept = {k: v for k, v in copy.headers.items() if k.startswith("x-qosmq-")}
        kept["x-qosmq-headers-dropped"] = str(exc)[:500]
        copy = dataclasses.replace(copy, headers=kept)
    check_message(copy, limits)  # every x-qosmq-* value is bounded (raw ones are short strings)
    return copy
