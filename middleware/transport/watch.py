"""Publishes the caller did not wait for, still watched by the layer (no I/O here).

RabbitMQ drops an unconfirmed publish without a word when a queue refuses it, and a
channel whose first publish to a quorum queue falls inside that queue's leader election
keeps refusing the queue (RabbitMQ 3.10: the channel's queue client never registered
with a leader, so it rejects every later publish to that queue until the old leader's
node is back).  A client that fails over lands exactly there: its new channels open
while the queues it publishes to elect new leaders.  With publisher confirms the refusal
is a ``basic.nack`` and the client moves to a fresh channel; without them it is silence.

So the channel that carries the layer's unconfirmed publishes (e2e messages and their
resends, receipts, beats, reports) runs in confirm mode too.  The caller does not wait
for the broker's answer; the layer does, here: each watched publish is kept, by delivery
tag, until the broker acks it.  A nack (or the channel closing under a live connection)
sends it again on a fresh channel after the retry policy's backoff, at most
``retry.attempts`` sends in all; a nack on the channel in use also retires that channel.
What a lost *connection* still owed is the caller's to resend, as without confirms (the
e2e publisher resends everything on failover).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from .message import OutgoingMessage

__all__ = ["Answer", "Resend", "WatchedChannel", "missing_exchange"]


@dataclass(frozen=True, slots=True)
class Resend:
    """Send ``message`` again (its ``attempt``-th send) after ``delay`` seconds."""

    message: OutgoingMessage
    attempt: int
    delay: float


@dataclass(frozen=True, slots=True)
class Answer:
    """What the broker's answer calls for: sends to repeat, whether the channel must be
    replaced (it refused a publish), and messages given up (every attempt refused, or
    ``no_exchange``: sent to an exchange that does not exist, never sent again)."""

    resend: tuple[Resend, ...] = ()
    retire_channel: bool = False
    given_up: tuple[OutgoingMessage, ...] = ()
    no_exchange: tuple[OutgoingMessage, ...] = ()

    def reasons(self) -> list[tuple[OutgoingMessage, str]]:
        """Each message given up, with why, for one log line each."""
        return [(m, "refused by the broker on every attempt") for m in self.given_up] + [
            (m, f"sent to exchange {m.exchange!r}, which does not exist") for m in self.no_exchange
        ]


NOTHING = Answer()


@dataclass
class WatchedChannel:
    """The unconfirmed publishes one confirm-mode channel still owes an answer for.

    Delivery tags follow the broker's numbering (1, 2, … per channel after
    ``confirm.select``); ``delay(n)`` is the backoff before the n-th send.
    """

    attempts: int
    delay: Callable[[int], float]
    current: bool = True  # False once retired: its nacks no longer retire anything
    _out: dict[int, tuple[OutgoingMessage, int]] = field(default_factory=dict)
    _last_tag: int = 0

    def sent(self, tag: int, message: OutgoingMessage, attempt: int = 1) -> None:
        """``message`` left on this channel with ``tag`` (its ``attempt``-th send)."""
        self._out[tag] = (message, attempt)
        self._last_tag = max(self._last_tag, tag)

    def next_tag(self) -> int:
        """The tag the broker gives the next publish on this channel."""
        return self._last_tag + 1

    @property
    def owed(self) -> int:
        """Publishes still without the broker's answer."""
        return len(self._out)

    def answered(self, tag: int, *, multiple: bool, ok: bool) -> Answer:
        """The broker acked (``ok``) or nacked ``tag`` (and every earlier one if
        ``multiple``)."""
        tags = [t for t in self._out if t <= tag] if multiple else [tag]
        settled = [self._out.pop(t) for t in tags if t in self._out]
        if ok or not settled:
            return NOTHING
        retire, self.current = self.current, False
        return self._again(settled, retire=retire)

    def closed(self, missing_exchange: str | None = None) -> Answer:
        """The channel closed under a live connection: everything it owed goes again,
        but for publishes to ``missing_exchange`` (the broker closed the channel because
        that exchange does not exist: sending them again would only close the next)."""
        settled, self._out = list(self._out.values()), {}
        self.current = False
        doomed = tuple(m for m, _ in settled if m.exchange == missing_exchange)
        answer = self._again(
            [(m, a) for m, a in settled if m.exchange != missing_exchange], retire=False
        )
        return Answer(answer.resend, False, answer.given_up, doomed) if doomed else answer

    def forget(self) -> list[OutgoingMessage]:
        """The connection is gone: hand back what was owed (the caller's to resend)."""
        owed, self._out = [m for m, _ in self._out.values()], {}
        self.current = False
        return owed

    def _again(self, settled: list[tuple[OutgoingMessage, int]], *, retire: bool) -> Answer:
        resend, given_up = [], []
        for message, attempt in settled:
            if attempt >= self.attempts:
                given_up.append(message)
            else:
                resend.append(Resend(message, attempt + 1, self.delay(attempt)))
        return Answer(tuple(resend), retire, tuple(given_up))


_NO_EXCHANGE = re.compile(r"no exchange '(.*)' in vhost")


def missing_exchange(reason: object) -> str | None:
    """The exchange a channel-close reason says does not exist (RabbitMQ's 404 text
    ``NOT_FOUND - no exchange 'x' in vhost '/'``), or None."""
    found = _NO_EXCHANGE.search(str(reason))
    return found.group(1) if found else None
