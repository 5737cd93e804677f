"""The bounded-step flood that tells a cut link from a failed master or a departed
cluster (middleware/recovery/flood.py), on simulated rings of 3 to 64 clusters with
random link and node failures and random message orders: the verdict matches the ground
truth, a detour is a real path, and the flood stays within the message bound it claims."""

from __future__ import annotations

import itertools
import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.phoenix.ring import ChordRing
from middleware.recovery.flood import (
    Classification,
    FloodNode,
    Found,
    Probe,
    Send,
    Verdict,
    answer,
    flood_links,
    message_bound,
    neighbours,
)


def _world(n: int, seed: int, cut_share: float, dead_share: float, q_state: str):
    rng = random.Random(seed)
    names = [f"c{i}" for i in range(n)]
    ring = ChordRing(names)
    origin = rng.choice(names)
    target = ring.successors(origin, 1)[0]
    links = {tuple(sorted(link)) for link in flood_links(ring)}
    cut = {link for link in links if rng.random() < cut_share}
    cut.add(tuple(sorted((origin, target))))  # why the origin floods: it cannot reach Q
    dead = {c for c in names if c not in (origin, target) and rng.random() < dead_share}
    return ring, origin, target, cut, dead, q_state


def _reaches(u: str, v: str, cut, gone: set[str]) -> bool:
    return tuple(sorted((u, v))) not in cut and v not in gone


def _simulate(ring, origin, target, cut, dead, q_state, order_seed: int):
    """Run one flood to the end; the verdict and how many messages it took."""
    gone = {target} if q_state == "left" else set()  # the whole cluster, its broker too
    nodes = {
        c: FloodNode(
            c,
            ring,
            reachable={
                v for v in ring.clusters if v != c and _reaches(c, v, cut, gone | dead - {target})
            },
        )
        for c in ring.clusters
        if c not in dead and c != target
    }
    # a dead routing master's cluster is reachable (its RabbitMQ runs) but nothing forwards
    for c, node in nodes.items():
        node.reachable |= {d for d in dead if _reaches(c, d, cut, gone)}
    flood, pending = nodes[origin].start(target)
    queue: deque[Send] = deque(pending)
    rng = random.Random(order_seed)
    sent, answered = len(queue), False
    verdict: Verdict | None = None
    while queue:
        i = rng.randrange(len(queue))
        queue.rotate(-i)
        send = queue.popleft()
        message = send.message
        if send.to == target:
            assert isinstance(message, Probe)
            if answered or q_state == "left":
                continue
            answered = True
            reply = answer(message, "master" if q_state == "alive" else "slave")
            if reply is not None:
                queue.append(reply)
                sent += 1
            continue
        if send.to in dead:
            continue  # its inbox keeps it; no live process forwards it
        node = nodes[send.to]
        out = node.on_probe(message) if isinstance(message, Probe) else node.on_found(message)
        if isinstance(out, Verdict):
            verdict = out
            continue
        queue.extend(out)
        sent += len(out)
    return verdict or FloodNode.timed_out(flood, target), sent


def _truth(ring, origin, target, cut, dead, q_state):
    """BFS over the live flood graph: can any node other than the origin reach Q?"""
    if q_state == "left":
        return Classification.LEFT
    seen, frontier = {origin}, deque([origin])
    while frontier:
        u = frontier.popleft()
        if u != origin and _reaches(u, target, cut, set()):
            return Classification.LINK if q_state == "alive" else Classification.MASTER
        for v in neighbours(ring, u):
            if v not in seen and v not in dead and v != target and _reaches(u, v, cut, set()):
                seen.add(v)
                frontier.append(v)
    return Classification.LEFT


@settings(max_examples=300, deadline=None)
@given(
    st.integers(3, 64),
    st.integers(0, 2**32),
    st.floats(0, 0.6),
    st.floats(0, 0.5),
    st.sampled_from(["alive", "master_dead", "left"]),
    st.integers(0, 2**32),
)
def test_the_flood_classifies_like_the_ground_truth_within_its_bound(
    n, seed, cut_share, dead_share, q_state, order_seed
) -> None:
    ring, origin, target, cut, dead, q_state = _world(n, seed, cut_share, dead_share, q_state)
    verdict, sent = _simulate(ring, origin, target, cut, dead, q_state, order_seed)
    truth = _truth(ring, origin, target, cut, dead, q_state)
    assert verdict.kind is truth, (verdict, truth)
    assert sent <= message_bound(ring)
    if verdict.kind is Classification.LINK:
        path = verdict.path
        assert path[0] == origin and path[-1] == target and len(set(path)) == len(path)
        assert len(path) <= len(ring) + 1
        for u, v in itertools.pairwise(path):
            assert tuple(sorted((u, v))) not in cut, f"detour over a cut link {u}-{v}"
        assert not set(path[1:-1]) & dead, "detour through a dead routing master"


def test_an_intact_detour_is_found_and_the_bound_is_linear_in_fingers() -> None:
    names = [f"c{i}" for i in range(16)]
    ring = ChordRing(names)
    origin = names[0]
    target = ring.successors(origin, 1)[0]
    cut = {tuple(sorted((origin, target)))}
    verdict, sent = _simulate(ring, origin, target, cut, set(), "alive", 0)
    assert verdict.kind is Classification.LINK and len(verdict.path) >= 3
    # 16 clusters: at most one probe per flood link (fingers + predecessor) plus one answer
    assert sent <= message_bound(ring) <= 16 * 16


def test_a_probe_is_forwarded_once_and_never_back_along_its_path() -> None:
    ring = ChordRing([f"c{i}" for i in range(8)])
    node = FloodNode("c3", ring, reachable=set(ring.clusters) - {"c3"})
    probe = Probe("c1#1", "c1", "c2", ("c1",), ttl=8)
    first = node.on_probe(probe)
    assert first and all(s.to != "c1" for s in first if isinstance(s.message, Probe))
    assert node.on_probe(probe) == []  # seen
    spent = Probe("c1#2", "c1", "c2", ("c1",), ttl=0)
    assert node.on_probe(spent) == []  # no steps left
    found = Found("c1#1", "c1", "c2", ("c1", "c3", "c5"), "master", at=1)
    assert node.on_found(found) == [
        Send("c1", Found("c1#1", "c1", "c2", ("c1", "c3", "c5"), "master", at=0))
    ]
