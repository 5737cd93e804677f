"""``departures.Departures``: a routing master's part in a cluster's departure."""

from __future__ import annotations

import itertools

from middleware.phoenix.effects import Box
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.phoenix.ring import ChordRing, ring_id
from middleware.recovery.capacity import plan_takeover
from middleware.routing.departures import (
    AfterRingApplied,
    Count,
    Departures,
    LeaveHere,
    PlanPrepare,
    RecordLeft,
    RouteKept,
    Send,
    TakeOverArc,
    TellMatchRoles,
    entries_of_arc,
    recover_asks,
)
from middleware.routing.messages import Leave
from middleware.routing.records import LatencyEntry

CLUSTERS = ["A", "B", "C", "D"]


def _topology(masters: int = 2) -> PhoenixTopology:
    return PhoenixTopology.model_validate(
        {"clusters": [{"id": c, "match_masters": masters} for c in CLUSTERS]}
    )


def _departures(cluster: str, clusters: list[str] = CLUSTERS) -> Departures:
    ids = (f"n{n}" for n in itertools.count())
    return Departures(cluster, ChordRing(clusters), _topology(), lambda: next(ids))


def test_an_announced_leave_is_told_to_every_other_router_then_left_here() -> None:
    machine = _departures("A")
    effects = machine.announce("C")
    told = Leave(cluster="C", by="A")
    bound = 2 * machine.topology.link_timeout_s  # one bounded try each
    assert effects[:-1] == [
        Send(RoleId.router(c), told, bound_s=bound) for c in machine.ring.clusters if c in "BD"
    ]
    assert effects[-1] == LeaveHere("C", "A")
    assert "C" in machine.ring.clusters  # the ring changes only when it is left here


def test_the_successor_takes_the_arc_over_and_everyone_drops_it_from_the_ring() -> None:
    ring = ChordRing(CLUSTERS)
    successor = ring.successors("C", 1)[0]
    arc_start = ring_id(ring.predecessor("C"))
    for cluster in (c for c in CLUSTERS if c != "C"):
        machine = _departures(cluster)
        effects = machine.leave("C", "B", ring_applied=True)
        assert "C" not in machine.ring.clusters
        assert effects[0] == RecordLeft("C")
        takes = [e for e in effects if isinstance(e, TakeOverArc)]
        if cluster == successor:
            assert len(takes) == 1 and takes[0].arc.start == arc_start
            assert takes[0].arc.end == ring_id("C")
        else:
            assert takes == []
        assert effects[-3:] == [
            RouteKept("C"),
            Count("leaves"),
            TellMatchRoles(Leave(cluster="C", by="B"), successor),
        ]


def test_a_leave_waits_for_the_recorded_ring_and_is_said_once() -> None:
    machine = _departures("A")
    assert machine.leave("C", "B", ring_applied=False) == [AfterRingApplied("C", "B")]
    assert "C" in machine.ring.clusters
    assert machine.leave("C", "B", ring_applied=True)
    assert machine.leave("C", "B", ring_applied=True) == []  # already gone
    assert machine.leave("A", "B", ring_applied=True) == []  # not its own


def test_a_ring_of_one_keeps_its_last_cluster() -> None:
    machine = _departures("A", ["A", "B"])
    assert machine.leave("B", "A", ring_applied=True)
    assert machine.leave("A", "A", ring_applied=True) == []


def test_a_suspect_is_prepared_at_its_successor_by_the_masters_that_run_already() -> None:
    machine = _departures("A")
    (plan_effect,) = machine.suspect("C")
    assert isinstance(plan_effect, PlanPrepare) and plan_effect.cluster == "C"
    successor = plan_effect.successor
    plan = plan_takeover(
        _topology(), "C", successor, departed_masters=3, departed_plain=True, can_add=True
    )
    effects = machine.prepare(plan_effect, plan, "reply-queue")
    asks = [e for e in effects if isinstance(e, Send)]
    assert effects[-1] == Count("suspected")
    assert asks and all(a.via == successor and a.bound_s for a in asks)
    assert all(a.box is Box.CONTROL for a in asks)
    assert all(not a.to.is_added(machine.topology) for a in asks)
    assert len(asks) < len(plan.restores)  # the added master reads at the leave
    assert {a.message.request for a in asks} == {"prepare-n0"}
    assert all(a.message.prepare and a.message.reply_to == "reply-queue" for a in asks)


def test_no_suspect_on_a_small_ring_or_for_a_cluster_already_gone() -> None:
    assert _departures("A", ["A", "B"]).suspect("B") == []
    assert _departures("A").suspect("Z") == []


def test_the_leaves_recover_asks_name_every_master_of_the_plan_unbounded() -> None:
    machine = _departures("B")
    arc, successor = machine.departure("C")
    plan = plan_takeover(
        _topology(), "C", successor, departed_masters=3, departed_plain=True, can_add=True
    )
    asks = recover_asks(plan, arc, request="r1", reply_to="q")
    assert [a.to for a in asks] == [r.master for r in plan.restores]
    assert all(a.bound_s is None and not a.message.prepare for a in asks)
    assert all(a.message.arc == (arc.start, arc.end) and a.message.masters == 3 for a in asks)


def test_the_departed_routers_entries_of_its_arc_are_taken_and_nothing_else() -> None:
    machine = _departures("A")
    arc, _ = machine.departure("C")
    types = (f"t{n}" for n in itertools.count())
    inside = next(t for t in types if arc.covers(t))
    outside = next(t for t in types if not arc.covers(t))
    empty = next(t for t in types if arc.covers(t))
    old = next(t for t in types if arc.covers(t))
    table = {
        inside: (3, LatencyEntry(5, 2).to_document()),
        outside: (1, LatencyEntry(1, 1).to_document()),
        empty: (2, LatencyEntry(0, 0).to_document()),
        old: (1, "an entry no version of the records wrote"),
    }
    assert entries_of_arc(arc, table) == {inside: LatencyEntry(5, 2)}
