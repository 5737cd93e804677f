"""What both faces decide about a delivery, once and without I/O.

A face (the asyncio core, the pika face) only executes it::

    outcome = before_handler(delivery)          # unreadable: dead-lettered, no handler
    if outcome is None:
        outcome = after_handler(delivery, err)  # the handler's return or exception
    for step in settle_steps(outcome):          # the frames (and the dead-letter copy)
        ...execute step...
    # a step raised (the channel or connection died before the settle left):
    outcome = settle_lost(delivery, exc, outcome)  # REQUEUE: the broker gives it back
    resubscribe_after_lost_settle(...)          # the consumer's channel is gone, not
                                                # the connection: subscribe it again

and hands the final outcome to the consumer's ``on_settled`` hook. Both faces therefore
say the same thing when a settle meets a dead channel: the hook hears REQUEUE with the
reason, the face goes on (nothing is raised into the loop, no other consumer or
publisher of the client is touched), and the consumer is subscribed again, so the
delivery the broker requeued is handled again (the contract test
``tests/integration/test_transport_contract.py`` checks it over both faces).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from . import metrics
from .delivery import Action, Delivery, Outcome, outcome_of, unreadable

__all__ = [
    "ConsumerCheck",
    "Step",
    "after_handler",
    "before_handler",
    "consumers_of",
    "resubscribe_after_lost_settle",
    "settle_lost",
    "settle_steps",
]

log = logging.getLogger("middleware.transport")


class Step(Enum):
    """One thing a face does on the wire to settle a delivery."""

    ACK = "basic.ack"
    REJECT = "basic.reject"  # no requeue: the queue's own dead-letter exchange, if any
    REQUEUE = "basic.nack requeue"
    COPY_TO_DEAD_LETTER = "publish to the layer's dead-letter queue"


_STEPS: dict[Action, tuple[Step, ...]] = {
    Action.ACK: (Step.ACK,),
    Action.REJECT: (Step.REJECT,),
    Action.REQUEUE: (Step.REQUEUE,),
    # the copy first: the original is acked only once its copy is published
    Action.DEAD_LETTER: (Step.COPY_TO_DEAD_LETTER, Step.ACK),
}


def consumers_of(consumers: Mapping[str, Any], queue: str) -> list[str]:
    """The tags of a client's own consumers (recorded with their ``spec``) of ``queue``:
    what its ``delete_queue`` stops before the delete, on both faces."""
    return [tag for tag, consumer in consumers.items() if consumer.spec.queue == queue]


def before_handler(delivery: Delivery) -> Outcome | None:
    """A delivery the layer cannot read (another client's non-UTF-8 id, a timestamp past
    9999, ...) is dead-lettered with its raw bytes and never reaches a handler."""
    problem = unreadable(delivery)
    return None if problem is None else _judged(delivery, Outcome(Action.DEAD_LETTER, problem))


def after_handler(delivery: Delivery, error: BaseException | None) -> Outcome:
    """The handler returned (``error`` None: ack) or raised: what its exception steers."""
    return _judged(delivery, outcome_of(error))


def _judged(delivery: Delivery, outcome: Outcome) -> Outcome:
    metrics.DELIVERIES_BY_ACTION[outcome.action].inc()
    if outcome.action is Action.DEAD_LETTER:
        log.warning(
            "dead-lettering message %s from %s: %s",
            delivery.message_id,
            delivery.queue,
            outcome.reason,
        )
    return outcome


def settle_steps(outcome: Outcome) -> tuple[Step, ...]:
    return _STEPS[outcome.action]


def settle_lost(delivery: Delivery, error: BaseException, decided: Outcome) -> Outcome:
    """A settle step raised: the channel (or its connection) closed before the frame left.
    The broker requeues what a closed channel held unacked, so the outcome is REQUEUE,
    carrying the handler's ``decided`` action as ``unsent`` (a layer that remembers what
    its handlers did, as the e2e consumer does, answers the redelivery without running
    the handler again)."""
    log.info("could not settle %s on %s: %s", delivery.message_id, delivery.queue, error)
    return Outcome(Action.REQUEUE, f"channel lost before settling: {error}", decided.action)


def resubscribe_after_lost_settle(*, channel_closed: bool, connection_open: bool) -> bool:
    """After a lost settle: subscribe the consumer again when its channel closed under a
    live connection. A dead connection is the connect loop's (it replays every consumer),
    and a channel still open lost only that frame (nothing to do)."""
    return channel_closed and connection_open


@dataclass
class ConsumerCheck:
    """The watchdog's state for one consumer the client believes subscribed (pure).

    Lost when its queue is gone, counted no consumer but messages ready at two checks in
    a row while this consumer was given nothing, or had messages ready at two checks in a
    row while this consumer had room for more and was given none in between: a queue deleted and
    declared again without a ``basic.cancel`` (RabbitMQ 3.10 sometimes sends none for a
    quorum queue deleted under load, and then even counts the stale consumer on the new
    queue).  A lost consumer is treated as cancelled: subscribed again as soon as the
    queue exists (the asyncio core closes its old channel only once the new subscription
    stands).  (A single-active-consumer queue's waiting consumers are given nothing by
    design: ``starvation`` false for them.)

    A count of no consumer is not enough: a quorum queue whose leader's node is frozen
    (a paused VM) answers a passive declare with 0 consumers and 0 messages for as long
    as that node still counts as up (the count is asked of the leader its queue record
    names), while a newly elected leader delivers to the consumer it has.  A new
    subscription waits, in ``basic.consume``, for the frozen node, which RabbitMQ 3.10
    sends it to (seen 2026-12-05: with the old channel closed first, every e2e confirm
    waited for the node's thaw, 25 s, where publisher confirms went on after 7 s; with
    it kept, the waiting subscription's channel crashed about 30 s after the thaw and
    took its connection down).  So a count of 0 with 0 messages tells nothing (an empty
    queue declared again has nothing to give either: its consumer is found once a
    message is ready there), and a consumer that was given messages since the last check
    is subscribed."""

    delivered: int = 0
    starved: int = 0
    unconsumed: int = 0  # checks in a row: no consumer, messages ready, nothing given

    def lost(
        self,
        *,
        queue_exists: bool,
        consumers: int,
        ready: int,
        delivered: int,
        room: bool,
        starvation: bool = True,
    ) -> bool:
        if not queue_exists:
            return True
        given = delivered != self.delivered
        self.delivered = delivered
        lacking = consumers == 0 and ready > 0 and not given  # (0 and 0: nothing learnt)
        self.unconsumed = self.unconsumed + 1 if lacking else 0
        if self.unconsumed >= 2:
            return True
        self.starved = self.starved + 1 if starvation and ready and room and not given else 0
        return self.starved >= 2
