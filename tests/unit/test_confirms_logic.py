from __future__ import annotations

import math
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.confirms.core import REPLY_TO, ConsumerCore, PublisherCore
from middleware.confirms.modes import ConfirmMode
from middleware.confirms.tracking import (
    RECEIPT_HEADER,
    ConfirmTracker,
    DuplicateFilter,
    Receipt,
    ReceiptBatcher,
    ReceiptLoad,
    Resolution,
    decode_receipts,
    encode_receipts,
    published_age,
)
from middleware.errors import NegativeReceipt, NoRoute, ReceiptTimeout
from middleware.settings import ConfirmSettings, RetrySettings
from middleware.transport.delivery import Action, Delivery, Outcome
from middleware.transport.topology import BindingSpec, ExchangeSpec, ExchangeType, TopologyRecord


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tracker_confirms_only_when_every_queue_answered() -> None:
    t = ConfirmTracker(timeout=1, max_attempts=3)
    t.track("m", frozenset({"a", "b", "c"}))
    assert t.on_receipt(Receipt("m", "a")) is None
    assert t.on_receipt(Receipt("m", "b")) is None
    assert t.on_receipt(Receipt("m", "x")) is None  # not expected: ignored
    resolution, pending = t.on_receipt(Receipt("m", "c"))
    assert resolution is Resolution.CONFIRMED and pending.answered == {"a", "b", "c"}
    assert t.on_receipt(Receipt("m", "c")) is None and t.late_receipts == 2


def test_tracker_negative_receipt_settles_at_once() -> None:
    t = ConfirmTracker(timeout=1, max_attempts=3)
    t.track("m", frozenset({"a", "b"}))
    resolution, _ = t.on_receipt(Receipt("m", "b", ok=False, reason="bad"))
    assert resolution is Resolution.NEGATIVE and "m" not in t


def test_tracker_resends_then_fails_with_the_missing_queues() -> None:
    clock = Clock()
    t = ConfirmTracker(timeout=1.0, max_attempts=3, backoff=lambda n: 0.5 * n, clock=clock)
    t.track("m", frozenset({"a", "b"}))
    t.on_receipt(Receipt("m", "a"))
    clock.now = 0.99
    assert t.due() == ([], [])
    clock.now = 1.0
    resend, failed = t.due()
    assert [p.attempts for p in resend] == [2] and not failed
    clock.now = 2.9  # next deadline = 1.0 + 1.0 + backoff(2)=1.0 -> 3.0
    assert t.due() == ([], [])
    clock.now = 3.0
    assert [p.attempts for p in t.due()[0]] == [3]
    clock.now = 100
    resend, failed = t.due()
    assert not resend and failed[0].missing == {"b"} and len(t) == 0


def test_batcher_by_count_and_by_linger() -> None:
    clock = Clock()
    b = ReceiptBatcher(max_batch=3, linger_s=0.005, clock=clock)
    assert b.add("p1", Receipt("1", "q")) == []
    assert b.add("p2", Receipt("2", "q")) == []
    assert b.add("p1", Receipt("3", "q")) == []
    full = b.add("p1", Receipt("4", "q"))
    assert [(k, [r.message_id for r in v]) for k, v in full] == [("p1", ["1", "3", "4"])]
    assert b.due() == []
    clock.now = 0.005
    assert [k for k, _ in b.due()] == ["p2"] and len(b) == 0


def test_batcher_waits_longer_while_the_process_is_busy() -> None:
    clock = Clock()
    load = ReceiptLoad(window_s=0.25, clock=clock)
    b = ReceiptBatcher(
        max_batch=1000, linger_s=0.005, busy_linger_s=0.025, busy_rate=500, load=load, clock=clock
    )
    b.add("p1", Receipt("0", "q"))  # quiet: the short linger
    clock.now = 0.005
    assert [k for k, _ in b.due()] == ["p1"]
    for i in range(200):  # 200 receipts in 0.25 s: 800/s
        clock.now = 0.005 + i * 0.00125
        b.add("p2", Receipt(str(i), "q"))
    clock.now = 0.26
    b.drain()
    b.add("p3", Receipt("x", "q"))
    assert load.rate >= 500 and b.busy
    clock.now = 0.26 + 0.005
    assert b.due() == []  # busy: the batch waits the long linger
    clock.now = 0.26 + 0.025
    assert [k for k, _ in b.due()] == ["p3"]
    clock.now = 10.0  # a quiet spell: the next receipt ends the window at a low rate
    b.add("p4", Receipt("y", "q"))
    assert not b.busy
    clock.now = 10.005
    assert [k for k, _ in b.due()] == ["p4"]


def test_duplicate_filter_is_bounded() -> None:
    d = DuplicateFilter(2)
    for i in range(3):
        d.remember(Receipt(str(i), "q"))
    assert d.get("q", "0") is None and d.get("q", "2") is not None and d.duplicates == 1


receipts = st.lists(
    st.builds(
        Receipt,
        st.text(min_size=1, max_size=8),
        st.sampled_from(["q1", "q2"]),
        st.booleans(),
        st.text(max_size=5),
    )
)


@given(receipts)
def test_receipt_encoding_roundtrips(items) -> None:
    normalised = [Receipt(r.message_id, r.queue, r.ok, "" if r.ok else r.reason) for r in items]
    decoded = decode_receipts(encode_receipts(normalised))
    assert sorted(decoded, key=repr) == sorted(normalised, key=repr)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"nope",
        b"[]",
        b'{"v":2}',
        b'{"v":1,"ok":{"q":[1]}}',
        b'{"v":1,"neg":[["a","b"]]}',
        b"\xff\xfe",
    ],
)
def test_malformed_receipts_are_refused_with_a_reason(body) -> None:
    with pytest.raises(ValueError, match="receipt"):
        decode_receipts(body)


def _core(mode: ConfirmMode = ConfirmMode.E2E) -> PublisherCore:
    topology = TopologyRecord()
    topology.add(ExchangeSpec("fan", ExchangeType.FANOUT))
    for q in ("a", "b", "c"):
        topology.add(BindingSpec(q, "fan"))
    return PublisherCore(
        mode=mode,
        confirms=ConfirmSettings(receipt_timeout=1, max_attempts=2),
        retry=RetrySettings(),
        topology=topology,
    )


def test_a_busy_batch_waits_a_fraction_of_its_messages_age_up_to_a_bound() -> None:
    clock = Clock()
    load = ReceiptLoad(window_s=0.25, clock=clock)
    b = ReceiptBatcher(
        max_batch=1000,
        linger_s=0.005,
        busy_linger_s=0.025,
        busy_rate=500,
        load=load,
        age_fraction=0.1,
        max_linger_s=0.25,
        clock=clock,
    )
    assert b.linger(3.0) == 0.005  # quiet: the short linger whatever the age
    load.rate = 1000.0  # busy
    assert b.linger(None) == 0.025 and b.linger(0.1) == 0.025  # young: the busy linger
    assert b.linger(1.5) == pytest.approx(0.15)  # a tenth of the age
    assert b.linger(60.0) == 0.25  # bounded
    assert b.linger(-1.0) == b.linger(math.nan) == 0.025  # unknown: the busy linger
    b.add("p1", Receipt("1", "q"), age_s=2.0)
    clock.now = 0.19
    assert b.due() == []
    clock.now = 0.2
    assert [k for k, _ in b.due()] == ["p1"]


@pytest.mark.parametrize(
    ("value", "age"),
    [
        (1, None),  # an earlier publisher: receipts wanted, age unknown
        (True, None),
        ("1700000000000", None),
        (1_000_000_000_000, None),  # 2001: older than a day
        (2_000_000_000_000_000, None),  # far future: a clock or a forger
        ("ms", None),
        (None, None),
    ],
)
def test_published_age_ignores_what_is_not_a_recent_time(value: object, age: object) -> None:
    assert published_age({RECEIPT_HEADER: value}, time.time()) is age


def test_published_age_reads_the_publish_time() -> None:
    now = time.time()
    assert published_age({RECEIPT_HEADER: int((now - 2) * 1000)}, now) == pytest.approx(2, 0.01)


def test_publisher_core_expects_queues_from_topology_or_override() -> None:
    core = _core()
    message = core.prepare(b"x", exchange="fan", message_id="m1")
    assert message.reply_to == REPLY_TO
    sent_ms = message.headers[RECEIPT_HEADER]  # receipts wanted; the value: when it was sent
    assert abs(sent_ms / 1000 - time.time()) < 5
    assert not message.persistent and not message.mandatory
    assert core.tracker._pending["m1"].expected == {"a", "b", "c"}
    core.prepare(b"x", exchange="elsewhere", message_id="m2", expect=["z"])
    assert core.tracker._pending["m2"].expected == {"z"}
    with pytest.raises(NoRoute, match="expect="):
        core.prepare(b"x", exchange="elsewhere")


def test_publisher_core_turns_receipts_and_timeouts_into_results() -> None:
    core = _core()
    core.prepare(b"x", exchange="fan", message_id="ok")
    core.prepare(b"x", exchange="fan", message_id="neg")
    batch = [Receipt("ok", q) for q in "abc"] + [Receipt("neg", "b", False, "schema")]
    settled = dict(core.on_reply(Delivery(encode_receipts(batch), "amq.rabbitmq.reply-to")))
    assert settled["ok"] is None
    assert isinstance(settled["neg"], NegativeReceipt) and settled["neg"].queue == "b"
    assert core.on_reply(Delivery(b"garbage", "r")) == [] and core.malformed_receipts == 1


def test_publisher_core_timeout_names_missing_queues() -> None:
    core = _core()
    core.tracker = ConfirmTracker(timeout=1, max_attempts=1, clock=lambda: 10.0)
    core.in_flight["m"] = core.prepare(b"x", exchange="fan", message_id="m")
    core.tracker._pending["m"].deadline = 0
    _, failed = core.due()
    error = failed[0][1]
    assert isinstance(error, ReceiptTimeout) and error.missing == {"a", "b", "c"}


def test_non_receipt_modes_use_broker_properties() -> None:
    msg = _core(ConfirmMode.PERSISTENT).prepare(b"x", exchange="fan")
    assert msg.persistent and msg.mandatory and msg.reply_to is None
    assert RECEIPT_HEADER not in msg.headers


def _delivery(mid: str = "m", queue: str = "q") -> Delivery:
    return Delivery(
        b"x", queue, message_id=mid, reply_to="amq.rabbitmq.reply-to.X", headers={RECEIPT_HEADER: 1}
    )


def test_consumer_core_suppresses_resends_and_repeats_the_receipt() -> None:
    core = ConsumerCore(ConfirmSettings(receipt_batch=100))
    first = _delivery()
    assert core.should_handle(first)
    concurrent = _delivery()
    assert not core.should_handle(concurrent)  # first copy still in its handler
    assert core.settled(concurrent, Outcome(Action.ACK)) == [] and len(core.batcher) == 0
    core.settled(first, Outcome(Action.REJECT, "bad"))
    later = _delivery()
    assert not core.should_handle(later)
    core.settled(later, Outcome(Action.ACK))
    ((_reply_to, sent),) = core.batcher.drain()
    assert [r.ok for r in sent] == [False, False] and sent[1].reason == "bad"
    assert core.suppressed == 2


def test_consumer_core_requeue_and_plain_messages_earn_no_receipt() -> None:
    core = ConsumerCore(ConfirmSettings())
    d = _delivery()
    assert core.should_handle(d)
    assert core.settled(d, Outcome(Action.REQUEUE)) == []
    assert core.should_handle(_delivery())  # the requeued copy is handled again
    plain = Delivery(b"x", "q", message_id="p")
    assert core.should_handle(plain) and core.settled(plain, Outcome(Action.ACK)) == []
    assert len(core.batcher) == 0


@pytest.mark.parametrize(
    ("decided", "handled_again"),
    [(Action.ACK, False), (Action.REJECT, True), (Action.DEAD_LETTER, True)],
)
def test_an_ack_the_channel_lost_still_earns_its_receipt_and_stops_the_redelivery(
    decided: Action, handled_again: bool
) -> None:
    """The handler ran and its ack met a dead channel: the broker redelivers, but the
    message was handled; its receipt goes out and the redelivery is a duplicate.  A
    lost reject or dead-letter is handled again (acking it as a duplicate would keep
    it from the dead letters)."""
    core = ConsumerCore(ConfirmSettings(receipt_batch=100))
    first = _delivery()
    assert core.should_handle(first)
    lost = Outcome(Action.REQUEUE, "channel lost before settling: closed", unsent=decided)
    core.settled(first, lost)
    assert core.should_handle(_delivery()) is handled_again
    drained = core.batcher.drain()
    if decided is Action.ACK:
        ((_reply_to, sent),) = drained
        assert [(r.ok, r.reason) for r in sent] == [(True, "")]
    else:
        assert drained == []


def test_a_named_content_makes_two_differently_stamped_copies_one_message() -> None:
    """``CONTENT_HEADER``: one id, one content name, other bodies (a Phoenix event matched
    by two match brokers): the second is a resend, answered with the first's receipt; a
    different content name under the same id is another message, refused."""
    from middleware.confirms.tracking import CONTENT_HEADER

    def copy(body: bytes, content: str) -> Delivery:
        headers = {RECEIPT_HEADER: 1, CONTENT_HEADER: content}
        return Delivery(
            body, "q", message_id="e1:q", reply_to="amq.rabbitmq.reply-to.X", headers=headers
        )

    core = ConsumerCore(ConfirmSettings(receipt_batch=100))
    first = copy(b'{"broker": "D/match-0"}', "ev-1")
    assert core.should_handle(first)
    core.settled(first, Outcome(Action.ACK))
    again = copy(b'{"broker": "A/match-0", "again": true}', "ev-1")
    assert not core.should_handle(again)
    core.settled(again, Outcome(Action.ACK))
    other = copy(b'{"broker": "A/match-0"}', "ev-2")
    assert not core.should_handle(other)
    core.settled(other, Outcome(Action.ACK))
    ((_reply_to, sent),) = core.batcher.drain()
    assert [r.ok for r in sent] == [True, True, False], sent
    assert "a different message" in sent[2].reason


def test_elements_header_roundtrips_and_refuses_what_is_not_pairs() -> None:
    from middleware.confirms.tracking import decode_elements, encode_elements

    pairs = [("e1:q", "c1"), ("e 2", 'c"2')]
    assert decode_elements(encode_elements(pairs)) == pairs
    assert decode_elements(encode_elements(pairs).encode()) == pairs
    for bad in ("[1", "{}", '[["a"]]', '[["a", ""]]', '[["a", 2]]', 7):
        with pytest.raises(ValueError):
            decode_elements(bad)


def test_an_element_handled_makes_a_later_copy_alone_a_resend() -> None:
    """An element of a batch handled, then the same id and content alone (the copy sent
    again unbatched): suppressed, answered with a positive receipt."""
    from middleware.confirms.tracking import CONTENT_HEADER, named_digest

    core = ConsumerCore(ConfirmSettings(receipt_batch=100))
    assert core.element_earlier("q", "e1:q", named_digest("c1")) is None
    core.element_handled("q", "e1:q", named_digest("c1"))
    assert core.element_earlier("q", "e1:q", named_digest("c1")).ok
    refused = core.element_earlier("q", "e1:q", named_digest("other"))
    assert not refused.ok and "duplicate" in refused.reason
    alone = Delivery(
        b"x",
        "q",
        message_id="e1:q",
        reply_to="amq.rabbitmq.reply-to.X",
        headers={RECEIPT_HEADER: 1, CONTENT_HEADER: "c1"},
    )
    assert not core.should_handle(alone)
    core.settled(alone, Outcome(Action.ACK))
    ((_reply_to, sent),) = core.batcher.drain()
    assert [r.ok for r in sent] == [True]
