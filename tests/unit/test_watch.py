"""The watched channel of unconfirmed publishes (``transport/watch.py``): what an ack, a
nack, a closed channel and a lost connection call for."""

from __future__ import annotations

import importlib.metadata
import inspect

import aiormq
from hypothesis import given
from hypothesis import strategies as st

from middleware.transport import OutgoingMessage
from middleware.transport.watch import WatchedChannel, missing_exchange


def _channel(attempts: int = 3) -> WatchedChannel:
    return WatchedChannel(attempts=attempts, delay=lambda n: 0.1 * n)


def _msg(i: int, exchange: str = "x") -> OutgoingMessage:
    return OutgoingMessage(b"b", exchange, "k", message_id=f"m{i}")


def test_an_ack_settles_and_a_multiple_ack_settles_every_earlier_tag() -> None:
    ch = _channel()
    for i in range(1, 5):
        ch.sent(ch.next_tag(), _msg(i))
    assert ch.answered(2, multiple=False, ok=True).resend == ()
    assert ch.owed == 3
    assert ch.answered(4, multiple=True, ok=True).resend == ()
    assert ch.owed == 0 and ch.current


def test_a_nack_retires_the_channel_once_and_sends_again_with_backoff() -> None:
    ch = _channel()
    for i in range(1, 4):
        ch.sent(ch.next_tag(), _msg(i))
    first = ch.answered(1, multiple=False, ok=False)
    assert first.retire_channel and not ch.current
    assert [(r.message.message_id, r.attempt, r.delay) for r in first.resend] == [("m1", 2, 0.1)]
    later = ch.answered(3, multiple=True, ok=False)  # the channel is retired already
    assert not later.retire_channel
    assert sorted(r.message.message_id for r in later.resend) == ["m2", "m3"]


def test_a_message_refused_on_every_attempt_is_given_up() -> None:
    ch = _channel(attempts=2)
    ch.sent(1, _msg(1), attempt=2)
    answer = ch.answered(1, multiple=False, ok=False)
    assert answer.resend == () and [m.message_id for m in answer.given_up] == ["m1"]


def test_a_closed_channel_sends_its_debt_again_but_not_to_the_missing_exchange() -> None:
    ch = _channel()
    ch.sent(1, _msg(1, "gone"))
    ch.sent(2, _msg(2, "here"))
    answer = ch.closed(missing_exchange("NOT_FOUND - no exchange 'gone' in vhost '/'"))
    assert [r.message.message_id for r in answer.resend] == ["m2"]
    assert answer.given_up == () and [m.message_id for m in answer.no_exchange] == ["m1"]
    assert [why for _, why in answer.reasons()] == [
        "sent to exchange 'gone', which does not exist"
    ]  # not "refused on every attempt": it was sent once
    assert not answer.retire_channel and not ch.current and ch.owed == 0


def test_a_lost_connection_hands_the_debt_back_to_the_caller() -> None:
    ch = _channel()
    ch.sent(1, _msg(1))
    assert [m.message_id for m in ch.forget()] == ["m1"]
    assert ch.answered(1, multiple=False, ok=False).resend == ()


def test_missing_exchange_reads_only_rabbitmqs_not_found_text() -> None:
    assert missing_exchange("NOT_FOUND - no exchange 'a.b' in vhost '/x'") == "a.b"
    assert missing_exchange("PRECONDITION_FAILED - inequivalent arg") is None
    assert missing_exchange(None) is None


@given(st.lists(st.tuples(st.integers(1, 30), st.booleans(), st.booleans()), max_size=60))
def test_every_publish_is_settled_resent_or_given_up_exactly_once(answers) -> None:
    ch = _channel(attempts=2)
    for i in range(1, 31):
        ch.sent(i, _msg(i))
    seen: list[str] = []
    for tag, multiple, ok in answers:
        before = ch.owed
        answer = ch.answered(tag, multiple=multiple, ok=ok)
        out = [r.message.message_id for r in answer.resend] + [
            m.message_id for m in answer.given_up
        ]
        assert before - ch.owed >= len(out)  # nothing is resent that was not owed
        seen += out
    assert len(seen) == len(set(seen))


def test_the_installed_aiormq_has_what_the_watched_channel_uses() -> None:
    """``aio_publish.publish_numbered`` mirrors aiormq 7's ``Channel.basic_publish``, and
    ``aio_watch`` reads the confirm frames aiormq's reader hands ``_on_confirm_frame``."""
    assert importlib.metadata.version("aiormq").startswith("7.")
    source = inspect.getsource(aiormq.Channel.basic_publish)
    for part in (
        "self.delivery_tag += 1",
        "write_queue.put",
        "ChannelFrame.marshall",
        "_split_body",
        "self.lock",
    ):
        assert part in source, part
    assert "await self._on_confirm_frame(frame)" in inspect.getsource(aiormq.Channel)
