"""Prometheus metrics of the transport (process-wide, served by observability's endpoint).

Label children are bound once here: ``Counter.labels()`` on every message is a
dict lookup under a lock that the hot path need not pay.
"""

import logging

from prometheus_client import Counter, Gauge

from .broker_info import BrokerInfo
from .delivery import Action

PUBLISHED = Counter("qosmq_published_total", "messages published", ["kind"])
PUBLISHED_CONFIRMED = PUBLISHED.labels("confirmed")
PUBLISHED_UNCONFIRMED = PUBLISHED.labels("unconfirmed")
DELIVERIES = Counter("qosmq_deliveries_total", "deliveries settled by handlers", ["outcome"])
DELIVERIES_BY_ACTION = {action: DELIVERIES.labels(action.value) for action in Action}
RECONNECTS = Counter("qosmq_failovers_total", "connections re-established after a loss")
CONSUMERS_CANCELLED_BY_BROKER = Counter(
    "qosmq_consumers_cancelled_by_broker_total",
    "consumers the broker cancelled (queue deleted, consumer timeout); each re-subscribes",
)
PUBLISH_SUSPECTS = Counter(
    "qosmq_publish_suspects_total",
    "publishes retried alone after the broker closed the connection in answer to a frame",
)
PUBLISH_ALONE = Counter(
    "qosmq_publish_alone_total",
    "publishes sent again alone after the broker closed their channel in answer to a frame",
)
PUBLISH_REFUSED = Counter(
    "qosmq_publish_refused_total",
    "publishes failed with MessageRefused (the broker closed the connection at them twice)",
)
CONFIRM_TIMEOUTS = Counter(
    "qosmq_publish_confirm_timeouts_total",
    "confirmed publishes with no broker answer within publish_timeout (ConfirmTimeout; "
    "not sent again)",
)
GET_TIMEOUTS = Counter(
    "qosmq_get_timeouts_total",
    "basic.gets the broker gave up on by closing the connection (GetTimeout; not tried again)",
)
CLOSES_CUT = Counter(
    "qosmq_closes_cut_total",
    "sync connections whose close the broker did not answer within close_grace: the "
    "socket was dropped",
)

CONSUMERS_LOST = Counter(
    "qosmq_consumers_lost_total",
    "consumers the watchdog found subscribed to nothing (queue gone or not counting them) "
    "without the broker's basic.cancel; each subscribes again",
)
UNCONFIRMED_RESENT = Counter(
    "qosmq_unconfirmed_resent_total",
    "unconfirmed publishes sent again on a fresh channel after the broker refused them "
    "(a nack, or their channel closed)",
)
UNCONFIRMED_GIVEN_UP = Counter(
    "qosmq_unconfirmed_given_up_total",
    "unconfirmed publishes refused by the broker on every attempt (or to a missing exchange)",
)


def consumer_cancelled_by_broker(log: logging.Logger, tag: str, queue: str) -> None:
    """Say and count that the broker cancelled a consumer (both faces re-subscribe it)."""
    log.warning(
        "consumer %s on queue %r cancelled by the broker; re-subscribing when the queue "
        "exists again",
        tag,
        queue,
    )
    CONSUMERS_CANCELLED_BY_BROKER.inc()


def consumer_lost(log: logging.Logger, tag: str, queue: str) -> None:
    """Say and count that the watchdog found a consumer subscribed to nothing (both faces
    subscribe it again)."""
    log.warning(
        "consumer %s: queue %r is gone, counts no consumer or gives it nothing (no "
        "basic.cancel came); subscribing again when it exists",
        tag,
        queue,
    )
    CONSUMERS_LOST.inc()


BROKER_VERSION = Gauge(
    "qosmq_broker_info",
    "1 for each broker version a client of this process connected to",
    ["product", "version"],
)
_announced: set[str] = set()


def broker_connected(log: logging.Logger, info: BrokerInfo) -> None:
    """Export the broker's version; log once per process and version what it lacks that
    the layer adapts to (``BrokerInfo.notices``)."""
    BROKER_VERSION.labels(info.product, info.raw_version).set(1)
    if info.raw_version in _announced:
        return
    _announced.add(info.raw_version)
    for notice in info.notices():
        log.warning("%s", notice)
