"""A Phoenix e2e subscriber as its own process, for tests that freeze or kill it.

usage: python -m tests.phoenix_subscriber_process FACE TOPOLOGY CLUSTER QUEUE OUTFILE
FACE is ``async`` (``PhoenixClient``) or ``sync`` (``SyncPhoenixClient``).  Consumes
QUEUE with ``e2e=True`` and appends each handled event's ``n`` attribute to OUTFILE
(line-buffered); prints ``ready`` once consuming.  Brokers come from QOSMQ_AMQP_URLS.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, TextIO

from middleware.phoenix.protocol import PhoenixTopology
from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.settings import Settings
from middleware.transport import AsyncClient


def run(face: str, topology: PhoenixTopology, cluster: str, queue: str, out: TextIO) -> None:
    settings = Settings.load()

    def handle(event: Any, _message: Any) -> None:
        out.write(f"{event.attributes['n']}\n")

    if face == "sync":
        with SyncPhoenixClient.connect(settings, topology=topology, cluster=cluster) as client:
            client.consume(queue, handle, e2e=True)
            print("ready", flush=True)
            client.run()
        return

    async def main() -> None:
        async with AsyncClient(settings=settings) as connection:
            client = PhoenixClient(connection, topology=topology, cluster=cluster)

            async def ahandle(event: Any, message: Any) -> None:
                handle(event, message)

            await client.consume(queue, ahandle, e2e=True)
            print("ready", flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())


if __name__ == "__main__":
    face, path, cluster, queue, outfile = sys.argv[1:6]
    with open(outfile, "a", buffering=1) as out:
        run(face, PhoenixTopology.load(path), cluster, queue, out)
