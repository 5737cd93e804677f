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
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Self

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.spec

from .. import tracing
from ..errors import (
    AccessRefused,
    BrokerUnreachable,
    ConnectionLost,
    MiddlewareError,
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
from .message import OutgoingMessage
from .outbound import Limits, check_message, is_reply, replies_settings
from .policy import NodeRotation
from .sync_connecting import SyncConnecting
from .sync_consumers import SyncConsumers
from .sync_live import (
    REPLY_TO,
    STEP_S,
    SyncConsumer,
    SyncHandler,
    SyncLive,
    SyncSettleHook,
    basic_publish,
    close_within,
    process_events,
    to_delivery,
)
from .sync_publishing import SyncPublishing
from .sync_turns import Turns, in_turns
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    QueueSpec,
    TopologyRecord,
)
from .translate import translate_sync

__all__ = ["SyncClient", "SyncHandler", "SyncSettleHook"]

log = logging.getLogger(__name__)


@codec.layer_calls
@in_turns(except_=("run", "wake", "turn"))
class SyncClient(SyncConnecting, SyncPublishing, SyncConsumers):
    """The blocking client: failover, record-and-replay, publisher confirms.

    Threads may share one: each public call runs in a turn, one thread's at a time
    (``sync_turns``); ``run`` takes a turn a step at a time, so other threads publish
    while one runs the consumers.

    Its parts: ``sync_connecting.SyncConnecting`` (calls under the retry policy, the
    connection, replay), ``sync_publishing.SyncPublishing`` (confirmed and watched
    publishes, suspects), ``sync_consumers.SyncConsumers`` (consumers, deliveries, the
    watchdog); what they hold is ``sync_live.SyncClientState``, set here."""

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
        self._live: SyncLive | None = None
        self._woken = threading.Event()  # ``wake``: the run under way returns
        #: one thread at a time on the connection; a forked child lets go of the parent's
        self._turns = Turns(self._interrupt_step, forked=self._forked)
        self._inherited: SyncLive | None = None  # the parent's connection, in a forked child
        self._stepping = False  # a ``run`` step is waiting for I/O (its turn held)
        self._consumers: dict[str, SyncConsumer] = {}
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
        """Let the watched channel settle (the broker's answers to unconfirmed publishes
        read, what it refused sent again; up to ``settings.close_grace``), then close."""
        if self._replies is not None:
            self._replies.close()
        self._opened = False
        if self._live is not None:
            self._settle_watched(self._live)
        live, self._live = self._live, None
        if live is not None:
            close_within(live.connection, self.settings.close_grace)

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

    def _start_replies(self, live: SyncLive) -> None:
        handlers = self._reply_handlers
        if not handlers:
            return

        def on_reply(ch: Any, method: Any, props: pika.BasicProperties, body: bytes) -> None:
            delivery = to_delivery(method, props, body, REPLY_TO)
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
        """Delete the queue, after cancelling this client's own consumers of it (as the
        asyncio core's ``delete_queue``: they are not subscribed again later)."""
        for tag in consuming.consumers_of(self._consumers, name):
            self.cancel(tag)
        self.topology.forget_queue(name)
        self._call(lambda live: self._on_temp_channel(live, lambda ch: ch.queue_delete(name)))

    def delete_exchange(self, name: str) -> None:
        self.topology.forget_exchange(name)
        self._call(lambda live: self._on_temp_channel(live, lambda ch: ch.exchange_delete(name)))

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
        self._consumers[spec.tag] = SyncConsumer(spec, handler, on_settled)
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
        """Process deliveries for ``seconds`` (forever if None), until ``until()`` is true
        or until another thread calls ``wake``.  ``step_s``: the longest one step waits
        for I/O before the hooks run and ``until`` is asked (default 0.1 s, less if a
        hook asked for less); a thread that only publishes (beats) sets its own interval
        and wakes no more often than that."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while (deadline is None or time.monotonic() < deadline) and not (until and until()):
            step = min(STEP_S if step_s is None else step_s, self._step_s_hooks)
            if deadline is not None:
                step = max(0.0, min(step, deadline - time.monotonic()))
            with self._turns:
                self._step(step)
            if self._woken.is_set():
                self._woken.clear()
                return

    def _step(self, step: float) -> None:
        """One step of ``run``: deliveries for up to ``step`` seconds, then the hooks."""
        self._stepping = True  # then a look at the queue: a thread that asked for a turn
        if self._turns.wanted():  # before this saw no step to interrupt
            step = 0.0
        try:
            self._call(functools.partial(process_events, time_limit=step))
        finally:
            self._stepping = False
        self._call(self._watch)
        for hook in list(self._step_hooks):
            hook()
        if self._replies is not None:
            self._replies.poll()
        if self._live is not None and self.settings.consumer_check_s > 0:
            self._watch_consumers(self._live)
        if self._cancelled and self._live is not None:
            self._resubscribe_cancelled(self._live)

    def turn(self) -> AbstractContextManager[None]:
        """A turn of the caller's own for several calls in a row (a face that keeps state
        beside the connection: ``SyncConfirmPublisher``); every call takes one anyway."""
        return self._turns

    def wake(self) -> None:
        """From any thread: the ``run`` under way (or the next one) returns after its
        current step, which stops waiting for I/O at once (pika's thread-safe callback
        ends the wait); the one call that takes no turn."""
        self._woken.set()
        self._interrupt()

    def _forked(self) -> None:
        """In a forked child (``os.fork``: a pre-forking server's workers): the
        connection is the parent's, its socket shared with it; the child says nothing on
        it and opens its own at its next call (replaying the record, consumers
        included). What the parent's watched channel owed is the parent's."""
        self._stepping = False  # a step under way was the parent's thread's
        if self._live is not None:
            self._inherited, self._live = self._live, None
            self._resends = []

    def _interrupt_step(self) -> None:
        """A thread waits for a turn: a step waiting for I/O ends at once (other calls
        in a turn end by themselves)."""
        if self._stepping:
            self._interrupt()

    def _interrupt(self) -> None:
        """From any thread: the wait for I/O under way (a ``run``'s step) ends at once."""
        live = self._live
        if live is not None:
            with contextlib.suppress(Exception):  # closed or closing: the run ends anyway
                live.connection.add_callback_threadsafe(_nothing)

    def get(self, queue: str) -> Delivery | None:
        """Take one message (acked on receipt), or None if the queue is empty."""

        def take(ch: blocking.BlockingChannel) -> Delivery | None:
            method, props, body = ch.basic_get(queue, auto_ack=True)
            return None if method is None else to_delivery(method, props, body, queue)

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

        def get(live: SyncLive) -> tuple[Delivery, Callable[[Action], None]] | None:
            channel = self._publish_channel(live)  # (a fresh one after a confirm timeout)
            method, props, body = channel.basic_get(queue, auto_ack=False)
            if method is None:
                return None
            delivery = to_delivery(method, props, body, queue)

            def settle(action: Action) -> None:
                with self._turns:
                    self._settle(channel, delivery, Outcome(action))

            return delivery, settle

        return self._call(get)

    def publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool = True,
        retry: bool = True,
        within: float | None = None,
        retry_nacked: bool = True,
    ) -> None:
        """Publish; with ``confirm`` return once the broker confirmed it.

        Retried on connection loss under the retry policy; ``retry=False`` makes
        one attempt (after reconnecting if needed) and raises the failure.  A message
        the broker would refuse raises ``MalformedMessage`` at once.  ``within``: the
        confirm's bound for this call (default ``publish_timeout``); past it
        ``ConfirmTimeout`` (the broker may still take the message).  ``retry_nacked=False``:
        a ``basic.nack`` raises ``PublishNacked`` at once (as ``AsyncClient.publish``).
        """
        check_message(message, self.limits)
        if is_reply(message) and not self._sends_own_replies:
            self._reply_sender().publish(
                message, confirm=confirm, retry=retry, within=within, retry_nacked=retry_nacked
            )
            return
        nacks = {"retry_nacked": retry_nacked}
        if tracing.active():
            with tracing.publish(message) as traced:
                return self._publish(traced, confirm=confirm, retry=retry, within=within, **nacks)
        return self._publish(message, confirm=confirm, retry=retry, within=within, **nacks)

    def answers(self, within: float) -> bool:
        """Whether the node this client is connected to answers a round trip (a passive
        declare of ``amq.direct`` on a channel of its own) within ``within`` seconds, as
        ``AsyncClient.answers``.  Never raises; a channel that did not answer in time is
        left to close when its answer comes (or with the connection)."""
        live = self._live
        if live is None or not live.connection.is_open:
            return False
        answered: list[bool] = []
        late: list[bool] = []
        impl = live.connection._impl

        def declared(_frame: object, channel: Any) -> None:
            answered.append(True)
            with contextlib.suppress(Exception):
                channel.close()

        def opened(channel: Any) -> None:
            channel.exchange_declare(
                "amq.direct", passive=True, callback=lambda f: declared(f, channel)
            )

        try:
            timer = impl._adapter_call_later(within, lambda: late.append(True))
            try:
                impl.channel(on_open_callback=opened)
                live.connection._flush_output(lambda: bool(answered or late))
            finally:
                impl._adapter_remove_timeout(timer)
        except Exception as exc:  # the connection is the next call's to mend
            log.debug("no round trip: %s", exc)
            return False
        return bool(answered)

    def publish_unwatched(self, message: OutgoingMessage) -> None:
        """Publish once with nothing coming back: no confirm, no watch, no retry (on the
        probe channel, which is not in confirm mode).  For a message the next one
        replaces (a beat): the broker sends no ack for it and this thread wakes for
        none.  A connection lost on the way raises; a message lost with it is not said."""
        check_message(message, self.limits)
        send = functools.partial(basic_publish, message=message, confirm=False)
        self._call(lambda live: self._on_probe_channel(live, send), attempts=1)
        metrics.PUBLISHED_UNCONFIRMED.inc()

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
            process_events(live, time_limit=0)
            self._watch(live)
        except Exception as exc:
            self._drop(live, translate_sync(exc), exc)

    # ------------------------------------------------------ watched channel

    def resend_alone(self, message: OutgoingMessage, *, confirm: bool = True) -> None:
        """As ``AsyncClient.resend_alone``: a message in flight when the broker closed
        the connection in answer to a frame, sent again alone and known taken (the
        broker's confirm, or a round trip on its channel); closed again: ``MessageRefused``."""
        check_message(message, self.limits)
        first = self._last_refusal or ConnectionLost("the broker closed the connection")
        self._publish_suspect(message, first, confirm=confirm)

    # ------------------------------------------------------------- internal

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        """Copy ``delivery`` to the layer's dead-letter queue with ``reason`` in its headers
        (always publishable: headers the broker would refuse are left out, and said so)."""
        if DEAD_LETTER_EXCHANGE not in self.topology.exchanges:
            for spec in DEAD_LETTER_TOPOLOGY:
                self._record(spec)
        self.publish(
            dead_letter_message(delivery, reason, exchange=DEAD_LETTER_EXCHANGE, limits=self.limits)
        )


def _nothing() -> None:
    """What ``wake`` asks the connection's thread to run: only the wake-up counts."""
