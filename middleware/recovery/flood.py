"""Telling a cut link from a failed cluster (pure): the paper's bounded-step flood.

When routing master P cannot send to its ring neighbour Q, it cannot tell from where it
stands whether the link P -> Q is cut, Q's routing master died (its slaves elect a new
one), or Q's whole cluster left.  P floods a probe over the other routing masters: each
node forwards a probe at most once, to its flood neighbours (its finger-table entries and
its predecessor), never back to a node already on the probe's path, for at most as many
steps as the ring has clusters.  A node that can reach Q's RabbitMQ hands the probe to
Q's routing master or, if that is gone, to one of Q's routing slaves; the first that
gets it answers FOUND back along the probe's path.  At P:

- FOUND from Q's routing master: a **link failure**; the probe's path is a detour;
- FOUND from a routing slave of Q only: Q's **master failed** (its slaves elect, #23);
- nothing within the timeout: Q's **cluster left** (or is cut off from every cluster
  P can reach: the paper's rule does not tell the two apart, and neither can P).

Bound: every node forwards one probe per flood to each flood neighbour once, so a flood
sends at most ``sum(len(neighbours(v)))`` PROBE messages over the ring, at most one more
from each node but the origin straight to the target, and, for the one answer the target
gives (it answers a flood once), at most ``len(ring) - 1`` FOUND hops
(:func:`message_bound`).

The machines here only return what to send (:class:`Send`) and the verdict
(:class:`Verdict`); a routing master's driver carries the messages and times out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum

from ..phoenix.ring import ChordRing

__all__ = [
    "Classification",
    "FloodNode",
    "Found",
    "Probe",
    "Send",
    "Verdict",
    "message_bound",
    "neighbours",
]


class Classification(StrEnum):
    LINK = "link"  # Q is alive and reachable another way: detour over the path
    MASTER = "master"  # Q's routing master is gone, a routing slave of Q answers
    LEFT = "left"  # nobody reaches any routing role of Q


@dataclass(frozen=True)
class Probe:
    flood: str  # the flood's id (origin and a sequence number)
    origin: str
    target: str
    path: tuple[str, ...]  # origin first, the sender last
    ttl: int  # steps left


@dataclass(frozen=True)
class Found:
    flood: str
    origin: str
    target: str
    path: tuple[str, ...]  # origin ... the last node before the target
    by: str  # "master" or "slave": who in the target cluster answered
    at: int  # index in ``path`` of the node this FOUND is addressed to


@dataclass(frozen=True)
class Send:
    to: str  # a cluster (its routing master), or the target cluster's roles
    message: Probe | Found
    deliver: str = "master"  # at the target: "master", or "slave" when it is gone


@dataclass(frozen=True)
class Verdict:
    flood: str
    target: str
    kind: Classification
    path: tuple[str, ...] = ()  # for LINK: origin, hops ..., target


def neighbours(ring: ChordRing, cluster: str) -> list[str]:
    """Where ``cluster`` forwards a probe: its distinct fingers and its predecessor."""
    if len(ring) < 2:
        return []
    found = set(ring.fingers(cluster)) | {ring.predecessor(cluster)}
    found.discard(cluster)
    return sorted(found)


def message_bound(ring: ChordRing) -> int:
    """The most messages one flood sends: PROBEs over every flood link once, one from
    each node but the origin and the target straight to the target, and one FOUND walking
    back at most ``len(ring) - 1`` hops."""
    n = len(ring)
    return sum(len(neighbours(ring, c)) for c in ring.clusters) + max(0, n - 2) + n - 1


@dataclass
class FloodNode:
    """One routing master's side of floods: starting one, forwarding, answering."""

    me: str
    ring: ChordRing
    #: the clusters whose RabbitMQ this node reaches now (its driver's view; the cut link
    #: is missing from the origin's)
    reachable: set[str] = field(default_factory=set)
    _seen: set[str] = field(default_factory=set)
    _sequence: int = 0

    def start(self, target: str) -> tuple[str, list[Send]]:
        """P cannot send to ``target``: a new flood's id and its first probes."""
        self._sequence += 1
        flood = f"{self.me}#{self._sequence}"
        self._seen.add(flood)
        probe = Probe(flood, self.me, target, (self.me,), ttl=len(self.ring))
        return flood, self._forward(probe)

    def _forward(self, probe: Probe) -> list[Send]:
        if probe.ttl <= 0:
            return []
        sends = []
        if probe.target in self.reachable and self.me != probe.origin:
            sends.append(Send(probe.target, probe))  # the target cluster itself
        nxt = Probe(probe.flood, probe.origin, probe.target, probe.path, probe.ttl - 1)
        for n in neighbours(self.ring, self.me):
            if n in self.reachable and n not in probe.path and n != probe.target:
                sends.append(Send(n, nxt))
        return sends

    def on_probe(self, probe: Probe) -> list[Send]:
        """A probe from ``probe.path[-1]``: forward it once (this node joins the path)."""
        if probe.flood in self._seen:
            return []
        self._seen.add(probe.flood)
        return self._forward(
            Probe(probe.flood, probe.origin, probe.target, (*probe.path, self.me), probe.ttl)
        )

    def on_found(self, found: Found) -> list[Send] | Verdict:
        """A FOUND walking back: pass it on toward the origin, or (at the origin) the
        verdict."""
        if found.at == 0:
            assert self.me == found.origin
            kind = Classification.LINK if found.by == "master" else Classification.MASTER
            path = (*found.path, found.target) if kind is Classification.LINK else ()
            return Verdict(found.flood, found.target, kind, path)
        back = Found(found.flood, found.origin, found.target, found.path, found.by, found.at - 1)
        return [Send(found.path[found.at - 1], back)]

    @staticmethod
    def timed_out(flood: str, target: str) -> Verdict:
        """No FOUND within the flood's timeout."""
        return Verdict(flood, target, Classification.LEFT)


def answer(probe: Probe, by: str) -> Send | None:
    """The target cluster's role (``by``: master or slave) got ``probe``: FOUND back to
    the last node of its path (None for a probe that came straight from the origin)."""
    if len(probe.path) < 2:
        return None
    found = Found(probe.flood, probe.origin, probe.target, probe.path, by, len(probe.path) - 1)
    return Send(probe.path[-1], found)


def flood_links(ring: ChordRing, clusters: Iterable[str] | None = None) -> set[tuple[str, str]]:
    """The directed flood links of ``ring`` (for simulations and the bound)."""
    return {(c, n) for c in (clusters or ring.clusters) for n in neighbours(ring, c)}
