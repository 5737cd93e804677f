"""A layer consumer as its own process, for tests that kill it with SIGKILL.

usage: python -m tests.e2e_consumer_process QUEUE OUTFILE DELAY_S
Appends "queue message_id" per handled message to OUTFILE (line-buffered).
Brokers come from QOSMQ_AMQP_URLS.
"""

from __future__ import annotations

import asyncio
import sys

from middleware.confirms import AsyncConfirmConsumer
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery


async def main(queue: str, outfile: str, delay: float) -> None:
    client = await AsyncClient(settings=Settings.load(prefetch=50)).connect()
    consumer = AsyncConfirmConsumer(client)
    out = open(outfile, "a", buffering=1)  # noqa: SIM115, ASYNC230 - lives with the process

    async def handler(d: Delivery) -> None:
        await asyncio.sleep(delay)
        out.write(f"{d.queue} {d.message_id}\n")

    await consumer.consume(queue, handler)
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], float(sys.argv[3])))
