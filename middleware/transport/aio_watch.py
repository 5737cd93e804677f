"""The asyncio core's watched channel: unconfirmed publishes and direct reply-to.

One per connection.  It runs in confirm mode although its callers do not wait for the
broker (``watch.py`` says why and decides what an answer calls for); this module only
performs it: publish and note the tag, read the broker's acks and nacks off the channel,
open a fresh channel when the one in use refused a publish (a nack), keep a retired
channel open ``linger_s`` for the replies still addressed to it, and hand what must go
again to the client's ``resend``.  A waited publish that is mandatory (an e2e copy
``publish_held`` sends straight to its queue) and that the broker returned is answered
with ``Unroutable`` at its ack: the broker acks what it routed nowhere too.

The channel is confirm-mode for the broker only: aiormq is not told (it would keep a
future per publish and settle each one through ``call_soon``, measured at a fifth more
CPU per unconfirmed publish), and its ``Basic.Ack``/``Basic.Nack`` frames reach this
module's handler, which settles a ``multiple`` answer in one step.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec

from ..errors import PublishNacked, Unroutable
from ..settings import RetrySettings
from . import metrics
from .aio_publish import publish_numbered
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
    underlay: aiormq.Channel
    ledger: WatchedChannel
    #: publishes whose sender waits for the broker's answer (``send(wait=True)``)
    waiting: dict[int, asyncio.Future[None]] = field(default_factory=dict)
    closing: bool = False  # closed by the layer (retired, or the connection went)
    replying: bool = False  # consuming direct reply-to (once: a second consume closes it)
    #: waited mandatory publishes: tag -> message id; and the ids the broker returned
    #: (a return comes before its publish's ack on the channel), with the reply text
    mandatory: dict[int, str] = field(default_factory=dict)
    returned: dict[str, str] = field(default_factory=dict)


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
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Future[None]] = set()
        self._retired: set[_Channel] = set()  # refused a publish, lingering
        self._resending: dict[asyncio.Future[None], OutgoingMessage] = {}  # refused, due again
        self._closed = False
        self._changed = asyncio.Event()  # an answer read, a resend done, a channel gone
        self.retired = 0  # channels retired after a refusal (tests and logs read it)

    # ------------------------------------------------------------ lifecycle
    async def open(self) -> None:
        """Open the first channel (replies start with :meth:`listen`)."""
        self._current = await self._new_channel()

    async def listen(self, on_reply: ReplyCallback) -> None:
        """Consume direct reply-to on the channel in use, and on every later one (once
        each, however often asked: a listener added while the connection came back finds
        the replies already consumed, and a second consume would close the channel with
        "reply consumer already set")."""
        self._on_reply = on_reply
        await self._replies_on(await self._usable())

    async def _replies_on(self, holder: _Channel) -> None:
        if self._on_reply is None or holder.replying:
            return
        holder.replying = True
        try:
            await holder.underlay.basic_consume(REPLY_TO, self._on_reply, no_ack=True)
        except BaseException:
            holder.replying = False
            raise

    async def settle(self, within: float) -> None:
        """Before a close: wait until the broker answered every publish the watched
        channels owe and what it refused went again, for up to ``within`` seconds
        (before, a refused publish waiting for its resend was dropped by the close).
        What is then still to be sent again is given up, counted and logged."""
        deadline = asyncio.get_running_loop().time() + within
        while self._owed():
            self._changed.clear()
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)
        waiting = [m for task, m in self._resending.items() if not task.done()]
        if waiting:
            metrics.UNCONFIRMED_GIVEN_UP.inc(len(waiting))
            log.warning(
                "closing: %d refused unconfirmed publish(es) not sent again within "
                "close_grace (%.1f s): %s",
                len(waiting),
                within,
                ", ".join(str(m.message_id) for m in waiting),
            )

    def _owed(self) -> int:
        holders = (self._current, *self._retired)
        owed = sum(h.ledger.owed for h in holders if h is not None and not h.closing)
        return owed + len(self._resending)

    def close(self) -> None:
        """The connection is going: forget what was owed, stop the timers."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        if self._current is not None:
            self._current.closing = True
            self._current.ledger.forget()

    # ----------------------------------------------------------- publishing
    async def send(
        self, message: OutgoingMessage, attempt: int = 1, *, wait: bool = False
    ) -> asyncio.Future[None] | None:
        """Queue ``message`` on the channel in use; the broker's answer is watched here.
        With ``wait``, also return a future of that answer (``PublishNacked`` on a nack)."""
        holder = await self._usable()
        if message.mandatory and not wait:  # only a waited publish hears of its return
            message = dataclasses.replace(message, mandatory=False)
        tag = await publish_numbered(holder.underlay, message)
        holder.ledger.sent(tag, message, attempt)
        if not wait:
            return None
        if message.mandatory and message.message_id:
            holder.mandatory[tag] = message.message_id
        answer = holder.waiting[tag] = asyncio.get_running_loop().create_future()
        answer.add_done_callback(_retrieved)  # a caller may stop waiting for it
        return answer

    async def _usable(self) -> _Channel:
        holder = self._current
        if holder is not None and holder.ledger.current and not holder.channel.is_closed:
            return holder
        async with self._lock:  # one replacement, however many publishes wait for it
            holder = self._current
            if holder is None or not holder.ledger.current or holder.channel.is_closed:
                # in use only once it consumes the replies: a publish with a reply address
                # on a channel without that consumer closes it (406 "fast reply consumer
                # does not exist"), which publishers saw as PreconditionFailed
                holder = await self._new_channel()
                await self._replies_on(holder)
                self._current = holder
            return holder

    async def _new_channel(self) -> _Channel:
        channel = await self.connection.channel(publisher_confirms=False)
        underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
        await underlay.rpc(spec.Confirm.Select())  # for the broker; aiormq keeps no futures
        ledger = WatchedChannel(attempts=self.policy.attempts, delay=backoff_delay(self.policy))
        holder = _Channel(channel, underlay, ledger)

        async def on_answer(frame: spec.Basic.Ack | spec.Basic.Nack) -> None:
            self._answered(holder, frame)

        underlay._on_confirm_frame = on_answer  # type: ignore[method-assign,assignment]

        async def on_return(frame: spec.Basic.Return) -> None:
            # read as aiormq reads it (which looks for a future of its own, and there is
            # none here): the publish's ack, which follows, answers with ``Unroutable``
            header = await underlay._Channel__get_content_header()  # type: ignore[attr-defined]
            message = await underlay._read_content(frame, header)
            message_id = message.header.properties.message_id
            if message_id is not None:
                holder.returned[message_id] = f"{frame.reply_code} {frame.reply_text}"

        underlay._on_return_frame = on_return  # type: ignore[method-assign]
        channel.close_callbacks.add(lambda _ch, exc: self._channel_closed(holder, exc))
        return holder

    # -------------------------------------------------------- the answers
    def _answered(self, holder: _Channel, frame: spec.Basic.Ack | spec.Basic.Nack) -> None:
        ok = isinstance(frame, spec.Basic.Ack)
        tag, multiple = int(frame.delivery_tag or 0), bool(frame.multiple)
        if holder.waiting:
            tags = [t for t in holder.waiting if t <= tag] if multiple else [tag]
            for t in tags:
                waiter = holder.waiting.pop(t, None)
                returned = holder.returned.pop(holder.mandatory.pop(t, ""), None)
                if waiter is not None and not waiter.done():
                    if ok and returned is not None:
                        waiter.set_exception(Unroutable(f"returned as unroutable: {returned}"))
                    elif ok:
                        waiter.set_result(None)
                    else:
                        waiter.set_exception(PublishNacked(f"the broker refused publish {t}"))
        self._act(holder, holder.ledger.answered(tag, multiple=multiple, ok=ok))
        self._changed.set()

    def _channel_closed(self, holder: _Channel, exc: BaseException | None) -> None:
        error = exc if isinstance(exc, Exception) else None  # the close's own reason
        for waiter in holder.waiting.values():
            if not waiter.done():  # (a 541 there is what the suspect retry looks for)
                waiter.set_exception(
                    error or aiormq.exceptions.ChannelInvalidStateError(f"channel closed: {exc}")
                )
        holder.waiting.clear()
        holder.mandatory.clear()
        holder.returned.clear()
        self._changed.set()
        if holder.closing or self._closed or self.connection.is_closed:
            holder.ledger.forget()  # the caller's to resend after failover
            return
        self._act(holder, holder.ledger.closed(missing_exchange(exc)))

    def _act(self, holder: _Channel, answer: Answer) -> None:
        if answer.retire_channel:
            self._retire(holder)
        for message, why in answer.reasons():
            metrics.UNCONFIRMED_GIVEN_UP.inc()
            log.warning("unconfirmed publish %s %s: not sent again", message.message_id, why)
        for resend in answer.resend:
            metrics.UNCONFIRMED_RESENT.inc()
            task = self._spawn(self._resend_later(resend.message, resend.attempt, resend.delay))
            self._resending[task] = resend.message
            task.add_done_callback(self._resent)

    def _resent(self, task: asyncio.Future[None]) -> None:
        self._resending.pop(task, None)
        self._changed.set()

    def _retire(self, holder: _Channel) -> None:
        """The channel refused a publish: the next publish opens a fresh one; this one
        stays open ``linger_s`` for the replies still addressed to it."""
        self.retired += 1
        self._retired.add(holder)
        log.info("unconfirmed publish refused: continuing on a fresh channel")
        self._spawn(self._close_later(holder))

    async def _resend_later(self, message: OutgoingMessage, attempt: int, delay: float) -> None:
        await asyncio.sleep(delay)
        try:
            await self._resend(message, attempt)
        except Exception as exc:  # the connection went meanwhile: the caller resends
            log.debug("resend of unconfirmed %s failed: %s", message.message_id, exc)

    async def _close_later(self, holder: _Channel) -> None:
        await asyncio.sleep(self.linger_s)
        holder.closing = True
        self._retired.discard(holder)
        self._changed.set()
        with contextlib.suppress(Exception):
            await holder.channel.close()

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Future[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _retrieved(answer: asyncio.Future[None]) -> None:
    if not answer.cancelled():
        answer.exception()
