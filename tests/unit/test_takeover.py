"""A successor's take-over of a departed arc (routing/takeover.py), driven with plain values."""

from __future__ import annotations

from middleware.phoenix.effects import After
from middleware.phoenix.ids import RoleId
from middleware.phoenix.ring import Handover as Arc
from middleware.recovery.capacity import CapacityPlan, Restore
from middleware.routing.departures import recover_asks
from middleware.routing.takeover import (
    Adopt,
    ArcTakeover,
    MakePlan,
    ReadTable,
    Released,
)

ARC = Arc("S", "D", 1, 2)
PLAN = CapacityPlan(
    departed="D",
    successor="S",
    departed_masters=2,
    departed_plain=True,
    masters=2,
    added=(),
    restores=tuple(Restore(RoleId.match("S", i), (f"D/match-{i}",)) for i in range(2)),
)


def _left() -> ArcTakeover:
    machine = ArcTakeover(bound_s=5.0, reply_to="S.process.p")
    assert machine.left("D", "r1", now=10.0, arc=ARC) == [ReadTable("D"), MakePlan("D")]
    return machine


def test_released_once_every_master_answered_and_the_table_was_read() -> None:
    machine = _left()
    asks = recover_asks(PLAN, ARC, request="r1", reply_to="S.process.p")
    assert [a.to for a in asks] == [RoleId.match("S", 0), RoleId.match("S", 1)]
    assert machine.planned("D", PLAN, ["S.match.0", "S.match.1"], now=10.5) == [
        Adopt("D", PLAN),
        *asks,  # RECOVER to each master of the plan
        After(5.0, "r1"),
    ]
    assert machine.answered("r1", "S.match.0", 3, now=11.0) == []
    assert machine.answered("r1", "S.match.0", 3, now=11.0) == []  # twice: once
    assert machine.answered("r1", "S.match.1", 4, now=11.5) == []  # the table not read
    assert machine.table_read("D", {"t": {"level_sum": 2}}, None, now=12.0) == [
        Released("D", 7, True, {"t": {"level_sum": 2}}, None, 2.0)
    ]
    assert machine.taking == {} and machine.expired("r1", now=20.0) == []


def test_the_bound_lets_the_events_go_with_what_was_restored() -> None:
    machine = _left()
    machine.table_read("D", None, "store unreadable", now=10.1)
    machine.planned("D", PLAN, ["S.match.0", "S.match.1"], now=10.2)
    machine.answered("r1", "S.match.0", 3, now=11.0)
    assert machine.expired("r1", now=15.25) == [
        Released("D", 3, False, {}, "store unreadable", 5.25)
    ]
    assert machine.answered("r1", "S.match.1", 9, now=16.0) == []  # late


def test_a_plan_naming_no_master_releases_once_the_table_is_read() -> None:
    machine = _left()
    assert machine.planned("D", PLAN, [], now=10.0) == [Adopt("D", PLAN)]
    assert machine.table_read("D", {}, None, now=10.25) == [Released("D", 0, True, {}, None, 0.25)]


def test_a_cluster_back_before_its_arc_was_restored_ends_the_take_over() -> None:
    machine = _left()
    machine.joined("D")
    assert machine.planned("D", PLAN, ["S.match.0"], now=11.0) == []  # not adopted
    assert machine.table_read("D", {}, None, now=11.0) == []
    assert machine.answered("r1", "S.match.0", 1, now=11.0) == []


def test_answers_of_other_requests_or_masters_are_ignored() -> None:
    machine = _left()
    machine.planned("D", PLAN, ["S.match.0"], now=10.0)
    assert machine.answered("other", "S.match.0", 1, now=10.0) == []
    assert machine.answered("r1", "T.match.0", 1, now=10.0) == []
    assert machine.requests() == {"r1"}
    assert machine.taking["D"].waiting == {"S.match.0"}
