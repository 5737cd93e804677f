"""A routing master's route, relay and carry loop as a machine, without I/O.

``RouterLogic`` says what one message takes at one router (its id, the latencyMap
entry to write, the next hop).  :class:`Forwarding` runs the loop around it:

- ``route``: a message from the client, the ring or a detour: the entries to write
  (``WriteEntry``), a duplicate the owner routed already dropped, then ``SendOn`` to
  the next cluster on the ring or a ``Send`` to this cluster's match master.  An event
  type of an arc being restored here (a departed cluster's, or this cluster's own while
  it joins) waits first (``WaitRestored``: the paper's buffer).
- the driver answers a ``SendOn`` with :meth:`Forwarding.sent` (the path the message
  took; none: the hop left the ring meanwhile): an event that entered the ring here is
  kept until its owner says it was matched (``KeptEvents``), one whose hop left is
  routed again from here.  The driver answers a ``Send`` to the match master with
  :meth:`Forwarding.to_match`: one that failed takes the id back and gives the message
  back (``GiveBack``), so it is routed when it comes again.
- ``relay``: a message on a detour goes on to the next hop of its path; if that hop left,
  it is routed (or carried) from here.
- ``copy``: a copy for a subscriber queue is put into the queue when its home is this
  cluster (``PutHere``), else carried toward the home's routing master; when the home
  left the ring it is dead-lettered with why (``Refuse``).
- ``left``: the events kept for a departed cluster go round again (``RouteAgain``).

The driver (``router_roles.RouterMaster``) performs the effects in order and feeds the
results back; it decides nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ..phoenix.effects import Count, GiveBack, Refuse, Send, Sent
from ..phoenix.protocol import MAX_PRIORITY
from ..phoenix.ring import Handover as Arc
from .messages import (
    HOME_LEFT,
    MAYBE_DELIVERED,
    Copy,
    Matched,
    Publish,
    RoutedMessage,
    Subscribe,
    Unsubscribe,
)
from .router import TO_MATCH, Forward, KeptEvents, RouterLogic, WriteEntry

__all__ = [
    "JOINING",
    "Count",
    "Effect",
    "Forwarding",
    "GiveBack",
    "Holds",
    "LinkReported",
    "Now",
    "Purpose",
    "PutHere",
    "Refuse",
    "RouteAgain",
    "SendOn",
    "WaitRestored",
    "WriteEntry",
]

#: the key of this cluster's own arc while it joins (no cluster id: they are words)
JOINING = "(joining)"

#: the arcs whose events wait now, by key (a departed cluster's id, or the join's)
Holds = Sequence[tuple[str, Arc]]


@dataclass(frozen=True, slots=True)
class Now:
    """The clocks an input comes with: ``wall`` (an event's entry stamp), ``mono``
    (how long an event is kept)."""

    wall: float
    mono: float


class Purpose(enum.Enum):
    ROUTE = "route"  # the ring's next hop
    RELAY = "relay"  # a detour's next hop
    CARRY = "carry"  # a copy toward its home's routing master


@dataclass(frozen=True, slots=True)
class SendOn:
    """Send ``message`` to ``cluster``'s routing master (over a detour when the direct
    link failed); answer with :meth:`Forwarding.sent` and the path it took."""

    cluster: str
    message: RoutedMessage | Copy
    priority: int
    purpose: Purpose
    #: the message as this router had it (routed again, or dead-lettered, from it)
    before: RoutedMessage | Copy
    held: bool = True  # whether an arc being restored holds it if it is routed again


@dataclass(frozen=True, slots=True)
class WaitRestored:
    """Wait until the arc held under ``key`` is restored, then answer with
    :meth:`Forwarding.restored`."""

    key: str
    message: RoutedMessage


@dataclass(frozen=True, slots=True)
class PutHere:
    """Put the copy into its subscriber queue on this cluster's RabbitMQ."""

    copy: Copy


@dataclass(frozen=True, slots=True)
class LinkReported:
    """A match broker of this cluster could not reach ``cluster``: the detours learn it."""

    cluster: str


@dataclass(frozen=True, slots=True)
class RouteAgain:
    """Route these events again (each through :meth:`Forwarding.route`), in the
    background: their owner or a cluster they passed left the ring."""

    departed: str
    events: list[Publish]


Effect = (
    Count
    | Refuse
    | GiveBack
    | WriteEntry
    | SendOn
    | Send
    | WaitRestored
    | PutHere
    | LinkReported
    | RouteAgain
)


class Forwarding:
    """One routing master's route/relay/carry decisions around its ``RouterLogic`` and
    the events it keeps until matched."""

    def __init__(self, logic: RouterLogic, kept: KeptEvents) -> None:
        self.logic, self.kept = logic, kept
        self.cluster = logic.cluster

    def route(
        self, message: RoutedMessage, now: Now, holds: Holds = (), *, held: bool = True
    ) -> list[Effect]:
        """A routed message (``held=False``: an arc being restored does not hold it: a
        subscription handed over for that very arc)."""
        if message.via:  # on a detour: pass it on toward the next hop of its path
            return self.relay(message, now, holds)
        entry = isinstance(message, Publish) and message.entered_at is None
        writes, forwarded = self.logic.accept(message, now.wall if entry else None)
        effects: list[Effect] = list(writes)
        if forwarded is None:
            if not writes:
                effects.append(Count("duplicates_dropped"))
            return effects
        return effects + self._step(forwarded, holds if held else (), held)

    def handed(self, message: Subscribe | Unsubscribe, now: Now, holds: Holds = ()) -> list[Effect]:
        """A subscription (or a removal) of the arc this cluster joins with, handed over by
        the previous owner: routed as any other, never held by the arc it is for, and at
        the top priority.  The arc's events are let go once these are routed, and one of
        a higher priority (its type's level as the entry router counted it) would
        otherwise pass a subscription in the match master's inbox and be matched
        without it."""
        return self.route(
            message.model_copy(update={"priority": MAX_PRIORITY}), now, holds, held=False
        )

    def sent(
        self, effect: SendOn, path: Sequence[str] | None, now: Now, holds: Holds = ()
    ) -> list[Effect]:
        """What the driver's send of ``effect`` took: the path (``effect.cluster``
        last), or None: that cluster left the ring meanwhile."""
        if effect.purpose is Purpose.CARRY:
            if path:
                return []
            copy = effect.before
            assert isinstance(copy, Copy)
            maybe = copy.unreachable or copy.publish.again
            return [
                Refuse(
                    f"{HOME_LEFT}: {copy.queue} (cluster {copy.home})"
                    + (f"; {MAYBE_DELIVERED}" if maybe else "")
                )
            ]
        if effect.purpose is Purpose.RELAY:
            if path:
                return []
            # the hop left the ring: the ring goes on from here
            again = effect.before.model_copy(update={"via": []})
            return [Count("rerouted"), *self._from_here(again, now, holds)]
        message = effect.message
        assert not isinstance(message, Copy)
        if not path:  # the next hop left the ring meanwhile: route again
            held = effect.held
            return [Count("rerouted"), *self._step(message, holds if held else (), held)]
        # the clusters it passes: if one leaves, so may the event (in its inbox)
        ring = self.logic.ring
        through = {*path, *ring.route(effect.cluster, message.event_type)}
        if self.kept.keep(message, ring.owner(message.event_type), now.mono, through=through):
            return [Count("kept_until_matched")]
        return []

    def to_match(self, sent: Sent) -> list[Effect]:
        """How a ``Send`` to this cluster's match master ended.  Not sent (its inbox's
        node down, a failover): the id is taken back, and the message handled goes back
        (``GiveBack``: tried again, then to this router's inbox), so that when it comes
        again it is routed, not dropped as one routed already; a message the broker
        refuses for itself is dead-lettered with why."""
        kind, message_id = sent.then
        if kind != TO_MATCH or sent.error is None:
            return []
        self.logic.forget(message_id)
        if sent.lasting:
            return [Refuse(f"not sent to the match master: {sent.error}")]
        return [Count("sends_given_back"), GiveBack(f"not sent to the match master: {sent.error}")]

    def restored(self, message: RoutedMessage, holds: Holds = ()) -> list[Effect]:
        """The arc that held ``message`` was restored: where it goes now (the take-over's
        plan routes it)."""
        return self._step(message, holds, True)

    def relay(self, message: RoutedMessage | Copy, now: Now, holds: Holds = ()) -> list[Effect]:
        """A message on a detour: on to the next hop of its path, or from here when the
        path names this cluster."""
        step = self.logic.relay(message)
        if not isinstance(step, Forward):
            return self._from_here(step, now, holds)
        return [
            Count("relayed"),
            SendOn(step.cluster, step.message, step.priority, Purpose.RELAY, message),
        ]

    def copy(self, message: Copy, now: Now, holds: Holds = ()) -> list[Effect]:
        """A copy for a subscriber queue: put here when its home is this cluster, else
        carried toward the home's routing master."""
        if message.via:
            return self.relay(message, now, holds)
        if message.home == self.cluster:
            return [PutHere(message)]
        effects: list[Effect] = [Count("copies_carried")]
        if message.unreachable and not message.hops:  # from a match broker of this cluster
            effects.append(LinkReported(message.home))
        onward = message.model_copy(update={"hops": [self.cluster]})
        effects.append(SendOn(message.home, onward, message.priority, Purpose.CARRY, message))
        return effects

    def matched(self, message: Matched, clusters: Sequence[str]) -> list[Effect]:
        """The owner matched these events: no longer kept here."""
        if message.by not in clusters:
            return [Refuse(f"matched: cluster {message.by!r} is not in the topology")]
        self.kept.matched(message.ids)
        return []

    def left(self, cluster: str) -> list[Effect]:
        """``cluster`` left the ring: what was kept for it (or passed it) goes round again."""
        again = self.kept.left(cluster)
        if not again:
            return []
        return [Count("rerouted_after_leave", len(again)), RouteAgain(cluster, again)]

    def _from_here(self, message: RoutedMessage | Copy, now: Now, holds: Holds) -> list[Effect]:
        if isinstance(message, Copy):
            return self.copy(message, now, holds)
        return self.route(message, now, holds)

    def _step(self, message: RoutedMessage, holds: Holds, held: bool) -> list[Effect]:
        step = self.logic.step(message)
        if isinstance(step, Forward):
            return [
                Count("forwarded"),
                SendOn(step.cluster, step.message, step.priority, Purpose.ROUTE, message, held),
            ]
        for key, arc in holds:  # an arc taken over, or this cluster's while it joins
            if arc.covers(message.event_type):
                return [Count("held_for_recovery"), WaitRestored(key, message)]
        return [Count("routed"), step]
