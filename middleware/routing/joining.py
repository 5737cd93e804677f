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
The count is a word too (an elected router may count fewer than told).  An open hold is
in the ring records (``store.hold_key``): a router elected meanwhile resumes it.  A timer
a quarter of the bound late (the router did not run) gives a quarter of the bound more:
what came meanwhile may wait unread behind it (``expired``).
While its match masters have not all answered, the previous owner says it is still
handing over (a ``handed_over`` without a count) every quarter of that bound, and each
such word starts the bound again: a previous owner behind with its own events (its match
masters hand over after the arc's events in their inboxes) is waited for, one gone not.

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

The previous owner's side is :class:`HandBack`: its routing master asks each of its match
masters to hand the arc over (a ``Send`` of HANDOVER to each), counts their answers
within a bound (``After``, keyed by request: then :meth:`HandBack.expired`), tells the
joiner's router how many (a ``Send`` of HANDED_OVER whose outcome comes back as
:meth:`HandBack.sent`; tried again after ``retry_s``, ``After`` keyed by ``("tell",
request)``, until ``handover_wait_s`` has passed: the link to a rejoining cluster may
still be connecting), then retires the match masters a take-over of the arc had added
(:class:`Retire`).  What each master sends is :func:`handover_plan`'s choice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ..phoenix.effects import After, Box, Count, Send
from ..phoenix.ids import RoleId
from .messages import HandedOver, Handover

T = TypeVar("T")

__all__ = [
    "Effect",
    "HandBack",
    "HandBackEffect",
    "HandedArcs",
    "Hold",
    "JoinHold",
    "NotHandedOver",
    "Release",
    "Retire",
    "handover_plan",
]


@dataclass(frozen=True, slots=True)
class Hold:
    """Hold the arc's events; call :meth:`JoinHold.expired` after ``bound_s``."""

    bound_s: float


@dataclass(frozen=True, slots=True)
class Release:
    """Let the arc's events go on: ``handed`` of ``expected`` (None: never told) were
    routed here, ``took_s`` after the start; ``timed_out``: by the bound."""

    handed: int
    expected: int | None
    took_s: float
    timed_out: bool


Effect = Hold | Release | After


class JoinHold:
    """One routing master's hold on its arc while it joins."""

    def __init__(self) -> None:
        self.holding = False
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
        as left, or it is listed as joining later and was never recorded as joined."""
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
        """The previous owner is still handing the arc over: the bound runs from now."""
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
        return [Release(self.handed, self.expected, now - self._since, timed_out=True)]

    def _complete(self, now: float) -> list[Effect]:
        if not self.holding or self.expected is None or self.handed < self.expected:
            return []
        self.holding = False
        return [Release(self.handed, self.expected, now - self._since, timed_out=False)]


# ------------------------------------------------------------- the previous owner's side


@dataclass(frozen=True, slots=True)
class NotHandedOver:
    """The masters did not all answer within the bound (``told``: False) or the count
    could not be told (``told``: True, ``error`` why); what was sent stays sent."""

    cluster: str
    count: int
    told: bool
    error: str = ""


@dataclass(frozen=True, slots=True)
class Retire:
    """The hand-over is done (``moved`` subscriptions): stop ``masters`` (owner names),
    the ones a take-over of ``cluster``'s arc had added, with their slaves."""

    cluster: str
    masters: tuple[str, ...]
    moved: int


HandBackEffect = Send | After | NotHandedOver | Retire


@dataclass
class _Round:
    cluster: str
    waiting: set[str]
    retiring: tuple[str, ...]
    count: int = 0
    tell_until: float | None = None  # set once the count is being told


@dataclass
class HandBack:
    """A previous owner's routing master handing a joiner's arc back.

    ``answer_s``: how long its match masters may take to answer (``read_timeout_s``);
    ``tell_s``: how long the count is tried on the joiner (``handover_wait_s``, the
    joiner's own hold; a quarter of it: how often the joiner hears, until they all
    answered, that the hand-over is under way); ``retry_s``: between tries;
    ``cluster``: the router's own; ``reply_to``: where its match masters answer (its
    process queue)."""

    answer_s: float
    tell_s: float
    retry_s: float = 0.1
    cluster: str = ""
    reply_to: str | None = None
    rounds: dict[str, _Round] = field(default_factory=dict)

    def start(
        self,
        request: str,
        cluster: str,
        arc: tuple[int, int],
        masters: Iterable[str],
        retiring: Iterable[str] = (),
    ) -> list[HandBackEffect]:
        """``cluster`` joined with ``arc``, which was this router's: every one of
        ``masters`` hands it over; ``retiring`` are stopped once that is done."""
        asked = tuple(masters)
        self.rounds[request] = _Round(cluster, set(asked), tuple(retiring))
        give = Handover(cluster=cluster, arc=arc, request=request, reply_to=self.reply_to)
        # each answers how many it sent; priority 0: behind the arc's events routed here
        # before the join (matched here with the subscriptions still held); none come
        # after it (forwarded to the joiner from now)
        effects: list[HandBackEffect] = [
            Send(RoleId.from_owner(owner), give, box=Box.INBOX, priority=0) for owner in asked
        ]
        return [*effects, After(self.answer_s, request), *self._under_way(request)]

    def answered(self, request: str, master: str, count: int, now: float) -> list[HandBackEffect]:
        """``master`` sent ``count``; the last answer starts telling the joiner."""
        held = self.rounds.get(request)
        if held is None or held.tell_until is not None or master not in held.waiting:
            return []  # late, or twice
        held.waiting.discard(master)
        held.count += count
        if held.waiting:
            return []
        held.tell_until = now + self.tell_s
        return [self._tell(request, held)]

    def expired(self, key: str | tuple[str, str]) -> list[HandBackEffect]:
        """A timer: the masters' bound passed (``key``: the request): if some never
        answered, the round ends here and the masters a take-over added stay (nothing of
        theirs is lost); or (``("tell", request)``) the count is to be told again; or
        (``("note", request)``) the joiner is to hear again that it is under way."""
        if isinstance(key, tuple):
            kind, request = key
            held = self.rounds.get(request)
            if held is None:
                return []
            if kind == "note":
                return [] if held.tell_until is not None else self._under_way(request)
            return [self._tell(request, held)]
        held = self.rounds.get(key)
        if held is None or held.tell_until is not None:
            return []
        del self.rounds[key]
        return [NotHandedOver(held.cluster, held.count, told=False)]

    def sent(self, request: str, error: str | None, now: float) -> list[HandBackEffect]:
        """How telling the count ended (``error``: None once told)."""
        return self.told(request) if error is None else self.tell_failed(request, error, now)

    def told(self, request: str) -> list[HandBackEffect]:
        held = self.rounds.pop(request, None)
        return [] if held is None else self._retire(held)

    def tell_failed(self, request: str, error: str, now: float) -> list[HandBackEffect]:
        """Telling failed: again after ``retry_s`` until ``tell_s`` has passed."""
        held = self.rounds.get(request)
        if held is None or held.tell_until is None:
            return []
        if now < held.tell_until:
            return [After(self.retry_s, ("tell", request))]
        del self.rounds[request]
        return [
            NotHandedOver(held.cluster, held.count, told=True, error=error),
            *self._retire(held),
        ]

    def _under_way(self, request: str) -> list[HandBackEffect]:
        """A ``handed_over`` without a count to the joiner's routing master (one bounded
        try: the next one follows), and the next in a quarter of its bound."""
        held, every = self.rounds[request], self.tell_s / 4
        if every <= 0:
            return []  # the joiner does not hold
        note = HandedOver(cluster=held.cluster, by=self.cluster, count=None)
        return [
            Send(RoleId.router(held.cluster), note, bound_s=every, missed="handover_notes_missed"),
            After(every, ("note", request)),
        ]

    def _tell(self, request: str, held: _Round) -> Send:
        """HANDED_OVER (the count) to the joiner's routing master; its outcome comes
        back as :meth:`sent`."""
        done = HandedOver(cluster=held.cluster, by=self.cluster, count=held.count)
        return Send(RoleId.router(held.cluster), done, priority=0, then=request)

    @staticmethod
    def _retire(held: _Round) -> list[HandBackEffect]:
        return [Retire(held.cluster, held.retiring, held.count)] if held.retiring else []


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
