"""The asyncio core's publish frames, on aiormq's channel without aio-pika's objects.

:func:`basic_publish` is aiormq's own publish of a layer message.  :func:`publish_numbered`
sends a publish and returns the delivery tag the broker numbers it with, for the watched
channel of unconfirmed publishes (``aio_watch.py``), which reads the broker's acks and
nacks itself instead of keeping a future per message in aiormq.  It does what aiormq 7's
``Channel.basic_publish`` does without confirms (take the channel lock, number the
publish, queue the frames), which ``tests/unit/test_watch.py`` checks against the
installed aiormq.
"""

from __future__ import annotations

import asyncio
import datetime

import aiormq
from aiormq.abc import AbstractChannel, ChannelFrame
from pamqp import commands as spec
from pamqp.header import ContentHeader

from .message import OutgoingMessage

__all__ = [
    "amqp_timestamp",
    "basic_publish",
    "properties",
    "publish_numbered",
    "queued",
    "settle_frame",
]


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


async def publish_numbered(underlay: aiormq.Channel, message: OutgoingMessage) -> int:
    """Queue ``message`` on ``underlay`` and return the delivery tag the broker gives it:
    on a channel the layer put in confirm mode itself (``aio_watch``), the tag its ack or
    nack will carry; aiormq keeps no future for it (``aio_watch`` reads a mandatory
    message's return)."""
    body = bytes(message.body)
    frames: list[object] = [
        spec.Basic.Publish(
            exchange=message.exchange,
            routing_key=message.routing_key,
            mandatory=message.mandatory,
        ),
        ContentHeader(properties=properties(message), body_size=len(body)),
        *underlay._split_body(body),
    ]
    async with underlay.lock:
        underlay.delivery_tag += 1
        tag = underlay.delivery_tag
        try:
            await queued(
                underlay,
                ChannelFrame.marshall(
                    frames=frames,  # type: ignore[arg-type]
                    channel_number=underlay.number,
                    drain_future=None,
                ),
            )
        except BaseException:
            underlay.delivery_tag -= 1  # the broker has not seen it: reuse the number
            raise
    return tag


async def queued(underlay: AbstractChannel, frame: ChannelFrame) -> None:
    """Put ``frame`` on the connection's frame queue: at once while it has room (the
    common case: no task, no wait); when it is full, wait for room unless the channel
    closes first.  The queue is bounded (``FRAME_BUFFER_SIZE``) and only the
    connection's writer empties it, so on a connection that was lost with its queue
    full the wait had no end: the publish hung, holding the channel's lock, and every
    publish queued behind it hung too (a Phoenix match broker's e2e copies across a cut
    link never settled, and the copies of those events that should have been carried
    around the link were never carried).  aiormq's own publish bounds this wait by its
    timeout; this one ends when the channel closes, raising why it closed."""
    if underlay.is_closed:
        raise aiormq.exceptions.ChannelInvalidStateError(f"channel {underlay.number} closed")
    queue: asyncio.Queue[ChannelFrame] = underlay.write_queue  # type: ignore[attr-defined]
    try:
        queue.put_nowait(frame)
        return
    except asyncio.QueueFull:
        pass
    closing = underlay.closing
    putting = asyncio.ensure_future(queue.put(frame))
    try:
        await asyncio.wait((putting, closing), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not putting.done():
            putting.cancel()
        closing.cancel()  # an observer of the close: cancelling it stops observing only
    if putting.done() and not putting.cancelled():
        putting.result()  # (raises what the put raised)
        return
    reason = closing.exception() if closing.done() and not closing.cancelled() else None
    if isinstance(reason, Exception):
        raise reason
    raise aiormq.exceptions.ChannelInvalidStateError(f"channel {underlay.number} closed")


async def settle_frame(
    underlay: AbstractChannel, frame: spec.Basic.Ack | spec.Basic.Nack | spec.Basic.Reject
) -> None:
    """A delivery's settlement (ack, requeue, reject) queued as aiormq's ``basic_ack``
    with ``wait=False`` queues it, except that the wait for room ends when the channel
    closes (``queued``): aiormq's waited for ever on a connection lost with its frame
    queue full, and the handler's task with it."""
    await queued(underlay, ChannelFrame.marshall(frames=[frame], channel_number=underlay.number))


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
