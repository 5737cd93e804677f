"""An e2e publisher or consumer as its own process, for tests that SIGKILL or SIGSTOP it.

usage: python -m tests.e2e_processes consumer FACE QUEUE OUTFILE [DELAY_S]
       python -m tests.e2e_processes publisher FACE QUEUE OUTFILE COUNT RATE
FACE is ``async`` or ``sync``.  The consumer (prefetch 50) handles each message in
DELAY_S (default 0) and then appends ``queue message_id`` to OUTFILE;
the publisher appends one JSON line per publish (``["ok", id]`` once confirmed, or
``["err", id, error]``) and ``["done"]`` at the end.  Each prints ``ready`` once it can
take messages.  Brokers and confirm settings come from the environment (QOSMQ_*).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import TextIO

from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmConsumer,
    SyncConfirmPublisher,
)
from middleware.errors import MiddlewareError
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, SyncClient


def consume(face: str, queue: str, out: TextIO, delay: float) -> None:
    settings = Settings.load(prefetch=50)
    if face == "sync":
        client = SyncClient(settings=settings).connect()
        consumer = SyncConfirmConsumer(client)

        def handle_sync(d: Delivery) -> None:
            time.sleep(delay)
            out.write(f"{d.queue} {d.message_id}\n")

        consumer.consume(queue, handle_sync)
        print("ready", flush=True)
        consumer.run()
        return

    async def main() -> None:
        client = await AsyncClient(settings=settings).connect()
        consumer = AsyncConfirmConsumer(client)

        async def handle(d: Delivery) -> None:
            await asyncio.sleep(delay)
            out.write(f"{d.queue} {d.message_id}\n")

        await consumer.consume(queue, handle)
        print("ready", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


def publish(face: str, queue: str, out: TextIO, count: int, rate: float) -> None:
    def record(*row: str) -> None:
        out.write(json.dumps(row) + "\n")

    if face == "sync":
        client = SyncClient(settings=Settings.load()).connect()
        publisher = SyncConfirmPublisher(client, mode="e2e")
        print("ready", flush=True)
        for i in range(count):
            try:
                publisher.publish(b"x", routing_key=queue, message_id=f"m{i}")
                record("ok", f"m{i}")
            except MiddlewareError as exc:
                record("err", f"m{i}", repr(exc)[:300])
            time.sleep(1 / rate)
        record("done")
        client.close()
        return

    async def main() -> None:
        client = await AsyncClient(settings=Settings.load()).connect()
        publisher = await AsyncConfirmPublisher(client, mode="e2e").start()
        print("ready", flush=True)

        async def one(i: int) -> None:
            try:
                await publisher.publish(b"x", routing_key=queue, message_id=f"m{i}")
                record("ok", f"m{i}")
            except MiddlewareError as exc:
                record("err", f"m{i}", repr(exc)[:300])

        tasks = []
        for i in range(count):
            tasks.append(asyncio.create_task(one(i)))
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*tasks)
        record("done")
        await publisher.close()
        await client.close()

    asyncio.run(main())


if __name__ == "__main__":
    role, face, queue, path = sys.argv[1:5]
    with open(path, "a", buffering=1) as out:
        if role == "consumer":
            consume(face, queue, out, float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)
        else:
            publish(face, queue, out, int(sys.argv[5]), float(sys.argv[6]))
