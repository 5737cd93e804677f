"""The delivery logic both faces execute (``middleware.transport.consuming``), no I/O."""

from __future__ import annotations

import pytest

from middleware.errors import DeadLetter, Reject, Requeue
from middleware.transport import consuming
from middleware.transport.consuming import Step
from middleware.transport.delivery import Action, Delivery, Outcome


def test_each_outcome_settles_in_its_steps_and_a_dead_letter_is_copied_before_the_ack() -> None:
    assert consuming.settle_steps(Outcome(Action.ACK)) == (Step.ACK,)
    assert consuming.settle_steps(Outcome(Action.REJECT)) == (Step.REJECT,)
    assert consuming.settle_steps(Outcome(Action.REQUEUE)) == (Step.REQUEUE,)
    assert consuming.settle_steps(Outcome(Action.DEAD_LETTER, "why")) == (
        Step.COPY_TO_DEAD_LETTER,
        Step.ACK,
    )


def test_an_unreadable_delivery_never_reaches_a_handler() -> None:
    assert consuming.before_handler(Delivery(b"x", "q", message_id="ok")) is None
    late = consuming.before_handler(Delivery(b"x", "q", timestamp=1e12))
    assert late is not None and late.action is Action.DEAD_LETTER and "9999" in late.reason


@pytest.mark.parametrize(
    ("error", "action"),
    [
        (None, Action.ACK),
        (Reject("no"), Action.REJECT),
        (Requeue(), Action.REQUEUE),
        (DeadLetter("schema"), Action.DEAD_LETTER),
        (KeyError("boom"), Action.DEAD_LETTER),
    ],
)
def test_the_handler_steers_the_outcome(error, action) -> None:
    assert consuming.after_handler(Delivery(b"x", "q"), error).action is action


def test_a_lost_settle_is_requeue_with_its_reason_and_the_handlers_decision() -> None:
    decided = Outcome(Action.ACK)
    outcome = consuming.settle_lost(Delivery(b"x", "q"), RuntimeError("channel 3 closed"), decided)
    assert outcome.action is Action.REQUEUE and "channel 3 closed" in outcome.reason
    assert outcome.unsent is Action.ACK


@pytest.mark.parametrize(
    ("channel_closed", "connection_open", "again"),
    [(True, True, True), (True, False, False), (False, True, False), (False, False, False)],
)
def test_only_a_dead_channel_under_a_live_connection_is_subscribed_again(
    channel_closed, connection_open, again
) -> None:
    assert (
        consuming.resubscribe_after_lost_settle(
            channel_closed=channel_closed, connection_open=connection_open
        )
        is again
    )


def test_the_watchdog_finds_a_consumer_subscribed_to_nothing() -> None:
    from middleware.transport.consuming import ConsumerCheck

    check = ConsumerCheck()
    assert check.lost(queue_exists=False, consumers=0, ready=0, delivered=0, room=True)
    # no consumer counted, messages ready, nothing given: lost at the second check in a
    # row (even with no room: the queue has nobody to give them to)
    unconsumed = ConsumerCheck()
    assert not unconsumed.lost(queue_exists=True, consumers=0, ready=2, delivered=0, room=False)
    assert unconsumed.lost(queue_exists=True, consumers=0, ready=2, delivered=0, room=False)
    # 0 consumers and 0 messages tell nothing: a quorum queue's frozen leader answers so
    # while a newly elected one delivers, and an empty queue has nothing to give anyway
    frozen = ConsumerCheck()
    for _ in range(5):
        assert not frozen.lost(queue_exists=True, consumers=0, ready=0, delivered=0, room=True)
    elected = ConsumerCheck()  # given messages: subscribed, whatever the count says
    for delivered in (0, 4, 9, 15):
        assert not elected.lost(
            queue_exists=True, consumers=0, ready=3, delivered=delivered, room=False
        )
    busy = ConsumerCheck()  # ready messages while it is given some: fine
    for delivered in (1, 5, 9):
        assert not busy.lost(
            queue_exists=True, consumers=1, ready=3, delivered=delivered, room=True
        )
    full = ConsumerCheck()  # ready messages, nothing given, but no room: its prefetch is full
    for _ in range(3):
        assert not full.lost(queue_exists=True, consumers=1, ready=3, delivered=4, room=False)
    starved = ConsumerCheck()  # messages ready, room, nothing given: twice in a row is lost
    assert not starved.lost(queue_exists=True, consumers=1, ready=2, delivered=7, room=True)
    assert not starved.lost(queue_exists=True, consumers=1, ready=2, delivered=7, room=True)
    assert starved.lost(queue_exists=True, consumers=1, ready=2, delivered=7, room=True)
    single_active = ConsumerCheck()  # a waiting single-active consumer is given nothing
    for _ in range(3):
        assert not single_active.lost(
            queue_exists=True, consumers=2, ready=5, delivered=0, room=True, starvation=False
        )
