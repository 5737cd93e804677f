"""The asyncio core's publish frames, on aiormq's channel without aio-pika's objects.

:func:`basic_publish` is aiormq's own publish of a layer message.  :func:`publish_unawaited`
sends a publish on a confirm-mode channel and hands back the broker's answer as a future
instead of waiting for it: the watched channel (``watch.py``) of unconfirmed publishes
uses it, so the caller goes on at once while the layer still hears an ack or a nack.
It does what aiormq 7's ``Channel.basic_publish`` does up to its last line (take the
channel lock, number the publish, register the confirmation, queue the frames), which
``tests/unit/test_watch.py`` checks against the installed aiormq.
"""

from __future__ import annotations

import asyncio
import datetime

import aiormq
from aiormq.abc import ChannelFrame
from pamqp import commands as spec
from pamqp.header import ContentHeader

from .message import OutgoingMessage

__all__ = ["amqp_timestamp", "basic_publish", "properties", "publish_unawaited"]


async def basic_publish(
    underlay: aiormq.Channel,
    message: OutgoingMessage,
    *,
    mandatory: bool,
    confirm_within: float | None,
    wait: bool,
) -> None:
    """aiormq's publish of a layer message (``bytes(body)``: a bytearray is sent too);
    ``confirm_within``: aiormq's own timeout for the broker's answer."""
    await underlay.basic_publish(
        bytes(message.body),
        exchange=message.exchange,
        routing_key=message.routing_key,
        properties=properties(message),
        mandatory=mandatory,
        timeout=confirm_within,
        wait=wait,
    )


async def publish_unawaited(
    underlay: aiormq.Channel, message: OutgoingMessage
) -> tuple[int, asyncio.Future[object]]:
    """Queue ``message`` (not mandatory) on the confirm-mode channel ``underlay``; return
    its delivery tag and the future of the broker's answer (a result for an ack, aiormq's
    ``DeliveryError`` for a nack, an error or cancellation when the channel closes)."""
    if not underlay.publisher_confirms:
        raise ValueError("publish_unawaited needs a channel in confirm mode")
    body = bytes(message.body)
    frames: list[object] = [
        spec.Basic.Publish(exchange=message.exchange, routing_key=message.routing_key),
        ContentHeader(properties=properties(message), body_size=len(body)),
        *underlay._split_body(body),
    ]
    async with underlay.lock:
        underlay.delivery_tag += 1
        tag = underlay.delivery_tag
        confirmation = underlay.create_future()
        underlay.confirmations[tag] = confirmation
        try:
            await underlay.write_queue.put(
                ChannelFrame.marshall(
                    frames=frames,  # type: ignore[arg-type]
                    channel_number=underlay.number,
                    drain_future=None,
                )
            )
        except BaseException:
            underlay.delivery_tag -= 1  # the broker has not seen it: reuse the number
            underlay.confirmations.pop(tag, None)
            confirmation.cancel()
            raise
    return tag, confirmation


def properties(message: OutgoingMessage) -> aiormq.spec.Basic.Properties:
    """The AMQP properties as aio-pika's ``Message.properties`` builds them, without the
    ``Message`` object (its locked attribute checks cost more than the publish's framing)."""
    return aiormq.spec.Basic.Properties(
        content_type=message.content_type,
        correlation_id=message.correlation_id,
        delivery_mode=message.delivery_mode,
        expiration=None if message.expiration_ms is None else str(int(message.expiration_ms)),
        headers=dict(message.headers),
        message_id=message.message_id,
        priority=message.priority or 0,
        reply_to=message.reply_to,
        timestamp=amqp_timestamp(message.timestamp),
    )


def amqp_timestamp(seconds: float | None) -> datetime.datetime | None:
    """AMQP carries whole seconds since the epoch; aiormq takes them as an aware datetime."""
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(int(seconds), tz=datetime.UTC)
