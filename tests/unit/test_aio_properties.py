"""The asyncio face builds AMQP properties itself: the same as aio-pika's Message would."""

from __future__ import annotations

import aio_pika
import pytest

from middleware.transport import OutgoingMessage
from middleware.transport.aio_publish import properties as _properties


def _aio_pika(message: OutgoingMessage) -> aio_pika.Message:
    return aio_pika.Message(
        message.body,
        headers=dict(message.headers) or None,
        message_id=message.message_id,
        delivery_mode=message.delivery_mode,
        priority=message.priority,
        reply_to=message.reply_to,
        correlation_id=message.correlation_id,
        expiration=message.expiration_ms / 1000 if message.expiration_ms is not None else None,
        content_type=message.content_type,
        timestamp=message.timestamp,
    )


@pytest.mark.parametrize(
    "message",
    [
        OutgoingMessage(b"x", "", "q"),
        OutgoingMessage(
            b"{}",
            "ex",
            "rk",
            message_id="m1",
            headers={"x-qosmq-reason": "bad", "n": 3, "nested": {"a": [1, "b"]}},
            persistent=True,
            priority=7,
            reply_to="amq.rabbitmq.reply-to",
            correlation_id="c1",
            expiration_ms=1500,
            content_type="application/json",
            timestamp=1_763_840_000.0,
        ),
        OutgoingMessage(b"", expiration_ms=0, priority=0),
    ],
)
def test_properties_equal_aio_pikas(message: OutgoingMessage) -> None:
    ours, theirs = _properties(message), _aio_pika(message).properties
    assert ours == theirs
    assert ours.marshal() == theirs.marshal()  # the same bytes on the wire


def test_a_fractional_timestamp_goes_out_as_whole_seconds_like_aio_pikas() -> None:
    message = OutgoingMessage(b"x", timestamp=1_763_840_000.75)
    assert _properties(message).marshal() == _aio_pika(message).properties.marshal()
