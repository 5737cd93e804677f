"""``ring``: the Chord ring (owners, finger routing, joins and their arcs)."""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from middleware.routing import (
    ChordRing,
)


def _sha(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16)


def _owner_brute_force(clusters: list[str], event_type: str) -> str:
    key = _sha(event_type)
    after = sorted((c for c in clusters if _sha(c) >= key), key=_sha)
    return after[0] if after else min(clusters, key=_sha)


CLUSTERS = [f"cluster-{i}" for i in range(12)]


@pytest.mark.parametrize("event_type", [f"type.{i}" for i in range(200)])
def test_owner_matches_an_independent_sha1_computation(event_type: str) -> None:
    assert ChordRing(CLUSTERS).owner(event_type) == _owner_brute_force(CLUSTERS, event_type)


def test_finger_routing_reaches_the_owner_in_log_hops() -> None:
    clusters = [f"c{i}" for i in range(64)]
    ring = ChordRing(clusters)
    rng = random.Random(3)
    for _ in range(300):
        start, event_type = rng.choice(clusters), f"e{rng.random()}"
        path = ring.route(start, event_type)
        assert path[0] == start and path[-1] == ring.owner(event_type)
        assert len(path) - 1 <= math.ceil(math.log2(len(clusters))) + 1


def test_a_join_hands_over_exactly_its_arc() -> None:
    ring = ChordRing(CLUSTERS)
    types = [f"t{i}" for i in range(2000)]
    before = {t: ring.owner(t) for t in types}
    handover = ring.join("newcomer")
    after = {t: ring.owner(t) for t in types}
    moved = {t for t in types if before[t] != after[t]}
    assert moved == {t for t in types if handover.covers(t)}
    assert all(after[t] == "newcomer" and before[t] == handover.previous_owner for t in moved)
    assert ring.leave("newcomer") == handover.previous_owner
    assert {t: ring.owner(t) for t in types} == before


def test_successor_list_and_predecessor() -> None:
    ring = ChordRing(CLUSTERS)
    order = ring.clusters
    i = order.index("cluster-3")
    assert ring.successors("cluster-3", 3) == [order[(i + k) % 12] for k in (1, 2, 3)]
    assert ring.predecessor(order[0]) == order[-1]


def test_a_route_found_once_follows_every_join_and_leave() -> None:
    """Routes are kept per (start, type) until the ring changes: a route read after a
    leave or a join is the new ring's, as a fresh ring computes it."""
    clusters = [f"c{i}" for i in range(16)]
    ring = ChordRing(clusters)
    rng = random.Random(5)
    types = [f"e{i}" for i in range(40)]
    for step in range(30):
        for event_type in types:
            start = rng.choice(ring.clusters)
            path = ring.route(start, event_type)
            assert path == ChordRing(ring.clusters).route(start, event_type)
            path.append("scribbled")  # a caller's list is its own
            assert ring.route(start, event_type)[-1] == ring.owner(event_type)
        if step % 2 and len(ring) > 2:
            ring.leave(rng.choice(ring.clusters))
        else:
            ring.join(f"n{step}")
