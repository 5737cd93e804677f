"""What an ``AsyncClient`` holds of its connection (``Live``, or ``Down`` between
connections), its consumers, and the helpers on aiormq's objects its parts share
(``aio.py``, ``aio_connecting.py``, ``aio_consumers.py``, ``aio_publishing.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import time
import weakref
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
    nacks_renewed: int
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


#: the short-lived channels' numbers, per connection, counted up through the top half of
#: the negotiated range and reused only after they wrap: aiormq frees a number when the
#: broker's ``channel.close`` arrives (a refused declare), before its ``close-ok`` is
#: written, so a channel opened meanwhile under its lowest free number was a second
#: ``channel.open`` to the broker, which closed the whole connection (CHANNEL_ERROR;
#: 30 concurrent refused passive declares did it every time, 2026-12-07)
_next_short_lived: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


class _Undropped:
    """A channel's view of its connection's write queue whose ``put_nowait`` never drops:
    aiormq answers the broker's ``channel.close`` with ``put_nowait(close-ok)`` and
    drops it when the queue (10 frames, shared by every channel) is full, so the broker
    kept that channel closing for good and a later ``channel.open`` under its number
    closed the connection.  A frame that finds the queue full is put as soon as there
    is room (the queue's own order)."""

    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self.queue = queue

    def put_nowait(self, item: Any) -> None:
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            task = asyncio.ensure_future(self.queue.put(item))
            _PUTTING.add(task)
            task.add_done_callback(_PUTTING.discard)

    async def put(self, item: Any) -> None:
        await self.queue.put(item)


_PUTTING: set[asyncio.Future[None]] = set()


def _short_lived_number(connection: Any) -> int:
    """A channel number for a short-lived channel of ``connection`` not in use and not
    used for the longest while."""
    top = connection.connection_tune.channel_max or 65535
    low = top // 2 + 1
    number = _next_short_lived.get(connection, low)
    for _ in range(top - low + 1):
        candidate, number = number, number + 1 if number < top else low
        if candidate not in connection.channels:
            _next_short_lived[connection] = number
            return candidate
    raise ConnectionLost(f"every channel number from {low} to {top} is in use")


async def on_channel_of(
    live: Live,
    action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]],
    *,
    confirms: bool = False,
) -> Any:
    """Run ``action`` on a short-lived channel, so a refused declare closes only that one.

    An aiormq channel, not an aio-pika one: with aiormq 7 every aio-pika channel
    leaves two callbacks on its connection when it closes (``closing`` is a new
    observer per access, so aio-pika's ``remove_done_callback`` removes nothing),
    and the roles and sidecars read queue lengths every second for as long as they
    run (measured: ~4 kB per channel, a sidecar's memory growing without end).
    ``confirms``: in confirm mode, a returned mandatory message raised (a publish
    alone: ``aio_publishing``)."""
    transport = live.connection.transport
    if transport is None:
        raise ConnectionLost(f"connection to {live.node} closed")
    try:
        connection = transport.connection
        number = _short_lived_number(connection)
        channel = await connection.channel(
            channel_number=number, publisher_confirms=confirms, on_return_raises=confirms
        )
        channel.write_queue = _Undropped(connection.write_queue)  # type: ignore[attr-defined]
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
