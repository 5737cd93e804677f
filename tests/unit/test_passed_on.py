"""``serving.each``: an inbox message whose onward send failed for a reason that passes
(the next role's inbox on a node that is down, a failover) is handled again after a
pause and in the end given back to the inbox, never dead-lettered; a message's own
fault is dead-lettered as before.  (Until 2026-12-06 every such failure dead-lettered
the event: a confirmed event gone from the flow at a RabbitMQ node's stop.)"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import pytest

from middleware.errors import DeadLetter, HopFailed, Requeue, Unroutable
from middleware.phoenix.ids import RoleId
from middleware.routing import serving
from middleware.routing.batching import encode as batch
from middleware.routing.matching import Event
from middleware.routing.messages import Message, Publish, Subscribe, encode
from middleware.routing.parked import ParkedPace
from middleware.transport import Delivery


class _Role:
    """What ``each`` asks of a role."""

    def __init__(self) -> None:
        self.id = RoleId.router("B")
        self.received = [0, 0]
        self.counts: Counter[str] = Counter()
        self.counters = self.counts  # (``Peer.counters``)
        self.fenced = False
        self.stop_event: asyncio.Event | None = None
        self.parked: list[int] = []  # what ``park`` took (``each(..., park=True)``)
        self.park_fails: list[BaseException] = []
        self.parked_pace = ParkedPace(pause_s=0.01)

    async def park(self, message: Message, *, again: bool = False) -> None:
        if self.park_fails:
            raise self.park_fails.pop(0)
        assert isinstance(message, Publish)
        self.parked.append(message.event.attributes["n"])
        self.count("parked_again" if again else "parked")

    def inbox_took(self) -> None:
        pass

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] += n

    def urgency(self, _message: Message) -> int:
        return 0


def _delivery(*ns: int) -> Delivery:
    messages = [
        Publish(event_type="t", event=Event(event_type="t", attributes={"n": n}), id=f"e{n}")
        for n in ns
    ]
    bodies = [encode(m) for m in messages]
    body = bodies[0] if len(bodies) == 1 else batch(bodies)
    return Delivery(body=body, queue="p.B.router", delivery_tag=1)


def _failing(failures: dict[int, list[BaseException]], handled: list[int]) -> Any:
    async def handle(message: Message) -> None:
        assert isinstance(message, Publish)
        n = message.event.attributes["n"]
        handled.append(n)
        if failures.get(n):
            raise failures[n].pop(0)

    return handle


def _each(
    role: _Role,
    failures: dict[int, list[BaseException]],
    handled: list[int],
    *ns: int,
    inbox: bool = True,
    park: bool = False,
    parked: bool = False,
) -> None:
    """``serving.each`` on a delivery of events ``ns`` (one: alone; more: a batch)."""
    delivery = _delivery(*(ns or (1,)))
    handle = _failing(failures, handled)
    each = serving.each(role, delivery, handle, inbox=inbox, park=park, parked=parked)  # type: ignore[arg-type]
    asyncio.run(each)


@pytest.fixture(autouse=True)
def _short_pauses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serving, "AGAIN_AFTER_S", (0.001, 0.001, 0.001))


def test_a_send_that_failed_and_then_went_through_is_handled_again_in_place() -> None:
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {
        1: [Unroutable("inbox's node down"), HopFailed("x")]
    }
    _each(role, failures, handled)
    assert handled == [1, 1, 1]
    assert role.counts["handled_again"] == 2


def test_a_send_that_keeps_failing_gives_the_message_back_to_the_inbox() -> None:
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down")] * 10}
    with pytest.raises(Requeue, match="not passed on: down"):
        _each(role, failures, handled)
    assert handled == [1] * 4  # once, and once after each pause


def test_a_role_that_stops_gives_it_back_at_once() -> None:
    role, handled = _Role(), []
    role.stop_event = asyncio.Event()
    role.stop_event.set()
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down")] * 10}
    with pytest.raises(Requeue):
        _each(role, failures, handled)
    assert handled == [1]


def test_the_message_s_own_fault_is_not_tried_again() -> None:
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {1: [DeadLetter("malformed filter")]}
    with pytest.raises(DeadLetter):
        _each(role, failures, handled)
    assert handled == [1]


def test_a_control_message_is_not_tried_again() -> None:
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {1: [Unroutable("gone")]}
    with pytest.raises(Unroutable):
        _each(role, failures, handled, inbox=False)
    assert handled == [1]


def test_a_batch_whose_element_keeps_failing_goes_back_whole() -> None:
    """The others were handled: when the batch comes again the owner's id check and the
    e2e filter drop what they passed on."""
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {2: [HopFailed("down")] * 10}
    with pytest.raises(Requeue):
        _each(role, failures, handled, 1, 2, 3)
    assert Counter(handled) == {1: 1, 2: 4, 3: 1}


def test_a_batch_whose_element_failed_once_is_settled_whole() -> None:
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {2: [HopFailed("down")]}
    _each(role, failures, handled, 1, 2, 3)
    assert Counter(handled) == {1: 1, 2: 2, 3: 1}
    assert role.counts["batches_received"] == 1


def test_a_message_not_passed_on_is_parked_and_its_delivery_settled() -> None:
    """From the inbox (``park``): at the first failure that passes the message goes to
    the role's parked queue, and the batch around it is settled (what comes behind it
    in the inbox is not held up by a queue that is down)."""
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {2: [Unroutable("node down")] * 10}
    _each(role, failures, handled, 1, 2, 3, park=True)
    assert Counter(handled) == {1: 1, 2: 1, 3: 1}
    assert role.parked == [2]
    assert role.counts["handled_again"] == 0


def test_a_message_that_cannot_be_parked_is_held_as_before() -> None:
    role, handled = _Role(), []
    role.park_fails = [Unroutable("its own node down too")]
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down"), HopFailed("down")]}
    _each(role, failures, handled, park=True)
    assert handled == [1, 1, 1]  # parked once tried, then held and handled again
    assert role.parked == []
    assert role.counts["handled_again"] == 2


def test_from_the_parked_queue_it_is_tried_then_parked_again_not_given_back() -> None:
    """From the parked queue (``parked``): tried once; failed, it is held ``pause_s``
    and parked again at the queue's tail, the delivery settled; never ``Requeue``
    (before 2026-12-07: given back to the head, so a queue that stayed down held every
    parked copy behind its own, and a quorum queue's delivery limit dropped it).  The
    next one for the same destination waits for the pace (``parked.py``)."""
    role, handled = _Role(), []
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down")] * 10}
    _each(role, failures, handled, 1, parked=True)
    assert handled == [1] and role.parked == [1]
    assert role.counts["parked_again"] == 1 and role.counts["parked"] == 0
    assert role.parked_pace.failing == 1
    _each(role, failures, handled, 1, parked=True)  # the probe, a pause later: fails
    assert handled == [1, 1] and role.parked == [1, 1]
    failures[1] = []
    _each(role, failures, handled, 1, parked=True)  # the probe passes
    assert handled == [1, 1, 1] and role.parked_pace.failing == 0


def test_a_parked_message_whose_try_passes_is_settled() -> None:
    role, handled = _Role(), []
    _each(role, {}, handled, 1, 2, parked=True)
    assert Counter(handled) == {1: 1, 2: 1} and role.parked == []


def test_a_parked_message_that_cannot_be_parked_again_is_given_back() -> None:
    role, handled = _Role(), []
    role.park_fails = [Unroutable("its own node down too")]
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down")] * 10}
    with pytest.raises(Requeue):
        _each(role, failures, handled, parked=True)
    assert role.parked == []


def test_a_parked_message_of_a_role_that_stops_is_given_back_at_once() -> None:
    role, handled = _Role(), []
    role.stop_event = asyncio.Event()
    role.stop_event.set()
    failures: dict[int, list[BaseException]] = {1: [HopFailed("down")] * 10}
    with pytest.raises(Requeue):
        _each(role, failures, handled, parked=True)
    assert handled == [1] and role.parked == []


def _handed(failures: list[BaseException], handled: list[str]) -> Any:
    async def handle(message: Message) -> None:
        assert isinstance(message, Subscribe)
        handled.append(message.subscription_id)
        if failures:
            raise failures.pop(0)

    return handle


def test_a_handed_subscription_on_the_control_queue_is_handled_again() -> None:
    """A subscription of an arc handed over at a join comes to the joiner's control
    queue; dead-lettered, it was lost from the arc.  Since 2026-12-07 it is handled
    again, and in the end given back, like an inbox message."""
    role, handled = _Role(), []
    subscribe = Subscribe(event_type="t", subscription_id="s1", queue="q", home="B")
    delivery = Delivery(body=encode(subscribe), queue="p.B.router.control", delivery_tag=1)
    failures: list[BaseException] = [HopFailed("match master's inbox down")]
    handle = _handed(failures, handled)
    asyncio.run(serving.each(role, delivery, handle, inbox=False))  # type: ignore[arg-type]
    assert handled == ["s1", "s1"]
    assert role.counts["handled_again"] == 1
    failures[:] = [HopFailed("down")] * 10
    with pytest.raises(Requeue):
        asyncio.run(serving.each(role, delivery, handle, inbox=False))  # type: ignore[arg-type]
    assert role.received == [0, 0]  # a control message: not counted as the inbox's
