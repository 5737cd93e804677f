"""RoleId (middleware/routing/ids.py): every name of a role built and parsed back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.phoenix.ids import RoleId, RoleKind, role_queues
from middleware.phoenix.protocol import ClusterSpec, PhoenixTopology

clusters = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
numbers = st.integers(0, 63)


@st.composite
def role_ids(draw: st.DrawFn) -> RoleId:
    kind = draw(st.sampled_from(RoleKind))
    index = draw(numbers) if kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE) else 0
    slave = draw(numbers) if kind.is_slave else 0
    return RoleId(draw(clusters), kind, index, slave)


@given(role_ids(), st.from_regex(r"[a-z][a-z0-9.]{0,10}", fullmatch=True))
def test_every_name_parses_back_to_the_same_id(role: RoleId, prefix: str) -> None:
    assert RoleId.from_owner(role.owner) == role
    assert RoleId.from_key(role.key) == role
    assert RoleId.from_inbox(prefix, role.inbox(prefix)) == role
    assert RoleId.from_inbox(prefix, role.control(prefix)) == role
    assert role.master.kind is role.kind.master_kind and not role.master.is_slave


@given(role_ids(), role_ids())
def test_distinct_ids_have_distinct_names(a: RoleId, b: RoleId) -> None:
    if a != b:
        assert a.owner != b.owner and a.key != b.key and a.inbox("p") != b.inbox("p")


def test_the_names_are_the_ones_stores_and_deployments_already_hold() -> None:
    """Persisted stores and phoenix.json written by earlier versions keep working."""
    slave = RoleId.match_slave("B", 0, 1)
    assert slave.owner == "B/match-0/slave-1"
    assert slave.key == "B/matcher-0-slave-1"
    assert slave.inbox("phoenix") == "phoenix.B.match.0.slave.1"
    assert slave.master.control("phoenix") == "phoenix.B.match.0.control"
    assert slave.log_file == "phoenix-B-matcher-0-slave-1.log"
    assert RoleId.router_slave("A", 2).owner == "A/router-slave-2"
    assert RoleId.router_slave("A", 2).inbox("px") == "px.A.router.slave.2"
    assert RoleId.router("A").key == RoleId.router("A").owner == "A/router"


@pytest.mark.parametrize(
    "text", ["B/match-x", "B/router-slave-", "B", "", "B/match-0/slave-", "a b/router", "B/evil"]
)
def test_a_name_that_is_no_role_is_refused_by_name(text: str) -> None:
    with pytest.raises(ValueError, match="not a Phoenix role"):
        RoleId.from_owner(text)


def test_ids_out_of_shape_are_refused() -> None:
    with pytest.raises(ValueError):
        RoleId(cluster="A", kind=RoleKind.ROUTER, index=1)
    with pytest.raises(ValueError):
        RoleId(cluster="A", kind=RoleKind.MATCH, slave=1)
    with pytest.raises(ValueError):
        RoleId.match("A", -1)


def test_rank_puts_the_master_first_then_the_lowest_slave_number() -> None:
    master = RoleId.match("A", 0)
    replicas = [RoleId.match_slave("A", 0, j) for j in (2, 0, 1)] + [master]
    ranked = sorted(replicas, key=lambda r: r.rank, reverse=True)
    assert ranked == [master, *(RoleId.match_slave("A", 0, j) for j in (0, 1, 2))]


def test_a_cluster_enumerates_its_roles_and_the_topology_knows_them() -> None:
    spec = ClusterSpec(id="B", match_masters=2, match_slaves=1, routing_slaves=2)
    roles = list(RoleId.of_cluster(spec))
    assert [r.key for r in roles] == [
        "B/router",
        "B/router-slave-0",
        "B/router-slave-1",
        "B/matcher-0",
        "B/matcher-1",
        "B/matcher-0-slave-0",
        "B/matcher-1-slave-0",
    ]
    topology = PhoenixTopology(clusters=(spec,), prefix="px")
    assert all(r.in_topology(topology) for r in roles)
    assert not RoleId.match_slave("B", 0, 1).in_topology(topology)  # no second slave
    assert not RoleId.router("Z").in_topology(topology)
    assert len(role_queues(topology)) == 3 * 7  # an inbox, a control and a parked queue each
