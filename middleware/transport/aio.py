"""The asyncio core: one connection to any node of the cluster, failover, record and replay.

:class:`AsyncClient` connects to one node; when that connection dies it
fails over to the next node (tenacity backoff from settings), replays every
recorded exchange, queue, binding and consumer, and lets waiting publishes
through again.  Publishes carry a message id, wait for the broker's confirm
inside an in-flight window, and are retried on connection loss (at least
once: a consumer may see a duplicate, which the confirms layer suppresses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Self

import aiormq
from aiormq.abc import DeliveredMessage

from .. import tracing
from ..errors import (
    AccessRefused,
    BrokerUnreachable,
    ConnectionLost,
    EntityNotFound,
    GetTimeout,
    MiddlewareError,
    ResourceLocked,
)
from ..settings import Settings
from . import codec, consuming, metrics
from .aio_connecting import Connecting
from .aio_consumers import ConsumerMachinery
from .aio_live import (
    AsyncHandler,
    Consumer,
    Down,
    Live,
    ReplyHandler,
    SettleHook,
    from_delivered,
    on_channel_of,
    on_probe_channel,
    written,
)
from .aio_publishing import Publishing
from .broker_info import BrokerInfo
from .delivery import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_TOPOLOGY,
    Delivery,
    dead_letter_message,
)
from .message import OutgoingMessage
from .outbound import Limits, check_message, is_reply, replies_settings
from .policy import NodeRotation, async_retrying
from .replay import absent
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    QueueSpec,
    TopologyRecord,
)
from .translate import translate_aio

__all__ = ["REPLY_TO", "AsyncClient", "AsyncHandler", "ReplyHandler", "SettleHook"]

log = logging.getLogger(__name__)
#: RabbitMQ's direct reply-to pseudo-queue: replies go straight to the publishing channel.
REPLY_TO = "amq.rabbitmq.reply-to"


@codec.layer_calls
class AsyncClient(Connecting, Publishing, ConsumerMachinery):
    """The asyncio client: failover, record-and-replay, confirms with an in-flight window.

    Its parts: ``aio_connecting.Connecting`` (the connection, failover, replay),
    ``aio_publishing.Publishing`` (publishes in the window, confirms, retries),
    ``aio_consumers.ConsumerMachinery`` (consumers, their deliveries, the watchdog); what
    they hold is ``aio_live.ClientState``, set here."""

    def __init__(self, *, settings: Settings) -> None:
        self.settings = settings
        self.topology = TopologyRecord()
        self.reconnects = 0
        self.confirmed = 0
        self.nacks_renewed = 0  # confirm channels replaced after a nack (logged 1, 2, 4, ...)
        #: what the broker of the current (or last) connection said it is
        self.server: BrokerInfo | None = None
        self._rotation = NodeRotation(settings)
        self._live: Live | Down = Down()
        self._ready = asyncio.Event()
        self._window = asyncio.Semaphore(settings.publish_window)
        self._channel_lock = asyncio.Lock()
        self._consumers: dict[str, Consumer] = {}
        self._reconnect_hooks: list[Callable[[], Awaitable[None]]] = []
        self._close_hooks: list[Callable[[], Awaitable[None]]] = []
        self._suspects = asyncio.Lock()  # retries after a refusal close: one at a time
        #: connections the broker closed in answer to a frame it could not take
        #: (``REFUSAL_CODES``): what was in flight then is suspect (see ``resend_alone``)
        self.refused_closes = 0
        self._last_refusal: MiddlewareError | None = None
        self._hook_tasks: set[asyncio.Task[None]] = set()
        # the deliveries being handled (handler, settle, settle hook), by consumer tag
        self._handling: dict[str, set[asyncio.Task[Any]]] = {}
        self._reconnect_task: asyncio.Task[None] | None = None
        self._closers: set[asyncio.Task[None]] = set()
        self._loop_watch: asyncio.Task[None] | None = None
        self._closing = False
        self._reply_handlers: list[ReplyHandler] = []
        self._fatal: MiddlewareError | None = None
        self._tag_seq = 0
        self._dead_letter_lock = asyncio.Lock()
        self._dead_letter_declared = False
        #: publishes to direct reply-to addresses go over a connection of their own
        #: (``is_reply``); opened at the first one
        self._replies: AsyncClient | None = None
        self._watchdog: asyncio.Task[None] | None = None  # consumers subscribed to nothing
        self._subscribed_at: dict[str, float] = {}  # consumer tag -> when consume-ok came
        self._checks: dict[str, consuming.ConsumerCheck] = {}  # the watchdog's, by tag
        self._delivered: dict[str, int] = {}  # deliveries each consumer was given
        self._sends_own_replies = False  # True for the replies client itself
        self._replies_lock = asyncio.Lock()

    # ------------------------------------------------------------ lifecycle
    async def connect(self) -> Self:
        """Connect to the first node that answers; fail fast (one try per node)."""
        self._closing = False
        self._watch_loop_end()
        errors: dict[str, str] = {}
        try:
            for _ in self._rotation.nodes:
                node = self._rotation.take()
                try:
                    await self._open(node)
                    self._start_watchdog()
                    return self
                except AccessRefused:
                    raise
                except MiddlewareError as exc:
                    errors[str(node)] = str(exc)
        except BaseException:  # refused, or cancelled (a caller's timeout)
            self._stop_loop_watch()
            raise
        self._stop_loop_watch()
        raise BrokerUnreachable(
            "no node of the cluster accepted a connection: "
            + "; ".join(f"{n}: {e}" for n, e in errors.items())
            + " (is the cluster up? `qosmq cluster status`; check QOSMQ_AMQP_URLS)",
            attempts=errors,
        )

    def reconnect_in_background(self) -> None:
        """Keep trying the nodes (backoff from settings) until one answers, then replay.

        For callers that must work while the whole cluster is down (the queue API
        spools meanwhile); ``ready`` turns true and reconnect hooks run once connected.
        """
        self._closing = False
        self._watch_loop_end()
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.ensure_future(self._reconnect())
        self._start_watchdog()

    async def close(self) -> None:
        """Stop the consumers, let the handlers already running finish and settle (up to
        ``settings.close_grace`` seconds), run the close hooks (receipts still batched go
        out), let the watched channel settle (the broker's answers to unconfirmed
        publishes, what it refused sent again; up to ``close_grace``), then close the
        connection and stop failing over."""
        await self._stop_consumers(list(self._consumers))
        for hook in list(self._close_hooks):
            try:
                await hook()
            except Exception as exc:
                log.info("close hook failed: %s", exc)
        if self._replies is not None:
            await self._replies.close()
        if isinstance(self._live, Live):
            await self._live.replies.settle(self.settings.close_grace)
        self._closing = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._loop_watch is not None:
            self._loop_watch.cancel()
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reconnect_task
        for task in list(self._hook_tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        live, self._live = self._live, Down()
        self._ready.clear()
        if isinstance(live, Live):
            live.replies.close()
            await written(live.connection, self.settings.close_grace)
            with contextlib.suppress(Exception):
                await live.connection.close()

    async def __aenter__(self) -> Self:
        """Connects, unless connected already (``async with await client.connect()``
        opens one connection, not two)."""
        return self if isinstance(self._live, Live) else await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def ready(self) -> bool:
        """True while a connection is up and its topology replayed."""
        return self._ready.is_set() and isinstance(self._live, Live)

    @property
    def limits(self) -> Limits:
        """What the brokers accept: the negotiated frame_max once connected, else the
        AMQP default; the settings' max_message_size."""
        live = self._live
        if isinstance(live, Live):
            return live.limits
        return Limits(max_message_size=self.settings.max_message_size)

    @property
    def connected_node(self) -> str | None:
        """``amqp://host:port`` of the node in use, or None while failing over."""
        return str(self._live.node) if isinstance(self._live, Live) else None

    @property
    def socket_writes(self) -> tuple[int, int] | None:
        """(frames written, socket writes made) on the current connection, or None when
        writes are not coalesced (``coalesce_writes = false``) or no connection is up."""
        if not isinstance(self._live, Live):
            return None
        factory = self._live.connection.kwargs.get("transport_factory")
        writer = getattr(factory, "writer", None)
        return None if writer is None else (writer.frames, writer.flushes)

    def on_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` after every successful failover (after topology replay)."""
        self._reconnect_hooks.append(hook)

    async def listen_replies(self, handler: ReplyHandler) -> None:
        """Receive direct reply-to messages on the channel unconfirmed publishes use.

        A publish with ``reply_to=REPLY_TO`` and ``confirm=False`` gets its replies
        here; no queue is declared, and the listener is re-established after failover.
        Any number of listeners share the one reply consumer; each hears every reply.
        """
        self._reply_handlers.append(handler)
        if len(self._reply_handlers) == 1:
            try:  # a connection lost meanwhile: after the failover (which starts the
                async for attempt in async_retrying(self.settings.retry):  # replies too)
                    with attempt:
                        await self._start_replies(await self._await_live())
            except BaseException:
                self._reply_handlers.remove(handler)
                raise

    async def _start_replies(self, live: Live) -> None:
        handlers = self._reply_handlers
        if not handlers:
            return

        async def on_reply(msg: DeliveredMessage) -> None:
            delivery = from_delivered(msg, REPLY_TO)
            for handler in handlers:
                handler(delivery)

        try:
            await live.replies.listen(on_reply)
        except Exception as exc:
            raise translate_aio(exc) from exc

    # ------------------------------------------------------------- topology
    async def declare_exchange(self, spec: ExchangeSpec) -> None:
        await self._apply_with_retry(spec)

    async def declare_queue(self, spec: QueueSpec) -> int:
        """Declare (and record) a queue; return its message count."""
        result: int = await self._apply_with_retry(spec)
        return result

    async def bind(self, spec: BindingSpec) -> None:
        await self._apply_with_retry(spec)

    async def delete_queue(self, name: str) -> None:
        """Delete the queue, after stopping this client's own consumers of it as
        ``cancel`` does (their running handlers finish and settle first): a consumer of
        a queue its own client deleted ends there; it is not subscribed again when a
        queue of that name is declared later.  (A queue deleted by someone else is the
        broker's cancel: the consumer is subscribed again once the queue is back.)"""
        own = consuming.consumers_of(self._consumers, name)
        if own:
            await self._stop_consumers(own)
        self.topology.forget_queue(name)
        await self._on_temp_channel(lambda ch: ch.queue_delete(name))

    async def delete_exchange(self, name: str) -> None:
        self.topology.forget_exchange(name)
        await self._on_temp_channel(lambda ch: ch.exchange_delete(name))

    async def queue_length(self, name: str) -> int:
        """Messages ready in the queue (passive declare: raises EntityNotFound if missing)."""

        async def passive(ch: aiormq.abc.AbstractChannel) -> int:
            ok = await ch.queue_declare(name, passive=True)
            return int(ok.message_count or 0) if ok else 0

        async for attempt in async_retrying(self.settings.retry):
            with attempt:
                live = await self._await_live()
                return int(await on_probe_channel(live, passive))
        raise AssertionError("unreachable: the retry raises its last error")

    async def queue_there(self, name: str) -> bool:
        """Whether the queue exists, asked once (no retry): an exclusive queue held by
        another connection (405) is there; one not found (404) is not.  Other failures
        raise (a lost connection, ...)."""
        return await self._refused_passively(name, on_probe_channel) is None

    async def queue_gone(self, name: str) -> bool:
        """Whether the queue does not exist, asked once (no retry): a passive declare
        refused with 404 "no queue".  One that exists but cannot be reached now (its
        home node down, its process stopped by a node's stop) is refused with 404 too,
        for another reason (``replay.absent``): not gone, and neither is one that
        answers.  Asked on a channel of its own: a 404 closes it, and the copies returned
        at a node's stop ask at once (the probe channel, closed by the first, would fail
        the others).  Other failures raise (a lost connection, ...)."""
        refused = await self._refused_passively(name, on_channel_of)
        return refused is not None and not absent(str(refused))

    async def _refused_passively(
        self, name: str, on: Callable[[Live, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]
    ) -> EntityNotFound | None:
        """A passive declare of ``name`` once, on the channel ``on`` gives: the 404 that
        refused it, or None (there; an exclusive queue held by another connection too)."""

        async def passive(ch: aiormq.abc.AbstractChannel) -> None:
            await ch.queue_declare(name, passive=True)

        try:
            await on(await self._await_live(), passive)
        except ResourceLocked:
            return None
        except EntityNotFound as exc:
            return exc
        return None

    async def answers(self, within: float) -> bool:
        """Whether the node this client is connected to answers a round trip (a passive
        declare of ``amq.direct`` on a channel of its own) within ``within`` seconds.

        Tells a publish its node holds up (a queue on a frozen node: the broker still
        counts that node as up, so it neither confirms nor returns) from a connection
        that does not answer at all, which the silence rule closes and the failover
        resends.  Never raises; the round trip, if it outlives ``within``, ends in the
        background."""
        live = self._live
        if not isinstance(live, Live) or not self._ready.is_set():
            return False

        async def trip() -> None:
            await on_channel_of(live, lambda ch: ch.exchange_declare("amq.direct", passive=True))

        task: asyncio.Task[None] = asyncio.ensure_future(trip())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (retrieved)
        done, _ = await asyncio.wait({task}, timeout=within)
        return bool(done) and not task.cancelled() and task.exception() is None

    # ------------------------------------------------------------ consuming
    async def consume(
        self,
        queue: str,
        handler: AsyncHandler,
        *,
        prefetch: int | None = None,
        tag: str | None = None,
        on_settled: SettleHook | None = None,
    ) -> str:
        """Consume ``queue`` with ``handler``; the consumer is replayed after failover.

        The handler's end decides the ack: return = ack; raise ``Reject``,
        ``Requeue`` or ``DeadLetter``; any other exception dead-letters the
        message with the exception as reason.  ``on_settled`` runs after the
        ack/reject was sent (the confirms layer sends receipts there).
        """
        self._tag_seq += 1
        spec = ConsumerSpec(
            queue=queue,
            tag=tag or f"qosmq-{id(self):x}-{self._tag_seq}",
            prefetch=prefetch or self.settings.prefetch,
        )
        self._consumers[spec.tag] = Consumer(spec, handler, on_settled)
        try:
            await self._apply_with_retry(spec)
        except BaseException:
            self._consumers.pop(spec.tag, None)
            raise
        return spec.tag

    async def cancel(self, tag: str, *, grace: float | None = None) -> None:
        """Stop a consumer (and forget it for replay): no new deliveries; the ones being
        handled finish and settle first, for up to ``grace`` seconds (default
        ``settings.close_grace``; 0: cancel them now, their deliveries go back to the
        queue, as a Phoenix master that stepped down wants)."""
        await self._stop_consumers([tag], grace)

    def on_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Run ``hook`` on ``close``, after the handlers finished, while still connected."""
        self._close_hooks.append(hook)

    async def get(self, queue: str) -> Delivery | None:
        """Take one message (basic.get, acked on receipt), or None if the queue is empty."""

        async def take(ch: aiormq.abc.AbstractChannel) -> Delivery | None:
            msg = await ch.basic_get(queue, no_ack=True)
            if isinstance(msg.delivery, aiormq.spec.Basic.GetEmpty):
                return None
            return from_delivered(msg, queue)

        try:
            result: Delivery | None = await self._on_temp_channel(take)
        except GetTimeout:
            metrics.GET_TIMEOUTS.inc()
            raise
        return result

    # ----------------------------------------------------------- publishing
    async def publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool = True,
        block: bool = True,
        retry: bool = True,
        retry_nacked: bool = True,
    ) -> None:
        """Publish and, with ``confirm``, return once the broker confirmed it.

        Retries on connection loss (same message id) under the settings'
        retry policy (``retry=False``: one attempt, the caller handles failure).
        ``retry_nacked=False``: a ``basic.nack`` (a full queue that rejects publishes,
        a quorum leader election) raises ``PublishNacked`` at once instead of being sent
        again on a fresh channel, for a caller that has somewhere else to send it.
        Raises ``MalformedMessage`` at once for a message the broker would refuse,
        ``Unroutable`` (mandatory and no queue bound), ``PublishNacked``,
        ``BrokerUnreachable`` after the last attempt, or ``WindowFull`` when
        ``block`` is false and the window is full.
        """
        check_message(message, self.limits)
        if is_reply(message) and not self._sends_own_replies:
            replies = await self._reply_sender()
            return await replies.publish(
                message, confirm=confirm, block=block, retry=retry, retry_nacked=retry_nacked
            )
        if tracing.active():
            with tracing.publish(message) as traced:
                return await self._publish(
                    traced, confirm=confirm, block=block, retry=retry, retry_nacked=retry_nacked
                )
        return await self._publish(
            message, confirm=confirm, block=block, retry=retry, retry_nacked=retry_nacked
        )

    async def _reply_sender(self) -> AsyncClient:
        """The client of this one's replies (``is_reply`` says why), connected at first use."""
        if self._replies is None:
            async with self._replies_lock:
                if self._replies is None:
                    client = AsyncClient(settings=replies_settings(self.settings))
                    client._sends_own_replies = True
                    await client.connect()
                    self._replies = client
        return self._replies

    async def resend_alone(self, message: OutgoingMessage, *, confirm: bool = True) -> None:
        """Send again a message that was in flight when the broker closed the connection
        in answer to a frame (``refused_closes`` went up): alone among the suspects, and
        known to be taken before this returns (``confirm``: the broker's confirm; else a
        round trip on the channel it went out on, which a direct reply-to publish needs).
        Closed at again: ``MessageRefused``, never sent again."""
        check_message(message, self.limits)
        first = self._last_refusal or ConnectionLost("the broker closed the connection")
        await self._publish_suspect(message, first, confirm=confirm, block=True)

    async def publish_watched(self, message: OutgoingMessage) -> asyncio.Future[None]:
        """An unconfirmed publish (it leaves as ``publish(confirm=False)`` does) whose
        broker answer is handed back: the future resolves when the broker took it, or
        raises ``PublishNacked`` (the layer sends it again itself) or the reason its
        channel closed.  For callers that wait for something else first (an e2e receipt)
        and want to know, once they stop waiting, that the broker holds the message."""
        check_message(message, self.limits)
        if is_reply(message) and not self._sends_own_replies:
            replies = await self._reply_sender()
            return await replies.publish_watched(message)
        async with self._window:
            live = await self._await_live()
            try:
                answer = await live.replies.send(message, wait=True)
            except Exception as exc:
                raise translate_aio(exc) from exc
        metrics.PUBLISHED_UNCONFIRMED.inc()
        assert answer is not None
        return answer

    def publish_nowait(
        self, message: OutgoingMessage, *, confirm: bool = True
    ) -> asyncio.Future[None]:
        """Start a publish; the returned future resolves on the broker's confirm."""
        return asyncio.ensure_future(self.publish(message, confirm=confirm))

    # ------------------------------------------------------------- internal

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy ``delivery`` to the layer's dead-letter queue with ``reason`` in its headers
        (always publishable: headers the broker would refuse are left out, and said so)."""
        if not self._dead_letter_declared:
            # once, whole: concurrent first dead-letters each saw the exchange recorded
            # before its queue was bound, published to no route and went unsettled
            async with self._dead_letter_lock:
                if not self._dead_letter_declared:
                    for spec in DEAD_LETTER_TOPOLOGY:
                        await self._apply_with_retry(spec)
                    self._dead_letter_declared = True
        await self.publish(
            dead_letter_message(delivery, reason, exchange=DEAD_LETTER_EXCHANGE, limits=self.limits)
        )
