"""``switching.become``: what a role process serves next."""

from __future__ import annotations

from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.recovery.fencing import Reign
from middleware.routing.messages import Takeover
from middleware.routing.switching import Become, become

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
