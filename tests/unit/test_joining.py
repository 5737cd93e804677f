"""A joining cluster's hold on its arc (routing/joining.py), driven with plain numbers."""

from __future__ import annotations

import logging

import pytest

from middleware.phoenix.effects import After, Box, Count, Send
from middleware.phoenix.ids import RoleId
from middleware.routing.handback import HandBack, HandedBack, NotHandedOver, OpenRound, Retire
from middleware.routing.joining import (
    HandedArcs,
    Hold,
    JoinHold,
    Release,
    handover_plan,
)
from middleware.routing.matching import Event
from middleware.routing.messages import HandedOver, Handover, Publish


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


def test_only_a_release_that_may_miss_some_of_the_hand_over_is_a_warning() -> None:
    assert Release(3, 3, 0.5, timed_out=False).said() == (
        logging.INFO,
        "the arc's hand-over is here (3 subscriptions); its events go on, 0.500 s after the start",
    )
    level, words = Release(1, 3, 5.0, timed_out=True).said()
    assert level == logging.WARNING and "(1 of 3 routed)" in words
    level, words = Release(2, None, 12.9, timed_out=True).said()
    assert level == logging.WARNING
    assert "(2 routed, no count came: a resumed hand-back sends none)" in words


def test_word_that_the_hand_over_is_under_way_starts_the_bound_again() -> None:
    """A previous owner behind with its own events is waited for as long as it says it
    is handing over; once it falls silent, the bound passes from its last word."""
    hold, _ = started("left")
    assert hold.noted(4.0) == []
    assert hold.expired(5.0) == [After(4.0, "join")]  # 5 s from the word, not the start
    hold.noted(8.0)
    assert hold.expired(9.0) == [After(4.0, "join")]
    assert hold.told(0, 12.0) == [Release(0, 0, 12.0, timed_out=False)]
    hold, _ = started("left")
    hold.noted(1.0)
    assert hold.expired(6.0) == [Release(0, None, 6.0, timed_out=True)]  # silent 5 s
    assert hold.noted(6.5) == [] and hold.expired(11.5) == []  # released once


def test_the_bound_runs_from_the_joins_announcement_not_the_routers_start() -> None:
    """``phoenix join`` announces the join once every role of the joiner serves, which on
    a busy machine came more than the bound after the router's start: a bound from the
    start let the events go as the others began routing them here (386 lost)."""
    hold = JoinHold()
    effects = hold.start(
        recorded=None, listed_as_joined=False, bound_s=5.0, clusters=4, now=0.0, announce_s=65.0
    )
    assert effects == [Hold(5.0)]
    assert hold.expired(5.0) == [After(60.0, "join")]  # not announced yet: still held
    assert hold.announce(6.0) == [After(5.0, "join")]
    assert hold.expired(8.0) == [After(3.0, "join")]
    assert hold.expired(11.0) == [Release(0, None, 11.0, timed_out=True)]
    assert hold.expired(65.0) == []  # the start's timer, late: released once
    hold2 = JoinHold()
    hold2.start(
        recorded="left", listed_as_joined=True, bound_s=5.0, clusters=4, now=0.0, announce_s=65.0
    )
    assert hold2.announce(6.0) == [After(5.0, "join")]
    assert hold2.expired(10.0) == [After(1.0, "join")]  # 5 s from the announcement
    assert hold2.noted(10.5) == []  # the previous owner's word: from there
    assert hold2.expired(11.0) == [After(4.5, "join")]
    assert hold2.told(0, 12.0) == [Release(0, 0, 12.0, timed_out=False)]
    assert hold2.announce(13.0) == [] and hold2.expired(20.0) == []  # released once


def test_without_an_announcement_the_hold_ends_after_announce_s() -> None:
    """A join whose announcer died before telling: nothing of the arc comes from the
    others; what the joiner's own publishers sent of it goes on after ``announce_s``."""
    hold = JoinHold()
    hold.start(
        recorded="left", listed_as_joined=True, bound_s=5.0, clusters=4, now=0.0, announce_s=65.0
    )
    assert hold.expired(5.0) == [After(60.0, "join")]
    assert hold.expired(65.0) == [Release(0, None, 65.0, timed_out=True)]


def test_a_late_timer_reads_what_came_meanwhile_before_letting_the_events_go() -> None:
    """The router did not run past its bound (a busy machine, a stop): the previous
    owner's word or count may wait unread behind the timer, so a quarter of the bound
    more is given; a timer on time lets the events go."""
    hold, _ = started("left")
    assert hold.expired(8.0) == [After(1.25, "join")]  # 3 s late: excused
    assert hold.told(0, 8.1) == [Release(0, 0, 8.1, timed_out=False)]  # what waited
    hold, _ = started("left")
    assert hold.expired(8.0) == [After(1.25, "join")]
    assert hold.expired(9.25) == [Release(0, None, 9.25, timed_out=True)]  # on time
    hold, _ = started("left")
    assert hold.expired(8.0) == [After(1.25, "join")]
    assert hold.expired(11.0) == [After(1.25, "join")]  # late again: excused again
    hold, _ = started("left")
    assert hold.expired(6.0) == [Release(0, None, 6.0, timed_out=True)]  # 1 s late: on time


def test_a_router_elected_while_the_hold_is_open_resumes_it_as_announced() -> None:
    """The joiner's router was killed after the join's announcement (the others record
    the cluster as joined and route its arc here) and before the hand-over was all
    routed: its elected slave, which reads "joined", holds again because the hold's own
    record is open (it let the events go unheld: 1 155 of 2 220 lost), with the bound
    running from its start and from every word of the previous owner."""
    hold = JoinHold()
    effects = hold.start(
        recorded="joined",
        listed_as_joined=False,
        bound_s=5.0,
        clusters=4,
        now=10.0,
        announce_s=65.0,
        resumed=True,
    )
    assert effects == [Hold(5.0)] and hold.holding
    hold.noted(13.0)
    assert hold.expired(15.0) == [After(3.0, "join")]  # the word of 13.0, not the start
    released = hold.expired(18.0)
    assert released == [Release(0, None, 8.0, timed_out=True, resumed=True)]
    level, words = released[0].said()  # the way a resumed hold ends: not a warning
    assert level == logging.INFO and "resumed hold let go" in words
    assert (
        JoinHold().start(  # a hold released (or never opened): nothing to resume
            recorded="joined", listed_as_joined=False, bound_s=5.0, clusters=4, now=0.0
        )
        == []
    )


def test_the_count_is_a_word_so_a_count_never_reached_ends_the_hold_a_bound_after_it() -> None:
    """An elected router counts only what it routed itself: its predecessor routed some
    of what was told.  Its hold ends a bound after the count, not ``announce_s`` after
    its start."""
    hold = JoinHold()
    hold.start(
        recorded="left", listed_as_joined=True, bound_s=5.0, clusters=4, now=0.0, announce_s=65.0
    )
    hold.routed(0.5)
    assert hold.told(3, 1.0) == []  # 1 of 3 routed here
    assert hold.expired(5.0) == [After(1.0, "join")]
    assert hold.expired(6.0) == [Release(1, 3, 6.0, timed_out=True)]


def test_who_joins() -> None:
    assert started(None, listed=False)[1] == [Hold(5.0)]  # listed as joining later
    assert started("joined", listed=False)[1] == []  # a router promoted after the join
    assert started(None, listed=True)[1] == []  # part of the ring from the start
    hold = JoinHold()
    no_bound = hold.start(recorded="left", listed_as_joined=True, bound_s=0, clusters=4, now=0)
    alone = hold.start(recorded="left", listed_as_joined=True, bound_s=5, clusters=1, now=0)
    assert no_bound == [] and alone == []


# ------------------------------------------------------- the previous owner's hand-back


M0, M1 = "S/match-0", "S/match-1"


def _round(retiring: tuple[str, ...] = (M1,)) -> tuple[HandBack, list]:
    back = HandBack(answer_s=10.0, tell_s=5.0, retry_s=0.25, cluster="S", reply_to="S.process.p")
    return back, back.start("r1", "D", (1, 2), [M0, M1], retiring)


def _tell(count: int) -> Send:
    told = HandedOver(cluster="D", by="S", count=count)
    return Send(RoleId.router("D"), told, priority=0, then="r1")


def _under_way() -> list:
    note = HandedOver(cluster="D", by="S", count=None)
    every = 5.0 / 4
    return [
        Send(RoleId.router("D"), note, bound_s=every, missed="handover_notes_missed"),
        After(every, ("note", "r1")),
    ]


def test_the_hand_back_asks_every_master_then_tells_the_sum_then_retires() -> None:
    back, effects = _round()
    give = Handover(cluster="D", arc=(1, 2), request="r1", reply_to="S.process.p")
    assert effects == [
        Send(RoleId.from_owner(M0), give, box=Box.INBOX, priority=0),
        Send(RoleId.from_owner(M1), give, box=Box.INBOX, priority=0),
        After(10.0, "r1"),
        *_under_way(),
    ]
    assert back.answered("r1", M0, 3, now=1.0) == []
    assert back.answered("r1", M0, 3, now=1.0) == []  # twice: counted once
    assert back.answered("r1", M1, 4, now=1.5) == [_tell(7)]
    assert back.answered("r1", M1, 4, now=1.6) == []  # late: the count is told
    assert back.expired("r1") == []  # answered in time: the bound does nothing
    assert back.sent("r1", None, now=1.7) == [Retire("D", (M1,), 7), HandedBack("D")]
    assert back.rounds == {}


def test_a_round_resumed_by_an_elected_router_ends_with_a_word_not_a_short_count() -> None:
    """The previous owner's router was killed mid-hand-back: the masters' answers to its
    round went to its process queue, so its elected slave's round counts only what was
    left (0 here, 1 was sent); told 0, the joiner would let go while the one sent could
    still be on its way.  The resumed round words it instead (the joiner's bound runs
    from the word), and ends as any round."""
    back = HandBack(answer_s=10.0, tell_s=5.0, cluster="S", reply_to="S.process.q")
    effects = back.start("r2", "D", (1, 2), [M0, M1], [M1], resumed=True)
    note = HandedOver(cluster="D", by="S", count=None)
    assert effects[-2:] == [  # the joiner holds on meanwhile
        Send(RoleId.router("D"), note, bound_s=1.25, missed="handover_notes_missed"),
        After(1.25, ("note", "r2")),
    ]
    back.answered("r2", M0, 0, now=1.0)
    last = HandedOver(cluster="D", by="S", count=None)
    assert back.answered("r2", M1, 0, now=1.5) == [
        Send(RoleId.router("D"), last, priority=0, then="r2")
    ]
    assert back.sent("r2", None, now=1.6) == [Retire("D", (M1,), 0), HandedBack("D")]


def test_a_count_that_cannot_be_told_is_tried_until_the_joiners_bound() -> None:
    back, _ = _round(retiring=())
    back.answered("r1", M0, 1, now=0.0)
    assert back.answered("r1", M1, 1, now=0.0) == [_tell(2)]
    assert back.sent("r1", "link down", now=1.0) == [After(0.25, ("tell", "r1"))]
    assert back.expired(("tell", "r1")) == [_tell(2)]  # the retry's timer: told again
    assert back.sent("r1", "link down", now=4.9) == [After(0.25, ("tell", "r1"))]
    assert back.sent("r1", "link down", now=5.0) == [
        NotHandedOver("D", 2, told=True, error="link down"),
        HandedBack("D"),
    ]  # nothing to retire: none added
    assert back.rounds == {} and back.told("r1") == []
    assert back.expired(("tell", "r1")) == []  # a retry's timer after the round ended


def test_the_joiner_hears_the_hand_over_is_under_way_until_the_masters_all_answered() -> None:
    back, _ = _round()
    assert back.expired(("note", "r1")) == _under_way()  # M0 and M1 still at it
    back.answered("r1", M0, 1, now=2.0)
    assert back.expired(("note", "r1")) == _under_way()
    assert back.answered("r1", M1, 1, now=3.0) == [_tell(2)]
    assert back.expired(("note", "r1")) == []  # the count is being told: no more word
    back, _ = _round()
    back.expired("r1")  # the masters' bound passed: the round ended, the joiner's runs
    assert back.expired(("note", "r1")) == []
    quiet = HandBack(answer_s=10.0, tell_s=0.0, cluster="S")  # the joiner does not hold
    assert quiet.start("r2", "D", (1, 2), [M0])[-1] == After(10.0, "r2")


def test_masters_that_do_not_answer_in_time_keep_the_added_ones_running() -> None:
    back, _ = _round()
    back.answered("r1", M0, 5, now=0.0)
    assert back.expired("r1") == [NotHandedOver("D", 5, told=False), HandedBack("D")]  # no Retire
    assert back.answered("r1", M1, 1, now=11.0) == []  # too late
    assert back.rounds == {}


def test_answers_of_an_unknown_master_or_round_are_ignored() -> None:
    back, _ = _round()
    assert back.answered("r1", "T/match-0", 9, now=0.0) == []
    assert back.answered("other", M0, 9, now=0.0) == []
    assert back.sent("r1", "x", now=0.0) == []  # not telling yet
    assert back.rounds["r1"].waiting == {M0, M1}


def test_the_plan_hands_over_the_arcs_subscriptions_and_removals_only() -> None:
    plan = handover_plan(
        [("s1", "record-1")], {"s2": "in-arc", "s3": "elsewhere"}, lambda t: t == "in-arc"
    )
    assert plan.subscriptions == [("s1", "record-1")] and plan.removals == [("s2", "in-arc")]


# ------------------------------------------- what reaches a master after its hand-over


def test_what_reaches_a_master_after_its_arc_was_handed_over_goes_on_to_the_joiner() -> None:
    """Routed there by a routing master that had not heard of the join (stopped across
    it and resumed before it was fenced): passed on to the joiner's routing master, at
    its priority, until the joiner leaves the ring again."""
    arcs = HandedArcs()
    late = Publish(event_type="quotes", event=Event(event_type="quotes", attributes={}), priority=4)
    assert arcs.pass_on(late) == []  # nothing handed over: matched here
    arcs.handed("D", lambda event_type: event_type.startswith("q"))
    assert arcs.pass_on(late) == [
        Count("passed_on_after_handover"),
        Send(RoleId.router("D"), late, box=Box.INBOX, priority=4),
    ]
    other = late.model_copy(update={"event_type": "news"})
    assert arcs.pass_on(other) == [] and arcs.joiner("news") is None
    arcs.left("X")  # another cluster: no change
    assert arcs.joiner("quotes") == "D"
    arcs.left("D")  # the arc is taken over again: matched where the ring sends it
    assert arcs.pass_on(late) == []


def test_the_answers_kept_per_event_type_stay_bounded() -> None:
    arcs = HandedArcs()
    arcs.MAX_TYPES = 4
    arcs.handed("D", lambda event_type: event_type.endswith("0"))
    assert [arcs.joiner(f"t{i}") for i in range(10)] == ["D" if i == 0 else None for i in range(10)]
    assert len(arcs._types) <= 4


def test_an_open_rounds_record_reads_back_and_a_bad_one_is_named() -> None:
    big = 2**159 + 7  # ring ids are 160-bit: text in the record, for every store
    round_ = OpenRound("S", (big, 3), (M0, M1), (M1,))
    assert OpenRound.from_document(round_.to_document()) == round_
    assert OpenRound.from_document({"state": "done", "at": 1.0}) is None  # ended
    assert OpenRound.from_document(None) is None
    with pytest.raises(ValueError, match="hand-back record"):
        OpenRound.from_document({"state": "handing", "by": "S", "arc": ["x", "1"]})
