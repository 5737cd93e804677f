"""The Phoenix client's reading of a subscriber-queue delivery that carries a batch of
copies (``ClientCore.batch_of``, ``ClientCore.failed``): without I/O."""

from __future__ import annotations

import json

from middleware.errors import DeadLetter, Reject, Requeue
from middleware.routing.batching import encode
from middleware.routing.client_core import ClientCore
from middleware.routing.messages import Publish, Subscribe
from middleware.routing.wiring import outgoing
from middleware.transport import Action, Delivery


def _delivery(body: bytes) -> Delivery:
    return Delivery(body=body, queue="q", exchange="", routing_key="q", delivery_tag=1)


def _copy(n: int) -> bytes:
    event = {"event_type": "t", "attributes": {"n": n}}
    return outgoing(Publish(event_type="t", event=event, broker="b"), "").body


def test_a_lone_event_is_not_a_batch() -> None:
    assert ClientCore.batch_of(_delivery(_copy(1))) is None


def test_a_batch_gives_its_events_in_order() -> None:
    events, bad = ClientCore.batch_of(_delivery(encode([_copy(n) for n in range(5)])))
    assert [e.event.attributes["n"] for e in events] == [0, 1, 2, 3, 4] and bad == []


def test_elements_that_are_not_events_are_dead_lettered_alone_with_why() -> None:
    other = outgoing(Subscribe(event_type="t", home="A", queue="q", subscription_id="s"), "")
    body = encode([_copy(1), b'{"kind": "publish"}', other.body, _copy(2)])
    events, bad = ClientCore.batch_of(_delivery(body))
    assert [e.event.attributes["n"] for e in events] == [1, 2]
    assert [outcome.action for _, outcome in bad] == [Action.DEAD_LETTER] * 2
    assert "malformed" in bad[0][1].reason and "not a Phoenix event" in bad[1][1].reason
    assert json.loads(bad[1][0])["kind"] == "subscribe"


def test_a_batch_that_is_not_json_is_one_dead_letter() -> None:
    events, bad = ClientCore.batch_of(_delivery(b"[not json"))
    assert events == [] and len(bad) == 1 and bad[0][0] == b"[not json"


def test_a_failed_event_is_requeued_alone_or_dead_lettered_alone() -> None:
    (message,), _ = ClientCore.batch_of(_delivery(encode([_copy(7), b"{}"])))
    body, outcome = ClientCore.failed(message, Requeue("later"))
    assert outcome.action is Action.REQUEUE and json.loads(body)["event"]["attributes"]["n"] == 7
    assert ClientCore.failed(message, DeadLetter("no"))[1].action is Action.DEAD_LETTER
    rejected = ClientCore.failed(message, Reject("refused"))[1]
    assert rejected.action is Action.DEAD_LETTER and "refused" in rejected.reason
    crashed = ClientCore.failed(message, ValueError("boom"))[1]
    assert crashed.action is Action.DEAD_LETTER and "ValueError: boom" in crashed.reason
