"""A match master restoring a departed arc (routing/restoring.py), driven with messages."""

from __future__ import annotations

import pytest

from middleware.errors import DeadLetter
from middleware.phoenix.effects import After, Count
from middleware.phoenix.ids import RoleId
from middleware.routing.messages import Recover
from middleware.routing.restoring import (
    Read,
    ReadAhead,
    Restore,
    RestorePlan,
    restore_plan,
)


def _recover(**fields: object) -> Recover:
    message = {"cluster": "D", "arc": (1, 5), "masters": 2, "request": "r", "reply_to": "q"}
    return Recover.model_validate({**message, **fields})


def test_the_plan_names_every_departed_master_unless_told_which() -> None:
    every = restore_plan(_recover(), cluster_masters=1, index=0)
    assert every == RestorePlan((RoleId.match("D", 0).owner, RoleId.match("D", 1).owner), 1, (1, 5))
    one = restore_plan(
        _recover(owners=[RoleId.match("D", 1).owner], routed_over=2), cluster_masters=1, index=1
    )
    assert one.owners == (RoleId.match("D", 1).owner,) and one.masters == 2


def test_a_recover_it_cannot_take_is_refused_by_name() -> None:
    with pytest.raises(DeadLetter, match="no match master of D"):
        restore_plan(_recover(owners=[RoleId.router("D").owner]), cluster_masters=1, index=0)
    with pytest.raises(DeadLetter, match="no match master of D"):
        restore_plan(_recover(owners=[RoleId.match("E", 0).owner]), cluster_masters=1, index=0)
    with pytest.raises(DeadLetter, match="routed over 1 masters, this is 1"):
        restore_plan(_recover(), cluster_masters=1, index=1)


PLAN = RestorePlan(("D/match-0",), 1, (1, 5))


def test_a_leave_not_read_ahead_reads_then_restores() -> None:
    assert ReadAhead().recover("D", PLAN, prepare=False) == [Read("D", PLAN, 1), Restore(1)]


def test_a_suspected_leave_is_read_ahead_and_the_leave_restores_that_read() -> None:
    ahead = ReadAhead(keep_s=60.0)
    assert ahead.recover("D", PLAN, prepare=True) == [
        Read("D", PLAN, 1),
        After(60.0, ("D", 1)),
        Count("prepared"),
    ]
    assert ahead.in_use() == {1}
    assert ahead.recover("D", PLAN, prepare=False) == [Restore(1)]  # not read again
    assert ahead.in_use() == set()
    assert ahead.forget("D", 1) == []  # the timer later: nothing left to forget


def test_a_read_for_another_plan_is_not_used_and_an_unused_one_is_forgotten() -> None:
    ahead = ReadAhead()
    ahead.recover("D", PLAN, prepare=True)
    other = RestorePlan(("D/match-0",), 2, (1, 5))  # the ring changed meanwhile
    assert ahead.recover("D", other, prepare=False) == [Read("D", other, 2), Restore(2)]
    ahead.recover("D", PLAN, prepare=True)
    assert ahead.forget("D", 1) == []  # an older read's timer
    assert ahead.forget("D", 3) == [Count("prepared_unused")]
    ahead.recover("D", PLAN, prepare=True)
    ahead.joined("D")  # back before it left: nothing kept
    assert ahead.in_use() == set()
