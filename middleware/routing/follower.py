"""A slave following its master, without I/O: the failure detector over the master's
beats, the rule of two looks, the bully election among the master's slaves, which reign
of the master it trusts (fencing), and when it takes over.

The slave's driver (``holding.py``) feeds it what happened with the time — a look at the
master (every half beat interval, with how late the look came), the master's lease
returned, a beat, a vote of a peer, the operator's take-over — and performs what it
returns: ``Signal`` (a vote to a peer, or a fence telling an older reign's process to
step down), :class:`StopServing` (retired by its master: another process serves the
role), :class:`Promote` (serve the master's role next, under a reign),
:class:`Suspected` and :class:`Elected` (the detection and election times, for the log
and the metrics), ``Count``, :class:`Leader` (another slave serves the master now) and
``Refuse`` (dead-letter the input with the reason; ``Signal``, ``Count`` and ``Refuse``
are shared: ``phoenix/effects.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..phoenix.effects import DUE_MARGIN_S, Count, Refuse, Signal
from ..phoenix.ids import RoleId
from ..phoenix.protocol import Kind
from ..recovery import Become, Bully, BullyState, FailureDetector
from ..recovery import Send as Ballot
from ..recovery.fencing import Reign, Trust, Verdict
from .messages import Fence, Vote

__all__ = [
    "Count",
    "Effect",
    "Elected",
    "Follower",
    "Leader",
    "NameLease",
    "Promote",
    "Refuse",
    "Signal",
    "StopServing",
    "Suspected",
    "retire",
]


@dataclass(frozen=True, slots=True)
class Promote:
    """Serve the master's role next, under ``reign`` (``why``: for the log)."""

    why: str
    reign: Reign


@dataclass(frozen=True, slots=True)
class Suspected:
    """The master is taken for failed after ``silent_s``: by its ``beats`` stopping, or
    its ``lease`` coming back (its connection closed)."""

    silent_s: float
    by: str


@dataclass(frozen=True, slots=True)
class Elected:
    """This slave won the election, ``took_s`` after it began."""

    took_s: float


@dataclass(frozen=True, slots=True)
class Leader:
    """``slave`` won the election: it serves the master's role now."""

    slave: RoleId


@dataclass(frozen=True, slots=True)
class StopServing:
    """Its master counts another process as serving this slave: this one stops for good
    (a clean stop: its lease is given back, so nobody elects or replaces)."""

    by: str


@dataclass(frozen=True, slots=True)
class NameLease:
    """The master's beat names its lease queue: watch it (its return is the master's
    death)."""

    lease: str


Effect = Signal | Promote | Suspected | Elected | Count | Leader | NameLease | StopServing | Refuse


_KINDS = {
    "election": Kind.ELECTION,
    "answer": Kind.ELECTION_ANSWER,
    "coordinator": Kind.COORDINATOR,
}


class Follower:
    """One slave's view of its master, from the first look on (a slave that starts before
    its master must not elect against a master still starting: it is watched from its
    first beat)."""

    def __init__(
        self,
        me: RoleId,
        peers: list[RoleId],
        *,
        interval_s: float,
        misses: int,
        ceiling_s: float,
        trust: Trust,
        failed_at: float | None = None,
    ) -> None:
        self.me, self.master = me, me.master
        self.interval_s = interval_s
        self.detector = FailureDetector[RoleId](interval_s, misses, ceiling_s)
        self.bully = Bully(
            me=me, peers=peers, answer_s=2 * interval_s, coordinator_s=misses * interval_s
        )
        self.trust = trust
        #: when (monotonic) the failed master was last heard: handed to the master it
        #: may become, for the recovery log
        self.failed_at = failed_at
        #: when this slave began the election it may win
        self.electing_since: float | None = None
        #: the reign it serves the master's role under once it won
        self.next_reign: Reign | None = None
        self.promoted = False
        self._first_look: float | None = None  # the first of two looks that suspect
        #: its master's last beat heard came at the quiet pace (``Beat.next_s``): this
        #: slave's own beats may be quiet too
        self.master_quiet = False

    # ------------------------------------------------------------------ inputs
    def look(self, now: float, late_s: float) -> list[Effect]:
        """A look at the master, ``late_s`` after it was due.  The master is taken for
        failed at the second look in a row that finds it silent: a slave that was itself
        paused (a look late by more than a beat interval) looks again once the beats
        waiting in its socket had their turn — one late look is no proof of a death."""
        effects: list[Effect] = []
        suspected = self.master in self.detector.suspects(now)
        if not suspected or late_s > self.interval_s:
            self._first_look = None
        elif self._first_look is None:
            self._first_look = now
        elif self.bully.state is BullyState.IDLE:
            effects += self._suspected(now, "beats")
        return effects + self._enact(self.bully.tick(now), now)

    def next_look_in(self, now: float) -> float:
        """How long the driver may wait before its next :meth:`look`: half a beat
        interval while a first look suspects the master or an election runs (their
        timers are these looks); else until the master would be suspected if nothing
        came meanwhile (a beat only moves that later), and at most half the detection
        floor (the timeout a busy spell lengthened may shorten again).  A slave whose
        master beats looks twice a second instead of every half interval."""
        step = self.interval_s / 2
        if self._first_look is not None or self.bully.state is not BullyState.IDLE:
            return step
        cap = self.detector.timeout_s / 2
        due = self.detector.suspect_at(self.master)
        if due is None:  # not watched before its first beat: no look can suspect it
            return cap
        return max(0.0, min(cap, due - now + DUE_MARGIN_S))

    def lease_returned(self, now: float) -> list[Effect]:
        """The master's connection closed: it is gone (a frozen master keeps it)."""
        self.detector.lost(self.master)
        if self.bully.state is not BullyState.IDLE:
            return []
        return self._suspected(now, "lease")

    def beat(
        self,
        sender: str,
        reign: Reign,
        reply_to: str | None,
        lease: str | None,
        *,
        stale: bool,
        now: float,
        next_s: float | None = None,
    ) -> list[Effect]:
        """A beat from ``sender`` naming its ``lease``; ``stale``: sent before that
        lease's connection closed; ``next_s``: the master is quiet, its next beat comes
        within that (``Beat.next_s``)."""
        if sender != self.master.owner:
            return [Refuse(f"beat from {sender!r}, not {self.me}'s master")]
        if self.trust.judge(reign) is Verdict.FENCE:
            # a master of an older reign is serving (it was frozen past the timeout, or
            # came back): its beat is not heard, and it is told to step down
            fence = [Signal(reply_to, self.fence())] if reply_to else []
            return [Count("fences_sent"), *fence]
        if stale:
            return []  # no sign of life
        self.detector.watch([self.master], now)
        self.detector.heard(self.master, now)
        self.detector.announced(self.master, next_s)
        self.master_quiet = next_s is not None
        self.bully.master_heard()
        return [NameLease(lease)] if lease is not None else []

    def vote(self, sender_owner: str, kind: Kind, reign: Reign, now: float) -> list[Effect]:
        """A peer's ELECTION, ANSWER or COORDINATOR."""
        try:
            sender: RoleId | None = RoleId.from_owner(sender_owner)
        except ValueError:
            sender = None
        if sender is None or sender not in self.bully.peers:
            return [Refuse(f"{kind.value} from {sender_owner!r}, not a peer of {self.me}")]
        if kind is Kind.ELECTION:
            if self.electing_since is None:  # an election another slave began: its phases
                self.electing_since = now  # are timed here too, should this one win
                silent = self.detector.silent_for(self.master, now)
                if self.failed_at is None and silent is not None:
                    self.failed_at = now - silent
            return self._enact(self.bully.on_election(sender, now), now)
        if kind is Kind.ELECTION_ANSWER:
            return self._enact(self.bully.on_answer(sender, now), now)
        if reign.slave != sender.slave or reign.epoch == 0:
            return [Refuse(f"coordinator from {sender} claims {reign}, not its own win")]
        if self.trust.judge(reign) is Verdict.FENCE:
            why = f"coordinator from {sender} of {reign}, older than {self.trust.reign}"
            return [Count("stale_coordinators"), Refuse(why)]
        self.bully.on_coordinator(sender, now)
        self.electing_since = None  # the election is over: another slave won it
        # the new master beats once it switched role, then reads its tables back and
        # collects its heap (every thread held, its beats too): time for all of it
        self.detector.grace(self.master, now + max(2 * self.detector.timeout_s, 2.0))
        return [Leader(sender)]

    def retire(self, sender: str, slave: str, reign: Reign) -> list[Effect]:
        """Its master tells the process serving ``slave`` to stop (:func:`retire`)."""
        return retire(self.me, self.trust.reign, sender, slave, reign, promoted=self.promoted)

    def take_over(self) -> list[Effect]:
        """The operator told this slave to serve its master's role: as an election's
        winner, it tells the other slaves first, so none of them elects against it once
        the old master is silent."""
        reign = self.winning_reign()
        self.promoted = True
        self.bully.state = BullyState.WON
        return [Signal(peer, self.vote_of(Kind.COORDINATOR, reign)) for peer in self.bully.peers]

    def vote_of(self, kind: Kind, reign: Reign | None = None) -> Vote:
        """This slave's vote of ``kind`` (a COORDINATOR names the reign it won)."""
        if kind is not Kind.COORDINATOR:
            return Vote(kind=kind, broker=self.me.owner)
        reign = reign or self.winning_reign()
        return Vote(kind=kind, broker=self.me.owner, epoch=reign.epoch, by=reign.by)

    def fence(self) -> Fence:
        """What tells an older reign's master that this slave trusts a newer one."""
        return Fence(broker=self.me.owner, epoch=self.trust.reign.epoch, by=self.trust.reign.by)

    def winning_reign(self) -> Reign:
        """The reign this slave serves under when it wins (fixed at the first ask)."""
        if self.next_reign is None:
            self.next_reign = self.trust.successor(self.me.slave)
        return self.next_reign

    # ----------------------------------------------------------------- inside
    def _suspected(self, now: float, by: str) -> list[Effect]:
        silent = self.detector.silent_for(self.master, now) or 0.0
        self.failed_at, self.electing_since = now - silent, now
        return [Suspected(silent, by), *self._enact(self.bully.master_suspected(now), now)]

    def _enact(self, effects: list[Ballot | Become], now: float) -> list[Effect]:
        out: list[Effect] = []
        for effect in effects:
            if isinstance(effect, Become):
                if self.promoted:
                    continue
                if self.electing_since is not None:  # the election: its start to this win
                    out.append(Elected(now - self.electing_since))
                self.promoted = True
                out.append(Promote("elected: its master went silent", self.winning_reign()))
                continue
            out.append(Signal(effect.to, self.vote_of(_KINDS[effect.what])))
        return out


def retire(
    me: RoleId, trusted: Reign, sender: str, slave: str, reign: Reign, *, promoted: bool
) -> list[Effect]:
    """The master ``sender`` (of ``reign``) tells the process serving ``slave`` to stop:
    another process serves it.  From another sender, for another role, or from an older
    reign than the one ``trusted`` (a master that was frozen and has not stepped down
    yet): refused, nothing stops.  A slave already promoted serves the master's role
    next: nothing stops either."""
    if sender != me.master.owner or slave != me.owner:
        return [Refuse(f"retire of {slave!r} from {sender!r}: not {me}'s master")]
    if reign < trusted:
        return [Refuse(f"retire from an older reign of {sender!r}: stale")]
    if promoted:
        return []
    return [Count("retired"), StopServing(sender)]
