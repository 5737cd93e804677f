"""A cluster joining the ring holds its arc's events for the hand-over, without I/O.

When a cluster joins (or rejoins) the ring, the other routing masters send it its arc's
events as soon as they hear the join, while the previous owner's match masters are still
sending it the arc's subscriptions (those made while it was away among them, and the
ones removed meanwhile).  An event matched before they are all there would miss them.
So the joining cluster's routing master holds its arc's events from its start until the
previous owner's routing master has said how many it sent (``handed_over``) and that many
were routed here, or until a bound passes (``handover_wait_s``) with no word from it.
The bound runs from the join's announcement (``phoenix join`` tells the joiner's router
last, to its control queue, once all the joiner's roles serve: on a busy machine more
than the bound after the router's start), at most ``announce_s`` from the start without
one (its announcer died: the others route nothing of the arc here then).
The previous owner's count is a word too: a router elected after its predecessor routed
some of the hand-over counts fewer than told, and lets go a bound after the count.
The hold is recorded while it is open (``store.hold_key``, written by the driver before
the inbox is consumed): a router elected or restarted meanwhile resumes it as announced
(the others route the arc here already), although its cluster is recorded as joined.
A timer more than a quarter of the bound late (the router did not run) gives a quarter
of the bound more: what came meanwhile may wait unread behind it (``expired``).
While its match masters have not all answered, the previous owner says it is still
handing over (a ``handed_over`` without a count) every quarter of that bound, and each
such word starts the bound again: a previous owner behind with its own events (its match
masters take the hand-over after the arc's events already in their inboxes) is waited
for, one gone is not.

The router's driver (``router_roles.py``) feeds it what happened with the time — its start with
the ring record it read of itself, each hand-over message routed, the count told, the
bound passed — and performs what it returns: :class:`Hold` (hold the arc's events, and
call :meth:`JoinHold.expired` after ``bound_s``), ``After`` (call it again then: a word
came meanwhile) and :class:`Release` (let them go on, with what to log).

A match master that handed an arc over keeps it in :class:`HandedArcs`: an event, a
subscribe or an unsubscribe of the arc that reaches it afterwards was routed by a
routing master that had not heard of the join (one stopped across it and resumed before
it was fenced routes the deliveries it held with its old ring) and is passed on to the
joiner's routing master, never matched here without the subscriptions handed over.

The previous owner's side, asking its match masters and telling the joiner, is
``handback.HandBack``; what each master sends is :func:`handover_plan`'s choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from ..phoenix.effects import After, Box, Count, Send
from ..phoenix.ids import RoleId

T = TypeVar("T")

__all__ = [
    "Effect",
    "HandedArcs",
    "Hold",
    "JoinHold",
    "Release",
    "handover_plan",
]


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold the arc's events; call :meth:`JoinHold.expired` after ``bound_s``."""

    bound_s: float


@dataclass(frozen=True, slots=True)
class Release:
    """Let the arc's events go on: ``handed`` of ``expected`` (None: never told) were
    routed here, ``took_s`` after the start; ``timed_out``: by the bound; ``resumed``:
    a hold this router resumed, which ends by the bound as announced (what was routed
    before it started is not in its count)."""

    handed: int
    expected: int | None
    took_s: float
    timed_out: bool
    resumed: bool = False

    def said(self) -> tuple[int, str]:
        """What the driver logs: its level, and the words after the router's name (a
        warning only where some of the hand-over may be missing)."""
        if not self.timed_out:
            return logging.INFO, (
                f"the arc's hand-over is here ({self.handed} subscriptions); its events "
                f"go on, {self.took_s:.3f} s after the start"
            )
        if self.resumed:  # the way a resumed hold ends
            return logging.INFO, (
                "the resumed hold let go one bound after the previous owner's last word, "
                f"{self.took_s:.1f} s after it resumed ({self.handed} routed here since): "
                "its events go on"
            )
        routed = f"{self.handed} of {self.expected} routed"
        if self.expected is None:
            routed = f"{self.handed} routed, no count came: a resumed hand-back sends none"
        return logging.WARNING, (
            f"the arc's hand-over not all here after {self.took_s:.1f} s ({routed}): "
            "its events go on"
        )


Effect = Hold | Release | After


class JoinHold:
    """One routing master's hold on its arc while it joins."""

    def __init__(self) -> None:
        self.holding = False
        self.resumed = False  # the hold of a router before this one, taken up
        self.handed = 0  # hand-over messages routed here
        self.expected: int | None = None  # the previous owner's count
        self.bound_s = 0.0
        self.announce_s = 0.0  # the longest hold without the join's announcement
        self._since = 0.0
        self._word: float | None = None  # the announcement, or the previous owner's word
        self._excused_until = 0.0  # a late timer excused the silence until then

    @staticmethod
    def joins(recorded: str | None, listed_as_joined: bool) -> bool:
        """Whether a router starting now joins the ring: the routers recorded its cluster
        as left, or it is listed as joining later and was never recorded as joined (a
        router promoted after the join finds "joined": it holds only if the hold's own
        record is open, ``resumed``)."""
        return recorded == "left" or (recorded is None and not listed_as_joined)

    def start(
        self,
        *,
        recorded: str | None,
        listed_as_joined: bool,
        bound_s: float,
        clusters: int,
        now: float,
        announce_s: float = 0.0,
        resumed: bool = False,
    ) -> list[Effect]:
        """The router starts, with the ring record of its own cluster (its ``state``);
        ``announce_s``: the longest hold before the join is announced here (at least the
        bound); ``resumed``: the record of a hold another router did not release."""
        joins = self.joins(recorded, listed_as_joined)
        if not (joins or resumed) or bound_s <= 0 or clusters < 2:
            return []
        self.holding, self._since, self.bound_s = True, now, bound_s
        self.resumed = not joins
        self.announce_s = max(announce_s, bound_s)
        self._word = None if joins else now  # recorded as joined: announced already
        return [Hold(bound_s)]

    def announce(self, now: float) -> list[Effect]:
        """The join was announced here: the others route the arc here from now, and the
        bound runs from now (a timer of its own: the one armed at the start may be later)."""
        if not self.holding:
            return []
        self._word = now
        return [After(self.bound_s, "join")]

    def routed(self, now: float) -> list[Effect]:
        """One hand-over message (a subscription, or a removal) was routed here."""
        self.handed += 1
        return self._complete(now)

    def told(self, count: int, now: float) -> list[Effect]:
        """The previous owner's routing master: ``count`` were sent (a word, too)."""
        self.expected = count
        if self.holding:
            self._word = now
        return self._complete(now)

    def noted(self, now: float) -> list[Effect]:
        """The previous owner's routing master is still handing the arc over: the bound
        runs from now."""
        if self.holding:
            self._word = now
        return []

    def expired(self, now: float) -> list[Effect]:
        """The bound passed (since the start, or the last word, when there was one);
        before the announcement, ``announce_s`` from the start."""
        if not self.holding:
            return []
        if self._word is not None:
            deadline = self._word + self.bound_s
        else:
            deadline = self._since + self.announce_s
        deadline = max(deadline, self._excused_until)
        if (left := deadline - now) > 0:
            return [After(left, "join")]
        late_s = self.bound_s / 4
        if now - deadline > late_s:
            # late: this router did not run (a busy machine, a stop), and a word, the
            # count or the subscriptions may wait unread: a quarter of the bound more
            self._excused_until = now + late_s
            return [After(late_s, "join")]
        self.holding = False
        took_s = now - self._since
        return [Release(self.handed, self.expected, took_s, timed_out=True, resumed=self.resumed)]

    def _complete(self, now: float) -> list[Effect]:
        if not self.holding or self.expected is None or self.handed < self.expected:
            return []
        self.holding = False
        return [Release(self.handed, self.expected, now - self._since, timed_out=False)]


@dataclass(frozen=True)
class HandoverPlan(Generic[T]):
    """What one match master sends a joiner: the arc's subscriptions it holds (removed
    here once sent) and the removals it remembers of the arc (forgotten once sent)."""

    subscriptions: list[tuple[str, T]]
    removals: list[tuple[str, str]]  # (subscription id, event type)


def handover_plan(
    held: Iterable[tuple[str, T]],
    removed: Mapping[str, str],
    covers: Callable[[str], bool],
) -> HandoverPlan[T]:
    """The subscriptions (``held``: id and record, already of the arc) and the removals
    (``removed``: id -> event type) to hand over for an arc whose event types ``covers``."""
    return HandoverPlan(
        list(held), [(sid, event_type) for sid, event_type in removed.items() if covers(event_type)]
    )


class HandedArcs:
    """The arcs one match master handed over, by joiner, each as its ``covers`` test."""

    MAX_TYPES = 65536  # event types whose answer is kept (then forgotten, all at once)

    def __init__(self) -> None:
        self._arcs: dict[str, Callable[[str], bool]] = {}
        self._types: dict[str, str | None] = {}  # event type -> the joiner it went to

    def handed(self, joiner: str, covers: Callable[[str], bool]) -> None:
        self._arcs[joiner] = covers
        self._types.clear()

    def left(self, cluster: str) -> None:
        """``cluster`` left the ring: its arc is no longer passed on to it (the take-over
        of the arc brings its subscriptions here, or to whom the ring gives it)."""
        if self._arcs.pop(cluster, None) is not None:
            self._types.clear()

    def joiner(self, event_type: str) -> str | None:
        """The joiner that holds ``event_type``'s subscriptions now (None: not handed)."""
        if not self._arcs:
            return None
        if event_type not in self._types:
            if len(self._types) >= self.MAX_TYPES:
                self._types.clear()
            self._types[event_type] = next(
                (joiner for joiner, covers in self._arcs.items() if covers(event_type)), None
            )
        return self._types[event_type]

    def pass_on(self, message: Any) -> list[Send | Count]:
        """A routed message (an event, a subscribe, an unsubscribe) to the inbox of the
        routing master of the joiner its type went to, at its priority; none when its
        type was not handed over."""
        joiner = self.joiner(message.event_type)
        if joiner is None:
            return []
        to = RoleId.router(joiner)
        return [
            Count("passed_on_after_handover"),
            Send(to, message, box=Box.INBOX, priority=message.priority),
        ]
