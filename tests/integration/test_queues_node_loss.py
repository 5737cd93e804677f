"""Persistent queues (EMQ) through a SIGKILL of the producer's and the consumer's node.

A producer (either face) enqueues 3 000 messages to a quorum queue while an asyncio
consumer dequeues and acks them; both are connected to the first node, which is
SIGKILLed 3 s in and started again 6 s later (or stopped gracefully, or frozen by
SIGSTOP for 20 s and then let go on).  Enqueues that meet the dead connection are
spooled and drained once a node answers.  A frozen node holds the queue's leader:
nothing can be enqueued or subscribed until it runs again (RabbitMQ 3.10 waits for it),
so the enqueues are spooled, and the consumer, failed over within 1.5 heartbeats, is
subscribed again in the background.  Before ``consume_timeout`` its replayed
``basic.consume`` waited 65 s, and the consumer got nothing until 50 s after the thaw.
The test counts itself:

- every message arrives, and none twice (the consumers' duplicate filter drops what a
  drain resends);
- no enqueue fails (another node is reachable, or the spool holds it);
- the producer's order holds for every delivery the broker did not flag redelivered.
  The deliveries the consumer held unacked when its node died (up to its prefetch) come
  again, flagged, when the broker has returned them; by then newer messages may have
  been delivered to the consumer's new connection: RabbitMQ does not keep order across
  a redelivery, and neither does the layer (docs/queues.md).
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from middleware.errors import MiddlewareError
from middleware.queues import AsyncQueues, SyncQueues
from middleware.settings import Settings
from middleware.transport import AsyncClient, SyncClient

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]

COUNT = 3000
FROZEN_S = 20.0


def _with_spool(settings: Settings, path: Path) -> Settings:
    queues = settings.queues.model_copy(update={"spool_path": path})
    return settings.model_copy(update={"queues": queues})


@pytest.mark.parametrize("fault", ["kill", "stop", "freeze"])
@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_lost_node_loses_no_enqueue_and_keeps_the_producers_order(
    face: str, fault: str, settings: Settings, local_cluster: Any, name: str, tmp_path: Path
) -> None:
    first = settings.starting_at(0)
    node = local_cluster.layout.nodes[0].short_name
    producing = _with_spool(first, tmp_path / "producer.sqlite3")
    consuming = _with_spool(first, tmp_path / "consumer.sqlite3")
    statuses: list[str] = []
    failed: list[str] = []
    done = threading.Event()

    def enqueued(status: Any) -> None:
        statuses.append(status.value)

    def sync_producer() -> None:
        queues = SyncQueues(SyncClient(settings=producing)).start()
        for i in range(COUNT):
            try:
                enqueued(queues.enqueue(name, b"x", message_id=f"m{i}").status)
            except MiddlewareError as exc:
                failed.append(repr(exc)[:200])
            time.sleep(0.003)
        while queues.recover().remaining:
            time.sleep(0.2)
        queues.client.close()
        done.set()

    async def async_producer() -> None:
        queues = await AsyncQueues(AsyncClient(settings=producing)).start()
        for i in range(COUNT):
            try:
                enqueued((await queues.enqueue(name, b"x", message_id=f"m{i}")).status)
            except MiddlewareError as exc:
                failed.append(repr(exc)[:200])
            await asyncio.sleep(0.003)
        while (await queues.recover()).remaining:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        await queues.close()
        await queues.client.close()
        done.set()

    async def scenario() -> tuple[list[str], set[str]]:
        consumer = await AsyncQueues(AsyncClient(settings=consuming)).start()
        await consumer.create_queue(name)
        got: list[str] = []
        redelivered: set[str] = set()
        stop = asyncio.Event()

        async def consume() -> None:
            while not stop.is_set():
                message = await consumer.dequeue(name, timeout=0.5)
                if message is None:
                    continue
                got.append(str(message.message_id))
                if message.delivery.redelivered:
                    redelivered.add(str(message.message_id))
                await message.ack()

        consuming_task = asyncio.create_task(consume())
        if face == "sync":
            producer = asyncio.create_task(asyncio.to_thread(sync_producer))
        else:
            producer = asyncio.create_task(async_producer())
        await asyncio.sleep(3)
        await asyncio.to_thread(getattr(local_cluster, fault), node)
        try:
            await asyncio.sleep(FROZEN_S if fault == "freeze" else 6)
        finally:
            if fault == "freeze":
                local_cluster.thaw(node)
        await asyncio.to_thread(local_cluster.start, node)
        await asyncio.wait_for(producer, 120)
        deadline = time.monotonic() + 40
        while len(set(got)) < COUNT and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)  # a late duplicate would show by now
        stop.set()
        await consuming_task
        await consumer.destroy_queue(name)
        await consumer.close()
        await consumer.client.close()
        return got, redelivered

    got, redelivered = asyncio.run(scenario())
    assert done.is_set()
    assert failed == [], failed[:5]
    assert len(statuses) == COUNT
    assert "spooled" in statuses, "the kill met no enqueue: the spool was not tested"
    assert sorted(set(got)) == sorted(f"m{i}" for i in range(COUNT)), "a message was lost"
    assert len(got) == len(set(got)), "a message was handed to the consumer twice"
    in_order = [int(m[1:]) for m in got if m not in redelivered]
    assert in_order == sorted(in_order), "the producer's order broke outside redeliveries"
