"""``switching``: what a role process serves next; the take-over and the live
configure every role answers."""

from __future__ import annotations

import pytest

from middleware.errors import DeadLetter
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.recovery.fencing import Reign
from middleware.routing.messages import Configure, Takeover
from middleware.routing.switching import SWITCHES, Become, become, configured, take_over

TOPOLOGY = PhoenixTopology.model_validate({"clusters": [{"id": "A", "match_slaves": 2}]})
SLAVE = RoleId.match_slave("A", 0, 1)
MASTER = RoleId.match("A", 0)


def test_a_role_that_stopped_for_good_serves_nothing_next() -> None:
    assert (
        become(
            SLAVE, None, won=None, trusted=Reign(), failed_at=None, reply=None, topology=TOPOLOGY
        )
        is None
    )


def test_a_winner_serves_its_masters_role_in_the_reign_it_won_from_the_failure() -> None:
    won, reply = Reign(3, -2), Takeover(master=MASTER.owner, request="r", reply_to="q")
    after = become(
        SLAVE, MASTER, won=won, trusted=Reign(2, 0), failed_at=7.5, reply=reply, topology=TOPOLOGY
    )
    assert after == Become(MASTER, SLAVE, won, 7.5, reply, TOPOLOGY)


def test_a_fenced_master_serves_a_slave_that_trusts_the_reign_that_fenced_it() -> None:
    fencing = Reign(4, -1)
    after = become(
        MASTER,
        SLAVE,
        won=Reign(9, -3),
        trusted=fencing,
        failed_at=7.5,
        reply=None,
        topology=TOPOLOGY,
    )
    assert after == Become(SLAVE, None, fencing, None, None, TOPOLOGY)


def test_a_slave_told_to_take_over_its_master_serves_it_and_answers_who_asked() -> None:
    asked = Takeover(master=MASTER.owner, request="r", reply_to="q")
    assert take_over(SLAVE, asked, switching=False) == (MASTER, asked)
    unasked = Takeover(master=MASTER.owner)
    assert take_over(SLAVE, unasked, switching=False) == (MASTER, None)
    assert take_over(SLAVE, asked, switching=True) is None  # told twice: once is enough


@pytest.mark.parametrize(
    ("role", "master"),
    [
        (MASTER, MASTER.owner),  # a master is not a slave
        (SLAVE, RoleId.match("A", 1).owner),  # another master's
        (RoleId.router_slave("A", 0), MASTER.owner),
    ],
)
def test_a_take_over_for_anyone_but_its_own_master_is_dead_lettered_with_why(
    role: RoleId, master: str
) -> None:
    with pytest.raises(DeadLetter, match="not its slave"):
        take_over(role, Takeover(master=master), switching=False)


def test_a_configure_changes_only_the_switches_that_may_change_live() -> None:
    message = Configure(switches={"outer": False, "batch_max": 7, "prefix": "other"})
    changed, switches = configured(TOPOLOGY, message)
    assert switches == {"outer": False, "batch_max": 7}
    assert (changed.outer, changed.batch_max, changed.prefix) == (False, 7, TOPOLOGY.prefix)
    assert set(SWITCHES) <= set(PhoenixTopology.model_fields)


def test_a_configure_the_topology_refuses_is_dead_lettered_and_changes_nothing() -> None:
    with pytest.raises(DeadLetter, match=r"configure: .*batch_max"):
        configured(TOPOLOGY, Configure(switches={"batch_max": "many"}))
