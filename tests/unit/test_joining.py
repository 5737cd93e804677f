"""A joining cluster's hold on its arc (routing/joining.py), driven with plain numbers."""

from __future__ import annotations

from middleware.routing.joining import Hold, JoinHold, Release


def started(recorded: str | None = "left", listed: bool = True) -> tuple[JoinHold, list]:
    hold = JoinHold()
    return hold, hold.start(
        recorded=recorded, listed_as_joined=listed, bound_s=5.0, clusters=4, now=0.0
    )


def test_a_rejoining_router_holds_until_the_count_told_is_routed() -> None:
    hold, effects = started("left")
    assert effects == [Hold(5.0)]
    assert hold.routed(0.25) == []  # one of them: the count not told yet
    assert hold.told(3, 0.375) == []
    assert hold.routed(0.4375) == []
    assert hold.routed(0.5) == [Release(3, 3, 0.5, timed_out=False)]
    assert hold.expired(5.0) == []  # released once
    assert hold.routed(5.125) == []


def test_the_count_may_come_before_what_it_counts() -> None:
    hold, _ = started("left")
    assert hold.told(1, 0.125) == []
    assert hold.routed(0.25) == [Release(1, 1, 0.25, timed_out=False)]
    hold, _ = started("left")
    assert hold.told(0, 0.125) == [Release(0, 0, 0.125, timed_out=False)]  # nothing to hand


def test_the_bound_lets_the_events_go_and_says_how_far_it_got() -> None:
    hold, _ = started("left")
    hold.routed(0.125)
    assert hold.expired(5.0) == [Release(1, None, 5.0, timed_out=True)]
    assert hold.told(1, 5.125) == []


def test_who_joins() -> None:
    assert started(None, listed=False)[1] == [Hold(5.0)]  # listed as joining later
    assert started("joined", listed=False)[1] == []  # a router promoted after the join
    assert started(None, listed=True)[1] == []  # part of the ring from the start
    hold = JoinHold()
    no_bound = hold.start(recorded="left", listed_as_joined=True, bound_s=0, clusters=4, now=0)
    alone = hold.start(recorded="left", listed_as_joined=True, bound_s=5, clusters=1, now=0)
    assert no_bound == [] and alone == []
