"""A cluster joining the ring holds its arc's events for the hand-over, without I/O.

When a cluster joins (or rejoins) the ring, the other routing masters send it its arc's
events as soon as they hear the join, while the previous owner's match masters are still
sending it the arc's subscriptions (those made while it was away among them, and the
ones removed meanwhile).  An event matched before they are all there would miss them.
So the joining cluster's routing master holds its arc's events from its start until the
previous owner's routing master has said how many it sent (``handed_over``) and that many
were routed here, or until a bound passes (``handover_wait_s``).

The router's driver (``roles.py``) feeds it what happened with the time — its start with
the ring record it read of itself, each hand-over message routed, the count told, the
bound passed — and performs what it returns: :class:`Hold` (hold the arc's events, and
call :meth:`JoinHold.expired` after ``bound_s``) and :class:`Release` (let them go on,
with what to log).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Effect", "Hold", "JoinHold", "Release"]


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


Effect = Hold | Release


class JoinHold:
    """One routing master's hold on its arc while it joins."""

    def __init__(self) -> None:
        self.holding = False
        self.handed = 0  # hand-over messages routed here
        self.expected: int | None = None  # the previous owner's count
        self._since = 0.0

    @staticmethod
    def joins(recorded: str | None, listed_as_joined: bool) -> bool:
        """Whether a router starting now joins the ring: the routers recorded its cluster
        as left, or it is listed as joining later and was never recorded as joined (a
        router promoted after the join finds "joined" and does not hold)."""
        return recorded == "left" or (recorded is None and not listed_as_joined)

    def start(
        self,
        *,
        recorded: str | None,
        listed_as_joined: bool,
        bound_s: float,
        clusters: int,
        now: float,
    ) -> list[Effect]:
        """The router starts, with the ring record of its own cluster (its ``state``)."""
        if not self.joins(recorded, listed_as_joined) or bound_s <= 0 or clusters < 2:
            return []
        self.holding, self._since = True, now
        return [Hold(bound_s)]

    def routed(self, now: float) -> list[Effect]:
        """One hand-over message (a subscription, or a removal) was routed here."""
        self.handed += 1
        return self._complete(now)

    def told(self, count: int, now: float) -> list[Effect]:
        """The previous owner's routing master: ``count`` were sent."""
        self.expected = count
        return self._complete(now)

    def expired(self, now: float) -> list[Effect]:
        """The bound passed."""
        if not self.holding:
            return []
        self.holding = False
        return [Release(self.handed, self.expected, now - self._since, timed_out=True)]

    def _complete(self, now: float) -> list[Effect]:
        if not self.holding or self.expected is None or self.handed < self.expected:
            return []
        self.holding = False
        return [Release(self.handed, self.expected, now - self._since, timed_out=False)]
