"""Fencing (pure): which of two processes serving one master role is the real one.

Queues are named after roles, not processes, so a master that was only frozen (a pause
longer than the detection timeout, SIGSTOP) and comes back after its slaves elected a
successor would serve the same inbox as the successor: two masters, one cluster split in
two.  Every reign of a master role is therefore numbered: :class:`Reign` ``(epoch, by)``,
the master as started is ``(0, 0)``, an election's winner takes the next epoch above the
highest its slave has trusted, and two winners of one epoch (a race) are ordered by the
slave each was (``slave-0`` above ``slave-1``).  Masters put their reign in every beat and
COORDINATOR; each slave trusts the highest reign it has heard (:class:`Trust`) and answers
a beat of a lower one with FENCE, upon which that master steps down to the slave role it
left (or, for the master as started, to the one its successor left).

Between its return and that FENCE the old master would act on what it held with what
it knew: a routing master that routed the deliveries it had with its old ring, to a
match master that had handed their arc to a joiner meanwhile, lost them.  So a master
that notices it did not run for longer than its slaves' detection (:class:`Doubt`)
acts on nothing until a slave's beat says the slaves still trust its reign (a beat
naming a newer one steps it down as a FENCE does), or no slave is heard for a while.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from ..phoenix.effects import Refuse

__all__ = [
    "Doubt",
    "Refuse",
    "Reign",
    "Reigning",
    "RivalOutcome",
    "SendFence",
    "Stale",
    "StepDown",
    "Trust",
    "Verdict",
    "fenced",
    "rival_beat",
]


@dataclass(frozen=True, order=True)
class Reign:
    epoch: int = 0
    by: int = 0  # 0: the master as started; -(k + 1): the winner that was slave k

    @classmethod
    def of_winner(cls, epoch: int, slave: int) -> Reign:
        return cls(epoch, -(slave + 1))

    @property
    def slave(self) -> int | None:
        """The slave number the reign's master left when it took over (None: started so)."""
        return None if self.by == 0 else -self.by - 1

    def __str__(self) -> str:
        return f"epoch {self.epoch}" + ("" if self.slave is None else f" (slave-{self.slave})")


class Verdict(StrEnum):
    TRUST = "trust"  # the master the slave follows (its beat counts as heard)
    FENCE = "fence"  # an older reign: tell it to step down; its beat is not heard


@dataclass
class Trust:
    """One slave's view of who serves its master role now."""

    reign: Reign = Reign()

    def judge(self, reign: Reign) -> Verdict:
        """A beat or COORDINATOR of ``reign``: follow it if it is not older than the one
        trusted so far (newer: trusted from now on), else fence it."""
        if reign < self.reign:
            return Verdict.FENCE
        self.reign = reign
        return Verdict.TRUST

    def successor(self, slave: int) -> Reign:
        """The reign this slave serves under when it wins an election."""
        return Reign.of_winner(self.reign.epoch + 1, slave)


# ------------------------------------------------------------- a master's side
@dataclass(frozen=True)
class SendFence:
    """Tell the process at ``to`` (an older reign serving this master role) to step down:
    a FENCE carrying this master's ``reign``."""

    to: str
    reign: Reign


@dataclass(frozen=True)
class StepDown:
    """Step down to the slave role ``slave`` (its number) under the newer ``reign``."""

    slave: int
    reign: Reign


@dataclass(frozen=True)
class Stale:
    """A fence of a reign not newer than this master's: nothing changes (counted)."""


RivalOutcome = SendFence | StepDown | Stale | Refuse | None


def rival_beat(
    own: Reign,
    theirs: Reign,
    reply_to: str | None,
    *,
    promoted_from: int | None,
    slaves: frozenset[int] | None,
) -> RivalOutcome:
    """A beat of another process serving this master role reached this master: the older
    reign steps down — the other one is fenced (if it said where), or this one, as if
    a slave had fenced it with the other's reign (:func:`fenced`)."""
    if theirs < own:
        return SendFence(reply_to, own) if reply_to else None
    if theirs > own:
        return fenced(own, theirs, promoted_from=promoted_from, slaves=slaves)
    return None


def fenced(
    own: Reign, told: Reign, *, promoted_from: int | None, slaves: frozenset[int] | None
) -> RivalOutcome:
    """A FENCE of reign ``told``: a slave trusts a newer reign than ``own``.  Step down to
    the slave role this process left when it took over (``promoted_from``), or — the
    master as started — to the one the newer master left (which must be one of
    ``slaves``; None: not checked here).  A reign no slave can have (epoch 0, or not
    won by a slave) is refused; an older or equal one is stale."""
    if told.slave is None or told.epoch == 0:
        return Refuse(f"fence of {told}")
    if told <= own:
        return Stale()
    back = promoted_from if promoted_from is not None else told.slave
    if promoted_from is None and slaves is not None and back not in slaves:
        return Refuse(f"fence of {told}: no slave-{told.slave}")
    return StepDown(back, told)


@dataclass
class Reigning:
    """One master process's reign over its role, the fencing decisions in one machine
    (the driver feeds it rival beats and fences, and performs what they return):
    ``reign`` it serves under, the slave number it left when it took over
    (``promoted_from``: None for the master as started), its slaves' numbers.

    Once it returned :class:`StepDown` it no longer serves (``serving`` is False): a
    second fence or rival beat changes nothing, and the driver hands nothing more to
    the master's handlers — what it still holds goes back to the inbox for the master
    it yielded to."""

    reign: Reign
    promoted_from: int | None
    slaves: frozenset[int] | None
    stepped_down: StepDown | None = None

    @property
    def serving(self) -> bool:
        return self.stepped_down is None

    def rival_beat(self, theirs: Reign, reply_to: str | None) -> RivalOutcome:
        """A beat of another process serving this master role."""
        if not self.serving:
            return None
        return self._outcome(
            rival_beat(
                self.reign,
                theirs,
                reply_to,
                promoted_from=self.promoted_from,
                slaves=self.slaves,
            )
        )

    def fence(self, told: Reign) -> RivalOutcome:
        """A slave's FENCE of reign ``told``."""
        if not self.serving:
            return Stale()  # told twice: it steps down once
        return self._outcome(
            fenced(self.reign, told, promoted_from=self.promoted_from, slaves=self.slaves)
        )

    def _outcome(self, outcome: RivalOutcome) -> RivalOutcome:
        if isinstance(outcome, StepDown):
            self.stepped_down, self.reign = outcome, outcome.reign  # the slave trusts it
        return outcome


@dataclass
class Doubt:
    """A master's own pauses, from the times it is looked at (``tick``, at least every
    half ``floor_s``, and before each inbox message): after a gap longer than
    ``floor_s`` (its slaves' detection: they may have elected a successor meanwhile) it
    doubts its reign until :meth:`trusted` (a slave's beat naming it) or until
    ``bound_s`` passed (no slave heard: none can have elected either)."""

    floor_s: float
    bound_s: float
    last: float | None = None
    since: float | None = None  # doubting since
    doubts: int = 0  # how many times it began to doubt

    def tick(self, now: float) -> None:
        if self.last is not None and now - self.last > self.floor_s and self.since is None:
            self.since = now
            self.doubts += 1
        self.last = now

    def wait_s(self, now: float) -> float:
        """How long to wait before acting on an inbox message (0: act now)."""
        self.tick(now)
        if self.since is None:
            return 0.0
        left = self.since + self.bound_s - now
        if left <= 0:
            self.since = None
            return 0.0
        return left

    def trusted(self) -> None:
        self.since = None
