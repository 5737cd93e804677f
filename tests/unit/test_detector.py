"""``recovery.detector``: who has been silent too long."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.recovery import (
    FailureDetector,
)
from middleware.routing.ids import RoleId

MASTER = RoleId.match("B", 0)


def test_a_peer_is_suspected_after_its_misses_and_trusted_again_when_heard() -> None:
    d: FailureDetector[RoleId] = FailureDetector(0.1, 5)
    d.watch([MASTER], now=10.0)
    assert d.suspects(10.49) == set() and d.alive(10.49) == {MASTER}  # grace at start
    assert d.suspects(10.51) == {MASTER}
    d.heard(MASTER, 10.6)
    assert d.suspects(11.0) == set()
    d.heard(RoleId.router("B"), 11.0)  # not watched: ignored
    assert d.alive(11.0) == {MASTER}
    with pytest.raises(ValueError):
        FailureDetector(0, 5)


@given(st.lists(st.floats(0, 0.49), min_size=1, max_size=50))
def test_beats_closer_than_the_timeout_are_never_suspected(gaps: list[float]) -> None:
    d: FailureDetector[str] = FailureDetector(0.1, 5)
    now = 0.0
    d.watch(["m"], now)
    for gap in gaps:
        now += gap
        assert d.suspects(now) == set()
        d.heard("m", now)


def test_a_master_just_elected_gets_one_more_timeout_for_its_first_beat() -> None:
    d: FailureDetector[RoleId] = FailureDetector(0.1, 5)
    d.watch([MASTER], now=0.0)
    d.grace(MASTER, until=1.0)
    assert d.suspects(0.99) == set() and d.suspects(1.01) == {MASTER}
    d.grace(RoleId.router("B"), until=5.0)  # not watched: nothing
    assert d.alive(1.01) == set()


def test_a_peer_whose_lease_came_back_is_suspected_at_once_until_heard() -> None:
    d: FailureDetector[RoleId] = FailureDetector(0.1, 5)
    d.watch([MASTER], now=10.0)
    d.lost(MASTER)
    assert d.suspects(10.01) == {MASTER} and d.alive(10.01) == set()
    d.heard(MASTER, 10.02)  # a new incarnation beats
    assert d.suspects(10.03) == set()
    d.lost(RoleId.router("B"))  # not watched: ignored
    assert d.suspects(10.03) == set()
    d.lost(MASTER)
    d.grace(MASTER, until=11.0)  # a master just elected
    assert d.suspects(10.5) == set()
