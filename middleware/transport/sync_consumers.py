"""The consumers of a ``SyncClient`` (a part of it, ``sync.py``): subscribed on channels
of their own, deliveries handled inside ``run`` and settled as ``consuming`` decides,
re-subscribed after a broker's cancel, looked at every ``consumer_check_s``."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.spec

from .. import tracing
from . import consuming, metrics
from .delivery import (
    Delivery,
    Outcome,
)
from .sync_live import (
    SyncClientState,
    SyncConsumer,
    SyncLive,
    counts_of,
    exists,
    to_delivery,
)

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _answered_within(live: SyncLive, queue: str, timeout: float) -> Iterator[None]:
    """Bound a blocking ``basic.consume`` by ``timeout``: pika's wait for consume-ok has
    none, and RabbitMQ 3.10 answers one on a quorum queue whose leader's node is frozen
    after 65 s.  A pika channel cannot be given up alone (its number stays the broker's
    until the close-ok, which waits as long), so the connection's stream is ended, from a
    timer of pika's own loop, as the silence rule does: the call raises
    ``ConnectionLost`` and the client connects and replays again (the asyncio core gives
    up the channel alone, ``SubscribeTimeout``)."""
    impl = getattr(live.connection, "_impl", None)
    if impl is None:
        yield
        return

    def unanswered() -> None:
        log.warning(
            "no answer to basic.consume on %r within %g s (consume_timeout): reconnecting",
            queue,
            timeout,
        )
        impl._terminate_stream(
            pika.exceptions.AMQPConnectionError(
                f"no answer to basic.consume on {queue!r} within {timeout:g} s (consume_timeout)"
            )
        )

    timer = impl._adapter_call_later(timeout, unanswered)
    try:
        yield
    finally:
        impl._adapter_remove_timeout(timer)


class SyncConsumers(SyncClientState):
    """Consumers on channels of their own, their deliveries handled inside ``run``."""

    def _start_consumer(self, live: SyncLive, consumer: SyncConsumer) -> None:
        spec = consumer.spec
        channel = live.connection.channel()
        channel.basic_qos(prefetch_count=spec.prefetch)

        def on_message(
            ch: blocking.BlockingChannel,
            method: pika.spec.Basic.Deliver,
            props: pika.BasicProperties,
            body: bytes,
        ) -> None:
            if not self._opened:  # closing (``close`` reads the broker's last answers):
                return  # left unacked, back in the queue once the connection closes
            self._deliver(ch, to_delivery(method, props, body, spec.queue), consumer)

        channel.add_on_cancel_callback(lambda _frame: self._on_broker_cancel(spec.tag))
        with _answered_within(live, spec.queue, self.settings.consume_timeout):
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

    def _watch_consumers(self, live: SyncLive) -> None:
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
                    live, functools.partial(counts_of, queue=consumer.spec.queue)
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

    def _resubscribe_cancelled(self, live: SyncLive) -> None:
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
                self._on_probe_channel(live, functools.partial(exists, queue=consumer.spec.queue))
                self._start_consumer(live, consumer)
            except Exception as exc:
                log.debug("queue %r not back yet: %s", consumer.spec.queue, exc)
                self._cancelled[tag] = now + self.settings.retry.max_delay
                continue
            del self._cancelled[tag]
            log.info("consumer %s re-subscribed to %r", tag, consumer.spec.queue)

    def _deliver(
        self, ch: blocking.BlockingChannel, delivery: Delivery, consumer: SyncConsumer
    ) -> None:
        """Execute what ``consuming`` decides (the asyncio core executes the same)."""
        self._delivered[consumer.spec.tag] = self._delivered.get(consumer.spec.tag, 0) + 1
        if tracing.active():
            with tracing.process(delivery):
                return self._deliver_traced(ch, delivery, consumer)
        return self._deliver_traced(ch, delivery, consumer)

    def _deliver_traced(
        self, ch: blocking.BlockingChannel, delivery: Delivery, consumer: SyncConsumer
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
            outcome = consuming.settle_lost(delivery, exc, outcome)
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
