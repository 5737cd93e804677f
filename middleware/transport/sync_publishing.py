"""The publishes of a ``SyncClient`` (a part of it, ``sync.py``): confirmed one at a time,
or unconfirmed on the watched channel whose acks and nacks pika reads, and a message
the broker closed the connection at sent again alone to tell whether it is the culprit."""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.spec

from ..errors import (
    ConfirmTimeout,
    MessageRefused,
    MiddlewareError,
    PublishNacked,
    TopologyError,
)
from . import metrics
from .message import OutgoingMessage
from .policy import backoff_delay
from .sync_live import (
    ConfirmDeadline,
    SyncClientState,
    SyncLive,
    Watched,
    abandon,
    basic_publish,
    process_events,
)
from .translate import confirm_timeout, refusal_code, translate_sync
from .watch import Answer, WatchedChannel, missing_exchange

log = logging.getLogger(__name__)


class _Refused(MiddlewareError):
    """The broker closed the connection in answer to a publish: not retried under the
    policy (not a ``RetryableError``), handled by ``_publish_suspect``."""

    def __init__(self, error: MiddlewareError, code: int) -> None:
        super().__init__(str(error))
        self.error, self.code = error, code


class _Nacked(MiddlewareError):
    """A ``basic.nack`` the caller asked not to retry (``retry_nacked=False``): not a
    ``RetryableError``; ``error`` is what the caller hears."""

    def __init__(self, error: PublishNacked) -> None:
        super().__init__(str(error))
        self.error = error


class _Late(MiddlewareError):
    """No confirm within ``publish_timeout``: not retried under the policy (not a
    ``RetryableError``); ``error`` is what the caller hears."""

    def __init__(self, error: ConfirmTimeout) -> None:
        super().__init__(str(error))
        self.error = error


class SyncPublishing(SyncClientState):
    """Confirmed publishes one at a time, watched ones, and suspects sent alone."""

    def _publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool,
        retry: bool,
        within: float | None = None,
        retry_nacked: bool = True,
    ) -> None:
        if not confirm:
            self._call(functools.partial(self._watch, then=message))
            metrics.PUBLISHED_UNCONFIRMED.inc()
            return

        def send(live: SyncLive) -> None:
            channel = self._publish_channel(live)
            try:
                self._confirmed(live, channel, message, within)
            except _Late:
                raise
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
                    if not retry_nacked:
                        raise _Nacked(error) from exc
                raise

        try:
            self._call(send, attempts=None if retry else 1)
        except _Refused as first:
            self._publish_suspect(message, first.error, confirm=confirm)
            return
        except _Late as late:
            metrics.CONFIRM_TIMEOUTS.inc()
            raise late.error from None
        except _Nacked as nacked:
            raise nacked.error from None
        metrics.PUBLISHED_CONFIRMED.inc()

    def _confirmed(
        self,
        live: SyncLive,
        channel: blocking.BlockingChannel,
        message: OutgoingMessage,
        within: float | None = None,
    ) -> None:
        """One confirmed publish, its wait bounded by ``within`` (default
        ``publish_timeout``): past it the channel is abandoned and ``_Late`` raised (not
        sent again, as the asyncio core)."""
        bound = self.settings.publish_timeout if within is None else within
        deadline = ConfirmDeadline(live.connection, channel, bound)
        try:
            basic_publish(channel, message, confirm=True)
        except Exception:
            if deadline.passed:
                abandon(channel)
                named = "publish_timeout" if within is None else "the call's bound"
                raise _Late(confirm_timeout(message, bound, bound=named)) from None
            raise
        finally:
            deadline.cancel()

    def _publish_channel(self, live: SyncLive) -> blocking.BlockingChannel:
        channel = live.confirm_channel  # (closing: abandoned after a confirm timeout)
        return channel if channel.is_open else self._reopen_channel(live)

    def _send_watched(
        self, live: SyncLive, *, message: OutgoingMessage, attempt: int = 1
    ) -> Watched:
        """An unconfirmed publish on the watched channel (``watch.py``): the caller goes
        on; the broker's answer is read with the connection's other frames."""
        holder = self._watched(live)
        tag = holder.ledger.next_tag()
        basic_publish(holder.channel, message, confirm=False)
        holder.ledger.sent(tag, message, attempt)
        return holder

    def _watched(self, live: SyncLive) -> Watched:
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

    def _open_watched(self, connection: pika.BlockingConnection) -> Watched:
        channel = connection.channel()
        policy = self.settings.retry
        holder = Watched(
            channel, WatchedChannel(attempts=policy.attempts, delay=backoff_delay(policy))
        )
        selected: list[bool] = []
        channel._impl.confirm_delivery(
            ack_nack_callback=lambda frame: holder.answers.append(frame.method),
            callback=lambda _frame: selected.append(True),
        )
        channel._flush_output(lambda: bool(selected))
        return holder

    def _watch(self, live: SyncLive, then: OutgoingMessage | None = None) -> None:
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

    def _settle_watched(self, live: SyncLive) -> None:
        """Before a close: read the broker's answers to what the watched channel owes and
        send again what it refused, until nothing is owed or ``close_grace`` is over
        (before, a refused publish waiting for its resend was dropped by the close).
        What is then still to be sent again is given up, counted and logged."""
        deadline = time.monotonic() + self.settings.close_grace
        try:
            while self._owed(live) and time.monotonic() < deadline:
                process_events(live, time_limit=0.02)
                self._watch(live)
        except Exception as exc:  # the connection went: what it owed is the caller's
            log.info("closing: the watched channel could not settle: %s", exc)
        if self._resends:
            metrics.UNCONFIRMED_GIVEN_UP.inc(len(self._resends))
            log.warning(
                "closing: %d refused unconfirmed publish(es) not sent again within "
                "close_grace (%.1f s): %s",
                len(self._resends),
                self.settings.close_grace,
                ", ".join(str(m.message_id) for _, m, _ in self._resends),
            )
            self._resends = []

    def _owed(self, live: SyncLive) -> int:
        """Unconfirmed publishes without the broker's answer, and refused ones to send
        again."""
        holders = (live.replies, *live.retired)
        return sum(h.ledger.owed for h in holders if h.channel.is_open) + len(self._resends)

    def _act(self, live: SyncLive, answer: Answer) -> None:
        now = time.monotonic()
        for message, why in answer.reasons():
            metrics.UNCONFIRMED_GIVEN_UP.inc()
            log.warning("unconfirmed publish %s %s: not sent again", message.message_id, why)
        for resend in answer.resend:
            metrics.UNCONFIRMED_RESENT.inc()
            self._resends.append((now + resend.delay, resend.message, resend.attempt))

    def _publish_suspect(
        self, message: OutgoingMessage, first: MiddlewareError, *, confirm: bool
    ) -> None:
        """As the asyncio core: the broker closed the connection in answer to a frame;
        one retry, known taken; closed at it again: ``MessageRefused``."""
        metrics.PUBLISH_SUSPECTS.inc()

        def send(live: SyncLive) -> None:
            try:
                if confirm:  # bounded as a first send is (``_Late``)
                    self._confirmed(live, self._publish_channel(live), message)
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
        except _Late as late:
            metrics.CONFIRM_TIMEOUTS.inc()
            raise late.error from None
        except _Refused as again:
            metrics.PUBLISH_REFUSED.inc()
            raise MessageRefused(
                f"message {message.message_id}: the broker closed the connection in answer "
                f"to it twice ({first}; then {again.error}); it is not sent again",
                reply_code=again.code,
            ) from again.error
        (metrics.PUBLISHED_CONFIRMED if confirm else metrics.PUBLISHED_UNCONFIRMED).inc()
