"""``routing.parked``: a parked message is tried again at the pace of its destination.
While one fails, one message of it at a time is tried (the probe), at most once per
``pause_s``; the others wait in hand, then go back to the parked queue's tail untried.
Once a probe passes, what follows is tried at once."""

from __future__ import annotations

from middleware.routing.matching import Event
from middleware.routing.messages import Copy, Publish
from middleware.routing.parked import Next, ParkedPace, key_of


def test_a_destination_never_seen_failing_is_tried_at_once() -> None:
    assert ParkedPace(1.0).next("q", 0.0, waited=False) == (Next.TRY, 0.0)


def test_while_a_destination_fails_one_probe_a_pause_the_rest_go_back_untried() -> None:
    pace = ParkedPace(1.0)
    pace.tried("q", 0.0, passed=False)
    assert pace.next("q", 0.25, waited=False) == (Next.WAIT, 0.75)  # held in hand
    assert pace.next("q", 0.5, waited=True) == (Next.REPARK, 0.0)  # held once: back
    assert pace.next("q", 1.0, waited=True) == (Next.TRY, 0.0)  # the probe
    assert pace.next("q", 1.0, waited=True) == (Next.REPARK, 0.0)  # while it is under way
    assert pace.next("q", 1.5, waited=False) == (Next.REPARK, 0.0)
    pace.tried("q", 1.25, passed=False)  # the probe failed: the next one a pause later
    assert pace.next("q", 1.5, waited=False) == (Next.WAIT, 0.75)
    assert pace.failing == 1


def test_a_probe_that_passes_lets_everything_for_it_through() -> None:
    pace = ParkedPace(1.0)
    pace.tried("q", 0.0, passed=False)
    assert pace.next("q", 1.0, waited=False)[0] is Next.TRY
    pace.tried("q", 1.1, passed=True)
    assert [pace.next("q", 1.1, waited=False)[0] for _ in range(3)] == [Next.TRY] * 3
    assert pace.failing == 0


def test_a_probe_that_ends_for_its_own_fault_frees_the_probe_only() -> None:
    """A probe dead-lettered for its own fault says nothing of the destination: the
    next message is the next probe (before this, no probe would ever run again)."""
    pace = ParkedPace(1.0)
    pace.tried("q", 0.0, passed=False)
    assert pace.next("q", 1.0, waited=False)[0] is Next.TRY
    pace.tried("q", 1.0, passed=None)
    assert pace.next("q", 1.0, waited=False)[0] is Next.TRY
    assert pace.failing == 1


def test_destinations_are_paced_apart() -> None:
    pace = ParkedPace(1.0)
    pace.tried("full", 0.0, passed=False)
    assert pace.next("other", 0.1, waited=False) == (Next.TRY, 0.0)


def test_a_copy_waits_for_its_queue_at_its_home_other_kinds_for_their_kind() -> None:
    publish = Publish(event_type="t", event=Event(event_type="t", attributes={}))
    copy = Copy(event_type="t", home="A", queue="q1", publish=publish)
    other = copy.model_copy(update={"queue": "q2"})
    assert key_of(copy) != key_of(other)
    assert key_of(copy) == "copy A q1"
    assert key_of(publish) == "publish"
