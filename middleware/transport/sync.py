"""The sync face on pika: the same record, rotation, retry policy and outcomes as the core.

Only sending and receiving differ from :mod:`middleware.transport.aio`: pika's
``BlockingConnection`` publishes with confirms one at a time (a window of one),
and consumers run inside :meth:`SyncClient.run`.  A lost connection is noticed
by the call that needed it; that call reconnects to the next node, replays the
topology and tries again under the one retry policy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.spec

from .. import tracing
from ..errors import (
    AccessRefused,
    BrokerUnreachable,
    ConnectionLost,
    MessageRefused,
    MiddlewareError,
    NotConnected,
    PublishNacked,
    RetryableError,
    TopologyError,
)
from ..settings import Settings
from . import codec, consuming, metrics
from .broker_info import BrokerInfo
from .delivery import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_TOPOLOGY,
    Action,
    Delivery,
    Outcome,
    dead_letter_message,
)
from .message import OutgoingMessage, tls_context
from .outbound import Limits, check_message, is_reply, replies_settings
from .policy import Node, NodeRotation, backoff_delay, sync_retrying
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    QueueSpec,
    TopologyRecord,
)
from .translate import refusal_code, translate_sync
from .watch import Answer, WatchedChannel, missing_exchange

__all__ = ["SyncClient", "SyncHandler", "SyncSettleHook"]
REPLY_TO = "amq.rabbitmq.reply-to"

log = logging.getLogger(__name__)
SyncHandler = Callable[[Delivery], None]
SyncSettleHook = Callable[[Delivery, Outcome], None]
T = TypeVar("T")


@dataclass(eq=False)
class _Watched:
    """The channel of unconfirmed publishes and replies, in confirm mode (``watch.py``):
    pika calls ``answers.append`` with each ack or nack while it reads."""

    channel: blocking.BlockingChannel
    ledger: WatchedChannel
    answers: list[Any] = field(default_factory=list)
    close_at: float = 0.0  # once retired: when its lingering replies no longer matter
    replying: bool = False  # consuming direct reply-to (once: a second consume closes it)


@dataclass
class _SyncLive:
    node: Node
    connection: pika.BlockingConnection
    confirm_channel: blocking.BlockingChannel
    replies: _Watched
    consumer_channels: dict[str, blocking.BlockingChannel] = field(default_factory=dict)
    retired: list[_Watched] = field(default_factory=list)
    #: the channel passive declares run on (queue lengths, the consumer watchdog)
    probe: blocking.BlockingChannel | None = None


@dataclass(frozen=True)
class _SyncConsumer:
    spec: ConsumerSpec
    handler: SyncHandler
    on_settled: SyncSettleHook | None


#: the longest one step of ``SyncClient.run`` waits for I/O before its hooks run
STEP_S = 0.1


@codec.layer_calls
class SyncClient:
    """The blocking client: failover, record-and-replay, publisher confirms."""

    def __init__(self, *, settings: Settings) -> None:
        self.settings = settings
        self.topology = TopologyRecord()
        self.reconnects = 0
        #: what the broker of the current (or last) connection said it is
        self.server: BrokerInfo | None = None
        #: connections the broker closed in answer to a frame it could not take (see
        #: ``AsyncClient.refused_closes``); what was in flight then is suspect
        self.refused_closes = 0
        self._last_refusal: MiddlewareError | None = None
        self._rotation = NodeRotation(settings)
        self._live: _SyncLive | None = None
        self._consumers: dict[str, _SyncConsumer] = {}
        self._opened = False
        self._tag_seq = 0
        self._reply_handlers: list[Callable[[Delivery], None]] = []
        self._cancelled: dict[str, float] = {}  # consumer tag -> next re-subscribe try
        #: unconfirmed publishes the broker refused: (when, message, attempt), sent by
        #: the next look at the connection (``run``, a publish) once due
        self._resends: list[tuple[float, OutgoingMessage, int]] = []
        #: publishes to direct reply-to addresses go over a connection of their own
        #: (``outbound.is_reply``); opened at the first one
        self._replies: SyncClient | None = None
        self._sends_own_replies = False  # True for the replies client itself
        self._step_hooks: list[Callable[[], None]] = []
        self._step_s_hooks = float("inf")  # the shortest a hook asked for (every_step)
        self._next_check = 0.0  # the consumer watchdog's next look (``consumer_check_s``)
        self._subscribed_at: dict[str, float] = {}
        self._checks: dict[str, consuming.ConsumerCheck] = {}  # the watchdog's, by tag
        self._delivered: dict[str, int] = {}  # deliveries each consumer was given

    # ------------------------------------------------------------ lifecycle
    def connect(self) -> Self:
        """Connect to the first node that answers; fail fast (one try per node)."""
        errors: dict[str, str] = {}
        for _ in self._rotation.nodes:
            node = self._rotation.take()
            try:
                self._open(node)
                self._opened = True
                return self
            except AccessRefused:
                raise
            except MiddlewareError as exc:
                errors[str(node)] = str(exc)
        raise BrokerUnreachable(
            "no node of the cluster accepted a connection: "
            + "; ".join(f"{n}: {e}" for n, e in errors.items())
            + " (is the cluster up? `qosmq cluster status`; check QOSMQ_AMQP_URLS)",
            attempts=errors,
        )

    def connect_later(self) -> None:
        """Start without a connection: the next call that needs one tries the nodes."""
        self._opened = True

    def close(self) -> None:
        if self._replies is not None:
            self._replies.close()
        self._opened = False
        live, self._live = self._live, None
        if live is not None:
            with contextlib.suppress(Exception):
                live.connection.close()

    def __enter__(self) -> Self:
        """Connects, unless connected already (``with SyncClient(...).connect() as c``
        opens one connection, not two)."""
        return self if self._live is not None else self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def limits(self) -> Limits:
        """What the brokers accept: the negotiated frame_max once connected, else the
        AMQP default; the settings' max_message_size."""
        frame_max = Limits().frame_max
        if self._live is not None:
            frame_max = int(self._live.connection._impl.params.frame_max or frame_max)
        return Limits(frame_max=frame_max, max_message_size=self.settings.max_message_size)

    @property
    def connected_node(self) -> str | None:
        return str(self._live.node) if self._live is not None else None

    def listen_replies(self, handler: Callable[[Delivery], None]) -> None:
        """Receive direct reply-to messages (see ``AsyncClient.listen_replies``); any
        number of listeners share the one reply consumer, each hears every reply."""
        self._reply_handlers.append(handler)
        if len(self._reply_handlers) == 1:
            try:
                self._call(self._start_replies)
            except BaseException:
                self._reply_handlers.remove(handler)
                raise

    def _start_replies(self, live: _SyncLive) -> None:
        handlers = self._reply_handlers
        if not handlers:
            return

        def on_reply(ch: Any, method: Any, props: pika.BasicProperties, body: bytes) -> None:
            delivery = _to_delivery(method, props, body, REPLY_TO)
            for handler in handlers:
                handler(delivery)

        if live.replies.replying:  # a reconnect already started them on this channel
            return
        live.replies.channel.basic_consume(REPLY_TO, on_reply, auto_ack=True)
        live.replies.replying = True

    # ------------------------------------------------------------- topology
    def declare_exchange(self, spec: ExchangeSpec) -> None:
        self._record(spec)

    def declare_queue(self, spec: QueueSpec) -> int:
        result: int = self._record(spec)
        return result

    def bind(self, spec: BindingSpec) -> None:
        self._record(spec)

    def delete_queue(self, name: str) -> None:
        self.topology.forget_queue(name)
        self._call(lambda live: self._on_temp_channel(live, lambda ch: ch.queue_delete(name)))

    def queue_length(self, name: str) -> int:
        def passive(ch: blocking.BlockingChannel) -> int:
            return int(ch.queue_declare(name, passive=True).method.message_count)

        result: int = self._call(lambda live: self._on_probe_channel(live, passive))
        return result

    # ------------------------------------------------------------ consuming
    def consume(
        self,
        queue: str,
        handler: SyncHandler,
        *,
        prefetch: int | None = None,
        tag: str | None = None,
        on_settled: SyncSettleHook | None = None,
    ) -> str:
        """Register a consumer; deliveries are handled inside :meth:`run`."""
        self._tag_seq += 1
        spec = ConsumerSpec(
            queue=queue,
            tag=tag or f"qosmq-sync-{id(self):x}-{self._tag_seq}",
            prefetch=prefetch or self.settings.prefetch,
        )
        self._consumers[spec.tag] = _SyncConsumer(spec, handler, on_settled)
        try:
            self._record(spec)
        except BaseException:
            self._consumers.pop(spec.tag, None)
            raise
        return spec.tag

    def every_step(self, hook: Callable[[], None], *, within: float = 0.1) -> None:
        """Call ``hook`` after each step of :meth:`run` (at least every ``within`` seconds,
        and after each batch of deliveries), whoever runs the client: the sync face has no
        background tasks, so work due on time (receipt batches) rides on the caller's pump."""
        self._step_hooks.append(hook)
        self._step_s_hooks = min(self._step_s_hooks, max(within, 0.001))

    def cancel(self, tag: str) -> None:
        self.topology.forget_consumer(tag)
        self._consumers.pop(tag, None)
        if self._live is not None:
            channel = self._live.consumer_channels.pop(tag, None)
            if channel is not None:
                with contextlib.suppress(Exception):
                    channel.close()

    def run(
        self,
        seconds: float | None = None,
        *,
        until: Callable[[], bool] | None = None,
        step_s: float | None = None,
    ) -> None:
        """Process deliveries for ``seconds`` (forever if None) or until ``until()`` is true.
        ``step_s``: the longest one step waits for I/O before the hooks run and ``until``
        is asked (default 0.1 s, less if a hook asked for less); a thread that only
        publishes (beats) sets its own interval and wakes no more often than that."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while (deadline is None or time.monotonic() < deadline) and not (until and until()):
            step = min(STEP_S if step_s is None else step_s, self._step_s_hooks)
            if deadline is not None:
                step = max(0.0, min(step, deadline - time.monotonic()))
            self._call(functools.partial(_process_events, time_limit=step))
            self._call(self._watch)
            for hook in list(self._step_hooks):
                hook()
            if self._replies is not None:
                self._replies.poll()
            if self._live is not None and self.settings.consumer_check_s > 0:
                self._watch_consumers(self._live)
            if self._cancelled and self._live is not None:
                self._resubscribe_cancelled(self._live)

    def get(self, queue: str) -> Delivery | None:
        """Take one message (acked on receipt), or None if the queue is empty."""

        def take(ch: blocking.BlockingChannel) -> Delivery | None:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            return None if method is None else _to_delivery(method, props, body, queue)

        result: Delivery | None = self._call(lambda live: self._on_temp_channel(live, take))
        return result

    # ----------------------------------------------------------- publishing
    @property
    def ready(self) -> bool:
        """True while a connection is open (the sync face notices a loss on its next call)."""
        return self._live is not None and self._live.connection.is_open

    def take(self, queue: str) -> tuple[Delivery, Callable[[Action], None]] | None:
        """One message with manual ack: (delivery, settle) or None if the queue is empty.

        ``settle(Action.ACK | Action.REJECT | Action.REQUEUE)`` must be called before
        the next ``take`` on this client.
        """

        def get(live: _SyncLive) -> tuple[Delivery, Callable[[Action], None]] | None:
            channel = live.confirm_channel
            method, props, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                return None
            delivery = _to_delivery(method, props, body, queue)

            def settle(action: Action) -> None:
                self._settle(channel, delivery, Outcome(action))

            return delivery, settle

        return self._call(get)

    def publish(
        self, message: OutgoingMessage, *, confirm: bool = True, retry: bool = True
    ) -> None:
        """Publish; with ``confirm`` return once the broker confirmed it.

        Retried on connection loss under the retry policy; ``retry=False`` makes
        one attempt (after reconnecting if needed) and raises the failure.  A message
        the broker would refuse raises ``MalformedMessage`` at once.
        """
        check_message(message, self.limits)
        if is_reply(message) and not self._sends_own_replies:
            self._reply_sender().publish(message, confirm=confirm, retry=retry)
            return
        if tracing.active():
            with tracing.publish(message) as traced:
                return self._publish(traced, confirm=confirm, retry=retry)
        return self._publish(message, confirm=confirm, retry=retry)

    def publish_unwatched(self, message: OutgoingMessage) -> None:
        """Publish once with nothing coming back: no confirm, no watch, no retry (on the
        probe channel, which is not in confirm mode).  For a message the next one
        replaces (a beat): the broker sends no ack for it and this thread wakes for
        none.  A connection lost on the way raises; a message lost with it is not said."""
        check_message(message, self.limits)
        send = functools.partial(_basic_publish, message=message, confirm=False)
        self._call(lambda live: self._on_probe_channel(live, send), attempts=1)
        metrics.PUBLISHED_UNCONFIRMED.inc()

    def _publish(self, message: OutgoingMessage, *, confirm: bool, retry: bool) -> None:
        if not confirm:
            self._call(functools.partial(self._watch, then=message))
            metrics.PUBLISHED_UNCONFIRMED.inc()
            return

        def send(live: _SyncLive) -> None:
            channel = self._publish_channel(live)
            try:
                _basic_publish(channel, message, confirm=confirm)
            except Exception as exc:
                error = translate_sync(exc)
                if code := refusal_code(exc):  # not retried under the policy: see below
                    self._drop(live, error, exc)
                    raise _Refused(error, code) from exc
                if isinstance(error, TopologyError) and channel.is_closed:
                    self._reopen_channel(live)
                elif isinstance(error, PublishNacked):
                    # same reason as the async core: a fresh channel finds the new leader
                    with contextlib.suppress(Exception):
                        channel.close()
                    self._reopen_channel(live)
                raise

        try:
            self._call(send, attempts=None if retry else 1)
        except _Refused as first:
            self._publish_suspect(message, first.error, confirm=confirm)
            return
        metrics.PUBLISHED_CONFIRMED.inc()

    def _reply_sender(self) -> SyncClient:
        """The client of this one's replies (``outbound.is_reply``), connected at first use."""
        if self._replies is None:
            client = SyncClient(settings=replies_settings(self.settings))
            client._sends_own_replies = True
            self._replies = client.connect()
        return self._replies

    def poll(self) -> None:
        """Read what the broker sent without waiting (acks of unconfirmed publishes,
        heartbeats) and act on it; a lost connection is left to the next call."""
        live = self._live
        if live is None:
            return
        try:
            _process_events(live, time_limit=0)
            self._watch(live)
        except Exception as exc:
            self._drop(live, translate_sync(exc), exc)

    def _publish_channel(self, live: _SyncLive) -> blocking.BlockingChannel:
        channel = live.confirm_channel
        return self._reopen_channel(live) if channel.is_closed else channel

    # ------------------------------------------------------ watched channel
    def _send_watched(
        self, live: _SyncLive, *, message: OutgoingMessage, attempt: int = 1
    ) -> _Watched:
        """An unconfirmed publish on the watched channel (``watch.py``): the caller goes
        on; the broker's answer is read with the connection's other frames."""
        holder = self._watched(live)
        tag = holder.ledger.next_tag()
        _basic_publish(holder.channel, message, confirm=False)
        holder.ledger.sent(tag, message, attempt)
        return holder

    def _watched(self, live: _SyncLive) -> _Watched:
        """The watched channel in use; a fresh one when it closed or refused a publish."""
        holder = live.replies
        if holder.ledger.current and holder.channel.is_open:
            return holder
        if holder.channel.is_closed:
            reason = getattr(holder.channel._impl, "_closing_reason", None)
            self._act(live, holder.ledger.closed(missing_exchange(reason)))
        live.replies = self._open_watched(live.connection)
        self._start_replies(live)
        return live.replies

    def _open_watched(self, connection: pika.BlockingConnection) -> _Watched:
        channel = connection.channel()
        policy = self.settings.retry
        holder = _Watched(
            channel, WatchedChannel(attempts=policy.attempts, delay=backoff_delay(policy))
        )
        selected: list[bool] = []
        channel._impl.confirm_delivery(
            ack_nack_callback=lambda frame: holder.answers.append(frame.method),
            callback=lambda _frame: selected.append(True),
        )
        channel._flush_output(lambda: bool(selected))
        return holder

    def _watch(self, live: _SyncLive, then: OutgoingMessage | None = None) -> None:
        """Act on the answers the broker sent since the last look, send what is due,
        then the unconfirmed publish ``then``."""
        now = time.monotonic()
        for holder in (live.replies, *live.retired):
            answers, holder.answers = holder.answers, []
            for method in answers:
                ok = isinstance(method, pika.spec.Basic.Ack)
                answer = holder.ledger.answered(
                    method.delivery_tag, multiple=bool(method.multiple), ok=ok
                )
                if answer.retire_channel:
                    holder.close_at = now + self.settings.publish_timeout
                    live.retired.append(holder)
                    log.info("unconfirmed publish refused: continuing on a fresh channel")
                self._act(live, answer)
        for holder in [h for h in live.retired if h.close_at <= now]:
            live.retired.remove(holder)
            with contextlib.suppress(Exception):
                holder.channel.close()
        due = [r for r in self._resends if r[0] <= now]
        if due:
            self._resends = [r for r in self._resends if r[0] > now]
            for _, message, attempt in due:
                self._send_watched(live, message=message, attempt=attempt)
        if then is not None:
            self._send_watched(live, message=then)

    def _act(self, live: _SyncLive, answer: Answer) -> None:
        now = time.monotonic()
        for message, why in answer.reasons():
            metrics.UNCONFIRMED_GIVEN_UP.inc()
            log.warning("unconfirmed publish %s %s: not sent again", message.message_id, why)
        for resend in answer.resend:
            metrics.UNCONFIRMED_RESENT.inc()
            self._resends.append((now + resend.delay, resend.message, resend.attempt))

    def resend_alone(self, message: OutgoingMessage, *, confirm: bool = True) -> None:
        """As ``AsyncClient.resend_alone``: a message in flight when the broker closed
        the connection in answer to a frame, sent again alone and known taken (the
        broker's confirm, or a round trip on its channel); closed again: ``MessageRefused``."""
        check_message(message, self.limits)
        first = self._last_refusal or ConnectionLost("the broker closed the connection")
        self._publish_suspect(message, first, confirm=confirm)

    def _publish_suspect(
        self, message: OutgoingMessage, first: MiddlewareError, *, confirm: bool
    ) -> None:
        """As the asyncio core: the broker closed the connection in answer to a frame;
        one retry, known taken; closed at it again: ``MessageRefused``."""
        metrics.PUBLISH_SUSPECTS.inc()

        def send(live: _SyncLive) -> None:
            try:
                if confirm:
                    _basic_publish(self._publish_channel(live), message, confirm=True)
                else:  # a channel's frames are handled in order: the answer to a
                    holder = self._send_watched(live, message=message)  # round trip
                    holder.channel.basic_qos(prefetch_count=0)  # means the broker took it
            except Exception as exc:
                if code := refusal_code(exc):
                    error = translate_sync(exc)
                    self._drop(live, error, exc)
                    raise _Refused(error, code) from exc
                raise

        try:
            self._call(send)
        except _Refused as again:
            metrics.PUBLISH_REFUSED.inc()
            raise MessageRefused(
                f"message {message.message_id}: the broker closed the connection in answer "
                f"to it twice ({first}; then {again.error}); it is not sent again",
                reply_code=again.code,
            ) from again.error
        (metrics.PUBLISHED_CONFIRMED if confirm else metrics.PUBLISHED_UNCONFIRMED).inc()

    # ------------------------------------------------------------- internal
    def _record(self, spec: Any) -> Any:
        result = self._call(lambda live: self._apply(live, spec))
        self.topology.add(spec)
        return result

    def _call(self, action: Callable[[_SyncLive], T], *, attempts: int | None = None) -> T:
        """Run ``action`` on a live connection; on loss reconnect, replay and retry."""
        if not self._opened:
            raise NotConnected("not connected: call client.connect() first")
        limit = attempts or self.settings.retry.attempts
        try:
            return self._attempt(action)
        except RetryableError as exc:
            if limit < 2:
                raise
            log.debug("%s failed (%s); retrying under the policy", action, exc)
        # The hot path above builds no retry object (as in the asyncio core): only a failed
        # call pays for tenacity.
        for attempt in sync_retrying(self.settings.retry, attempts=limit - 1):
            with attempt:
                return self._attempt(action)
        raise AssertionError("unreachable")  # pragma: no cover - tenacity re-raises

    def _attempt(self, action: Callable[[_SyncLive], T]) -> T:
        live = self._ensure_live()
        try:
            return action(live)
        except MiddlewareError as known:
            if isinstance(known, ConnectionLost):
                self._drop(live, known, known.__cause__)
            raise
        except Exception as exc:
            translated = translate_sync(exc)
            if not isinstance(translated, ConnectionLost) and live.connection.is_closed:
                # pika's errors on a connection the broker closed under the call are not
                # always its own (a timer on the closed loop: "Timeout closed before
                # call", after a 541 closed it as a quorum queue was deleted): lost
                translated = ConnectionLost(f"connection closed under the call: {exc!r}")
            if isinstance(translated, ConnectionLost):
                self._drop(live, translated, exc)
            raise translated from exc

    def _ensure_live(self) -> _SyncLive:
        if self._live is not None:
            return self._live
        node = self._rotation.take()
        self._open(node)
        self.reconnects += 1
        metrics.RECONNECTS.inc()
        log.info("failed over to %s; topology replayed", node)
        assert self._live is not None
        return self._live

    def _drop(self, live: _SyncLive, error: Exception, cause: BaseException | None = None) -> None:
        if self._live is live:
            if refusal_code(cause or error):
                self.refused_closes += 1
                self._last_refusal = translate_sync(error)  # a MiddlewareError is kept as is
            log.warning("connection to %s lost (%s); failing over", live.node, error)
            self._live = None
            self._resends = []  # what the lost connection owed is the caller's to resend
            with contextlib.suppress(Exception):
                live.connection.close()

    def _open(self, node: Node) -> None:
        params = pika.ConnectionParameters(
            host=node.host,
            port=node.port,
            virtual_host=self.settings.vhost,
            credentials=pika.PlainCredentials(
                self.settings.username, self.settings.password.get_secret_value()
            ),
            heartbeat=self.settings.heartbeat,
            ssl_options=pika.SSLOptions(tls_context(self.settings), node.host)
            if node.tls
            else None,
            socket_timeout=self.settings.connect_timeout,
            stack_timeout=self.settings.connect_timeout,
            blocked_connection_timeout=self.settings.publish_timeout,
            connection_attempts=1,
            client_properties={"connection_name": self.settings.client_name},
        )
        try:
            connection = pika.BlockingConnection(params)
        except Exception as exc:
            raise translate_sync(exc) from exc
        try:
            confirm = connection.channel()
            confirm.confirm_delivery()
            live = _SyncLive(node, connection, confirm, self._open_watched(connection))
            self._start_replies(live)
            for spec in list(self.topology.replay_plan()):
                self._replay(live, spec)
        except Exception as exc:
            with contextlib.suppress(Exception):
                connection.close()
            raise translate_sync(exc) from exc
        self._live = live
        impl = getattr(connection, "_impl", None)
        self.server = BrokerInfo.from_properties(getattr(impl, "server_properties", None))
        metrics.broker_connected(log, self.server)
        log.debug("connected to %s (%s)", node, self.server.describe())

    def _replay(self, live: _SyncLive, spec: Any) -> None:
        """One step of a failover's replay.  A consumer whose queue is not there (404) does
        not fail the connection: a queue this client declared is declared again and
        consumed (it vanished between the two: the broker removing a lost node's exclusive
        queues while this client declared its own again on another node); a queue someone
        else declares waits for the watchdog, which subscribes it again once it exists."""
        try:
            self._apply(live, spec)
        except pika.exceptions.ChannelClosedByBroker as exc:
            if exc.reply_code != 404 or not isinstance(spec, ConsumerSpec):
                raise
            queue = self._consumers[spec.tag].spec.queue
            declared = self.topology.queues.get(queue)
            if declared is None:
                log.warning("consumer %s: queue %r not there after failover", spec.tag, queue)
                self._cancelled[spec.tag] = time.monotonic()
                return
            log.info("queue %r vanished during the replay; declared again", queue)
            self._apply(live, declared)
            self._apply(live, spec)

    def _reopen_channel(self, live: _SyncLive) -> blocking.BlockingChannel:
        channel = live.connection.channel()
        channel.confirm_delivery()
        live.confirm_channel = channel
        return channel

    def _apply(self, live: _SyncLive, spec: Any) -> Any:
        if isinstance(spec, ConsumerSpec):
            return self._start_consumer(live, self._consumers[spec.tag])

        def declare(ch: blocking.BlockingChannel) -> Any:
            match spec:
                case ExchangeSpec():
                    ch.exchange_declare(
                        spec.name,
                        spec.type.value,
                        durable=spec.durable,
                        auto_delete=spec.auto_delete,
                        arguments=dict(spec.arguments),
                    )
                case QueueSpec():
                    ok = ch.queue_declare(
                        spec.name,
                        durable=spec.durable,
                        exclusive=spec.exclusive,
                        auto_delete=spec.auto_delete,
                        arguments=spec.declare_arguments(),
                    )
                    return int(ok.method.message_count)
                case BindingSpec():
                    ch.queue_bind(
                        spec.queue, spec.exchange, spec.routing_key, arguments=dict(spec.arguments)
                    )
            return None

        return self._on_temp_channel(live, declare)

    @staticmethod
    def _on_temp_channel(live: _SyncLive, action: Callable[[blocking.BlockingChannel], T]) -> T:
        channel = live.connection.channel()
        try:
            return action(channel)
        finally:
            if channel.is_open:
                with contextlib.suppress(Exception):
                    channel.close()

    @staticmethod
    def _on_probe_channel(live: _SyncLive, action: Callable[[blocking.BlockingChannel], T]) -> T:
        """Run ``action`` (a passive declare: a queue length, the consumer watchdog's
        look) on the connection's probe channel, opened again only after a refusal
        closed it (as the asyncio face: no channel churn)."""
        if live.probe is None or not live.probe.is_open:
            live.probe = live.connection.channel()
        return action(live.probe)

    def _start_consumer(self, live: _SyncLive, consumer: _SyncConsumer) -> None:
        spec = consumer.spec
        channel = live.connection.channel()
        channel.basic_qos(prefetch_count=spec.prefetch)

        def on_message(
            ch: blocking.BlockingChannel,
            method: pika.spec.Basic.Deliver,
            props: pika.BasicProperties,
            body: bytes,
        ) -> None:
            self._deliver(ch, _to_delivery(method, props, body, spec.queue), consumer)

        channel.add_on_cancel_callback(lambda _frame: self._on_broker_cancel(spec.tag))
        channel.basic_consume(
            spec.queue, on_message, consumer_tag=spec.tag, exclusive=spec.exclusive
        )
        live.consumer_channels[spec.tag] = channel
        self._subscribed_at[spec.tag] = time.monotonic()
        self._checks.pop(spec.tag, None)

    def _on_broker_cancel(self, tag: str) -> None:
        """The broker cancelled a consumer (queue deleted, consumer timeout): ``run``
        re-subscribes it as soon as the queue exists again (see the asyncio core)."""
        consumer = self._consumers.get(tag)
        if consumer is None:
            return
        metrics.consumer_cancelled_by_broker(log, tag, consumer.spec.queue)
        self._cancelled[tag] = time.monotonic()

    def _watch_consumers(self, live: _SyncLive) -> None:
        """As the asyncio core's watchdog, inside ``run``: every ``consumer_check_s`` each
        consumer's queue must exist and count a consumer, else it is subscribed again."""
        now = time.monotonic()
        if now < self._next_check:
            return
        interval = self.settings.consumer_check_s
        self._next_check = now + interval
        for tag, consumer in list(self._consumers.items()):
            if tag in self._cancelled or self._subscribed_at.get(tag, now) > now - interval / 2:
                continue
            check = self._checks.setdefault(tag, consuming.ConsumerCheck())
            try:
                count, ready = self._on_probe_channel(
                    live, functools.partial(_counts_of, queue=consumer.spec.queue)
                )
                exists = True
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    continue
                exists, count, ready = False, 0, 0
            except Exception:  # not known either way: looked at next time
                continue
            delivered = self._delivered.get(tag, 0)  # handlers run inside ``run``: room
            if check.lost(
                queue_exists=exists, consumers=count, ready=ready, delivered=delivered, room=True
            ):
                metrics.consumer_lost(log, tag, consumer.spec.queue)
                self._cancelled[tag] = now

    def _resubscribe_cancelled(self, live: _SyncLive) -> None:
        now = time.monotonic()
        for tag, due in list(self._cancelled.items()):
            consumer = self._consumers.get(tag)
            if consumer is None:
                del self._cancelled[tag]
                continue
            if now < due:
                continue
            channel = live.consumer_channels.pop(tag, None)
            if channel is not None and channel.is_open:
                # returns what the cancelled consumer held unacked
                with contextlib.suppress(Exception):
                    channel.close()
            try:
                self._on_probe_channel(live, functools.partial(_exists, queue=consumer.spec.queue))
                self._start_consumer(live, consumer)
            except Exception as exc:
                log.debug("queue %r not back yet: %s", consumer.spec.queue, exc)
                self._cancelled[tag] = now + self.settings.retry.max_delay
                continue
            del self._cancelled[tag]
            log.info("consumer %s re-subscribed to %r", tag, consumer.spec.queue)

    def _deliver(
        self, ch: blocking.BlockingChannel, delivery: Delivery, consumer: _SyncConsumer
    ) -> None:
        """Execute what ``consuming`` decides (the asyncio core executes the same)."""
        self._delivered[consumer.spec.tag] = self._delivered.get(consumer.spec.tag, 0) + 1
        if tracing.active():
            with tracing.process(delivery):
                return self._deliver_traced(ch, delivery, consumer)
        return self._deliver_traced(ch, delivery, consumer)

    def _deliver_traced(
        self, ch: blocking.BlockingChannel, delivery: Delivery, consumer: _SyncConsumer
    ) -> None:
        outcome = consuming.before_handler(delivery)
        if outcome is None:
            try:
                consumer.handler(delivery)
            except Exception as exc:
                outcome = consuming.after_handler(delivery, exc)
            else:
                outcome = consuming.after_handler(delivery, None)
        try:
            self._settle(ch, delivery, outcome)
        except Exception as exc:
            outcome = consuming.settle_lost(delivery, exc)
            live = self._live
            if live is not None and consuming.resubscribe_after_lost_settle(
                channel_closed=ch.is_closed, connection_open=live.connection.is_open
            ):
                self._cancelled.setdefault(consumer.spec.tag, time.monotonic())  # by ``run``
        if consumer.on_settled is not None:
            consumer.on_settled(delivery, outcome)

    def _settle(self, ch: blocking.BlockingChannel, delivery: Delivery, outcome: Outcome) -> None:
        tag = delivery.delivery_tag
        for step in consuming.settle_steps(outcome):
            match step:
                case consuming.Step.ACK:
                    ch.basic_ack(tag)
                case consuming.Step.REJECT:
                    ch.basic_reject(tag, requeue=False)
                case consuming.Step.REQUEUE:
                    ch.basic_nack(tag, requeue=True)
                case consuming.Step.COPY_TO_DEAD_LETTER:
                    self.dead_letter(delivery, outcome.reason)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy ``delivery`` to the layer's dead-letter queue with ``reason`` in its headers
        (always publishable: headers the broker would refuse are left out, and said so)."""
        if DEAD_LETTER_EXCHANGE not in self.topology.exchanges:
            for spec in DEAD_LETTER_TOPOLOGY:
                self._record(spec)
        self.publish(
            dead_letter_message(delivery, reason, exchange=DEAD_LETTER_EXCHANGE, limits=self.limits)
        )


def _basic_publish(
    channel: blocking.BlockingChannel, message: OutgoingMessage, *, confirm: bool
) -> None:
    channel.basic_publish(
        message.exchange,
        message.routing_key,
        bytes(message.body),  # pika takes bytes or str only
        properties=_to_pika_properties(message),
        mandatory=message.mandatory and confirm,
    )


class _Refused(MiddlewareError):
    """The broker closed the connection in answer to a publish: not retried under the
    policy (not a ``RetryableError``), handled by ``_publish_suspect``."""

    def __init__(self, error: MiddlewareError, code: int) -> None:
        super().__init__(str(error))
        self.error, self.code = error, code


def _counts_of(channel: blocking.BlockingChannel, *, queue: str) -> tuple[int, int]:
    """(consumers, ready messages) of ``queue`` (the broker closes the channel with 404
    if there is no such queue)."""
    ok = channel.queue_declare(queue, passive=True).method
    return int(ok.consumer_count), int(ok.message_count)


def _exists(channel: blocking.BlockingChannel, *, queue: str) -> None:
    """Raise (the broker closes the channel with 404) unless ``queue`` exists."""
    channel.queue_declare(queue, passive=True)


def _process_events(live: _SyncLive, *, time_limit: float) -> None:
    live.connection.process_data_events(time_limit=time_limit)


def _to_pika_properties(message: OutgoingMessage) -> pika.BasicProperties:
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


def _to_delivery(method: Any, props: pika.BasicProperties, body: bytes, queue: str) -> Delivery:
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
