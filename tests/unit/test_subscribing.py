"""A match master's book of subscriptions (routing/subscribing.py), driven with messages."""

from __future__ import annotations

from middleware.phoenix.effects import Box
from middleware.phoenix.ids import RoleId
from middleware.routing.messages import Subscribe, Unsubscribe, Unsubscribed
from middleware.routing.registry import Registry
from middleware.routing.subscribing import (
    Confirm,
    Count,
    Persist,
    Refuse,
    Send,
    SubscriptionBook,
    subscription_record,
)


def _subscribe(sid: str = "s1", **fields: object) -> Subscribe:
    message = {
        "subscription_id": sid,
        "event_type": "t",
        "queue": "q",
        "filter": [["x", "<", 5]],
        "latency_level": 2,
        "home": "A",
        "hops": ["A", "B"],
        "reply_to": "reply",
        **fields,
    }
    return Subscribe.model_validate(message)


def _book() -> SubscriptionBook:
    return SubscriptionBook(Registry("B"), remember=2)


def test_a_subscribe_is_held_written_then_confirmed() -> None:
    book = _book()
    message = _subscribe()
    assert book.subscribe(message) == [
        Persist("s1", subscription_record(message).to_document()),
        Confirm({}, after_write=True),
    ]
    assert book.registry.match("t", {"x": 1}) == {"s1"}


def test_a_filter_the_index_refuses_is_answered_and_dead_lettered() -> None:
    book = _book()
    effects = book.subscribe(_subscribe(filter=[["x", "~", 5]]))
    assert [type(e) for e in effects] == [Confirm, Refuse]
    confirm, refuse = effects
    assert isinstance(confirm, Confirm) and confirm.after_write is False
    assert confirm.outcome["refused"] == "filter" and "s1" in refuse.reason  # type: ignore[union-attr]
    assert "s1" not in book.registry


def test_an_unsubscribe_tombstones_tells_the_routers_of_its_path_then_confirms() -> None:
    book = _book()
    book.subscribe(_subscribe(hops=["A", "C", "A"]))
    book.left("C")  # a cluster that left counts nothing
    assert book.unsubscribe(
        Unsubscribe(event_type="t", subscription_id="s1", reply_to="reply")
    ) == [
        Persist("s1", None),
        Count("unsubscribed"),
        Send(
            RoleId.router("A"),
            Unsubscribed(event_type="t", latency_level=2),
            box=Box.INBOX,
            bound_s=1.0,
            missed="unsubscribed_not_told",
        ),
        Confirm({"removed": True}, after_write=True),
    ]
    assert book.registry.match("t", {"x": 1}) == set()


def test_an_unknown_or_other_types_unsubscribe_changes_nothing() -> None:
    book = _book()
    book.subscribe(_subscribe())
    unknown = [Confirm({"removed": False}, after_write=False)]
    assert book.unsubscribe(Unsubscribe(event_type="t", subscription_id="nope")) == unknown
    assert book.unsubscribe(Unsubscribe(event_type="u", subscription_id="s1")) == unknown
    assert "s1" in book.registry


def test_a_removal_handed_over_tells_nobody_and_answers_nobody() -> None:
    book = _book()
    book.subscribe(_subscribe())
    removal = Unsubscribe(event_type="t", subscription_id="s1", handed_over=True)
    assert book.unsubscribe(removal) == [Persist("s1", None), Count("unsubscribed")]


def test_removals_of_restored_types_are_remembered_for_the_hand_back_oldest_out() -> None:
    book = _book()
    book.local_types.add("t")
    for sid in ("s1", "s2", "s3"):
        book.subscribe(_subscribe(sid))
        book.unsubscribe(Unsubscribe(event_type="t", subscription_id=sid))
    assert book.removed_adopted == {"s2": "t", "s3": "t"}  # remember=2
    book.removal_handed("s2")
    assert book.removed_adopted == {"s3": "t"}
    book.joined("C")  # nothing departed: no change
    assert book.departed == set()
