"""``recovery.fencing``: reigns, and which master a slave trusts."""

from __future__ import annotations

from middleware.recovery import (
    Reign,
    Trust,
    Verdict,
)
from middleware.recovery.fencing import Doubt


def test_a_slave_trusts_the_newest_reign_and_fences_older_ones() -> None:
    trust = Trust()
    assert trust.judge(Reign()) is Verdict.TRUST  # the master as started
    won = trust.successor(1)
    assert won == Reign(1, -2) and won.slave == 1 and str(won) == "epoch 1 (slave-1)"
    assert trust.judge(won) is Verdict.TRUST and trust.reign == won
    assert trust.judge(Reign()) is Verdict.FENCE  # the old master came back
    # two winners of one epoch (a race): the one that was the higher slave stays
    assert trust.judge(Reign.of_winner(1, 0)) is Verdict.TRUST
    assert trust.judge(won) is Verdict.FENCE
    assert trust.successor(2) == Reign(2, -3)


def test_a_master_s_rival_reign_decisions() -> None:
    """A master meeting another reign of its role: the older steps down (the other one
    fenced if it said where, or this one); a fence no slave can have is refused, an older
    or equal one is stale; stepping down goes to the slave it was, or the one the newer
    master left."""
    from middleware.recovery.fencing import (
        Refuse,
        SendFence,
        Stale,
        StepDown,
        fenced,
        rival_beat,
    )

    started, won_by_1, later = Reign(), Reign.of_winner(1, 1), Reign.of_winner(2, 0)
    lineage = {"promoted_from": None, "slaves": frozenset({0, 1})}
    assert rival_beat(won_by_1, started, "p-old", **lineage) == SendFence("p-old", won_by_1)
    assert rival_beat(won_by_1, started, None, **lineage) is None  # nowhere to send it
    assert rival_beat(won_by_1, won_by_1, "p", **lineage) is None
    assert rival_beat(started, won_by_1, "p", **lineage) == StepDown(1, won_by_1)
    assert fenced(won_by_1, later, promoted_from=1, slaves=frozenset({0})) == StepDown(1, later)
    assert fenced(later, won_by_1, **lineage) == Stale()
    assert isinstance(fenced(started, Reign(), **lineage), Refuse)  # epoch 0
    assert isinstance(fenced(started, Reign(3, 0), **lineage), Refuse)  # not a slave's
    assert fenced(started, Reign.of_winner(1, 5), **lineage) == Refuse(
        "fence of epoch 1 (slave-5): no slave-5"
    )


def test_a_reigning_master_steps_down_once_and_serves_no_more() -> None:
    """``Reigning``: the master's fencing decisions in one machine.  A rival beat of an
    older reign is fenced; one of a newer reign steps it down to the slave it was; after
    that it serves no more and nothing changes it again (a second fence is stale)."""
    from middleware.recovery.fencing import Reigning, SendFence, Stale, StepDown

    started = Reigning(Reign(), None, frozenset({0, 1}))
    assert started.serving
    assert started.rival_beat(Reign(), "p-other") is None  # its own reign: nothing
    newer = Reign.of_winner(1, 1)
    assert started.rival_beat(newer, "p-new") == StepDown(1, newer)
    assert not started.serving and started.reign == newer
    assert started.fence(Reign.of_winner(2, 0)) == Stale()
    assert started.rival_beat(Reign.of_winner(3, 0), "p") is None

    winner = Reigning(newer, 1, frozenset({0, 1}))
    assert winner.rival_beat(Reign(), "p-old") == SendFence("p-old", newer)
    assert winner.fence(Reign(1, 0)).__class__.__name__ == "Refuse"  # no slave's reign
    assert winner.serving
    assert winner.fence(Reign.of_winner(2, 0)) == StepDown(1, Reign.of_winner(2, 0))
    assert not winner.serving


def test_a_master_doubts_its_reign_after_a_pause_past_its_slaves_detection() -> None:
    """Ticks every half floor; a gap past the floor (a SIGSTOP, a starved machine) makes
    it wait before acting until a slave's beat trusts it, or the bound passes."""
    doubt = Doubt(floor_s=1.0, bound_s=2.5)
    for now in (0.0, 0.5, 1.0, 1.5):
        doubt.tick(now)
    assert doubt.wait_s(1.9) == 0.0  # 0.4 s since the last tick: no pause
    assert doubt.wait_s(5.0) == 2.5  # stopped 3.1 s: wait for its slaves
    assert doubt.wait_s(6.0) == 1.5 and doubt.doubts == 1  # one doubt, still on
    doubt.trusted()  # a slave's beat names its reign
    assert doubt.wait_s(6.1) == 0.0
    doubt.tick(9.0)  # stopped again: nobody says anything
    assert doubt.wait_s(9.0) == 2.5 and doubt.wait_s(11.5) == 0.0  # the bound passed
    assert doubt.doubts == 2 and doubt.wait_s(11.6) == 0.0


def test_a_late_tick_of_a_busy_loop_is_no_doubt() -> None:
    doubt = Doubt(floor_s=1.0, bound_s=2.5)
    doubt.tick(0.0)
    doubt.tick(0.9)  # the half-floor tick came 0.4 s late
    assert doubt.wait_s(1.0) == 0.0 and doubt.doubts == 0
