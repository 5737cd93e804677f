"""A matched event's copies, without I/O: what each copy's outcome takes, and the
receipts a match broker owes the router an event entered at.

A match broker puts one copy per subscriber queue (``delivery.CopySender`` does the
I/O); each copy has an outcome of its own, so one subscriber never costs another its
copy:

- ``DELIVERED``: the broker confirmed it (broker-confirmed subscriptions) or the
  subscriber's handler took it in time (e2e);
- ``TAKEN``: e2e, the receipt did not come within the hold, the subscriber's broker
  holds the copy (``confirms/pace.py``: that queue lags);
- ``GONE``: the queue does not exist (the subscriber deleted it): said, nothing more;
- ``DOWN``: the queue exists but its node is down (its copy was returned): the copy is
  carried by this cluster's routing master as an unreachable one is, and put into the
  queue once its node is back (the home's router holds it meanwhile);
- ``REFUSED``: the subscriber's handler rejected it: the event is dead-lettered with the
  reason, after the other copies went out;
- ``UNREACHABLE``: the home's RabbitMQ did not take it in time: the copy is carried by
  this cluster's routing master around the failed link (:class:`Carry`).

:func:`settle` turns the outcomes into effects in that order; a copy for a subscriber
whose home cluster left the ring is dead-lettered with ``HOME_LEFT`` (and, for an event
handled again, ``MAYBE_DELIVERED``: the departed cluster may have delivered it first).

:class:`MatchedReceipts`: an event that entered the ring at another cluster is kept by
that cluster's router until the match broker says it was matched; the ids are batched
per entry cluster and sent every ``every_s`` (a timer), in chunks.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..phoenix.effects import After, Count, Refuse, Send
from ..phoenix.ids import RoleId
from .messages import HOME_LEFT, MAYBE_DELIVERED, Matched

__all__ = [
    "Carry",
    "CopyOutcome",
    "Count",
    "Gone",
    "MatchedReceipts",
    "Outcome",
    "Refuse",
    "copy_id",
    "event_content",
    "settle",
]


class Outcome(enum.Enum):
    DELIVERED = "delivered"
    TAKEN = "taken"
    GONE = "gone"
    REFUSED = "refused"
    UNREACHABLE = "unreachable"
    DOWN = "down"


@dataclass(frozen=True, slots=True)
class CopyOutcome:
    outcome: Outcome
    reason: str = ""


def event_content(event_json: str) -> str:
    """An event's name for an e2e subscriber's duplicate check (``CONTENT_HEADER``):
    the same for every copy of one event, whichever match broker stamped it."""
    return hashlib.blake2b(event_json.encode(), digest_size=8).hexdigest()


def copy_id(event_id: str | None, queue: str) -> str | None:
    """One id per (event, queue), within 255 characters: a copy sent again (the event
    handled again after a match master's death) is suppressed by the subscriber's filter."""
    if event_id is None:
        return None
    return f"{event_id}:{hashlib.blake2b(queue.encode(), digest_size=8).hexdigest()}"


@dataclass(frozen=True, slots=True)
class Gone:
    """The subscriber's queue does not exist: say so."""

    home: str
    queue: str


@dataclass(frozen=True, slots=True)
class Carry:
    """Hand the copy to this cluster's routing master, which carries it to ``home``
    (``link``: because the way to ``home`` failed; not when the queue's node is down)."""

    home: str
    queue: str
    confirm: str
    reason: str
    link: bool = True


Effect = Count | Gone | Carry | Refuse


def settle(
    outcomes: Sequence[tuple[tuple[str, str], str, CopyOutcome]],
    departed: Sequence[str],
    again: bool,
) -> list[Effect]:
    """What the copies' outcomes take: ``outcomes`` as ((home, queue), confirm,
    outcome) in the order the copies went, ``departed`` the queues whose home left the
    ring (no copy went), ``again``: the event is handled again."""
    effects: list[Effect] = []
    for (home, queue), confirm, result in outcomes:
        effects.append(Count(f"copies_{result.outcome.value}"))
        if result.outcome is Outcome.GONE:
            effects.append(Gone(home, queue))
        elif result.outcome is Outcome.UNREACHABLE:
            effects.append(Carry(home, queue, confirm, result.reason))
        elif result.outcome is Outcome.DOWN:
            effects.append(Carry(home, queue, confirm, result.reason, link=False))
        if result.outcome in (Outcome.DELIVERED, Outcome.TAKEN):
            effects.append(Count("delivered"))
    why = [f"{HOME_LEFT}: {', '.join(departed)}"] if departed else []
    if departed and again:
        why[0] += f"; {MAYBE_DELIVERED}"
    if departed:
        effects.append(Count("home_departed", len(departed)))
    why += [r.reason for _, _, r in outcomes if r.outcome is Outcome.REFUSED]
    if why:
        effects.append(Refuse("; ".join(why)))
    return effects


@dataclass
class MatchedReceipts:
    """The ids of events matched here that entered at another cluster, per that
    cluster, until the next MATCHED to its router: one ``Send`` per chunk of ids, the
    next once the one before was sent (``sent``); a send that fails ends the others
    (the entry router keeps those events a while longer)."""

    cluster: str  # this match broker's: an event that entered here owes nobody
    every_s: float = 0.02
    chunk: int = 4096
    waiting: dict[str, list[str]] = field(default_factory=dict)
    #: the chunks not sent yet, by the ``then`` of the send before them
    rest: dict[tuple[str, int], list[list[str]]] = field(default_factory=dict)
    _rounds: int = 0

    def matched(self, hops: Sequence[str], event_id: str | None) -> list[After]:
        entry = hops[0] if hops else self.cluster
        if entry == self.cluster or event_id is None:
            return []
        waiting = self.waiting.setdefault(entry, [])
        waiting.append(event_id)
        return [After(self.every_s, entry)] if len(waiting) == 1 else []

    def due(self, entry: str) -> list[Send]:
        """The timer for ``entry`` fired: MATCHED to its router's control queue, the
        first chunk of ids (the others follow it)."""
        ids = self.waiting.pop(entry, [])
        if not ids:
            return []
        chunks = [ids[start : start + self.chunk] for start in range(0, len(ids), self.chunk)]
        self._rounds += 1
        then = (entry, self._rounds)
        self.rest[then] = chunks[1:]
        return [self._send(then, chunks[0])]

    def sent(self, then: tuple[str, int], error: str | None) -> list[Send]:
        """How the send of a chunk ended: the next chunk, unless it failed."""
        rest = self.rest.pop(then, [])
        if error is not None or not rest:
            return []
        self.rest[then] = rest[1:]
        return [self._send(then, rest[0])]

    def _send(self, then: tuple[str, int], ids: list[str]) -> Send:
        return Send(RoleId.router(then[0]), Matched(by=self.cluster, ids=ids), then=then)
