"""A consumer whose RabbitMQ node freezes (SIGSTOP, a paused VM) is back at the thaw.

The consumer (either face) is connected to the first node, which leads its quorum
queue; a producer on the second node publishes with broker confirms.  The first node is
frozen for ``FROZEN_S`` and let go on.  The consumer's client finds its silent
connection in 1.5 heartbeats and fails over, and its replayed ``basic.consume`` meets
RabbitMQ 3.10 waiting for the frozen leader: one sent during the freeze is answered
after 65 s.  Before ``consume_timeout`` the consumer got nothing until 48 s after the
thaw (both faces); now the subscription is given up after ``consume_timeout`` and made
again (the asyncio core on a new channel, in the background; the sync face by
reconnecting), and it is answered at the thaw.  The test counts every confirmed publish
and every delivery itself: all arrive within ``AFTER_S`` of the thaw (a few twice: at
least once, see the end of the test).
A sync client that failed over onto the frozen node itself (its TCP port accepts, the
handshake never comes) got an "unexpected" ``TopologyError`` and its ``run`` died; a
handshake timeout is a ``ConnectionLost`` now, and it tries the next node.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from middleware.errors import MiddlewareError
from middleware.transport import (
    AsyncClient,
    Delivery,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]

FROZEN_S = 20.0
AFTER_S = 25.0  # the old code's first delivery came 48 s after the thaw


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_consumer_on_a_frozen_node_is_back_at_the_thaw(
    face: str, settings: Any, local_cluster: Any, name: str
) -> None:
    node = local_cluster.layout.nodes[0].short_name
    got: dict[str, int] = {}
    stop = threading.Event()
    thawed: list[float] = []

    def handle(delivery: Delivery) -> None:
        got[delivery.message_id or ""] = got.get(delivery.message_id or "", 0) + 1

    def sync_consumer(ready: threading.Event) -> None:
        client = SyncClient(settings=settings.starting_at(0)).connect()
        try:
            client.declare_queue(
                QueueSpec(name, kind=QueueKind.QUORUM, leader_locator="client-local")
            )
            client.consume(name, handle)
            ready.set()
            while not stop.is_set():
                client.run(0.2)
        finally:
            client.close()

    async def scenario() -> list[str]:
        consumer: AsyncClient | None = None
        ready = threading.Event()
        if face == "sync":
            running = asyncio.create_task(asyncio.to_thread(sync_consumer, ready))
            while not ready.is_set():
                assert not running.done(), running
                await asyncio.sleep(0.1)
        else:
            consumer = await AsyncClient(settings=settings.starting_at(0)).connect()
            await consumer.declare_queue(
                QueueSpec(name, kind=QueueKind.QUORUM, leader_locator="client-local")
            )

            async def on_delivery(delivery: Delivery) -> None:
                handle(delivery)

            await consumer.consume(name, on_delivery)
        confirmed: list[str] = []
        async with AsyncClient(settings=settings.starting_at(1)) as producer:
            await asyncio.to_thread(local_cluster.freeze, node)
            timer = threading.Timer(
                FROZEN_S, lambda: (local_cluster.thaw(node), thawed.append(time.monotonic()))
            )
            timer.start()
            try:
                i = 0
                while not thawed or time.monotonic() < thawed[0] + 5.0:
                    try:
                        await producer.publish(
                            OutgoingMessage(b"x", routing_key=name, message_id=f"m{i}")
                        )
                        confirmed.append(f"m{i}")
                    except MiddlewareError:
                        pass  # refused or failed: the publisher knows; not counted
                    i += 1
                    await asyncio.sleep(0.05)
            finally:
                timer.cancel()
                local_cluster.thaw(node)
            deadline = thawed[0] + AFTER_S if thawed else time.monotonic()
            while time.monotonic() < deadline and not set(confirmed) <= set(got):  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            await producer.delete_queue(name)
        stop.set()
        if face == "sync":
            await running
        elif consumer is not None:
            await consumer.close()
        return confirmed

    confirmed = asyncio.run(scenario())
    assert thawed, "the node was never let go on by its timer"
    assert len(confirmed) >= 20, len(confirmed)  # (a publish waits for the new leader)
    missing = sorted(set(confirmed) - set(got))
    assert not missing, f"{len(missing)} confirmed messages not consumed {AFTER_S} s after the thaw"
    # Not asserted: that each arrives once.  A publish resent across the freeze (a nack in
    # the leader's election) is in the queue twice (the producer's at least once), and a
    # copy the broker first handed to a given-up subscription comes flagged redelivered,
    # so the test cannot tell a second copy from a second handing-out (seen: m0 twice,
    # once flagged, in a fresh-clone run of the first version of this cell).
    assert sum(got.values()) - len(got) <= 5, {m: n for m, n in got.items() if n > 1}
