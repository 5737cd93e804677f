"""A routing master's link table (middleware/recovery/links.py) on simulated rings of 3
to 32 clusters, every node running its own table, messages delivered in random order over
links that may be cut: a failed direct link gets a detour that only crosses working links
and ends at the destination; a detour through a cluster that then fails is replaced; no
way at all leaves the destination waiting (path None) until a flood finds one or the
direct link heals, and traffic then goes back to the direct link."""

from __future__ import annotations

import itertools
import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.phoenix.ring import ChordRing
from middleware.recovery.flood import Classification, Found, Probe, Send, Verdict
from middleware.recovery.links import LinkTable, Started


class World:
    """Every cluster's table and a network whose links can be cut (both directions)."""

    def __init__(self, n: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.ring = ChordRing(f"c{i}" for i in range(n))
        self.tables = {c: LinkTable(c, self.ring) for c in self.ring.clusters}
        self.cut: set[frozenset[str]] = set()
        self.dead: set[str] = set()  # whole clusters gone
        self.sent = 0
        self.verdicts: list[Verdict] = []

    def works(self, a: str, b: str) -> bool:
        return frozenset((a, b)) not in self.cut and b not in self.dead and a not in self.dead

    def run(self, started: list[Started]) -> None:
        """Deliver every flood message (random order) until none is left; a message over
        a cut link is lost, as the driver's one bounded try loses it."""
        queue: deque[tuple[str, Send]] = deque()
        for s in started:
            queue.extend((s.sends[0].message.origin, send) for send in s.sends)
        while queue:
            queue.rotate(-self.rng.randrange(len(queue)))
            sender, send = queue.popleft()
            self.sent += 1
            if not self.works(sender, send.to):
                continue
            here = self.tables[send.to]
            message = send.message
            if isinstance(message, Probe):
                out = here.answer(message) if message.target == send.to else here.probe(message)
            else:
                assert isinstance(message, Found)
                result = here.found(message)
                if isinstance(result, Verdict):
                    self.verdicts.append(result)
                    continue
                out = result
            queue.extend((send.to, o) for o in out)

    def valid(self, origin: str, path: tuple[str, ...]) -> bool:
        hops = (origin, *path)
        return all(self.works(a, b) for a, b in itertools.pairwise(hops))


@settings(max_examples=150, deadline=None)
@given(n=st.integers(3, 32), seed=st.integers(0, 2**32), cut_share=st.floats(0, 0.5))
def test_a_failed_link_gets_a_working_detour_or_waits(n: int, seed: int, cut_share: float) -> None:
    world = World(n, seed)
    clusters = world.ring.clusters
    origin = world.rng.choice(clusters)
    dest = world.ring.successors(origin, 1)[0]
    world.cut = {
        frozenset((a, b))
        for a in clusters
        for b in clusters
        if a < b and world.rng.random() < cut_share
    }
    world.cut.add(frozenset((origin, dest)))
    table = world.tables[origin]
    assert table.path(dest) == (dest,)  # before anything failed: direct
    world.run(table.failed(dest, dest, now=0.0))
    path = table.path(dest)
    if path is not None:  # a FOUND came back: a real path over working links, dest last
        assert path[-1] == dest and len(path) >= 2
        assert world.valid(origin, path)
        assert any(v.kind is Classification.LINK for v in world.verdicts)
    else:  # none: waits; after the timeout it is unreachable and can flood again
        flood = next(iter(table.floods.values()), None)
        if flood is not None:
            assert table.timed_out(flood, dest) is not None
        assert dest in table.unreachable and table.path(dest) is None
        assert table.again(dest)  # flood again
    # the direct link heals: back to it, whatever was found
    world.cut.discard(frozenset((origin, dest)))
    assert table.healed(dest) and table.path(dest) == (dest,)
    assert not table.healed(dest)  # once


@settings(max_examples=100, deadline=None)
@given(n=st.integers(4, 32), seed=st.integers(0, 2**32))
def test_a_detour_through_a_cluster_that_fails_is_replaced(n: int, seed: int) -> None:
    world = World(n, seed)
    clusters = world.ring.clusters
    origin = world.rng.choice(clusters)
    dest = world.ring.successors(origin, 1)[0]
    world.cut = {frozenset((origin, dest))}
    table = world.tables[origin]
    world.run(table.failed(dest, dest, now=0.0))
    first = table.path(dest)
    assert first is not None and len(first) >= 2  # only one link is cut: always a way
    hop = first[0]
    world.dead.add(hop)  # the detour's first hop's cluster goes
    started = table.failed(hop, dest, now=1.0)
    assert {s.target for s in started} >= {dest}  # a new flood for dest
    assert table.path(dest) is None  # no stale detour in the meantime
    world.run(started)
    second = table.path(dest)
    if second is not None:
        assert hop not in second and world.valid(origin, second)


def test_floods_are_not_started_twice_and_late_answers_after_a_heal_are_ignored() -> None:
    world = World(8, 7)
    origin, dest = "c0", world.ring.successors("c0", 1)[0]
    world.cut = {frozenset((origin, dest))}
    table = world.tables[origin]
    started = table.failed(dest, dest, now=0.0)
    assert len(started) == 1 and table.flooding(dest)
    assert table.failed(dest, dest, now=0.1) == []  # the same failure again: no new flood
    assert table.healed(dest)  # the link came back before any FOUND
    world.run(started)  # the late FOUND: no detour for a link that works
    assert table.path(dest) == (dest,) and not table.detours


def test_flood_messages_are_counted_within_the_bound() -> None:
    from middleware.recovery.flood import message_bound

    world = World(16, 3)
    origin = "c5"
    dest = world.ring.successors(origin, 1)[0]
    world.cut = {frozenset((origin, dest))}
    world.run(world.tables[origin].failed(dest, dest, now=0.0))
    total = sum(t.flood_messages for t in world.tables.values())
    assert 0 < total <= message_bound(world.ring)


def test_a_cluster_no_flood_reaches_is_gone_after_leave_after_s_and_then_forgotten() -> None:
    world = World(8, 11)
    origin = "c0"
    gone = world.ring.successors(origin, 1)[0]
    other = next(c for c in world.ring.clusters if c not in (origin, gone))
    world.dead.add(gone)  # the whole cluster: nobody reaches it
    table = world.tables[origin]
    started = table.failed(gone, gone, now=10.0)
    world.run(started)
    assert table.path(gone) is None
    assert table.timed_out(started[0].flood, gone) is not None
    assert table.gone(now=12.0, after_s=3.0) == []  # not yet
    assert table.gone(now=13.0, after_s=3.0) == [gone]
    table.detours[other] = (gone, other)  # a stale detour through it goes too
    world.ring.leave(gone)
    table.forget(gone)
    assert gone not in table.down and gone not in table.unreachable
    assert other not in table.detours and gone not in table.node.reachable
    assert table.gone(now=99.0, after_s=3.0) == []


def test_a_send_under_way_when_its_cluster_left_leaves_no_trace_after_it_rejoins() -> None:
    """A forward to X was under way when X left the ring (its failure comes after
    ``forget``): it must not mark X down again, or X would be found gone anew the moment
    it rejoins (seen for real: a router took a rejoined cluster for departed 0.1 s
    after the join)."""
    world = World(5, 3)
    origin = "c0"
    x = world.ring.successors(origin, 1)[0]
    table = world.tables[origin]
    world.ring.leave(x)
    table.forget(x)
    assert table.failed(x, x, now=20.0) == []  # the late failure of the send under way
    assert table.again(x) == []
    assert x not in table.down and not table.flooding(x)
    world.ring.join(x)
    table.joined(x)
    assert table.path(x) == (x,)  # back on the direct link
    assert table.gone(now=99.0, after_s=1.5) == []
