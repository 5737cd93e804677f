"""What the queue API decides without I/O: validation, results, error mapping."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..errors import (
    BrokerUnreachable,
    ConnectionNotEstablished,
    EntityNotFound,
    MalformedMessage,
    MessageMalformed,
    MiddlewareError,
    PublishNacked,
    QueueDoesNotExist,
    QueueSaveFailed,
    RetryableError,
    Unroutable,
)
from ..settings import QueueSettings
from ..transport.delivery import Delivery
from ..transport.message import OutgoingMessage
from ..transport.outbound import Limits, check_headers, check_message
from ..transport.topology import QueueKind, QueueSpec
from .spool import Spool, SpoolEntry

__all__ = [
    "EnqueueResult",
    "EnqueueStatus",
    "RecoverReport",
    "admit",
    "drain_failure",
    "must_spool",
    "open_spool",
    "queue_spec",
    "result_error",
    "spool_or_raise",
    "validate",
]

_SCALARS = (str, int, float, bool, type(None))


class EnqueueStatus(StrEnum):
    CONFIRMED = "confirmed"  # the broker confirmed it (quorum queue: on a majority's disk)
    SPOOLED = "spooled"  # no broker reachable: held in the local spool, sent on reconnect


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    message_id: str
    status: EnqueueStatus


@dataclass(frozen=True, slots=True)
class RecoverReport:
    replayed: int  # spool entries the broker confirmed during this call
    remaining: int  # still in the spool (broker unreachable meanwhile)


def validate(
    body: bytes,
    headers: Mapping[str, Any] | None,
    *,
    max_bytes: int,
    schema: Callable[[bytes], Any] | None = None,
) -> dict[str, Any]:
    """Refuse a message the queue must not accept; return its headers as a plain dict."""
    if not isinstance(body, bytes | bytearray | memoryview):
        raise MessageMalformed(
            f"body must be bytes, got {type(body).__name__} (code 4: {MessageMalformed.hint})"
        )
    if len(body) > max_bytes:
        raise MessageMalformed(
            f"body of {len(body)} bytes exceeds max_message_bytes "
            f"{max_bytes} (code 4: {MessageMalformed.hint})"
        )
    out: dict[str, Any] = {}
    for key, value in (headers or {}).items():
        if not isinstance(key, str) or not key or key.startswith("x-qosmq-"):
            raise MessageMalformed(
                f"bad header name {key!r}: non-empty strings, not x-qosmq-* "
                f"(code 4: {MessageMalformed.hint})"
            )
        if not isinstance(value, _SCALARS):
            raise MessageMalformed(
                f"header {key!r} must be a string, number, bool or null "
                f"(code 4: {MessageMalformed.hint})"
            )
        out[key] = value
    try:
        check_headers(out)  # what AMQP and RabbitMQ accept: finite floats, 64-bit ints, ...
        json.dumps(out, allow_nan=False)  # the spool keeps headers as JSON
    except (MalformedMessage, ValueError) as exc:
        raise MessageMalformed(f"{exc} (code 4: {MessageMalformed.hint})") from None
    if schema is not None:
        try:
            schema(bytes(body))
        except Exception as exc:
            raise MessageMalformed(
                f"body does not decode with the queue's schema: {exc} "
                f"(code 4: {MessageMalformed.hint})"
            ) from None
    return out


def admit(message: OutgoingMessage, limits: Limits) -> OutgoingMessage:
    """``message`` if the broker can take it as a whole (its properties fit a frame, its
    body the broker's limit); else ``MessageMalformed``: never spooled, never sent."""
    try:
        check_message(message, limits)
    except MalformedMessage as exc:
        raise MessageMalformed(f"{exc} (code 4: {MessageMalformed.hint})") from None
    return message


def drain_failure(entry: SpoolEntry, error: MiddlewareError) -> str | None:
    """Why a spooled entry goes to the dead-letter queue instead of staying (None: keep it
    and retry later).  A spool written by an older version may hold a message the broker
    refuses; sending it first for ever would wedge everything behind it."""
    match error:
        case Unroutable() | EntityNotFound():
            return f"queue {entry.queue!r} does not exist"
        case MalformedMessage():
            return f"the broker cannot take it: {error}"
    return None


def must_spool(ready: bool, spool: Spool | None) -> bool:
    """Spool instead of publishing: no connection, or earlier messages still wait (order)."""
    return not ready or (spool is not None and len(spool) > 0)


def spool_or_raise(queue: str, error: MiddlewareError, *, can_spool: bool) -> None:
    """What a failed direct enqueue becomes: returns to spool it, or raises its result code.

    A lost connection or a confirm timeout is spooled (resent later, duplicates
    dropped by id); a nack is the broker refusing to store it (code 3), not retried.
    """
    if can_spool and isinstance(error, RetryableError) and not isinstance(error, PublishNacked):
        return
    raise result_error(queue, error) from error


def result_error(queue: str, error: MiddlewareError) -> MiddlewareError:
    """The EMQ result-code error for a broker-side failure of an enqueue."""
    match error:
        case Unroutable() | EntityNotFound():
            return QueueDoesNotExist(
                f"queue {queue!r} does not exist (code 1: {QueueDoesNotExist.hint})"
            )
        case PublishNacked():
            return QueueSaveFailed(
                f"queue {queue!r} refused the message (code 3: {QueueSaveFailed.hint})"
            )
        case BrokerUnreachable():
            return ConnectionNotEstablished(
                f"no broker node reachable for {queue!r} (code 2: {ConnectionNotEstablished.hint})"
            )
    return error


def open_spool(settings: QueueSettings) -> Spool | None:
    """The spool the settings ask for (None when disabled)."""
    if not settings.spool_enabled:
        return None
    return Spool(
        settings.spool_path,
        max_messages=settings.spool_max_messages,
        synchronous=settings.spool_synchronous,
    )


def queue_spec(
    name: str,
    *,
    kind: QueueKind,
    dead_letter_exchange: str | None,
    max_length: int | None,
    message_ttl_ms: int | None,
    overflow: str | None,
) -> QueueSpec:
    """The declaration behind ``create_queue``: durable, quorum unless told otherwise."""
    return QueueSpec(
        name,
        kind=kind,
        dead_letter_exchange=dead_letter_exchange,
        max_length=max_length,
        message_ttl_ms=message_ttl_ms,
        arguments={"x-overflow": overflow} if overflow else {},
    )


def no_spool(queue: str) -> ConnectionNotEstablished:
    return ConnectionNotEstablished(
        f"no broker node reachable for {queue!r} and no spool "
        f"(code 2: {ConnectionNotEstablished.hint})"
    )


def spool_full(exc: Exception) -> QueueSaveFailed:
    return QueueSaveFailed(f"the local spool is full: {exc} (code 3: {QueueSaveFailed.hint})")


def as_delivery(entry: SpoolEntry) -> Delivery:
    """A spool entry as a delivery, for the dead-letter path."""
    return Delivery(
        entry.body,
        entry.queue,
        routing_key=entry.queue,
        message_id=entry.message_id,
        headers=dict(entry.headers),
    )


def to_message(entry: SpoolEntry) -> OutgoingMessage:
    return OutgoingMessage(
        entry.body,
        "",
        entry.queue,
        entry.message_id,
        dict(entry.headers),
        persistent=True,
        mandatory=True,
    )
