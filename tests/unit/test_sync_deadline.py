"""The sync face's confirm deadline hands pika's wait a nack of delivery tag 0; pika
then warns "Message was Nack'ed by broker", which would tell the operator the broker
refused a message it never refused.  The filter drops that warning, and only that."""

from __future__ import annotations

import logging

import pika.spec

from middleware.transport.sync_live import _DeadlineNacks


def _record(tag: int) -> logging.LogRecord:
    return logging.LogRecord(
        "pika.adapters.blocking_connection",
        logging.WARNING,
        __file__,
        1,
        "Message was Nack'ed by broker: nack=%r; channel=%s; exchange=%s; routing_key=%s; "
        "mandatory=%r; ",
        (pika.spec.Basic.Nack(delivery_tag=tag), 1, "", "q", True),
        None,
    )


def test_the_deadlines_nack_is_not_logged_as_the_brokers() -> None:
    quiet = _DeadlineNacks()
    assert not quiet.filter(_record(0))  # the deadline's
    assert quiet.filter(_record(7))  # a real nack is still told
    other = logging.LogRecord("pika", logging.WARNING, __file__, 1, "something else", (), None)
    assert quiet.filter(other)
