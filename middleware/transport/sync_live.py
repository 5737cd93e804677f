"""What a ``SyncClient`` holds of its connection (``SyncLive``), its consumers and its
watched channel, and the helpers on pika's objects its parts share (``sync.py``,
``sync_connecting.py``, ``sync_consumers.py``, ``sync_publishing.py``)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.frame
import pika.spec

from ..errors import (
    MiddlewareError,
)
from ..settings import Settings
from . import consuming, metrics
from .broker_info import BrokerInfo
from .delivery import (
    Delivery,
    Outcome,
)
from .message import OutgoingMessage
from .policy import Node, NodeRotation
from .topology import (
    ConsumerSpec,
    TopologyRecord,
)
from .watch import WatchedChannel

REPLY_TO = "amq.rabbitmq.reply-to"

SyncHandler = Callable[[Delivery], None]
SyncSettleHook = Callable[[Delivery, Outcome], None]
T = TypeVar("T")


@dataclass(eq=False)
class Watched:
    """The channel of unconfirmed publishes and replies, in confirm mode (``watch.py``):
    pika calls ``answers.append`` with each ack or nack while it reads."""

    channel: blocking.BlockingChannel
    ledger: WatchedChannel
    answers: list[Any] = field(default_factory=list)
    close_at: float = 0.0  # once retired: when its lingering replies no longer matter
    replying: bool = False  # consuming direct reply-to (once: a second consume closes it)


@dataclass
class SyncLive:
    """A connection up: its node, channels and the watched channel of replies."""

    node: Node
    connection: pika.BlockingConnection
    confirm_channel: blocking.BlockingChannel
    replies: Watched
    consumer_channels: dict[str, blocking.BlockingChannel] = field(default_factory=dict)
    retired: list[Watched] = field(default_factory=list)
    #: the channel passive declares run on (queue lengths, the consumer watchdog)
    probe: blocking.BlockingChannel | None = None


@dataclass(frozen=True)
class SyncConsumer:
    """A consumer as recorded: replayed after a failover."""

    spec: ConsumerSpec
    handler: SyncHandler
    on_settled: SyncSettleHook | None


#: the longest one step of ``SyncClient.run`` waits for I/O before its hooks run
STEP_S = 0.1


class SyncClientState:
    """What a ``SyncClient`` holds (set in its ``__init__``), named for its parts."""

    settings: Settings
    topology: TopologyRecord
    reconnects: int
    server: BrokerInfo | None
    refused_closes: int
    _last_refusal: MiddlewareError | None
    _rotation: NodeRotation
    _live: SyncLive | None
    _inherited: SyncLive | None
    _consumers: dict[str, SyncConsumer]
    _opened: bool
    _reply_handlers: list[Callable[[Delivery], None]]
    _cancelled: dict[str, float]
    _resends: list[tuple[float, OutgoingMessage, int]]
    _next_check: float
    _subscribed_at: dict[str, float]
    _checks: dict[str, consuming.ConsumerCheck]
    _delivered: dict[str, int]

    if TYPE_CHECKING:  # one part's steps another part takes (all of them are the client's)

        def _call(self, action: Callable[[SyncLive], T], *, attempts: int | None = None) -> T: ...
        def _drop(
            self, live: SyncLive, error: Exception, cause: BaseException | None = None
        ) -> None: ...
        def _reopen_channel(self, live: SyncLive) -> blocking.BlockingChannel: ...
        def _start_replies(self, live: SyncLive) -> None: ...
        def _open_watched(self, connection: pika.BlockingConnection) -> Watched: ...
        def _start_consumer(self, live: SyncLive, consumer: SyncConsumer) -> None: ...
        def dead_letter(self, delivery: Delivery, reason: str) -> None: ...
        @staticmethod
        def _on_probe_channel(
            live: SyncLive, action: Callable[[blocking.BlockingChannel], T]
        ) -> T: ...


def basic_publish(
    channel: blocking.BlockingChannel, message: OutgoingMessage, *, confirm: bool
) -> None:
    channel.basic_publish(
        message.exchange,
        message.routing_key,
        bytes(message.body),  # pika takes bytes or str only
        properties=to_pika_properties(message),
        mandatory=message.mandatory and confirm,
    )


class _DeadlineNacks(logging.Filter):
    """Drops pika's "Message was Nack'ed by broker" warning for the nack a
    ``ConfirmDeadline`` handed the wait (delivery tag 0, which no broker sends): the
    broker refused nothing, the caller hears ``ConfirmTimeout``."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        deadline = bool(args) and getattr(args[0], "delivery_tag", None) == 0
        return not (deadline and str(record.msg).startswith("Message was Nack'ed"))


_PIKA_PUBLISH_LOG = logging.getLogger("pika.adapters.blocking_connection")
_DEADLINE_NACKS = _DeadlineNacks()


class ConfirmDeadline:
    """Ends a confirmed publish's wait on ``channel`` after ``within`` seconds.

    pika's blocking publish waits for the broker's ack with no bound (a quorum queue
    without its quorum, or whose leader's node is paused, answers only when that is
    over).  A timer of pika's I/O loop (its timers run inside the blocking wait, as
    ``SyncSilence``'s) hands the wait a nack for an answer; ``passed`` then tells the
    caller the nack was the deadline's.  The channel must not be used again: the
    broker's late ack would be read as the next publish's.  ``cancel`` once the wait
    is over."""

    __slots__ = ("_handle", "_impl", "_result", "passed")

    def __init__(
        self, connection: pika.BlockingConnection, channel: blocking.BlockingChannel, within: float
    ) -> None:
        self.passed = False
        self._impl = connection._impl
        self._result = channel._message_confirmation_result
        self._handle = self._impl._adapter_call_later(within, self._fire)

    def _fire(self) -> None:
        if self._result.ready:  # answered in the same read
            return
        self.passed = True
        if _DEADLINE_NACKS not in _PIKA_PUBLISH_LOG.filters:  # (once, at the first deadline)
            _PIKA_PUBLISH_LOG.addFilter(_DEADLINE_NACKS)
        self._result.set_value_once(pika.frame.Method(0, pika.spec.Basic.Nack(delivery_tag=0)))

    def cancel(self) -> None:
        self._impl._adapter_remove_timeout(self._handle)


def close_within(connection: pika.BlockingConnection, within: float) -> None:
    """Close ``connection``, waiting at most ``within`` seconds for the broker's
    close-ok; past it the socket is dropped.  RabbitMQ answers a close only once every
    channel process of the connection ended, and a channel whose publish waits for a
    quorum queue without its quorum ends only after about 60 s: pika's close waited
    that long (63 s measured), with no bound.  Never raises."""
    impl = connection._impl
    handle = None

    def cut() -> None:
        metrics.CLOSES_CUT.inc()
        impl._adapter_disconnect_stream()

    with contextlib.suppress(Exception):
        handle = impl._adapter_call_later(within, cut)
    try:
        with contextlib.suppress(Exception):
            connection.close()
    finally:
        if handle is not None:
            with contextlib.suppress(Exception):
                impl._adapter_remove_timeout(handle)


def abandon(channel: blocking.BlockingChannel) -> None:
    """Close ``channel`` without waiting for the broker's answer (a channel whose
    publish timed out: its late ack must reach no later publish)."""
    if channel.is_open:
        with contextlib.suppress(pika.exceptions.AMQPError):  # closing or closed already
            channel._impl.close(200, "publish confirm timed out")


def counts_of(channel: blocking.BlockingChannel, *, queue: str) -> tuple[int, int]:
    """(consumers, ready messages) of ``queue`` (the broker closes the channel with 404
    if there is no such queue)."""
    ok = channel.queue_declare(queue, passive=True).method
    return int(ok.consumer_count), int(ok.message_count)


def exists(channel: blocking.BlockingChannel, *, queue: str) -> None:
    """Raise (the broker closes the channel with 404) unless ``queue`` exists."""
    channel.queue_declare(queue, passive=True)


def process_events(live: SyncLive, *, time_limit: float) -> None:
    live.connection.process_data_events(time_limit=time_limit)


def to_pika_properties(message: OutgoingMessage) -> pika.BasicProperties:
    return pika.BasicProperties(
        headers=dict(message.headers) or None,
        message_id=message.message_id,
        delivery_mode=message.delivery_mode,
        priority=message.priority,
        reply_to=message.reply_to,
        correlation_id=message.correlation_id,
        expiration=str(message.expiration_ms) if message.expiration_ms is not None else None,
        content_type=message.content_type,
        timestamp=None if message.timestamp is None else int(message.timestamp),
    )


def to_delivery(method: Any, props: pika.BasicProperties, body: bytes, queue: str) -> Delivery:
    return Delivery(
        body=body,
        queue=queue,
        exchange=getattr(method, "exchange", "") or "",
        routing_key=getattr(method, "routing_key", "") or "",
        message_id=props.message_id,
        correlation_id=props.correlation_id,
        reply_to=props.reply_to,
        content_type=props.content_type,
        priority=props.priority,
        timestamp=None if props.timestamp is None else float(props.timestamp),
        redelivered=bool(getattr(method, "redelivered", False)),
        delivery_tag=int(getattr(method, "delivery_tag", 0) or 0),
        persistent=props.delivery_mode == 2,
        headers=dict(props.headers or {}),
    )
