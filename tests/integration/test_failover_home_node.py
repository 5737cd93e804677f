"""A failover goes on without a classic queue whose home node is down.

A client connected to node C declared a durable classic queue there (its home is C),
bound it to an exchange and consumes it; it publishes to a quorum queue that another
service owns.  Node C is killed (or stopped, as a rolling restart does).  The failover's
replay is refused the home queue's declare with 404 ("home node ... is down or
inaccessible") for as long as C is down.  Before the fix, that refusal failed the whole
failover and it was tried again until C was back: the asyncio face's publishes to the
quorum queue waited (``connect_timeout``, then ``BrokerUnreachable``: 0 of 148 in 15 s),
the pika face's raised ``EntityNotFound``, and so did ``run``.  Now every publish is
confirmed while C is down, and the consumer of the home queue is subscribed again
once C is back.  Counted by the test: the owner reads the quorum queue; the handler
counts what the home queue delivers.
"""

from __future__ import annotations

import contextlib
import time

import pytest

from middleware.errors import MiddlewareError
from middleware.transport import (
    BindingSpec,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)
from tests.conftest import Face

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]

WHILE_DOWN = 30  # publishes while the home node is down, one every 0.1 s


@pytest.mark.parametrize(
    ("kind", "fault"),
    [("async", "kill"), ("sync", "kill"), ("async", "stop"), ("sync", "stop")],
)
def test_a_failover_goes_on_without_a_queue_whose_home_node_is_down(
    kind, fault, settings, brokers, local_cluster, name
) -> None:
    urls = brokers.urls
    home, other, exchange = f"{name}.home", f"{name}.other", f"{name}.x"
    owner = SyncClient(settings=settings.model_copy(update={"amqp_urls": (urls[0],)})).connect()
    owner.declare_queue(QueueSpec(other))  # a quorum queue: it outlives one node
    client = Face(kind, settings.model_copy(update={"amqp_urls": (urls[2], urls[0], urls[1])}))
    client.call("connect")
    victim = brokers.node_of_url(client.client.connected_node)
    got: list[str] = []
    try:
        client.call("declare_exchange", ExchangeSpec(exchange, ExchangeType.FANOUT))
        client.call("declare_queue", QueueSpec(home, kind=QueueKind.CLASSIC))  # home: C
        client.call("bind", BindingSpec(home, exchange))
        client.consume(home, lambda d: got.append(d.text()))
        client.call("publish", OutgoingMessage(b"before", exchange))
        client.pump(10, until=lambda: "before" in got)
        assert got == ["before"]

        faulted_at = time.monotonic()
        getattr(local_cluster, fault)(victim)  # a stop returns once the node is down
        confirmed: list[str] = []
        errors: list[str] = []
        first = 0.0
        for i in range(WHILE_DOWN):
            if time.monotonic() - faulted_at > 45:  # the old replay: each publish waited
                break
            mid = f"m{i}"
            try:
                client.call("publish", OutgoingMessage(mid.encode(), "", other, message_id=mid))
                confirmed.append(mid)
                first = first or time.monotonic() - faulted_at
            except MiddlewareError as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            client.pump(0.1)
        down_for = time.monotonic() - faulted_at
        assert errors == [], errors[:3]
        assert confirmed == [f"m{i}" for i in range(WHILE_DOWN)]
        assert client.client.reconnects >= 1
        assert brokers.node_of_url(client.client.connected_node) != victim
        stored: list[str] = []
        while (d := owner.get(other)) is not None:
            stored.append(d.text())
        assert sorted(stored) == sorted(confirmed), "confirmed while down, not stored"

        local_cluster.start(victim)
        started_at = time.monotonic()
        # the binding was kept with the queue: a publish to the exchange reaches it, and
        # the consumer is subscribed again once the queue answers
        client.call("publish", OutgoingMessage(b"after", exchange))
        client.pump(60, until=lambda: "after" in got)
        assert got == ["before", "after"], (got, f"down {down_for:.1f} s")
        print(
            f"\n{kind} {fault}: {len(confirmed)}/{WHILE_DOWN} confirmed while the home node "
            f"was down ({down_for:.1f} s), the first {first:.2f} s after the fault; the "
            f"consumer back {time.monotonic() - started_at:.1f} s after the node's start"
        )
    finally:
        with contextlib.suppress(MiddlewareError):
            client.call("delete_queue", home)
            client.call("delete_exchange", exchange)
        client.close()
        with contextlib.suppress(MiddlewareError):
            owner.delete_queue(other)
        owner.close()
