"""The chaos harness's accounting: when an undelivered copy is a loss and when it raced
its subscriber's unsubscribe (``qosmq_bench/chaos_judge.py``)."""

from __future__ import annotations

from qosmq_bench.chaos_judge import Subscription, _raced_its_unsubscribe


def _sub(removing: float | None) -> Subscription:
    return Subscription("t", [], sent=0.0, confirmed=1.0, removing=removing, removed=None)


def test_a_copy_seen_elsewhere_before_the_unsubscribe_went_is_a_loss() -> None:
    # published at 5.0, matched (another subscriber had it) at 5.02, unsubscribe sent 5.05
    assert not _raced_its_unsubscribe([_sub(5.05)], 5.0, 5.02)


def test_a_copy_first_seen_after_the_unsubscribe_went_may_have_raced_it() -> None:
    assert _raced_its_unsubscribe([_sub(5.05)], 5.0, 5.4)


def test_no_copy_anywhere_or_no_unsubscribe_is_a_loss() -> None:
    assert not _raced_its_unsubscribe([_sub(5.05)], 5.0, None)
    assert not _raced_its_unsubscribe([_sub(None)], 5.0, 5.4)


def test_every_standing_subscription_must_have_been_removed() -> None:
    # one matching subscription stays: the copy was owed to it whatever the other did
    assert not _raced_its_unsubscribe([_sub(5.05), _sub(None)], 5.0, 5.4)
    # a subscription removed before the publish does not stand: the other decides
    assert _raced_its_unsubscribe([_sub(4.0), _sub(5.05)], 5.0, 5.4)
