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
import datetime
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Self, cast

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
)
from aiormq.abc import DeliveredMessage
from tenacity import AsyncRetrying, retry_if_exception_type

from .. import tracing
from ..errors import (
    AccessRefused,
    BrokerUnreachable,
    ConnectionLost,
    EntityNotFound,
    MessageRefused,
    MiddlewareError,
    NotConnected,
    PublishNacked,
    ResourceLocked,
    RetryableError,
    TopologyError,
    WindowFull,
)
from ..settings import Settings
from . import codec, consuming, metrics
from .aio_publish import basic_publish
from .aio_watch import WatchedReplies
from .broker_info import BrokerInfo
from .coalesce import CoalescingConnection
from .delivery import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_TOPOLOGY,
    Delivery,
    Outcome,
    dead_letter_message,
)
from .message import OutgoingMessage, tls_context
from .outbound import Limits, check_message, is_reply, replies_settings
from .policy import Node, NodeRotation, async_retrying, backoff
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    QueueSpec,
    TopologyRecord,
)
from .translate import refusal_code, translate_aio

__all__ = ["REPLY_TO", "AsyncClient", "AsyncHandler", "ReplyHandler", "SettleHook"]

log = logging.getLogger(__name__)
AsyncHandler = Callable[[Delivery], Awaitable[None]]
SettleHook = Callable[[Delivery, Outcome], Awaitable[None]]
ReplyHandler = Callable[[Delivery], None]
#: RabbitMQ's direct reply-to pseudo-queue: replies go straight to the publishing channel.
REPLY_TO = "amq.rabbitmq.reply-to"


@dataclass
class _Live:
    node: Node
    connection: AbstractConnection
    confirm_channel: AbstractChannel
    replies: WatchedReplies  # unconfirmed publishes and direct reply-to, watched
    limits: Limits
    consumer_channels: dict[str, AbstractChannel] = field(default_factory=dict)
    #: the channel passive declares run on (queue lengths, the consumer watchdog)
    probe: aiormq.abc.AbstractChannel | None = None


class _Refused(Exception):
    """Ends the suspect retry: the broker closed the connection at the message again."""

    def __init__(self, error: MiddlewareError) -> None:
        super().__init__(str(error))
        self.error = error


class _Down:
    """No live connection: every use says what to do."""

    def __getattr__(self, name: str) -> Any:
        raise NotConnected("not connected: await client.connect() first")


@dataclass(frozen=True)
class _Consumer:
    spec: ConsumerSpec
    handler: AsyncHandler
    on_settled: SettleHook | None


@codec.layer_calls
class AsyncClient:
    """The asyncio client: failover, record-and-replay, confirms with an in-flight window."""

    def __init__(self, *, settings: Settings) -> None:
        self.settings = settings
        self.topology = TopologyRecord()
        self.reconnects = 0
        #: what the broker of the current (or last) connection said it is
        self.server: BrokerInfo | None = None
        self._rotation = NodeRotation(settings)
        self._live: _Live | _Down = _Down()
        self._ready = asyncio.Event()
        self._window = asyncio.Semaphore(settings.publish_window)
        self._channel_lock = asyncio.Lock()
        self._consumers: dict[str, _Consumer] = {}
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
        out), then close the connection and stop failing over."""
        await self._stop_consumers(list(self._consumers))
        for hook in list(self._close_hooks):
            try:
                await hook()
            except Exception as exc:
                log.info("close hook failed: %s", exc)
        if self._replies is not None:
            await self._replies.close()
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
        live, self._live = self._live, _Down()
        self._ready.clear()
        if isinstance(live, _Live):
            live.replies.close()
            await _written(live.connection, self.settings.close_grace)
            with contextlib.suppress(Exception):
                await live.connection.close()

    async def __aenter__(self) -> Self:
        """Connects, unless connected already (``async with await client.connect()``
        opens one connection, not two)."""
        return self if isinstance(self._live, _Live) else await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def ready(self) -> bool:
        """True while a connection is up and its topology replayed."""
        return self._ready.is_set() and isinstance(self._live, _Live)

    @property
    def limits(self) -> Limits:
        """What the brokers accept: the negotiated frame_max once connected, else the
        AMQP default; the settings' max_message_size."""
        live = self._live
        if isinstance(live, _Live):
            return live.limits
        return Limits(max_message_size=self.settings.max_message_size)

    @property
    def connected_node(self) -> str | None:
        """``amqp://host:port`` of the node in use, or None while failing over."""
        return str(self._live.node) if isinstance(self._live, _Live) else None

    @property
    def socket_writes(self) -> tuple[int, int] | None:
        """(frames written, socket writes made) on the current connection, or None when
        writes are not coalesced (``coalesce_writes = false``) or no connection is up."""
        if not isinstance(self._live, _Live):
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

    async def _start_replies(self, live: _Live) -> None:
        handlers = self._reply_handlers
        if not handlers:
            return

        async def on_reply(msg: DeliveredMessage) -> None:
            delivery = _from_delivered(msg, REPLY_TO)
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
                return int(await self._on_probe_channel(live, passive))
        raise AssertionError("unreachable: the retry raises its last error")

    async def queue_there(self, name: str) -> bool:
        """Whether the queue exists, asked once (no retry): an exclusive queue held by
        another connection (405) is there; one not found (404) is not.  Other failures
        raise (a lost connection, ...)."""

        async def passive(ch: aiormq.abc.AbstractChannel) -> None:
            await ch.queue_declare(name, passive=True)

        try:
            await self._on_probe_channel(await self._await_live(), passive)
        except ResourceLocked:
            return True
        except EntityNotFound:
            return False
        return True

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
        self._consumers[spec.tag] = _Consumer(spec, handler, on_settled)
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

    async def _stop_consumers(self, tags: list[str], grace: float | None = None) -> None:
        grace = self.settings.close_grace if grace is None else grace
        live = self._live
        channels = []
        for tag in tags:
            self.topology.forget_consumer(tag)
            self._consumers.pop(tag, None)
            if isinstance(live, _Live) and (channel := live.consumer_channels.pop(tag, None)):
                channels.append(channel)
                with contextlib.suppress(Exception):
                    # basic_cancel first: the channel stays open for the acks of the
                    # deliveries in hand (closing it would cancel their handlers)
                    underlay = await channel.get_underlay_channel()
                    await underlay.basic_cancel(tag, timeout=self.settings.connect_timeout)
        running = {t for tag in tags for t in self._handling.get(tag, ())}
        running.discard(asyncio.current_task())  # a handler cancelling its own consumer
        if running:
            late = running
            if grace:
                _, late = await asyncio.wait(running, timeout=grace)
            if late:
                log.log(
                    logging.WARNING if grace else logging.INFO,
                    "%d handlers still running after %.1f s: their deliveries go back to the queue",
                    len(late),
                    grace,
                )
                for task in late:
                    task.cancel()
        for channel in channels:
            with contextlib.suppress(Exception):
                await channel.close()

    async def get(self, queue: str) -> Delivery | None:
        """Take one message (basic.get, acked on receipt), or None if the queue is empty."""

        async def take(ch: aiormq.abc.AbstractChannel) -> Delivery | None:
            msg = await ch.basic_get(queue, no_ack=True)
            if isinstance(msg.delivery, aiormq.spec.Basic.GetEmpty):
                return None
            return _from_delivered(msg, queue)

        result: Delivery | None = await self._on_temp_channel(take)
        return result

    # ----------------------------------------------------------- publishing
    async def publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool = True,
        block: bool = True,
        retry: bool = True,
    ) -> None:
        """Publish and, with ``confirm``, return once the broker confirmed it.

        Retries on connection loss (same message id) under the settings'
        retry policy (``retry=False``: one attempt, the caller handles failure).
        Raises ``MalformedMessage`` at once for a message the broker would refuse,
        ``Unroutable`` (mandatory and no queue bound), ``PublishNacked``,
        ``BrokerUnreachable`` after the last attempt, or ``WindowFull`` when
        ``block`` is false and the window is full.
        """
        check_message(message, self.limits)
        if is_reply(message) and not self._sends_own_replies:
            replies = await self._reply_sender()
            return await replies.publish(message, confirm=confirm, block=block, retry=retry)
        if tracing.active():
            with tracing.publish(message) as traced:
                return await self._publish(traced, confirm=confirm, block=block, retry=retry)
        return await self._publish(message, confirm=confirm, block=block, retry=retry)

    async def _publish(
        self, message: OutgoingMessage, *, confirm: bool, block: bool, retry: bool
    ) -> None:
        try:
            await self._publish_once(message, confirm=confirm, block=block)
            return
        except RetryableError as exc:
            if refusal_code(exc):
                return await self._publish_suspect(message, exc, confirm=confirm, block=block)
            if isinstance(exc, WindowFull) or not retry or self.settings.retry.attempts < 2:
                raise
            log.debug("publish %s failed (%s); retrying under the policy", message.message_id, exc)
        # The hot path above builds no retry object; only a failed publish pays for tenacity.
        retries = self.settings.retry.attempts - 1
        async for attempt in async_retrying(self.settings.retry, attempts=retries):
            with attempt:
                try:
                    await self._publish_once(message, confirm=confirm, block=block)
                except RetryableError as exc:
                    if not refusal_code(exc):
                        raise
                    return await self._publish_suspect(message, exc, confirm=confirm, block=block)

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

    async def _publish_suspect(
        self, message: OutgoingMessage, first: MiddlewareError, *, confirm: bool, block: bool
    ) -> None:
        """The broker closed the connection in answer to a frame while ``message`` was in
        flight (it, or another message then in flight, is one the checks let through):
        one retry, alone among the suspects and known taken, tells which. Closed
        again: ``MessageRefused``, never sent again; the rest of the traffic goes on."""
        metrics.PUBLISH_SUSPECTS.inc()
        async with self._suspects:
            try:  # an ordinary loss meanwhile (the failover itself) is retried as usual
                async for attempt in async_retrying(self.settings.retry):
                    with attempt:
                        try:
                            if confirm:
                                await self._publish_once(message, confirm=True, block=block)
                            else:
                                await self._publish_checked(message)
                        except RetryableError as exc:
                            if refusal_code(exc):
                                raise _Refused(exc) from exc
                            raise
            except _Refused as refused:
                again = refused.error
                code = refusal_code(again)
                metrics.PUBLISH_REFUSED.inc()
                raise MessageRefused(
                    f"message {message.message_id}: the broker closed the connection in "
                    f"answer to it twice ({first}; then {again}); it is not sent again",
                    reply_code=code,
                ) from again

    async def _publish_checked(self, message: OutgoingMessage) -> None:
        """An unconfirmed publish whose broker answer is awaited: an ack means it took
        the message (the channel of unconfirmed publishes runs in confirm mode)."""
        async with self._window:
            live = await self._await_live()
            try:
                answer = await live.replies.send(message, wait=True)
                assert answer is not None
                await asyncio.wait_for(answer, self.settings.publish_timeout)
            except Exception as exc:
                raise translate_aio(exc) from exc
        metrics.PUBLISHED_UNCONFIRMED.inc()

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

    async def _publish_once(self, message: OutgoingMessage, *, confirm: bool, block: bool) -> None:
        if not block and self._window.locked():
            raise WindowFull(f"{self.settings.publish_window} publishes already in flight")
        async with self._window:
            live = await self._await_live()
            channel = live.confirm_channel
            try:
                if not confirm:  # the broker's answer is the watched channel's
                    await live.replies.send(message)
                    metrics.PUBLISHED_UNCONFIRMED.inc()
                    return
                # aiormq's own publish, as aio-pika's Exchange.publish calls it, but without
                # waiting for the frame to reach the socket (wait=False) while the channel's
                # lock is held: publishes of one turn then queue together (and leave in one
                # write), where waiting let one publish per channel out every two loop turns.
                # The frame queue is bounded (backpressure), and the confirm is still awaited.
                underlay = await self._publish_channel(live)
                await basic_publish(
                    underlay,
                    message,
                    mandatory=message.mandatory,
                    confirm_within=self.settings.publish_timeout,
                    wait=False,
                )
            except Exception as exc:
                error = translate_aio(exc)
                with contextlib.suppress(Exception):  # repair is best effort; report `error`
                    if isinstance(error, TopologyError):
                        # the broker closed the channel (e.g. 404 exchange): the next gets a new one
                        await self._reopen_publish_channels(live)
                    elif isinstance(error, PublishNacked):
                        await self._replace_confirm_channel(live, channel)
                raise error from exc
        metrics.PUBLISHED_CONFIRMED.inc()

    async def _resend_watched(self, message: OutgoingMessage, attempt: int) -> None:
        """An unconfirmed publish the broker refused, sent again (``WatchedReplies``)."""
        live = await self._await_live()
        await live.replies.send(message, attempt)

    async def _publish_channel(self, live: _Live) -> aiormq.Channel:
        """aiormq's channel under the confirm publish channel, reopened if closed."""
        if live.confirm_channel.is_closed:
            await self._reopen_publish_channels(live)
        return cast(aiormq.Channel, await live.confirm_channel.get_underlay_channel())

    async def _replace_confirm_channel(self, live: _Live, stale: AbstractChannel) -> None:
        """Publish on a fresh channel after a nack; close the stale one once it has drained.

        A channel opened while a quorum queue elects a leader can keep nacking after
        the election (its queue client still points at the dead leader); a new
        channel starts from the current leader.  Measured: without this, publishes
        after a node kill stay nacked for ~a minute on the failed-over connection.
        """
        async with self._channel_lock:
            if live.confirm_channel is not stale or live.connection.is_closed:
                return
            live.confirm_channel = await live.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
        log.info("publish nacked on %s: continuing on a fresh channel", live.node)
        loop = asyncio.get_running_loop()
        loop.call_later(
            self.settings.publish_timeout,
            lambda: None if stale.is_closed else asyncio.ensure_future(stale.close()),
        )

    async def _reopen_publish_channels(self, live: _Live) -> None:
        """Replace closed publish channels; a dying connection is left to failover."""
        try:
            await self._open_publish_channels(live)
        except Exception as exc:
            raise translate_aio(exc) from exc

    async def _open_publish_channels(self, live: _Live) -> None:
        if live.connection.is_closed:
            return
        if live.confirm_channel.is_closed:
            live.confirm_channel = await live.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )

    # ------------------------------------------------------------- internal
    async def _open(self, node: Node) -> None:
        """Connect to ``node``, open channels, replay the topology; raise translated errors."""
        # aio_pika.connect() drops a connection whose handshake failed without closing it;
        # its __del__ then makes a close() coroutine that, collected off the loop, is never
        # awaited.  Build it here so that a failed connect is closed on this loop.
        connection_class = (  # amqps: aiormq's own writer
            CoalescingConnection
            if self.settings.coalesce_writes and not node.tls
            else aio_pika.Connection
        )
        connection = connection_class(
            aio_pika.connection.make_url(
                host=node.host,
                port=node.port,
                login=self.settings.username,
                password=self.settings.password.get_secret_value(),
                virtualhost=self.settings.vhost,
                ssl=node.tls,
                heartbeat=self.settings.heartbeat,
            ),
            ssl_context=tls_context(self.settings) if node.tls else None,
            client_properties={"connection_name": self.settings.client_name},
        )
        try:
            await connection.connect(timeout=self.settings.connect_timeout)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await connection.close()
            if isinstance(exc, Exception):
                raise translate_aio(exc) from exc
            raise
        try:
            live = _Live(
                node=node,
                connection=connection,
                confirm_channel=await connection.channel(
                    publisher_confirms=True, on_return_raises=True
                ),
                replies=WatchedReplies(
                    connection,
                    policy=self.settings.retry,
                    linger_s=self.settings.publish_timeout,
                    resend=self._resend_watched,
                ),
                limits=Limits(
                    frame_max=_frame_max(connection),
                    max_message_size=self.settings.max_message_size,
                ),
            )
            self._live = live
            await live.replies.open()
            await self._start_replies(live)
            for spec in list(self.topology.replay_plan()):
                await self._apply(live, spec)
        except BaseException as exc:
            self._live = _Down()
            with contextlib.suppress(Exception):
                await connection.close()
            if isinstance(exc, Exception):
                raise translate_aio(exc) from exc
            raise
        connection.close_callbacks.add(self._on_connection_closed)
        self._fatal = None
        underlay = getattr(connection.transport, "connection", None)
        self.server = BrokerInfo.from_properties(getattr(underlay, "server_properties", None))
        metrics.broker_connected(log, self.server)
        self._ready.set()
        log.debug("connected to %s (%s)", node, self.server.describe())

    def _stop_loop_watch(self) -> None:
        """After a failed or cancelled ``connect``: the caller may drop the client, and a
        watch left pending would be collected with it ("Task was destroyed but it is
        pending!", seen when a link's connect outlived its caller's timeout)."""
        if self._reconnect_task is not None and not self._reconnect_task.done():
            return  # reconnecting in the background: it watches on
        watch, self._loop_watch = self._loop_watch, None
        if watch is not None:
            watch.cancel()

    def _watch_loop_end(self) -> None:
        """Start a task that only waits, so that the end of the event loop shows.

        ``asyncio.run`` (and every runner like it) cancels all remaining tasks when its
        main coroutine returns: aiormq's reader with them, and the connection then closes
        with a CancelledError, as it does when aiormq finds it stuck (missed heartbeats).
        This task is cancelled only by us (``close``) or by that sweep, so a client left
        open at the end of the loop stops instead of failing over into a closing loop."""
        if self._loop_watch is None or self._loop_watch.done():
            self._loop_watch = asyncio.ensure_future(self._wait_for_loop_end())

    async def _wait_for_loop_end(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if asyncio.current_task() is not self._loop_watch:
                raise  # stopped by _stop_loop_watch: a connect that failed, nothing to close
            if not self._closing:
                log.debug("event loop ending with the client open: closing it, not failing over")
                self._closing = True
                if self._reconnect_task is not None:
                    self._reconnect_task.cancel()
                # Close within the sweep (it waits for this task): left to the cancelled
                # reader, aio-pika's channel-close callbacks start tasks after the sweep and
                # the loop closes under them ("Task was destroyed", "Event loop is closed").
                live, self._live = self._live, _Down()
                if isinstance(live, _Live):
                    live.replies.close()
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(live.connection.close(), 2.0)
            raise

    def _loop_ending(self) -> bool:
        watch = self._loop_watch
        return watch is not None and (watch.done() or watch.cancelling() > 0)

    def _on_connection_closed(self, connection: object, exc: BaseException | None) -> None:
        live = self._live
        if self._closing or not isinstance(live, _Live) or live.connection is not connection:
            return
        live.replies.close()
        if self._loop_ending():  # cancelled with every other task; aiormq closes it
            self._closing = True
            self._live = _Down()
            self._ready.clear()
            return
        self._live = _Down()
        self._ready.clear()
        if exc is not None and refusal_code(exc):
            self.refused_closes += 1
            self._last_refusal = translate_aio(exc)
        log.warning("connection to %s lost (%s); failing over", live.node, exc or "closed")
        # Finish closing the dead connection now, on this loop: left to aio-pika's __del__, its
        # close() coroutine may be created when no loop runs and is then never awaited.
        self._finish_close(live.connection)
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.ensure_future(self._reconnect())

    def _finish_close(self, connection: AbstractConnection) -> None:
        async def close() -> None:
            with contextlib.suppress(Exception):
                await connection.close()

        task = asyncio.ensure_future(close())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _reconnect(self) -> None:
        """Try the nodes in turn with backoff until one accepts and the replay succeeds."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(MiddlewareError),
            wait=backoff(self.settings.retry),
            stop=lambda _state: self._closing,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    node = self._rotation.take()
                    try:
                        await self._open(node)
                    except AccessRefused as exc:
                        self._fatal = exc
                        raise
                    except MiddlewareError as exc:
                        log.info("failover to %s failed: %s", node, exc)
                        raise
        except MiddlewareError:
            return
        self.reconnects += 1
        metrics.RECONNECTS.inc()
        log.info("failed over to %s; topology replayed", self.connected_node)
        # The hooks run beside this task, not in it: a connection lost while they run
        # (a resent suspect closing it again) must start a new failover.
        task = asyncio.ensure_future(self._run_reconnect_hooks())
        self._hook_tasks.add(task)
        task.add_done_callback(self._hook_tasks.discard)

    async def _run_reconnect_hooks(self) -> None:
        for hook in list(self._reconnect_hooks):
            try:
                await hook()
            except Exception:
                log.exception("reconnect hook failed")

    async def _await_live(self) -> _Live:
        if self._closing:
            raise NotConnected("client is closed")
        if self._fatal is not None:
            raise self._fatal
        if not self._ready.is_set():
            if self._reconnect_task is None and not isinstance(self._live, _Live):
                raise NotConnected("not connected: await client.connect() first")
            wait = self.settings.connect_timeout
            try:
                await asyncio.wait_for(self._ready.wait(), wait)
            except TimeoutError:
                raise BrokerUnreachable(
                    f"no node reachable for {wait:.1f} s (failover still in progress)"
                ) from None
        live = self._live
        if not isinstance(live, _Live):
            raise BrokerUnreachable("connection lost while waiting")
        return live

    async def _apply_with_retry(self, spec: Any) -> Any:
        async for attempt in async_retrying(self.settings.retry):
            with attempt:
                live = await self._await_live()
                result = await self._apply(live, spec)
        self.topology.add(spec)
        return result

    async def _apply(self, live: _Live, spec: Any) -> Any:
        if isinstance(spec, ConsumerSpec):
            return await self._start_consumer(live, self._consumers[spec.tag])

        async def declare(ch: aiormq.abc.AbstractChannel) -> Any:
            match spec:
                case ExchangeSpec():
                    await ch.exchange_declare(
                        spec.name,
                        exchange_type=spec.type.value,
                        durable=spec.durable,
                        auto_delete=spec.auto_delete,
                        arguments=dict(spec.arguments),
                    )
                case QueueSpec():
                    ok = await ch.queue_declare(
                        spec.name,
                        durable=spec.durable,
                        exclusive=spec.exclusive,
                        auto_delete=spec.auto_delete,
                        arguments=spec.declare_arguments(),
                    )
                    return int(ok.message_count or 0) if ok else 0
                case BindingSpec():
                    await ch.queue_bind(
                        spec.queue,
                        spec.exchange,
                        routing_key=spec.routing_key,
                        arguments=dict(spec.arguments),
                    )
            return None

        return await self._on_channel_of(live, declare)

    async def _on_temp_channel(
        self, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
    ) -> Any:
        async for attempt in async_retrying(self.settings.retry):
            with attempt:
                live = await self._await_live()
                result = await self._on_channel_of(live, action)
        return result

    @staticmethod
    async def _on_channel_of(
        live: _Live, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
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

    @staticmethod
    async def _on_probe_channel(
        live: _Live, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
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

    async def _start_consumer(self, live: _Live, consumer: _Consumer) -> None:
        spec = consumer.spec
        channel = None
        try:
            channel = await live.connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=spec.prefetch)

            # aiormq's consumer straight: aio-pika's Queue.consume wraps every delivery in an
            # IncomingMessage and a second task, and its ack waits for the frame to drain
            async def on_message(msg: DeliveredMessage) -> None:
                self._deliver(msg, spec.queue, consumer)

            underlay = await channel.get_underlay_channel()
            underlay.on_consumer_cancel_callbacks.add(
                lambda _frame: self._on_broker_cancel(live, spec.tag)
            )
            # known before the first delivery: a queue's backlog arrives with consume-ok
            live.consumer_channels[spec.tag] = channel
            self._subscribed_at.pop(spec.tag, None)
            self._checks.pop(spec.tag, None)
            await underlay.basic_consume(
                spec.queue, on_message, consumer_tag=spec.tag, exclusive=spec.exclusive
            )
            self._subscribed_at[spec.tag] = time.monotonic()
        except Exception as exc:
            if channel is not None and live.consumer_channels.get(spec.tag) is channel:
                del live.consumer_channels[spec.tag]
            raise translate_aio(exc) from exc

    def _start_watchdog(self) -> None:
        if self.settings.consumer_check_s > 0 and (self._watchdog is None or self._watchdog.done()):
            self._watchdog = asyncio.ensure_future(self._watch_consumers())

    async def _watch_consumers(self) -> None:
        """Every ``consumer_check_s``: each consumer's queue, by a passive declare, still
        exists and counts a consumer (``consuming.consumer_lost``); one that does not is
        subscribed again as after the broker's cancel (which RabbitMQ 3.10 sometimes does
        not send for a quorum queue deleted under load: the consumer waited for ever)."""
        interval = self.settings.consumer_check_s
        while not self._closing:
            await asyncio.sleep(interval)
            live = self._live
            if not isinstance(live, _Live) or not self._ready.is_set():
                continue
            settled = time.monotonic() - interval / 2
            for tag, consumer in list(self._consumers.items()):
                channel = live.consumer_channels.get(tag)
                if channel is None or self._subscribed_at.get(tag, float("inf")) > settled:
                    continue  # being subscribed (again) right now
                verdict = await self._still_consumed(live, tag, consumer)
                if verdict is False and live.consumer_channels.get(tag) is channel:
                    metrics.consumer_lost(log, tag, consumer.spec.queue)
                    task = asyncio.ensure_future(self._resubscribe(live, consumer))
                    self._closers.add(task)
                    task.add_done_callback(self._closers.discard)

    async def _still_consumed(self, live: _Live, tag: str, consumer: _Consumer) -> bool | None:
        """The watchdog's verdict on one consumer; None when it cannot be told now."""
        queue = consumer.spec.queue
        check = self._checks.setdefault(tag, consuming.ConsumerCheck())
        try:
            ok = await self._on_probe_channel(
                live, lambda ch: ch.queue_declare(queue, passive=True)
            )
        except EntityNotFound:
            return not check.lost(queue_exists=False, consumers=0, ready=0, delivered=0, room=False)
        except MiddlewareError:
            return None
        return not check.lost(
            queue_exists=True,
            consumers=int(getattr(ok, "consumer_count", 0) or 0),
            ready=int(getattr(ok, "message_count", 0) or 0),
            delivered=self._delivered.get(tag, 0),
            room=len(self._handling.get(tag, ())) < consumer.spec.prefetch,
        )

    def _on_broker_cancel(self, live: _Live, tag: str) -> None:
        """The broker cancelled a consumer (its queue was deleted, a consumer timeout):
        say so, and re-subscribe as soon as the queue exists again."""
        consumer = self._consumers.get(tag)
        if consumer is None or self._live is not live:
            return
        metrics.consumer_cancelled_by_broker(log, tag, consumer.spec.queue)
        task = asyncio.ensure_future(self._resubscribe(live, consumer))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _resubscribe(self, live: _Live, consumer: _Consumer) -> None:
        # Closing the cancelled consumer's channel returns what it held unacked (a quorum
        # queue declared again under the same name otherwise leaves a message held for ever).
        channel = live.consumer_channels.pop(consumer.spec.tag, None)
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close()
        delay = self.settings.retry.initial_delay or 0.1
        while self._consumers.get(consumer.spec.tag) is consumer and self._live is live:
            try:
                await self._on_probe_channel(
                    live, lambda ch: ch.queue_declare(consumer.spec.queue, passive=True)
                )
                await self._start_consumer(live, consumer)
                log.info("consumer %s re-subscribed to %r", consumer.spec.tag, consumer.spec.queue)
                return
            except MiddlewareError as exc:
                log.debug("queue %r not back yet: %s", consumer.spec.queue, exc)
            await asyncio.sleep(delay)
            delay = min(delay * self.settings.retry.multiplier, self.settings.retry.max_delay)

    def _deliver(self, msg: DeliveredMessage, queue: str, consumer: _Consumer) -> None:
        """Handle ``msg`` in a task of the client's own: aiormq cancels its channel's
        tasks when the channel closes, which would cut a running handler short; this one
        runs to its end and meets the dead channel at its settle, as in the pika face."""
        task = asyncio.ensure_future(self._handle(msg, queue, consumer))
        self._delivered[consumer.spec.tag] = self._delivered.get(consumer.spec.tag, 0) + 1
        running = self._handling.setdefault(consumer.spec.tag, set())
        running.add(task)
        task.add_done_callback(functools.partial(self._handled, consumer.spec.tag, running))

    def _handled(self, tag: str, running: set[asyncio.Task[Any]], task: asyncio.Task[Any]) -> None:
        running.discard(task)
        if not running and self._handling.get(tag) is running:
            del self._handling[tag]

    async def _handle(self, msg: DeliveredMessage, queue: str, consumer: _Consumer) -> None:
        """Execute what ``consuming`` decides (the pika face executes the same)."""
        delivery = _from_delivered(msg, queue)
        if tracing.active():
            with tracing.process(delivery):
                return await self._handle_delivery(msg, delivery, consumer)
        return await self._handle_delivery(msg, delivery, consumer)

    async def _handle_delivery(
        self, msg: DeliveredMessage, delivery: Delivery, consumer: _Consumer
    ) -> None:
        outcome = consuming.before_handler(delivery)
        if outcome is None:
            try:
                await consumer.handler(delivery)
            except Exception as exc:
                outcome = consuming.after_handler(delivery, exc)
            else:
                outcome = consuming.after_handler(delivery, None)
        try:
            await self._settle(msg.channel, delivery, outcome)
        except Exception as exc:
            outcome = consuming.settle_lost(delivery, exc)
            self._after_lost_settle(consumer, msg.channel)
        if consumer.on_settled is not None:
            await consumer.on_settled(delivery, outcome)

    async def _settle(
        self, channel: aiormq.abc.AbstractChannel, delivery: Delivery, outcome: Outcome
    ) -> None:
        """Settle on the delivery's channel; the frame leaves with the loop turn's others
        (``wait=False``: not awaiting its drain; a channel already closed raises)."""
        tag = delivery.delivery_tag
        for step in consuming.settle_steps(outcome):
            match step:
                case consuming.Step.ACK:
                    await channel.basic_ack(tag, wait=False)
                case consuming.Step.REJECT:
                    await channel.basic_reject(tag, requeue=False, wait=False)
                case consuming.Step.REQUEUE:
                    await channel.basic_nack(tag, requeue=True, wait=False)
                case consuming.Step.COPY_TO_DEAD_LETTER:
                    await self.dead_letter(delivery, outcome.reason)

    def _after_lost_settle(self, consumer: _Consumer, channel: aiormq.abc.AbstractChannel) -> None:
        live, tag = self._live, consumer.spec.tag
        if not isinstance(live, _Live) or self._consumers.get(tag) is not consumer:
            return
        current = live.consumer_channels.get(tag)
        if current is None:
            return  # being subscribed again already (another delivery of the dead channel)
        if consuming.resubscribe_after_lost_settle(
            channel_closed=current.is_closed or channel.is_closed,
            connection_open=not live.connection.is_closed,
        ):
            live.consumer_channels.pop(tag, None)  # once per dead channel
            task = asyncio.ensure_future(self._resubscribe(live, consumer))
            self._closers.add(task)
            task.add_done_callback(self._closers.discard)

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


async def _written(connection: AbstractConnection, within: float) -> None:
    """Wait (up to ``within`` seconds) until aiormq's writer took every frame queued:
    closing cancels that writer, and what it still queued (an unconfirmed publish, the
    last receipts, acks) would never leave."""
    queue = getattr(getattr(connection.transport, "connection", None), "write_queue", None)
    if queue is None:
        return
    deadline = time.monotonic() + within
    while not queue.empty() and time.monotonic() < deadline:  # noqa: ASYNC110 (no event)
        await asyncio.sleep(0.005)


def _frame_max(connection: AbstractConnection) -> int:
    """The frame_max the broker and aiormq agreed on (the AMQP default if unknown)."""
    tune = getattr(getattr(connection.transport, "connection", None), "connection_tune", None)
    return int(getattr(tune, "frame_max", 0) or Limits().frame_max)


def _seconds(stamp: datetime.datetime | int | None) -> float | None:
    """A timestamp as decoded (``codec`` keeps one past the year 9999 as raw seconds)."""
    if stamp is None:
        return None
    return stamp.timestamp() if isinstance(stamp, datetime.datetime) else float(stamp)


def _from_delivered(msg: DeliveredMessage, queue: str) -> Delivery:
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
