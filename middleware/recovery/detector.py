"""Failure detection from heartbeats (pure): who has been silent too long.

A peer is suspected once nothing was heard from it for its *timeout*: at least
``misses`` heartbeat intervals (the floor), and more when its beats have been arriving
irregularly, the way a busy machine delays them.  The timeout follows the observed
inter-arrival gaps as TCP's retransmission timeout follows round trips (Jacobson's
estimator: a smoothed mean and mean deviation, timeout = mean + ``k`` deviations), a
phi-accrual detector's idea without its distribution: a peer whose beats come every
0.1 s to the millisecond is suspected after the floor, one whose beats came 0.1 to 0.6 s
apart after a second or more, and never later than ``ceiling_s``.  So a machine whose
cores are oversubscribed does not elect new masters whenever a beat is late, while a
silent peer on a quiet machine is found as fast as before; and a dead *process* is
not waited for at all: its lease comes back at once (:meth:`lost`, routing/beats.py).

A peer that beats slowly while it has nothing to do says so (:meth:`announced`: its next
beat comes within ``next_s``, the topology's ``quiet_beat_interval_s``): its silence is
excused by how much longer than the usual interval that is (on top of the timeout its
usual beats earned, so a busy machine's late beat is excused as before), and the gaps it
announced are not fed to the estimator, so a master that goes back to its usual beats
is judged by them again at once.

A peer starts with a grace period (watched = heard now), so a role that has just
started is not suspected before its first heartbeat can arrive.  A peer known to be gone
(:meth:`lost`) is suspected at once, until it is heard again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FailureDetector"]

P = TypeVar("P", bound=Hashable)

#: mean deviations above the mean gap before a silence counts (about a phi-accrual
#: threshold of 8 for a normal spread of gaps, 5.6 standard deviations)
DEVIATIONS = 7.0
_GAIN, _DEV_GAIN = 1 / 8, 1 / 4  # Jacobson's


@dataclass
class _Gaps:
    """One peer's beats: when last heard (or watched), the gaps' smoothed mean and mean
    deviation (from its second beat on), and a grace that holds suspicion off."""

    last: float
    mean: float
    dev: float = 0.0
    beats: int = 0  # heard since watched
    quiet_until: float = 0.0
    #: how much longer than the usual interval its next beat may take (its last beat
    #: announced a quiet interval); 0: the usual rule
    excused: float = 0.0

    def heard(self, now: float) -> None:
        gap, self.last = now - self.last, now
        if self.excused > 0:
            return  # a gap it announced: not one of its usual gaps
        self.beats += 1
        if self.beats == 1:  # the wait for the first beat is no gap between beats
            return
        if self.beats == 2:
            self.mean, self.dev = gap, gap / 2
            return
        self.dev += _DEV_GAIN * (abs(gap - self.mean) - self.dev)
        self.mean += _GAIN * (gap - self.mean)


@dataclass
class FailureDetector(Generic[P]):
    interval_s: float
    misses: int
    #: the longest a silence may be waited for, however irregular the beats were
    #: (0: the floor, ``interval_s * misses``, always: the fixed rule)
    ceiling_s: float = 0.0
    _gaps: dict[P, _Gaps] = field(default_factory=dict)
    _lost: set[P] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.misses < 1:
            raise ValueError(f"need interval > 0 and misses >= 1: {self.interval_s}, {self.misses}")

    @property
    def timeout_s(self) -> float:
        """The floor: silence after which a peer with regular beats is suspected."""
        return self.interval_s * self.misses

    def timeout_for(self, peer: P) -> float:
        """The silence after which ``peer`` is suspected now (see the module doc)."""
        gaps = self._gaps.get(peer)
        floor = self.timeout_s
        if gaps is None:
            return floor
        if gaps.beats < 3 or self.ceiling_s <= floor:
            return floor + gaps.excused
        adaptive = gaps.mean + DEVIATIONS * gaps.dev + self.interval_s
        return min(self.ceiling_s, max(floor, adaptive)) + gaps.excused

    def watch(self, peers: Iterable[P], now: float) -> None:
        """Start watching ``peers`` (already watched ones keep their last heartbeat)."""
        for peer in peers:
            if peer not in self._gaps:
                self._gaps[peer] = _Gaps(last=now, mean=self.interval_s)

    def heard(self, peer: P, now: float) -> None:
        """A heartbeat (or any message) from ``peer``; unknown peers are not watched."""
        gaps = self._gaps.get(peer)
        if gaps is not None and now > gaps.last:
            gaps.heard(now)
            self._lost.discard(peer)

    def announced(self, peer: P, next_s: float | None) -> None:
        """A beat from ``peer`` said its next one comes within ``next_s`` (None: its
        usual interval): its silence is excused by as much more than the interval."""
        gaps = self._gaps.get(peer)
        if gaps is not None:
            gaps.excused = 0.0 if next_s is None else max(0.0, next_s - self.interval_s)

    def lost(self, peer: P) -> None:
        """``peer`` is gone (its connection closed): suspected from now until heard."""
        if peer in self._gaps:
            self._lost.add(peer)

    def grace(self, peer: P, until: float) -> None:
        """Do not suspect ``peer`` before ``until`` (one known to be starting: a master
        just elected, whose first beat may take a while)."""
        gaps = self._gaps.get(peer)
        if gaps is not None:
            gaps.quiet_until = max(gaps.quiet_until, until)
            self._lost.discard(peer)

    def forget(self, peer: P) -> None:
        self._gaps.pop(peer, None)
        self._lost.discard(peer)

    def _silent(self, peer: P, gaps: _Gaps, now: float) -> bool:
        return now > gaps.quiet_until and now - gaps.last > self.timeout_for(peer)

    def suspect_at(self, peer: P) -> float | None:
        """When ``peer`` is suspected if nothing is heard from it before (a heartbeat
        only moves this later, as long as its timeout holds); None: not watched."""
        gaps = self._gaps.get(peer)
        if gaps is None:
            return None
        if peer in self._lost:
            return 0.0
        return max(gaps.quiet_until, gaps.last + self.timeout_for(peer))

    def suspects(self, now: float) -> set[P]:
        return {
            p for p, gaps in self._gaps.items() if p in self._lost or self._silent(p, gaps, now)
        }

    def alive(self, now: float) -> set[P]:
        return {
            p
            for p, gaps in self._gaps.items()
            if p not in self._lost and not self._silent(p, gaps, now)
        }

    def silent_for(self, peer: P, now: float) -> float | None:
        """How long ``peer`` has been silent beyond what its last beat excused (None:
        not watched)."""
        gaps = self._gaps.get(peer)
        return None if gaps is None else max(0.0, now - gaps.last - gaps.excused)
