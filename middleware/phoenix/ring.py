"""Chord ring of Phoenix clusters (paper 000): pure arithmetic, no I/O.

Routing masters sit on a ring of 2**160 positions at SHA-1(ClusterID).  The
owner of an event type is the successor of SHA-1(event type): the first
cluster at or clockwise after that position.  Finger tables give O(log N)
lookups; successor lists give the next clusters to try when one fails.  A
cluster that joins takes over exactly the arc (predecessor, itself] from its
successor.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["BITS", "ChordRing", "Handover", "master_index", "ring_id"]

BITS = 160
SIZE = 1 << BITS


@functools.lru_cache(maxsize=65536)  # routers hash every event's type: the types repeat
def ring_id(key: str) -> int:
    """Position of ``key`` on the ring: SHA-1 as a 160-bit integer."""
    return int.from_bytes(hashlib.sha1(key.encode("utf-8")).digest(), "big")


def master_index(event_type: str, masters: int) -> int:
    """The match master of an owner's ``masters`` that holds ``event_type``'s
    subscriptions (and is routed its events): SHA-1(type) mod P, the one place it is
    written."""
    return ring_id(event_type) % masters


def _between(x: int, a: int, b: int) -> bool:
    """x in the ring interval (a, b]."""
    if a < b:
        return a < x <= b
    return x > a or x <= b  # wraps around zero (or a == b: the whole ring)


@dataclass(frozen=True, slots=True)
class Handover:
    """When ``joiner`` joins, the arc (start, end] moves to it from ``previous_owner``."""

    joiner: str
    previous_owner: str
    start: int
    end: int

    def covers(self, key: str) -> bool:
        return _between(ring_id(key), self.start, self.end)


class ChordRing:
    """The set of clusters on the ring, with ownership, fingers and successor lists."""

    #: routes a ring keeps (start, event type -> path) until its clusters change
    MAX_ROUTES = 65536

    def __init__(self, clusters: Iterable[str] = ()) -> None:
        self._ids: list[int] = []
        self._names: dict[int, str] = {}
        #: every event of a type takes the same path from a router: found once
        self._routes: dict[tuple[str, str], tuple[str, ...]] = {}
        for cluster in clusters:
            self.join(cluster)

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def clusters(self) -> list[str]:
        """Clusters in ring order."""
        return [self._names[i] for i in self._ids]

    def join(self, cluster: str) -> Handover | None:
        """Add a cluster; return the arc it takes over (None for the first cluster)."""
        position = ring_id(cluster)
        if position in self._names:
            if self._names[position] != cluster:
                raise ValueError(
                    f"SHA-1 collision between {cluster!r} and {self._names[position]!r}"
                )
            return None
        handover = None
        if self._ids:
            successor = self._successor_id(position)
            handover = Handover(
                cluster, self._names[successor], self._predecessor_id(position), position
            )
        bisect.insort(self._ids, position)
        self._names[position] = cluster
        self._routes.clear()
        return handover

    def leave(self, cluster: str) -> str | None:
        """Remove a cluster; return the cluster that now owns its arc (its successor)."""
        position = ring_id(cluster)
        if self._names.get(position) != cluster:
            raise KeyError(cluster)
        self._ids.remove(position)
        del self._names[position]
        self._routes.clear()
        return self._names[self._successor_id(position)] if self._ids else None

    def owner(self, event_type: str) -> str:
        """The cluster that owns ``event_type``: successor of SHA-1(event type)."""
        if not self._ids:
            raise LookupError("the ring is empty")
        return self._names[self._successor_id(ring_id(event_type))]

    def successors(self, cluster: str, count: int) -> list[str]:
        """The next ``count`` distinct clusters clockwise after ``cluster``."""
        start = self._ids.index(ring_id(cluster))
        n = len(self._ids)
        return [self._names[self._ids[(start + k) % n]] for k in range(1, min(count, n - 1) + 1)]

    def predecessor(self, cluster: str) -> str:
        return self._names[self._predecessor_id(ring_id(cluster))]

    def fingers(self, cluster: str) -> list[str]:
        """finger[i] = successor(n + 2**i), i = 0..159."""
        n = ring_id(cluster)
        return [self._names[self._successor_id((n + (1 << i)) % SIZE)] for i in range(BITS)]

    def route(self, start: str, event_type: str) -> list[str]:
        """Clusters a message visits from ``start`` to the owner, by finger tables."""
        path = self._routes.get((start, event_type))
        if path is None:
            if len(self._routes) >= self.MAX_ROUTES:
                self._routes.clear()  # many one-off types: start again
            path = self._routes[start, event_type] = tuple(self._route(start, event_type))
        return list(path)

    def _route(self, start: str, event_type: str) -> list[str]:
        key = ring_id(event_type)
        path = [start]
        current = ring_id(start)
        if self._successor_id(key) == current:  # the start owns it: no hop
            return path
        while True:
            successor = self._successor_id((current + 1) % SIZE)
            if current == successor or _between(key, current, successor):
                if successor != current:
                    path.append(self._names[successor])
                return path
            nxt = self._closest_preceding(current, key)
            if nxt == current:
                path.append(self._names[successor])
                return path
            path.append(self._names[nxt])
            current = nxt

    def _closest_preceding(self, current: int, key: int) -> int:
        for i in reversed(range(BITS)):
            finger = self._successor_id((current + (1 << i)) % SIZE)
            if finger != key and _between(finger, current, (key - 1) % SIZE):
                return finger
        return current

    def _successor_id(self, position: int) -> int:
        i = bisect.bisect_left(self._ids, position)
        return self._ids[i % len(self._ids)]

    def _predecessor_id(self, position: int) -> int:
        i = bisect.bisect_left(self._ids, position)
        return self._ids[(i - 1) % len(self._ids)]
