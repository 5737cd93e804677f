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


# --- e2e batches: each event with its own id and content digest (ELEMENTS_HEADER) ---


def _e2e(bodies: list[bytes], names: list[tuple[str, str]] | None) -> Delivery:
    from middleware.confirms.tracking import ELEMENTS_HEADER, encode_elements

    headers = {} if names is None else {ELEMENTS_HEADER: encode_elements(names)}
    return Delivery(body=encode(bodies), queue="q", headers=headers, delivery_tag=1)


def test_an_e2e_batch_names_each_event_for_its_duplicate_check() -> None:
    from middleware.confirms.tracking import named_digest

    names = [("e1:q", "c1"), ("e2:q", "c2")]
    events, bad = ClientCore.e2e_batch_of(_e2e([_copy(1), _copy(2)], names))
    assert [(e.event.attributes["n"], name) for e, name in events] == [
        (1, ("e1:q", named_digest("c1"))),
        (2, ("e2:q", named_digest("c2"))),
    ] and bad == []


def test_an_e2e_batch_whose_header_does_not_name_each_event_is_checked_as_a_whole() -> None:
    """Too few names, a malformed header, no header, a malformed element (the names can
    no longer be matched to the events): no event gets a check of its own."""
    two = [_copy(1), _copy(2)]
    for delivery in (
        _e2e(two, [("e1:q", "c1")]),
        _e2e(two, None),
        _e2e([_copy(1), b'{"kind": "publish"}'], [("e1:q", "c1"), ("e2:q", "c2")]),
    ):
        events, _ = ClientCore.e2e_batch_of(delivery)
        assert all(name is None for _, name in events)
    from middleware.confirms.tracking import ELEMENTS_HEADER

    forged = Delivery(body=encode(two), queue="q", headers={ELEMENTS_HEADER: "[1"})
    assert all(name is None for _, name in ClientCore.e2e_batch_of(forged)[0])


def test_an_e2e_event_handled_once_is_skipped_after_and_a_requeue_sends_the_batch_back() -> None:
    from middleware.confirms.core import ConsumerCore
    from middleware.settings import ConfirmSettings

    consumer = ConsumerCore(ConfirmSettings())
    message = Publish.model_validate_json(_copy(1))
    name = ("e1:q", b"digest-1")
    failed: list = []
    assert not ClientCore.handled_before(consumer, "q", message, name, failed)
    assert not ClientCore.element_settled(consumer, "q", message, name, None, failed)
    assert ClientCore.handled_before(consumer, "q", message, name, failed) and failed == []
    # the same id with other content: another message reusing it, dead-lettered with why
    assert ClientCore.handled_before(consumer, "q", message, ("e1:q", b"other"), failed)
    assert failed[0][1].action is Action.DEAD_LETTER and "duplicate" in failed[0][1].reason
    # that element again (its batch came back whole, or a resend of it): skipped, not
    # dead-lettered twice; another content under the id is refused on its own
    assert ClientCore.handled_before(consumer, "q", message, ("e1:q", b"other"), failed)
    assert len(failed) == 1
    assert ClientCore.handled_before(consumer, "q", message, ("e1:q", b"third"), failed)
    assert len(failed) == 2
    # Requeue with a check of its own: the whole delivery goes back, the event not kept
    again = ("e2:q", b"digest-2")
    assert ClientCore.element_settled(consumer, "q", message, again, Requeue("x"), [])
    assert not ClientCore.handled_before(consumer, "q", message, again, [])
    # without one: put back alone, as in a broker-confirmed batch
    alone: list = []
    assert not ClientCore.element_settled(consumer, "q", message, None, Requeue("x"), alone)
    assert alone[0][1].action is Action.REQUEUE


def test_the_largest_e2e_batch_names_fit_one_frame() -> None:
    """``E2E_BATCH_MAX`` copies with the longest ids an event can have: the message's
    headers pass the broker's frame limit (checked before sending)."""
    from middleware.confirms.tracking import CONTENT_HEADER, ELEMENTS_HEADER, encode_elements
    from middleware.routing.copies import copy_id
    from middleware.routing.delivery import E2E_BATCH_MAX
    from middleware.transport import OutgoingMessage
    from middleware.transport.outbound import check_message

    names = [(copy_id("e" * 64, f"queue-{i}"), "0123456789abcdef") for i in range(E2E_BATCH_MAX)]
    headers = {CONTENT_HEADER: "f" * 24, ELEMENTS_HEADER: encode_elements(names)}
    check_message(OutgoingMessage(b"[]", "", "q", headers=headers, message_id="batch:" + "a" * 24))
