"""``recovery.detector``: who has been silent too long."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.phoenix.ids import RoleId
from middleware.recovery import (
    FailureDetector,
)

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


def _beats(detector, peer, gaps, start=0.0) -> float:
    now = start
    detector.watch([peer], now)
    for gap in gaps:
        now += gap
        detector.heard(peer, now)
    return now


def test_regular_beats_are_suspected_after_the_floor() -> None:
    detector = FailureDetector[str](0.1, 5, ceiling_s=2.0)
    now = _beats(detector, "m", [0.1] * 50)
    assert detector.timeout_for("m") == detector.timeout_s == 0.5
    assert "m" not in detector.suspects(now + 0.49)
    assert "m" in detector.suspects(now + 0.51)


def test_irregular_beats_raise_the_timeout_up_to_the_ceiling() -> None:
    import random

    rng = random.Random(1)
    busy = FailureDetector[str](0.1, 5, ceiling_s=2.0)
    now = _beats(busy, "m", [rng.uniform(0.1, 0.6) for _ in range(200)])
    assert 1.0 < busy.timeout_for("m") <= 2.0
    assert "m" not in busy.suspects(now + 0.8)  # a late beat on a busy machine: no election
    stalled = FailureDetector[str](0.1, 5, ceiling_s=2.0)
    now = _beats(stalled, "m", [rng.uniform(0.1, 5.0) for _ in range(200)])
    assert stalled.timeout_for("m") == 2.0
    assert "m" in stalled.suspects(now + 2.01)  # never waits past the ceiling


def test_the_fixed_rule_without_a_ceiling_and_the_first_wait_is_no_gap() -> None:
    fixed = FailureDetector[str](0.1, 5)
    now = _beats(fixed, "m", [0.05, 0.9, 0.05, 0.9])
    assert fixed.timeout_for("m") == 0.5 and "m" in fixed.suspects(now + 0.6)
    late_start = FailureDetector[str](0.1, 5, ceiling_s=2.0)
    now = _beats(late_start, "m", [3.0, 0.1, 0.1, 0.1, 0.1])  # 3 s to the first beat
    assert late_start.timeout_for("m") == 0.5


def test_a_lost_peer_is_suspected_at_once_and_a_grace_holds_silence_off() -> None:
    detector = FailureDetector[str](0.1, 5, ceiling_s=2.0)
    now = _beats(detector, "m", [0.1] * 10)
    detector.lost("m")
    assert "m" in detector.suspects(now + 0.01)
    detector.grace("m", now + 3.0)
    assert "m" not in detector.suspects(now + 2.9)
    assert "m" in detector.suspects(now + 3.1)


def test_a_quiet_peer_s_announced_gap_is_excused_and_not_learnt() -> None:
    detector = FailureDetector[str](0.2, 5, ceiling_s=2.0)
    now = _beats(detector, "m", [0.2] * 20)
    assert detector.timeout_for("m") == 1.0
    detector.announced("m", 2.0)  # its next beat comes within 2 s
    assert detector.timeout_for("m") == pytest.approx(2.8)
    assert "m" not in detector.suspects(now + 2.7)
    assert detector.silent_for("m", now + 2.0) == pytest.approx(0.2)  # beyond the excuse
    assert "m" in detector.suspects(now + 2.81)  # frozen while quiet: found after 2.8 s
    for _ in range(5):  # quiet beats, 2 s apart: never suspected, never learnt as gaps
        now += 2.0
        assert "m" not in detector.suspects(now - 0.01)
        detector.heard("m", now)
        detector.announced("m", 2.0)
    now += 2.0
    detector.heard("m", now)  # busy again: a beat at the usual pace
    detector.announced("m", None)
    assert detector.timeout_for("m") == 1.0  # judged by its usual gaps at once
    assert "m" in detector.suspects(now + 1.01)
    detector.announced("x", 2.0)  # not watched: nothing
    assert detector.silent_for("x", now) is None


def test_a_quiet_peer_keeps_the_timeout_its_irregular_beats_earned() -> None:
    import random

    rng = random.Random(2)
    busy = FailureDetector[str](0.2, 5, ceiling_s=2.0)
    now = _beats(busy, "m", [rng.uniform(0.2, 0.8) for _ in range(200)])
    earned = busy.timeout_for("m")
    assert 1.0 < earned <= 2.0
    busy.announced("m", 2.0)
    assert busy.timeout_for("m") == pytest.approx(earned + 1.8)
    assert "m" not in busy.suspects(now + earned + 1.7)
