"""The asyncio core's watched channel: unconfirmed publishes and direct reply-to.

One per connection.  It runs in confirm mode although its callers do not wait for the
broker (``watch.py`` says why and decides what an answer calls for); this module only
performs it: publish and register the answer, open a fresh channel when the one in use
refused a publish (a nack), keep a retired channel open ``linger_s`` for the replies
still addressed to it, and hand what must go again to the client's ``resend``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage

from ..settings import RetrySettings
from . import metrics
from .aio_publish import publish_unawaited
from .message import OutgoingMessage
from .policy import backoff_delay
from .watch import Answer, WatchedChannel, missing_exchange

__all__ = ["WatchedReplies"]

log = logging.getLogger(__name__)
REPLY_TO = "amq.rabbitmq.reply-to"
Resender = Callable[[OutgoingMessage, int], Awaitable[None]]
ReplyCallback = Callable[[DeliveredMessage], Coroutine[Any, Any, None]]


@dataclass(eq=False)
class _Channel:
    channel: AbstractChannel
    ledger: WatchedChannel


class WatchedReplies:
    """The connection's channel for unconfirmed publishes and replies, watched."""

    def __init__(
        self,
        connection: AbstractConnection,
        *,
        policy: RetrySettings,
        linger_s: float,
        resend: Resender,
    ) -> None:
        self.connection = connection
        self.policy = policy
        self.linger_s = linger_s
        self._resend = resend
        self._on_reply: ReplyCallback | None = None
        self._current: _Channel | None = None
        self._retired: set[_Channel] = set()
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        self.retired = 0  # channels retired after a refusal (tests and logs read it)
        self._closed = False

    # ------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open the first channel (replies start with :meth:`listen`)."""
        self._current = await self._new_channel()

    async def listen(self, on_reply: ReplyCallback) -> None:
        """Consume direct reply-to on the channel in use, and on every later one."""
        self._on_reply = on_reply
        current = await self._usable()
        await self._consume_replies(current.channel)

    def close(self) -> None:
        """The connection is going: forget what was owed, stop the timers."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for holder in (self._current, *self._retired):
            if holder is not None:
                holder.ledger.forget()

    # ----------------------------------------------------------- publishing
    async def send(self, message: OutgoingMessage, attempt: int = 1) -> asyncio.Future[object]:
        """Queue ``message`` on the channel in use; the broker's answer is watched here
        and also returned (``resend_alone`` waits for it)."""
        holder = await self._usable()
        underlay = cast(aiormq.Channel, await holder.channel.get_underlay_channel())
        tag, answer = await publish_unawaited(underlay, message)
        holder.ledger.sent(tag, message, attempt)
        answer.add_done_callback(lambda fut: self._answered(holder, tag, fut))
        return answer

    async def _usable(self) -> _Channel:
        holder = self._current
        if holder is not None and holder.ledger.current and not holder.channel.is_closed:
            return holder
        async with self._lock:  # one replacement, however many publishes wait for it
            holder = self._current
            if holder is None or not holder.ledger.current or holder.channel.is_closed:
                holder = self._current = await self._new_channel()
                if self._on_reply is not None:
                    await self._consume_replies(holder.channel)
            return holder

    async def _new_channel(self) -> _Channel:
        channel = await self.connection.channel(publisher_confirms=True)
        delay = backoff_delay(self.policy)
        return _Channel(channel, WatchedChannel(attempts=self.policy.attempts, delay=delay))

    async def _consume_replies(self, channel: AbstractChannel) -> None:
        on_reply = self._on_reply
        assert on_reply is not None
        underlay = await channel.get_underlay_channel()
        await underlay.basic_consume(REPLY_TO, on_reply, no_ack=True)

    # -------------------------------------------------------- the answers
    def _answered(self, holder: _Channel, tag: int, answer: asyncio.Future[object]) -> None:
        error = None if answer.cancelled() else answer.exception()
        if error is None and not answer.cancelled():
            self._act(holder, holder.ledger.answered(tag, multiple=False, ok=True))
        elif isinstance(error, aiormq.exceptions.DeliveryError):
            self._act(holder, holder.ledger.answered(tag, multiple=False, ok=False))
        elif self.connection.is_closed or self._closed:
            holder.ledger.forget()  # the caller's to resend after failover
        else:
            self._act(holder, holder.ledger.closed(missing_exchange(error)))

    def _act(self, holder: _Channel, answer: Answer) -> None:
        if answer.retire_channel:
            self._retire(holder)
        for message in answer.given_up:
            metrics.UNCONFIRMED_GIVEN_UP.inc()
            log.warning(
                "unconfirmed publish %s refused by the broker %d times; not sent again",
                message.message_id,
                self.policy.attempts,
            )
        for resend in answer.resend:
            metrics.UNCONFIRMED_RESENT.inc()
            self._spawn(self._resend_later(resend.message, resend.attempt, resend.delay))

    def _retire(self, holder: _Channel) -> None:
        """The channel refused a publish: the next publish opens a fresh one; this one
        stays open ``linger_s`` for the replies still addressed to it."""
        self.retired += 1
        log.info("unconfirmed publish refused: continuing on a fresh channel")
        self._retired.add(holder)
        self._spawn(self._close_later(holder))

    async def _resend_later(self, message: OutgoingMessage, attempt: int, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self._resend(message, attempt)
        except Exception as exc:  # the connection went meanwhile: the caller resends
            log.debug("resend of unconfirmed %s failed: %s", message.message_id, exc)

    async def _close_later(self, holder: _Channel) -> None:
        await asyncio.sleep(self.linger_s)
        self._retired.discard(holder)
        with contextlib.suppress(Exception):
            await holder.channel.close()

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
