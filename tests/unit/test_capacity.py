"""The capacity plan for a departed cluster's arc (issue #24, paper 000 §2.2 steps 2-5)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.phoenix.effects import Send
from middleware.phoenix.ids import RoleId, role_queues
from middleware.phoenix.protocol import ClusterSpec, PhoenixTopology
from middleware.phoenix.ring import ChordRing, ring_id
from middleware.phoenix.ring import Handover as Arc
from middleware.recovery.capacity import plan_takeover, running_masters
from middleware.routing.router import RouterLogic


def topology(x_masters: int, s_masters: int, slaves: int = 2) -> PhoenixTopology:
    return PhoenixTopology(
        clusters=(
            ClusterSpec(id="X", match_masters=x_masters, match_slaves=slaves),
            ClusterSpec(id="S", match_masters=s_masters, match_slaves=slaves),
        )
    )


def test_a_larger_departed_cluster_gets_as_many_masters_each_mapped_to_one_lost_master() -> None:
    plan = plan_takeover(
        topology(3, 1), "X", "S", departed_masters=3, departed_plain=True, can_add=True
    )
    assert plan.masters == 3
    # (1 + k)·(N - M) roles: masters 1 and 2, two slaves each
    assert plan.added == (
        RoleId.match("S", 1),
        RoleId.match_slave("S", 1, 0),
        RoleId.match_slave("S", 1, 1),
        RoleId.match("S", 2),
        RoleId.match_slave("S", 2, 0),
        RoleId.match_slave("S", 2, 1),
    )
    assert plan.added_masters == (RoleId.match("S", 1), RoleId.match("S", 2))
    assert plan.match_broker_map == {
        "X/match-0": "S/match-0",
        "X/match-1": "S/match-1",
        "X/match-2": "S/match-2",
    }
    assert all(r.is_added(topology(3, 1)) for r in plan.added)


def test_without_a_provisioner_the_successor_s_own_masters_share_the_arc() -> None:
    plan = plan_takeover(
        topology(3, 2), "X", "S", departed_masters=3, departed_plain=True, can_add=False
    )
    assert plan.masters == 2 and plan.added == ()
    # each reads every lost master and keeps the types it now routes
    assert all(len(r.owners) == 3 for r in plan.restores)
    assert plan.match_broker_map == {}


def test_a_smaller_departed_cluster_is_shared_over_the_successor_s_masters() -> None:
    plan = plan_takeover(
        topology(1, 3), "X", "S", departed_masters=1, departed_plain=True, can_add=True
    )
    assert plan.masters == 3 and plan.added == ()
    assert [r.master.index for r in plan.restores] == [0, 1, 2]
    assert all(r.owners == ("X/match-0",) for r in plan.restores)


def test_a_departed_cluster_that_held_an_adopted_arc_is_read_whole() -> None:
    """X ran 3 masters while it held another arc routed % 3 (its own % 2): no one-to-one
    map is exact, so every one of S's masters reads every lost master."""
    topo = topology(2, 1)
    assert running_masters(topo, "X", [3]) == 3
    plan = plan_takeover(topo, "X", "S", departed_masters=3, departed_plain=False, can_add=True)
    assert plan.masters == 3
    assert all(len(r.owners) == 3 for r in plan.restores)


def test_the_plan_is_persisted_as_text_for_every_store() -> None:
    plan = plan_takeover(
        topology(2, 1), "X", "S", departed_masters=2, departed_plain=True, can_add=True
    )
    big = 2**159 + 1
    doc = plan.to_document((big, 5))
    assert doc == {"by": "S", "masters": 2, "departed_masters": 2, "arc": [str(big), "5"]}


@given(
    n=st.integers(1, 6),
    m=st.integers(1, 6),
    can_add=st.booleans(),
    types=st.lists(st.from_regex(r"\Ae[a-z0-9]{0,8}\Z"), min_size=1, max_size=40),
)
def test_every_subscription_of_the_arc_is_restored_by_exactly_the_master_that_routes_it(
    n: int, m: int, can_add: bool, types: list[str]
) -> None:
    """X routed its types % N to its masters; after the plan, S's router routes the
    arc's types % P, and the master it routes a type to is the one (and only one) whose
    restore reads the lost master that held it and keeps it."""
    topo = topology(n, m)
    plan = plan_takeover(topo, "X", "S", departed_masters=n, departed_plain=True, can_add=can_add)
    ring = ChordRing(["S"])
    logic = RouterLogic("S", topo, ring)
    whole = Arc("X", "S", 0, 0)  # (0, 0]: the whole ring
    logic.adopted["X"] = (whole, plan.masters)
    for et in types:
        held_by = RoleId.match("X", ring_id(et) % n).owner
        restoring = [
            r.master.index
            for r in plan.restores
            if held_by in r.owners and ring_id(et) % plan.masters == r.master.index
        ]
        step = logic.step(_publish(et))
        assert isinstance(step, Send)
        assert restoring == [step.to.index]
        assert step.to.index < max(m, n if can_add else m)


def _publish(event_type: str):
    from middleware.routing.matching import Event
    from middleware.routing.messages import Publish

    return Publish(event_type=event_type, event=Event(event_type=event_type, attributes={}))


def test_added_roles_are_in_the_topology_up_to_the_most_masters_a_cluster_has() -> None:
    topo = topology(3, 1, slaves=1)
    assert RoleId.match("S", 2).in_topology(topo)
    assert RoleId.match_slave("S", 2, 0).in_topology(topo)
    assert not RoleId.match_slave("S", 2, 1).in_topology(topo)  # S has one slave each
    assert not RoleId.match("S", 3).in_topology(topo)  # no cluster runs four
    assert not RoleId.match("S", 0).is_added(topo)
    # their queues are removed with the deployment's
    assert RoleId.match("S", 2).inbox(topo.prefix) in role_queues(topo)


def test_a_plan_for_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="ran 0 match masters"):
        plan_takeover(
            topology(1, 1), "X", "S", departed_masters=0, departed_plain=True, can_add=True
        )


def test_retiring_added_roles_keeps_a_slot_an_add_refilled_meanwhile() -> None:
    """Retire stops the processes it saw; if its cluster left again right after it
    rejoined, an ``add`` may have started a new process for the same role meanwhile:
    that slot stays in the state file, so ``status`` and ``down`` still see it (the
    first fresh-clone run of this session left such a process running unseen)."""
    from middleware.sidecar.processes import after_retire as _after_retire

    master, slave, other = (
        RoleId.match("S", 1),
        RoleId.match_slave("S", 1, 0),
        RoleId.router("S"),
    )
    now = {master: 200, slave: 101, other: 50}  # the master's slot was refilled
    assert _after_retire(now, {master: 100, slave: 101}) == {master: 200, other: 50}


def test_a_take_over_record_reads_back_and_a_broken_one_is_named() -> None:
    from middleware.recovery.capacity import Adoption

    plan = plan_takeover(
        topology(2, 1), "X", "S", departed_masters=2, departed_plain=True, can_add=True
    )
    big = 2**159 + 1
    assert Adoption.from_document(plan.to_document((big, 5))) == Adoption("S", 2, 2, (big, 5))
    for broken in ({"by": "S"}, {**plan.to_document((1, 2)), "arc": ["x", "2"]}):
        with pytest.raises(ValueError, match="take-over record"):
            Adoption.from_document(broken)
