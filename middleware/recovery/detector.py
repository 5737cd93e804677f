"""Failure detection from heartbeats (pure): who has been silent too long.

One rule for every use: a peer is suspected once nothing was heard from it for
``misses`` heartbeat intervals.  A peer starts with a grace period (watched = heard now),
so a role that has just started is not suspected before its first heartbeat can arrive.
A peer known to be gone (:meth:`lost`: its lease came back, see routing/beats.py) is
suspected at once, until it is heard again.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["FailureDetector"]

P = TypeVar("P", bound=Hashable)


@dataclass
class FailureDetector(Generic[P]):
    interval_s: float
    misses: int
    _last: dict[P, float] = field(default_factory=dict)
    _lost: set[P] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.misses < 1:
            raise ValueError(f"need interval > 0 and misses >= 1: {self.interval_s}, {self.misses}")

    @property
    def timeout_s(self) -> float:
        """Silence after which a peer is suspected."""
        return self.interval_s * self.misses

    def watch(self, peers: Iterable[P], now: float) -> None:
        """Start watching ``peers`` (already watched ones keep their last heartbeat)."""
        for peer in peers:
            self._last.setdefault(peer, now)

    def heard(self, peer: P, now: float) -> None:
        """A heartbeat (or any message) from ``peer``; unknown peers are not watched."""
        if peer in self._last and now > self._last[peer]:
            self._last[peer] = now
            self._lost.discard(peer)

    def lost(self, peer: P) -> None:
        """``peer`` is gone (its connection closed): suspected from now until heard."""
        if peer in self._last:
            self._lost.add(peer)

    def grace(self, peer: P, until: float) -> None:
        """Do not suspect ``peer`` before ``until`` (one known to be starting: a master
        just elected, whose first beat may take a while)."""
        if peer in self._last:
            self._last[peer] = max(self._last[peer], until - self.timeout_s)
            self._lost.discard(peer)

    def forget(self, peer: P) -> None:
        self._last.pop(peer, None)
        self._lost.discard(peer)

    def suspects(self, now: float) -> set[P]:
        return {
            p for p, last in self._last.items() if now - last > self.timeout_s or p in self._lost
        }

    def alive(self, now: float) -> set[P]:
        return {
            p
            for p, last in self._last.items()
            if now - last <= self.timeout_s and p not in self._lost
        }

    def silent_for(self, peer: P, now: float) -> float | None:
        last = self._last.get(peer)
        return None if last is None else now - last
