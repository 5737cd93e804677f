"""The consumers of an ``AsyncClient`` (a part of it, ``aio.py``): each subscribed on a
channel of its own, its deliveries handled in tasks of the client's own and settled as
``consuming`` decides, re-subscribed after a broker's cancel or a lost settle, and
looked at by the watchdog every ``consumer_check_s``."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from .. import tracing
from ..errors import (
    EntityNotFound,
    MiddlewareError,
    SubscribeTimeout,
)
from . import consuming, metrics
from .aio_live import (
    ClientState,
    Consumer,
    Live,
    from_delivered,
    on_probe_channel,
)
from .aio_publish import settle_frame
from .delivery import Delivery, Outcome
from .translate import translate_aio

log = logging.getLogger(__name__)


class ConsumerMachinery(ClientState):
    """Consumers on channels of their own, their deliveries handled and settled."""

    async def _stop_consumers(self, tags: list[str], grace: float | None = None) -> None:
        grace = self.settings.close_grace if grace is None else grace
        live = self._live
        channels = []
        for tag in tags:
            self.topology.forget_consumer(tag)
            self._consumers.pop(tag, None)
            if isinstance(live, Live) and (channel := live.consumer_channels.pop(tag, None)):
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

    async def _start_consumer(self, live: Live, consumer: Consumer) -> None:
        spec = consumer.spec
        channel = None
        given_up = False
        try:
            channel = await live.connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=spec.prefetch)

            # aiormq's consumer straight: aio-pika's Queue.consume wraps every delivery in an
            # IncomingMessage and a second task, and its ack waits for the frame to drain
            async def on_message(msg: DeliveredMessage) -> None:
                if not given_up:  # (a subscription given up: its deliveries go back)
                    self._deliver(msg, spec.queue, consumer)

            underlay = await channel.get_underlay_channel()
            underlay.on_consumer_cancel_callbacks.add(
                lambda _frame: None if given_up else self._on_broker_cancel(live, spec.tag)
            )
            # known before the first delivery: a queue's backlog arrives with consume-ok
            live.consumer_channels[spec.tag] = channel
            self._subscribed_at.pop(spec.tag, None)
            self._checks.pop(spec.tag, None)
            try:
                await underlay.basic_consume(
                    spec.queue,
                    on_message,
                    consumer_tag=spec.tag,
                    exclusive=spec.exclusive,
                    timeout=self.settings.consume_timeout,
                )
            except TimeoutError:
                given_up = True
                # aiormq has sent the channel's close; the broker ends the subscription
                # when it answers (a frozen quorum leader's node: 65 s, or its thaw)
                raise SubscribeTimeout(
                    f"no answer to basic.consume on {spec.queue!r} within "
                    f"{self.settings.consume_timeout:g} s (consume_timeout)"
                ) from None
            self._subscribed_at[spec.tag] = time.monotonic()
        except Exception as exc:
            if channel is not None and live.consumer_channels.get(spec.tag) is channel:
                del live.consumer_channels[spec.tag]
            if isinstance(exc, MiddlewareError):
                raise
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
            if not isinstance(live, Live) or not self._ready.is_set():
                continue
            settled = time.monotonic() - interval / 2
            for tag, consumer in list(self._consumers.items()):
                channel = live.consumer_channels.get(tag)
                if channel is None or self._subscribed_at.get(tag, float("inf")) > settled:
                    continue  # being subscribed (again) right now
                verdict = await self._still_consumed(live, tag, consumer)
                if verdict is False and live.consumer_channels.get(tag) is channel:
                    metrics.consumer_lost(log, tag, consumer.spec.queue)
                    self._resubscribe_soon(live, consumer)

    async def _still_consumed(self, live: Live, tag: str, consumer: Consumer) -> bool | None:
        """The watchdog's verdict on one consumer; None when it cannot be told now."""
        queue = consumer.spec.queue
        check = self._checks.setdefault(tag, consuming.ConsumerCheck())
        try:
            ok = await on_probe_channel(live, lambda ch: ch.queue_declare(queue, passive=True))
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

    def _subscribe_later(self, live: Live, tag: str, why: str) -> None:
        """A failover's replay could not subscribe this consumer (``SubscribeTimeout``, or
        its queue not there or unreachable): the client goes on (publishes, the other
        consumers) while this consumer is subscribed again in the background."""
        consumer = self._consumers.get(tag)
        if consumer is None:
            return
        log.warning(
            "consumer %s of %r: %s; subscribing it again in the background",
            tag,
            consumer.spec.queue,
            why,
        )
        self._resubscribe_soon(live, consumer)

    def _on_broker_cancel(self, live: Live, tag: str) -> None:
        """The broker cancelled a consumer (its queue was deleted, a consumer timeout):
        say so, and re-subscribe as soon as the queue exists again."""
        consumer = self._consumers.get(tag)
        if consumer is None or self._live is not live:
            return
        metrics.consumer_cancelled_by_broker(log, tag, consumer.spec.queue)
        self._resubscribe_soon(live, consumer)

    def _resubscribe_soon(self, live: Live, consumer: Consumer) -> None:
        """``_resubscribe`` in a task of the client's own (held until it ends)."""
        task = asyncio.ensure_future(self._resubscribe(live, consumer))
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _resubscribe(self, live: Live, consumer: Consumer) -> None:
        """Subscribe ``consumer`` again on a new channel, then close its old one (make
        before break): closing it returns what it held unacked (a quorum queue declared
        again under the same name otherwise leaves a message held for ever), and until
        then it goes on delivering what it is given.  That matters when the old consumer
        was not lost after all: a quorum queue whose leader's node is frozen counts no
        consumer while a new leader delivers to it, and the new ``basic.consume`` waits
        for the frozen node (docs/transport.md, "The consumer watchdog").  An exclusive
        consumer's old channel is closed first (the queue would refuse a second one)."""
        old = live.consumer_channels.pop(consumer.spec.tag, None)
        if old is not None and consumer.spec.exclusive:
            with contextlib.suppress(Exception):
                await old.close()
            old = None
        delay = self.settings.retry.initial_delay or 0.1
        try:
            while self._consumers.get(consumer.spec.tag) is consumer and self._live is live:
                try:
                    await on_probe_channel(
                        live, lambda ch: ch.queue_declare(consumer.spec.queue, passive=True)
                    )
                    await self._start_consumer(live, consumer)
                    log.info(
                        "consumer %s re-subscribed to %r", consumer.spec.tag, consumer.spec.queue
                    )
                    return
                except MiddlewareError as exc:
                    log.debug("queue %r not back yet: %s", consumer.spec.queue, exc)
                await asyncio.sleep(delay)
                delay = min(delay * self.settings.retry.multiplier, self.settings.retry.max_delay)
        finally:
            if old is not None:
                with contextlib.suppress(Exception):
                    await old.close()

    def _deliver(self, msg: DeliveredMessage, queue: str, consumer: Consumer) -> None:
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

    async def _handle(self, msg: DeliveredMessage, queue: str, consumer: Consumer) -> None:
        """Execute what ``consuming`` decides (the pika face executes the same)."""
        delivery = from_delivered(msg, queue)
        if tracing.active():
            with tracing.process(delivery):
                return await self._handle_delivery(msg, delivery, consumer)
        return await self._handle_delivery(msg, delivery, consumer)

    async def _handle_delivery(
        self, msg: DeliveredMessage, delivery: Delivery, consumer: Consumer
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
            outcome = consuming.settle_lost(delivery, exc, outcome)
            self._after_lost_settle(consumer, msg.channel)
        if consumer.on_settled is not None:
            await consumer.on_settled(delivery, outcome)

    async def _settle(
        self, channel: aiormq.abc.AbstractChannel, delivery: Delivery, outcome: Outcome
    ) -> None:
        """Settle on the delivery's channel; the frame leaves with the loop turn's others
        (not awaiting its drain; a channel already closed, or closing while the frame
        waits for room, raises: ``settle_frame``)."""
        tag = delivery.delivery_tag
        for step in consuming.settle_steps(outcome):
            match step:
                case consuming.Step.ACK:
                    await settle_frame(channel, spec.Basic.Ack(delivery_tag=tag))
                case consuming.Step.REJECT:
                    await settle_frame(channel, spec.Basic.Reject(delivery_tag=tag, requeue=False))
                case consuming.Step.REQUEUE:
                    await settle_frame(channel, spec.Basic.Nack(delivery_tag=tag, requeue=True))
                case consuming.Step.COPY_TO_DEAD_LETTER:
                    await self.dead_letter(delivery, outcome.reason)

    def _after_lost_settle(self, consumer: Consumer, channel: aiormq.abc.AbstractChannel) -> None:
        live, tag = self._live, consumer.spec.tag
        if not isinstance(live, Live) or self._consumers.get(tag) is not consumer:
            return
        current = live.consumer_channels.get(tag)
        if current is None:
            return  # being subscribed again already (another delivery of the dead channel)
        if channel.is_closed and not current.is_closed:
            return  # not the consumer's channel now: one it was subscribed again from
        if consuming.resubscribe_after_lost_settle(
            channel_closed=current.is_closed or channel.is_closed,
            connection_open=not live.connection.is_closed,
        ):
            live.consumer_channels.pop(tag, None)  # once per dead channel
            self._resubscribe_soon(live, consumer)
