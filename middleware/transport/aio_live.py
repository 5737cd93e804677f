"""What an ``AsyncClient`` holds of its connection (``Live``, or ``Down`` between
connections), its consumers, and the helpers on aiormq's objects its parts share
(``aio.py``, ``aio_connecting.py``, ``aio_consumers.py``, ``aio_publishing.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from ..errors import (
    ConnectionLost,
    MiddlewareError,
    NotConnected,
)
from ..settings import Settings
from . import consuming
from .aio_watch import WatchedReplies
from .broker_info import BrokerInfo
from .delivery import Delivery, Outcome
from .message import OutgoingMessage
from .outbound import Limits
from .policy import Node, NodeRotation
from .topology import ConsumerSpec, TopologyRecord
from .translate import translate_aio

AsyncHandler = Callable[[Delivery], Awaitable[None]]
SettleHook = Callable[[Delivery, Outcome], Awaitable[None]]
ReplyHandler = Callable[[Delivery], None]


@dataclass
class Live:
    """A connection up: its node, channels, watched replies and limits."""

    node: Node
    connection: AbstractConnection
    confirm_channel: AbstractChannel
    replies: WatchedReplies  # unconfirmed publishes and direct reply-to, watched
    limits: Limits
    consumer_channels: dict[str, AbstractChannel] = field(default_factory=dict)
    #: the channel passive declares run on (queue lengths, the consumer watchdog)
    probe: aiormq.abc.AbstractChannel | None = None


class Down:
    """No live connection: every use says what to do."""

    def __getattr__(self, name: str) -> Any:
        raise NotConnected("not connected: await client.connect() first")


@dataclass(frozen=True)
class Consumer:
    """A consumer as recorded: replayed after a failover."""

    spec: ConsumerSpec
    handler: AsyncHandler
    on_settled: SettleHook | None


class ClientState:
    """What an ``AsyncClient`` holds (set in its ``__init__``), named for its parts."""

    settings: Settings
    topology: TopologyRecord
    reconnects: int
    #: publishes the broker confirmed on this client, ever: a caller bounding its own
    #: wait tells a slow link (confirms still coming) from a silent one by it
    confirmed: int
    server: BrokerInfo | None
    refused_closes: int
    _rotation: NodeRotation
    _live: Live | Down
    _ready: asyncio.Event
    _window: asyncio.Semaphore
    _channel_lock: asyncio.Lock
    _consumers: dict[str, Consumer]
    _reconnect_hooks: list[Callable[[], Awaitable[None]]]
    _suspects: asyncio.Lock
    _last_refusal: MiddlewareError | None
    _hook_tasks: set[asyncio.Task[None]]
    _handling: dict[str, set[asyncio.Task[Any]]]
    _reconnect_task: asyncio.Task[None] | None
    _closers: set[asyncio.Task[None]]
    _loop_watch: asyncio.Task[None] | None
    _closing: bool
    _fatal: MiddlewareError | None
    _watchdog: asyncio.Task[None] | None
    _subscribed_at: dict[str, float]
    _checks: dict[str, consuming.ConsumerCheck]
    _delivered: dict[str, int]

    if TYPE_CHECKING:  # one part's steps another part takes (all of them are the client's)

        async def _await_live(self) -> Live: ...
        async def _start_consumer(self, live: Live, consumer: Consumer) -> None: ...
        def _subscribe_later(self, live: Live, tag: str, why: str) -> None: ...
        async def _start_replies(self, live: Live) -> None: ...
        async def _resend_watched(self, message: OutgoingMessage, attempt: int) -> None: ...
        async def dead_letter(self, delivery: Delivery, reason: str) -> None: ...

        @property
        def connected_node(self) -> str | None: ...


async def written(connection: AbstractConnection, within: float) -> None:
    """Wait (up to ``within`` seconds) until aiormq's writer took every frame queued:
    closing cancels that writer, and what it still queued (an unconfirmed publish, the
    last receipts, acks) would never leave."""
    queue = getattr(getattr(connection.transport, "connection", None), "write_queue", None)
    if queue is None:
        return
    deadline = time.monotonic() + within
    while not queue.empty() and time.monotonic() < deadline:  # noqa: ASYNC110 (no event)
        await asyncio.sleep(0.005)


def frame_max(connection: AbstractConnection) -> int:
    """The frame_max the broker and aiormq agreed on (the AMQP default if unknown)."""
    tune = getattr(getattr(connection.transport, "connection", None), "connection_tune", None)
    return int(getattr(tune, "frame_max", 0) or Limits().frame_max)


def _seconds(stamp: datetime.datetime | int | None) -> float | None:
    """A timestamp as decoded (``codec`` keeps one past the year 9999 as raw seconds)."""
    if stamp is None:
        return None
    return stamp.timestamp() if isinstance(stamp, datetime.datetime) else float(stamp)


def from_delivered(msg: DeliveredMessage, queue: str) -> Delivery:
    """A delivery (consumed or taken with basic.get), from aiormq's message (no aio-pika
    object in between)."""
    props = msg.header.properties
    return Delivery(
        body=msg.body,
        queue=queue,
        exchange=msg.exchange or "",
        routing_key=msg.routing_key or "",
        message_id=props.message_id,
        correlation_id=props.correlation_id,
        reply_to=props.reply_to,
        content_type=props.content_type,
        priority=props.priority,
        timestamp=_seconds(props.timestamp),
        redelivered=bool(msg.redelivered),
        delivery_tag=msg.delivery_tag or 0,
        persistent=props.delivery_mode == 2,
        headers=dict(props.headers or {}),
    )


async def on_channel_of(
    live: Live, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
) -> Any:
    """Run ``action`` on a short-lived channel, so a refused declare closes only that one.

    An aiormq channel, not an aio-pika one: with aiormq 7 every aio-pika channel
    leaves two callbacks on its connection when it closes (``closing`` is a new
    observer per access, so aio-pika's ``remove_done_callback`` removes nothing),
    and the roles and sidecars read queue lengths every second for as long as they
    run (measured: ~4 kB per channel, a sidecar's memory growing without end)."""
    transport = live.connection.transport
    if transport is None:
        raise ConnectionLost(f"connection to {live.node} closed")
    try:
        channel = await transport.connection.channel(publisher_confirms=False)
        try:
            return await action(channel)
        finally:
            if not channel.is_closed:
                with contextlib.suppress(Exception):
                    await channel.close()
    except MiddlewareError:
        raise
    except Exception as exc:
        raise translate_aio(exc) from exc


async def on_probe_channel(
    live: Live, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
) -> Any:
    """Run ``action`` (a passive declare: a queue length, the consumer watchdog's
    look) on the connection's probe channel, opened once and again only after a
    refusal closed it: the roles and sidecars read a queue length every second and
    look at each consumer's queue every ``consumer_check_s``, and a channel opened
    and closed each time is churn the broker pays for (a channel is several Erlang
    processes and their statistics)."""
    transport = live.connection.transport
    if transport is None:
        raise ConnectionLost(f"connection to {live.node} closed")
    try:
        probe = live.probe
        if probe is None or probe.is_closed:
            probe = await transport.connection.channel(publisher_confirms=False)
            if live.probe is None or live.probe.is_closed:
                live.probe = probe
            else:  # another read opened one meanwhile: that one stays
                await probe.close()
                probe = live.probe
        return await action(probe)
    except MiddlewareError:
        raise
    except Exception as exc:
        raise translate_aio(exc) from exc
