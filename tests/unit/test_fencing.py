"""``recovery.fencing``: reigns, and which master a slave trusts."""

from __future__ import annotations

from middleware.recovery import (
    Reign,
    Trust,
    Verdict,
)


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
