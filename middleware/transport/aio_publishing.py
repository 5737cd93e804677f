"""The publishes of an ``AsyncClient`` (a part of it, ``aio.py``): within the in-flight
window, on the confirm channel (repaired after a nack or a channel-closing refusal),
retried on connection loss, and a message the broker closed the connection at sent
again alone to tell whether it is the culprit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import cast

import aiormq
from aio_pika.abc import AbstractChannel

from ..errors import (
    ConfirmTimeout,
    MessageRefused,
    MiddlewareError,
    PublishNacked,
    RetryableError,
    TopologyError,
    WindowFull,
)
from . import metrics
from .aio_live import (
    ClientState,
    Live,
    on_channel_of,
)
from .aio_publish import basic_publish
from .message import OutgoingMessage
from .policy import async_retrying
from .translate import confirm_timeout, refusal_code, translate_aio

log = logging.getLogger(__name__)


class _Refused(Exception):
    """Ends the suspect retry: the broker closed the connection at the message again."""

    def __init__(self, error: MiddlewareError) -> None:
        super().__init__(str(error))
        self.error = error


class _Late(Exception):
    """Ends the retry: no confirm within ``publish_timeout`` (not sent again)."""

    def __init__(self, error: ConfirmTimeout) -> None:
        super().__init__(str(error))
        self.error = error


class Publishing(ClientState):
    """Publishes within the window, confirmed, retried; a suspect sent again alone."""

    async def _publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool,
        block: bool,
        retry: bool,
        retry_nacked: bool = True,
    ) -> None:
        try:
            await self._publish_on_channel(message, confirm=confirm, block=block)
            return
        except RetryableError as exc:
            if refusal_code(exc):
                return await self._publish_suspect(message, exc, confirm=confirm, block=block)
            if (
                isinstance(exc, WindowFull | ConfirmTimeout)
                or (isinstance(exc, PublishNacked) and not retry_nacked)
                or not retry
                or self.settings.retry.attempts < 2
            ):
                raise
            log.debug("publish %s failed (%s); retrying under the policy", message.message_id, exc)
        # The hot path above builds no retry object; only a failed publish pays for tenacity.
        # A confirm that did not come within ``publish_timeout`` is not retried: the broker
        # holds the message (a queue without its quorum, a leader's node paused) and a
        # second send would only add a copy; the caller hears ``ConfirmTimeout`` then.
        retries = self.settings.retry.attempts - 1
        try:
            async for attempt in async_retrying(self.settings.retry, attempts=retries):
                with attempt:
                    try:
                        await self._publish_on_channel(message, confirm=confirm, block=block)
                    except ConfirmTimeout as late:
                        raise _Late(late) from late
                    except RetryableError as exc:
                        if not refusal_code(exc):
                            raise
                        return await self._publish_suspect(
                            message, exc, confirm=confirm, block=block
                        )
        except _Late as late:
            raise late.error from late.error.__cause__

    async def _publish_on_channel(
        self, message: OutgoingMessage, *, confirm: bool, block: bool
    ) -> None:
        """``_publish_once``; where the broker closed the confirm channel in answer to a
        frame (a 404 "no exchange", a 403, a 406: ``TopologyError``), the message is sent
        again alone (``_publish_alone``): another publish on that channel may be the one
        refused, and the broker drops every frame after it until the channel closes."""
        try:
            await self._publish_once(message, confirm=confirm, block=block)
        except TopologyError as refused:
            if not confirm:
                raise
            await self._publish_alone(message, refused)

    async def _publish_alone(self, message: OutgoingMessage, first: TopologyError) -> None:
        """``message`` on a confirm channel of its own: refused again, it is the one the
        broker refused, and its caller hears why; taken, it was another's refusal that
        closed the shared channel (until 2026-12-07 it failed with that error: a publish
        to an exchange that does not exist failed every publish then in flight on the
        client).  Sent twice at most, as any publish whose confirm was lost may be."""
        metrics.PUBLISH_ALONE.inc()

        async def alone(channel: aiormq.abc.AbstractChannel) -> None:
            await basic_publish(
                cast(aiormq.Channel, channel),
                message,
                mandatory=message.mandatory,
                confirm_within=self.settings.publish_timeout,
                wait=False,
            )

        async with self._window:
            live = await self._await_live()
            try:
                await on_channel_of(live, alone, confirms=True)
            except TimeoutError as exc:
                raise confirm_timeout(message, self.settings.publish_timeout) from exc
            except TopologyError as again:
                raise again from first
        self.confirmed += 1
        metrics.PUBLISHED_CONFIRMED.inc()

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
                        except ConfirmTimeout as late:  # bounded as a first send is
                            raise _Late(late) from late
                        except RetryableError as exc:
                            if refusal_code(exc):
                                raise _Refused(exc) from exc
                            raise
            except _Late as late:
                raise late.error from late.error.__cause__
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
                if isinstance(error, ConfirmTimeout):
                    metrics.CONFIRM_TIMEOUTS.inc()
                    error = confirm_timeout(message, self.settings.publish_timeout)
                with contextlib.suppress(Exception):  # repair is best effort; report `error`
                    if isinstance(error, TopologyError):
                        # the broker closed the channel (e.g. 404 exchange): the next gets a new one
                        await self._reopen_publish_channels(live)
                    elif isinstance(error, PublishNacked):
                        await self._replace_confirm_channel(live, channel)
                raise error from exc
        self.confirmed += 1
        metrics.PUBLISHED_CONFIRMED.inc()

    async def _resend_watched(self, message: OutgoingMessage, attempt: int) -> None:
        """An unconfirmed publish the broker refused, sent again (``WatchedReplies``)."""
        live = await self._await_live()
        await live.replies.send(message, attempt)

    async def _publish_channel(self, live: Live) -> aiormq.Channel:
        """aiormq's channel under the confirm publish channel, reopened if closed."""
        if live.confirm_channel.is_closed:
            await self._reopen_publish_channels(live)
        return cast(aiormq.Channel, await live.confirm_channel.get_underlay_channel())

    async def _replace_confirm_channel(self, live: Live, stale: AbstractChannel) -> None:
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
        self.nacks_renewed += 1
        renewed = self.nacks_renewed  # a full queue nacks often: 1st, 2nd, 4th... at info
        log.log(
            logging.INFO if renewed & (renewed - 1) == 0 else logging.DEBUG,
            "publish nacked on %s: continuing on a fresh channel (%d so far)",
            live.node,
            renewed,
        )
        loop = asyncio.get_running_loop()
        loop.call_later(
            self.settings.publish_timeout,
            lambda: None if stale.is_closed else asyncio.ensure_future(stale.close()),
        )

    async def _reopen_publish_channels(self, live: Live) -> None:
        """Replace closed publish channels; a dying connection is left to failover."""
        try:
            await self._open_publish_channels(live)
        except Exception as exc:
            raise translate_aio(exc) from exc

    async def _open_publish_channels(self, live: Live) -> None:
        if live.connection.is_closed:
            return
        if live.confirm_channel.is_closed:
            live.confirm_channel = await live.connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
