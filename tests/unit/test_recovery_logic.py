"""Failure detection and the bully election (middleware/recovery/), without a broker:
the state machines take the time and messages and return what to do."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.recovery import Become, Bully, BullyState, FailureDetector, Send
from middleware.routing.ids import RoleId

MASTER = RoleId.match("B", 0)
SLAVES = [RoleId.match_slave("B", 0, j) for j in range(3)]


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


def _drive(machines: dict[RoleId, Bully], suspect: list[RoleId], dead: set[RoleId]) -> list[RoleId]:
    """Deliver every effect (to live slaves only) until quiet; time moves past timeouts."""
    now, winners = 0.0, []
    queue: list[tuple[RoleId, Send | Become, RoleId]] = []
    for role in suspect:
        queue += [(role, e, role) for e in machines[role].master_suspected(now)]
    for _ in range(100):
        while queue:
            sender, effect, _ = queue.pop(0)
            if isinstance(effect, Become):
                winners.append(sender)
                continue
            if effect.to in dead:
                continue
            target = machines[effect.to]
            handle = {
                "election": target.on_election,
                "answer": target.on_answer,
                "coordinator": target.on_coordinator,
            }[effect.what]
            queue += [(effect.to, e, effect.to) for e in handle(sender, now)]
        now += 0.05
        for role, machine in machines.items():
            if role not in dead:
                queue += [(role, e, role) for e in machine.tick(now)]
        if not queue and all(
            m.state in (BullyState.IDLE, BullyState.WON)
            for r, m in machines.items()
            if r not in dead
        ):
            break
    return winners


@pytest.mark.parametrize("dead", [set(), {SLAVES[0]}, {SLAVES[0], SLAVES[1]}])
@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_exactly_the_highest_live_slave_takes_over(dead, order) -> None:
    machines = {s: Bully(me=s, peers=SLAVES, answer_s=0.2, coordinator_s=0.5) for s in SLAVES}
    suspect = [SLAVES[i] for i in order if SLAVES[i] not in dead]
    winners = _drive(machines, suspect, dead)
    highest = max((s for s in SLAVES if s not in dead), key=lambda s: s.rank)
    assert winners == [highest]
    for s in SLAVES:
        if s not in dead and s != highest:
            assert machines[s].state is BullyState.IDLE and machines[s].leader == highest


def test_the_highest_slave_wins_at_once_and_tells_the_others() -> None:
    bully = Bully(me=SLAVES[0], peers=SLAVES, answer_s=0.2, coordinator_s=0.5)
    assert bully.master_suspected(0.0) == [
        Send(SLAVES[1], "coordinator"),
        Send(SLAVES[2], "coordinator"),
        Become(MASTER),
    ]
    assert bully.master_suspected(0.1) == []  # once


def test_a_lower_slave_waits_for_the_coordinator_and_trusts_a_beating_master() -> None:
    bully = Bully(me=SLAVES[2], peers=SLAVES, answer_s=0.2, coordinator_s=0.5)
    assert bully.master_suspected(0.0) == [Send(SLAVES[0], "election"), Send(SLAVES[1], "election")]
    bully.on_answer(SLAVES[0], 0.05)
    assert bully.state is BullyState.WAITING and bully.tick(0.3) == []
    bully.master_heard()  # a false suspicion: the master beats again
    assert bully.state is BullyState.IDLE and bully.tick(10.0) == []
    assert bully.on_election(RoleId.match_slave("B", 0, 9), 0.0) == []  # not a peer
