"""A slave following its master (routing/follower.py), driven with plain numbers: the
rule of two looks, the lease, fencing an older reign, the election's votes."""

from __future__ import annotations

from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import Kind
from middleware.recovery.fencing import Reign, Trust
from middleware.routing.follower import (
    Count,
    Elected,
    Follower,
    Leader,
    NameLease,
    Promote,
    Refuse,
    Signal,
    Suspected,
)
from middleware.routing.messages import Fence, Vote

SLAVES = [RoleId.router_slave("A", j) for j in range(2)]
MASTER = SLAVES[0].master


def follower(slave: int = 0, trust: Trust | None = None) -> Follower:
    return Follower(
        SLAVES[slave],
        SLAVES,
        interval_s=0.1,
        misses=5,
        ceiling_s=0.0,
        trust=trust or Trust(),
    )


def vote(sender: RoleId, kind: Kind, reign: Reign | None = None) -> Vote:
    """The vote ``sender`` signals (a COORDINATOR names the reign it won)."""
    won = reign or Reign()
    return Vote(kind=kind, broker=sender.owner, epoch=won.epoch, by=won.by)


def heard(f: Follower, now: float, lease: str | None = None) -> list:
    return f.beat(MASTER.owner, Reign(), "p-master", lease, stale=False, now=now)


def test_a_master_is_taken_for_failed_at_the_second_look_that_finds_it_silent() -> None:
    f = follower(0)
    assert heard(f, 0.0, "lease-1") == [NameLease("lease-1")]
    assert f.look(0.3, 0.0) == []  # under the floor (5 x 0.1 s)
    assert f.look(0.6, 0.0) == []  # first look that suspects
    effects = f.look(0.65, 0.0)  # second: slave-0 outranks the others: it wins at once
    assert effects[0] == Suspected(0.65, "beats")
    assert Signal(SLAVES[1], vote(SLAVES[0], Kind.COORDINATOR, Reign.of_winner(1, 0))) in effects
    assert Promote("elected: its master went silent", Reign.of_winner(1, 0)) in effects
    assert any(isinstance(e, Elected) for e in effects)
    assert f.failed_at == 0.0 and f.look(0.7, 0.0) == []  # promoted once


def test_a_late_look_is_no_proof_of_a_death() -> None:
    f = follower(1)
    heard(f, 0.0)
    assert f.look(0.6, 0.0) == []  # first look that suspects
    assert f.look(1.0, 0.35) == []  # this slave was paused itself: looks again
    assert f.look(1.05, 0.0) == []  # first look again
    effects = f.look(1.1, 0.0)
    assert Suspected(1.1, "beats") in effects
    assert Signal(SLAVES[0], vote(SLAVES[1], Kind.ELECTION)) in effects  # asks the higher slave


def test_the_master_s_lease_returned_elects_at_once_and_once() -> None:
    f = follower(0)
    heard(f, 0.0)
    effects = f.lease_returned(0.05)
    assert effects[0] == Suspected(0.05, "lease") and any(isinstance(e, Promote) for e in effects)
    assert f.lease_returned(0.06) == []


def test_an_older_reign_s_beat_is_fenced_and_not_heard() -> None:
    f = follower(1, Trust(Reign.of_winner(1, 0)))
    effects = f.beat(MASTER.owner, Reign(), "p-old", "lease-old", stale=False, now=0.0)
    fence = Fence(broker=SLAVES[1].owner, epoch=1, by=-1)  # the reign it trusts
    assert effects == [Count("fences_sent"), Signal("p-old", fence)]
    assert f.beat(MASTER.owner, Reign(), None, None, stale=False, now=0.0) == [Count("fences_sent")]
    stranger = f.beat("A/router/slave-7", Reign(), None, None, stale=False, now=0.0)
    assert isinstance(stranger[0], Refuse) and "not A/" in stranger[0].reason, stranger
    # a stale beat (sent before its lease's connection closed) is no sign of life
    assert f.beat(MASTER.owner, Reign.of_winner(1, 0), None, "l", stale=True, now=0.0) == []


def test_votes_from_strangers_and_false_coordinators_are_refused() -> None:
    f = follower(1)
    assert isinstance(f.vote("B/router/slave-0", Kind.ELECTION, Reign(), 0.0)[0], Refuse)
    claim = Reign.of_winner(1, 1)  # slave-0 claiming slave-1's win
    assert isinstance(f.vote(SLAVES[0].owner, Kind.COORDINATOR, claim, 0.0)[0], Refuse)
    won = Reign.of_winner(1, 0)
    assert f.vote(SLAVES[0].owner, Kind.COORDINATOR, won, 0.0) == [Leader(SLAVES[0])]
    assert f.trust.reign == won
    stale = f.vote(SLAVES[0].owner, Kind.COORDINATOR, Reign.of_winner(0, 0), 0.0)
    assert isinstance(stale[-1], Refuse)  # epoch 0: no win


def test_the_operator_s_take_over_tells_the_other_slaves_first() -> None:
    f = follower(1)
    won = vote(SLAVES[1], Kind.COORDINATOR, Reign.of_winner(1, 1))
    assert f.take_over() == [Signal(SLAVES[0], won)]
    assert f.winning_reign() == Reign.of_winner(1, 1)
    heard(f, 0.0)
    assert f.lease_returned(0.1) == []  # it won already: no election


def test_a_retire_stops_the_slave_only_from_its_master_of_a_reign_it_trusts() -> None:
    """A master that hears a second process beating as a slave tells one to stop; the
    process obeys its own master of a reign not older than the one it trusts.  A retire
    from a frozen master not stepped down yet (older reign) or for another role is
    refused: nothing stops."""
    from middleware.routing.follower import StopServing

    f = follower(1, Trust(Reign.of_winner(1, 0)))
    me = SLAVES[1].owner
    assert f.retire(MASTER.owner, me, Reign.of_winner(1, 0)) == [
        Count("retired"),
        StopServing(MASTER.owner),
    ]
    stale = f.retire(MASTER.owner, me, Reign())
    assert isinstance(stale[0], Refuse) and "older reign" in stale[0].reason
    assert isinstance(f.retire(MASTER.owner, SLAVES[0].owner, Reign.of_winner(1, 0))[0], Refuse)
    assert isinstance(f.retire("B/router", me, Reign.of_winner(1, 0))[0], Refuse)
    f.take_over()  # promoted: it serves the master's role next, not stopped
    assert f.retire(MASTER.owner, me, Reign.of_winner(2, 0)) == []


def test_a_slave_whose_master_beats_looks_twice_a_second_and_in_time() -> None:
    """The driver sleeps as long as ``next_look_in`` says: at most half the detection
    floor while the master beats, to the moment it would be suspected once it is
    silent, half a beat interval between the two looks and during an election."""
    f = follower(1)
    assert f.next_look_in(0.0) == 0.25  # not watched yet: half the floor (5 x 0.1 s)
    heard(f, 0.0)
    for now in (0.1, 0.2, 0.3):  # beats every 0.1 s: every look is half a floor away
        heard(f, now)
        assert f.next_look_in(now) == 0.25
    # silent from 0.3: suspected after 0.8; a look comes then, not up to 0.1 s later
    assert f.look(0.55, 0.0) == [] and f.next_look_in(0.55) == 0.25
    wait = f.next_look_in(0.6)
    assert abs(0.6 + wait - 0.801) < 1e-9
    assert f.look(0.801, 0.0) == []  # the first look that suspects
    assert f.next_look_in(0.801) == 0.05  # the second, half an interval later
    effects = f.look(0.851, 0.0)
    assert Suspected(0.851 - 0.3, "beats") in effects  # slave-1 asks slave-0: electing
    assert f.next_look_in(0.851) == 0.05  # the election's timers are the looks


def test_a_quiet_master_s_beats_excuse_its_gap_and_make_the_slave_quiet() -> None:
    f = follower()
    heard(f, 0.0)
    assert not f.master_quiet
    f.beat(MASTER.owner, Reign(), "p-master", None, stale=False, now=0.1, next_s=2.0)
    assert f.master_quiet  # the slave's own beats may be quiet too
    assert f.look(2.0, 0.0) == [] and f.look(2.5, 0.0) == []  # 2.4 s silent: excused
    f.beat(MASTER.owner, Reign(), "p-master", None, stale=False, now=2.6)  # busy again
    assert not f.master_quiet
    assert f.look(3.2, 0.0) == []  # the first look that finds it silent past the floor
    assert any(isinstance(e, Suspected) for e in f.look(3.3, 0.0))  # the usual rule again
