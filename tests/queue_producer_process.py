"""A queue producer as its own process, for tests that SIGKILL it mid-drain.

usage: python -m tests.queue_producer_process produce|recover SPOOL QUEUE N
produce: enqueue N messages (ids p0..pN-1, body = index), print "enqueued <statuses>",
         then keep running (the spool drains in the background when brokers answer).
recover: open the same spool, recover(), print the report as JSON, exit.
Brokers come from QOSMQ_AMQP_URLS.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter

from middleware.queues import AsyncQueues
from middleware.settings import Settings
from middleware.transport import AsyncClient


async def main(mode: str, spool: str, queue: str, n: int) -> None:
    settings = Settings.load(
        heartbeat=2,
        connect_timeout=2,
        retry={"attempts": 5, "max_delay": 0.5},
        queues={"spool_path": spool, "drain_batch": 64},
    )
    queues = await AsyncQueues(AsyncClient(settings=settings)).start()
    if mode == "recover":
        while not queues.client.ready:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        report = await queues.recover()
        print(json.dumps({"replayed": report.replayed, "remaining": report.remaining}), flush=True)
        await queues.client.close()
        return
    statuses = Counter()
    for i in range(n):
        result = await queues.enqueue(queue, str(i).encode(), message_id=f"p{i}")
        statuses[result.status.value] += 1
    print("enqueued", json.dumps(statuses), flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])))
