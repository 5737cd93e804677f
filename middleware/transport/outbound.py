"""What can be checked before a message is sent: pure, shared by both faces and the queue API.

A message the broker would refuse must never reach it: RabbitMQ answers a NaN or an
infinite float header with connection.close 541, a content header larger than the
negotiated ``frame_max`` with 501 ``frame_too_large``, and a body above its
``max_message_size`` with a channel error.  A connection closed that way takes every
other publish and consumer on it down, and a resend (a retry, an e2e retransmit, a
spool drain) kills it again.  So each is refused here, at once, with
:class:`~middleware.errors.MalformedMessage` naming what is wrong, and never retried.

The checks follow AMQP 0-9-1 and RabbitMQ's field types: table keys are short strings of
at most 128 bytes, integers fit a signed 64-bit, floats are finite (sent as doubles, see
``middleware.transport.codec``), strings are UTF-8, decimals fit an octet scale and a
32-bit mantissa, timestamps fit 64 bits, and tables nest at most :data:`MAX_DEPTH` deep.
"""

from __future__ import annotations

import datetime
import decimal
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import MalformedMessage
from ..settings import Settings
from .message import OutgoingMessage

__all__ = [
    "AMQP_FRAME_MAX",
    "MAX_DEPTH",
    "RABBITMQ_MAX_MESSAGE_SIZE",
    "Limits",
    "check_headers",
    "check_message",
    "is_reply",
    "replies_settings",
]

#: RabbitMQ's default frame_max (the negotiated value is used once connected).
AMQP_FRAME_MAX = 131_072
#: RabbitMQ 3.8+'s default ``max_message_size`` (128 MiB).
RABBITMQ_MAX_MESSAGE_SIZE = 134_217_728
#: Deepest nesting of tables and arrays in headers (the encoders recurse once a level).
MAX_DEPTH = 64
_FRAME_OVERHEAD = 8 + 14  # frame header and end octet; class, weight, body size, flags
_INT64 = (-(2**63), 2**63 - 1)
_SHORTSTR_FIELDS = ("message_id", "correlation_id", "reply_to", "content_type")
_TABLE_KEY_MAX = 128


@dataclass(frozen=True, slots=True)
class Limits:
    """What the broker accepts: its negotiated frame size and its largest message."""

    frame_max: int = AMQP_FRAME_MAX
    max_message_size: int = RABBITMQ_MAX_MESSAGE_SIZE


_DEFAULT_LIMITS = Limits()


def _refuse(what: str) -> MalformedMessage:
    return MalformedMessage(f"{what}; the broker would refuse it, so it is never sent or retried")


def check_message(message: OutgoingMessage, limits: Limits | None = None) -> None:
    """Raise :class:`MalformedMessage` if the broker would refuse ``message``."""
    limits = limits or _DEFAULT_LIMITS
    if not isinstance(message.body, bytes | bytearray | memoryview):
        raise _refuse(f"body must be bytes, got {type(message.body).__name__}")
    if len(message.body) > limits.max_message_size:
        raise _refuse(
            f"body of {len(message.body)} bytes exceeds the broker's max_message_size "
            f"({limits.max_message_size})"
        )
    if not message.message_id:  # aiormq would put a random one in its place
        raise _refuse(
            "message_id is empty: returns, receipts and duplicate checks go by it "
            "(leave it out for a generated one)"
        )
    size = _FRAME_OVERHEAD
    for name in (*_SHORTSTR_FIELDS, "exchange", "routing_key"):
        value = getattr(message, name)
        if value is not None:
            size += 1 + _short_string(value, name)
    size += _properties_size(message)
    size += check_headers(message.headers, what="headers")
    if size > limits.frame_max:
        raise _refuse(
            f"its properties and headers take {size} bytes, more than the connection's "
            f"frame_max ({limits.frame_max}): move large values into the body"
        )


def _properties_size(message: OutgoingMessage) -> int:
    if message.priority is not None and not (
        isinstance(message.priority, int) and 0 <= message.priority <= 255
    ):
        raise _refuse(f"priority must be an integer 0..255, got {message.priority!r}")
    if message.expiration_ms is not None and not (
        isinstance(message.expiration_ms, int) and 0 <= message.expiration_ms < 2**32
    ):
        raise _refuse(f"expiration_ms must be an integer 0..2**32-1, got {message.expiration_ms!r}")
    if message.timestamp is not None:
        _timestamp(message.timestamp, "timestamp")
    return 1 + 1 + 8 + 16  # delivery mode, priority, timestamp, expiration (at most)


def _timestamp(value: Any, where: str) -> None:
    if isinstance(value, datetime.datetime):
        value = value.timestamp()
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _refuse(f"{where} must be seconds since the epoch, got {type(value).__name__}")
    # AMQP carries 64 bits; the receiving clients turn it into a datetime (years 1..9999)
    if not (math.isfinite(value) and 0 <= value <= 253_402_300_799):
        raise _refuse(f"{where} {value!r} is not a time between 1970 and 9999")


def _short_string(value: Any, where: str) -> int:
    if not isinstance(value, str):
        raise _refuse(f"{where} must be a string, got {type(value).__name__}")
    encoded = _utf8(value, where)
    if len(encoded) > 255:
        raise _refuse(f"{where} is {len(encoded)} bytes long; AMQP allows 255")
    return len(encoded)


def _utf8(value: str, where: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refuse(f"{where} is not valid UTF-8 text ({exc.reason})") from None


def check_headers(headers: Mapping[str, Any] | None, *, what: str = "headers") -> int:
    """Check a header table; return an upper bound of its encoded size in bytes."""
    if headers is None:
        return 4
    if not isinstance(headers, Mapping):
        raise _refuse(f"{what} must be a mapping, got {type(headers).__name__}")
    return _table(headers, what, 1)


def _table(table: Mapping[Any, Any], where: str, depth: int) -> int:
    if depth > MAX_DEPTH:
        raise _refuse(f"{where} nests deeper than {MAX_DEPTH} levels")
    size = 4
    for key, value in table.items():
        if not isinstance(key, str) or not key:
            raise _refuse(f"{where}: header name {key!r} must be a non-empty string")
        encoded = _utf8(key, f"{where}: header name {key[:40]!r}")
        if len(encoded) > _TABLE_KEY_MAX:
            raise _refuse(
                f"{where}: header name {key[:40]!r}... is {len(encoded)} bytes; "
                f"AMQP allows {_TABLE_KEY_MAX}"
            )
        size += 1 + len(encoded) + _value(value, f"{where}[{key[:40]!r}]", depth)
    return size


def _value(value: Any, where: str, depth: int) -> int:
    match value:
        case None:
            return 1
        case bool():
            return 2
        case int():
            if not _INT64[0] <= value <= _INT64[1]:
                raise _refuse(f"{where}: integer {value} does not fit a signed 64-bit field")
            return 9
        case float():
            if not math.isfinite(value):
                raise _refuse(f"{where}: {value} is not a finite number")
            return 9
        case decimal.Decimal():
            return _decimal(value, where)
        case str():
            return 5 + len(_utf8(value, where))
        case bytes() | bytearray():
            return 5 + len(value)
        case datetime.datetime():
            _timestamp(value, where)
            return 9
        case Mapping():
            return 1 + _table(value, where, depth + 1)
        case list():
            if depth + 1 > MAX_DEPTH:
                raise _refuse(f"{where} nests deeper than {MAX_DEPTH} levels")
            return 5 + sum(_value(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value))
    raise _refuse(
        f"{where}: a {type(value).__name__} cannot be carried in an AMQP header "
        "(use str, bytes, int, float, bool, None, Decimal, datetime, list or dict)"
    )


def _decimal(value: decimal.Decimal, where: str) -> int:
    """AMQP's decimal: a scale octet and a signed 32-bit mantissa.  Judged from the digits
    and the exponent alone: ``int(Decimal("1E+999999"))`` would build a million-digit
    integer (half a minute of CPU, the event loop and its heartbeats stopped)."""
    if not value.is_finite():
        raise _refuse(f"{where}: {value} is not a finite number")
    sign, digits, exponent = value.normalize().as_tuple()
    assert isinstance(exponent, int)  # finite
    places = len(digits) + max(exponent, 0)  # decimal digits of the mantissa
    scale = max(-exponent, 0)
    mantissa = 0
    if places <= 10:
        mantissa = int("".join(map(str, digits)) or "0") * 10 ** max(exponent, 0)
        mantissa = -mantissa if sign else mantissa
    if places > 10 or scale > 255 or not -(2**31) <= mantissa < 2**31:
        raise _refuse(f"{where}: decimal {value:.12} needs more than a 32-bit mantissa")
    return 6


#: the prefix RabbitMQ gives a direct reply-to address (``amq.rabbitmq.reply-to.<key>``)
REPLY_ADDRESS = "amq.rabbitmq.reply-to."


def is_reply(message: OutgoingMessage) -> bool:
    """True for a publish to a direct reply-to address (a receipt, a confirmation).

    RabbitMQ 3.10 crashes the channel that publishes to the reply address of a channel
    whose node is down, and closes its whole connection with 541 INTERNAL_ERROR.  A
    consumer answering a publisher whose node just died met that for every receipt batch
    it still owed it, and failed over with every delivery it held.  So both faces send
    replies over a connection of their own: such a crash costs the replies then in
    flight (their publishers resend after failover or ``receipt_timeout``), never the
    consumer's deliveries, acks or other publishes."""
    return not message.exchange and message.routing_key.startswith(REPLY_ADDRESS)


def replies_settings(settings: Settings) -> Settings:
    """The settings of a client's replies connection (named so in the management UI)."""
    return settings.model_copy(update={"client_name": f"{settings.client_name} replies"})
