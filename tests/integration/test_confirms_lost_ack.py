"""An e2e consumer whose link is cut while its handlers run: nothing is handled twice.

The handlers finish after the cut, so their acks meet a dead connection and the broker
gives the deliveries back: they come again on the consumer's next connection. The
handler ran and succeeded, so the consumer owes the receipt and answers the redelivery
from its duplicate filter without running the handler again. (Before 2026-11-29 a lost
ack counted as a requeue: every such message was handled a second time.)

The consumer reaches the broker through a ``FaultProxy`` (the publisher directly); the
test counts each handler's completion itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from typing import Any

import pytest

from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmConsumer,
)
from middleware.errors import MiddlewareError
from middleware.localcluster.proxy import FaultProxy
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, QueueSpec, SyncClient

pytestmark = [pytest.mark.rabbit, pytest.mark.chaos]

COUNT, HANDLER_S = 8, 1.0


@pytest.mark.parametrize("face", ["async", "sync"])
def test_handlers_whose_acks_the_link_lost_do_not_run_again(
    face: str, settings: Settings, brokers: Any, name: str
) -> None:
    port = int(brokers.urls[0].rstrip("/").rsplit(":", 1)[1])
    proxy = FaultProxy(port)
    through = settings.model_copy(update={"amqp_urls": (proxy.url,)})
    completed: Counter[str] = Counter()
    started = threading.Event()

    def done(delivery: Delivery) -> None:
        completed[str(delivery.message_id)] += 1

    async def scenario() -> list[str]:
        async with AsyncClient(settings=settings) as publisher_client:
            await publisher_client.declare_queue(QueueSpec(name))
            publisher = await AsyncConfirmPublisher(publisher_client, mode="e2e").start()
            failed: list[str] = []

            async def one(i: int) -> None:
                try:
                    await publisher.publish(b"x", routing_key=name, message_id=f"m{i}")
                except MiddlewareError as exc:
                    failed.append(repr(exc))

            publishes = [asyncio.create_task(one(i)) for i in range(COUNT)]
            await asyncio.to_thread(started.wait, 30)
            await asyncio.sleep(HANDLER_S / 3)  # every handler is running
            proxy.cut()
            await asyncio.sleep(HANDLER_S)  # every handler has finished: its ack is lost
            proxy.heal()
            await asyncio.gather(*publishes)
            await asyncio.sleep(1.0)  # a handler run again would show by now
            await publisher.close()
            await publisher_client.delete_queue(name)
            return failed

    try:
        if face == "async":

            async def consuming() -> list[str]:
                client = await AsyncClient(settings=through).connect()
                await client.declare_queue(QueueSpec(name))
                consumer = AsyncConfirmConsumer(client)

                async def handle(delivery: Delivery) -> None:
                    started.set()
                    await asyncio.sleep(HANDLER_S)
                    done(delivery)

                await consumer.consume(name, handle)
                try:
                    return await scenario()
                finally:
                    await consumer.close()
                    await client.close()

            failed = asyncio.run(consuming())
        else:
            with SyncClient(settings=settings) as admin:
                admin.declare_queue(QueueSpec(name))
            client = SyncClient(settings=through).connect()
            consumer = SyncConfirmConsumer(client)
            finished = threading.Event()

            def handle_sync(delivery: Delivery) -> None:
                started.set()
                time.sleep(HANDLER_S)
                done(delivery)

            consumer.consume(name, handle_sync)
            thread = threading.Thread(target=consumer.run, kwargs={"until": finished.is_set})
            thread.start()
            try:
                failed = asyncio.run(scenario())
            finally:
                finished.set()
                thread.join(30)
                client.close()
    finally:
        proxy.close()
    assert failed == []
    assert set(completed) == {f"m{i}" for i in range(COUNT)}, "a message was never handled"
    twice = sorted(m for m, n in completed.items() if n > 1)
    assert twice == [], f"{len(twice)} handled twice: {twice}"
