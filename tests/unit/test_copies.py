"""A matched event's copies (routing/copies.py): outcomes to effects, receipts batched."""

from __future__ import annotations

from middleware.phoenix.effects import After, Send
from middleware.phoenix.ids import RoleId
from middleware.routing.copies import (
    Carry,
    CopyOutcome,
    Count,
    Gone,
    MatchedReceipts,
    Outcome,
    Refuse,
    copy_id,
    settle,
)
from middleware.routing.messages import HOME_LEFT, MAYBE_DELIVERED, Matched


def test_each_outcome_takes_its_own_effect_and_one_subscriber_never_costs_another() -> None:
    outcomes = [
        (("A", "q1"), "broker", CopyOutcome(Outcome.DELIVERED)),
        (("A", "q2"), "e2e", CopyOutcome(Outcome.TAKEN)),
        (("C", "q3"), "e2e", CopyOutcome(Outcome.UNREACHABLE, "link down")),
        (("A", "q4"), "broker", CopyOutcome(Outcome.GONE)),
    ]
    assert settle(outcomes, [], again=False) == [
        Count("copies_delivered"),
        Count("delivered"),
        Count("copies_taken"),
        Count("delivered"),
        Count("copies_unreachable"),
        Carry("C", "q3", "e2e", "link down"),
        Count("copies_gone"),
        Gone("A", "q4"),
    ]


def test_a_copy_whose_queue_s_node_is_down_is_carried_without_reporting_the_link() -> None:
    """Returned by a durable queue whose node is down (or stopping) is not gone: until
    2026-12-06 it was taken as gone and the copy dropped, lost at a node's stop."""
    outcomes = [(("A", "q1"), "broker", CopyOutcome(Outcome.DOWN, "its node is down"))]
    assert settle(outcomes, [], again=False) == [
        Count("copies_down"),
        Carry("A", "q1", "broker", "its node is down", link=False),
    ]


def test_a_refusal_and_a_departed_home_dead_letter_the_event_last_with_every_reason() -> None:
    outcomes = [
        (("A", "q1"), "e2e", CopyOutcome(Outcome.REFUSED, "q1: rejected")),
        (("A", "q2"), "broker", CopyOutcome(Outcome.DELIVERED)),
    ]
    effects = settle(outcomes, ["q9 (cluster D)"], again=True)
    assert effects[-2:] == [
        Count("home_departed", 1),
        Refuse(f"{HOME_LEFT}: q9 (cluster D); {MAYBE_DELIVERED}; q1: rejected"),
    ]
    assert Count("delivered") in effects  # the other copy went
    assert settle([], ["q9 (cluster D)"], again=False)[-1] == Refuse(f"{HOME_LEFT}: q9 (cluster D)")


def test_a_copy_id_is_one_per_event_and_queue_and_short() -> None:
    assert copy_id(None, "q") is None
    assert copy_id("e1", "q") == copy_id("e1", "q") != copy_id("e1", "r")
    assert len(copy_id("e1", "x" * 300) or "") == len("e1:") + 16


def test_receipts_are_owed_only_to_another_entry_cluster_batched_by_one_timer() -> None:
    receipts = MatchedReceipts("B", every_s=0.02, chunk=2)
    assert receipts.matched([], "e0") == []  # entered here
    assert receipts.matched(["B", "C"], "e0") == []
    assert receipts.matched(["A", "B"], None) == []  # no id: nothing to say
    assert receipts.matched(["A", "B"], "e1") == [After(0.02, "A")]
    assert receipts.matched(["A"], "e2") == []  # the timer runs already
    assert receipts.matched(["A"], "e3") == []
    router = RoleId.router("A")
    # to A's router's control queue, a chunk each, the next once the one before was sent
    first = receipts.due("A")
    assert first == [Send(router, Matched(by="B", ids=["e1", "e2"]), then=("A", 1))]
    assert receipts.due("A") == []
    assert receipts.matched(["A"], "e4") == [After(0.02, "A")]  # a new batch
    assert receipts.sent(("A", 1), None) == [
        Send(router, Matched(by="B", ids=["e3"]), then=("A", 1))
    ]
    assert receipts.sent(("A", 1), None) == []  # all sent
    assert receipts.rest == {}


def test_a_receipt_that_fails_ends_the_chunks_after_it() -> None:
    receipts = MatchedReceipts("B", every_s=0.02, chunk=1)
    for event in ("e1", "e2", "e3"):
        receipts.matched(["A"], event)
    [send] = receipts.due("A")
    assert send.message.ids == ["e1"]
    assert receipts.sent(send.then, "link down") == []  # A's router keeps e2, e3 longer
    assert receipts.rest == {}
    assert receipts.sent(send.then, None) == []  # told twice: nothing more
