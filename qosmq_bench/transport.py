"""The asyncio client's cost per message, against raw aio-pika in the same run.

One connection publishes ``messages`` confirmed messages (all started at once, the
client's publish window bounding them) to a classic queue and consumes them back with
acks: the work of one Phoenix hop per message.  Reported per cell: messages/s, the
process's CPU per message, and frames per socket write (the layer's client only).
Clients: ``raw`` (aio-pika's Exchange.publish and IncomingMessage.ack), ``layer`` (the
AsyncClient with ``coalesce_writes``), ``layer-per-frame`` (``coalesce_writes=false``);
for the sync face, ``raw-pika`` (pika's BlockingConnection: publish with confirms, one
at a time, then consume and ack), ``layer-sync`` (the SyncClient doing the same) and
``balanced-sync`` (the SyncClient's ``SyncBalancedPublisher`` over two replicas,
``predictive`` with no sidecar: what the choice adds to a sync publish).
Cells alternate within each repeat, so the clients compared ran seconds apart.  A
client named ``NAME@LOOP`` (``raw@asyncio``, ``layer@uvloop``) runs on that event loop,
a bare name on the settings' (``event_loop``), so one run can compare the loops too.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import aio_pika
import pika

from middleware import runtime
from middleware.balancer import SyncBalancedPublisher, replica_names
from middleware.runtime import EventLoopName
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    Delivery,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)

from .live import Live

__all__ = [
    "CLIENTS",
    "LOOPS",
    "SYNC_CLIENTS",
    "run_transport",
    "split_client",
    "sync_transport_cell",
    "transport_cell",
]

ASYNC_CLIENTS = ("raw", "layer", "layer-per-frame")
SYNC_CLIENTS = ("raw-pika", "layer-sync", "balanced-sync")
CLIENTS = (*ASYNC_CLIENTS, *SYNC_CLIENTS)
LOOPS = ("asyncio", "uvloop")


def split_client(client: str) -> tuple[str, str | None]:
    """``layer@uvloop`` -> (``layer``, ``uvloop``); a bare name: no loop of its own."""
    name, _, loop = client.partition("@")
    return name, loop or None


async def transport_cell(
    settings: Settings, client: str, *, messages: int, size: int, live: Live | None = None
) -> dict[str, Any]:
    """Publish and consume ``messages`` through one connection of ``client``."""
    live = live or Live(client)
    if client not in ASYNC_CLIENTS:
        raise ValueError(f"client must be one of {', '.join(ASYNC_CLIENTS)}, got {client!r}")
    queue = f"bench-transport-{uuid.uuid4().hex[:8]}"
    body = b"x" * size
    done = asyncio.Event()
    handled = 0

    def on_handled() -> None:
        nonlocal handled
        handled += 1
        live.consumed += 1
        if handled == messages:
            done.set()

    writes: tuple[int, int] | None = None
    if client == "raw":
        host, port, _ = settings.nodes[0]
        password = settings.password.get_secret_value()
        connection = await aio_pika.connect(f"amqp://{settings.username}:{password}@{host}:{port}/")
        try:
            publish_channel = await connection.channel(publisher_confirms=True)
            consume_channel = await connection.channel()
            await consume_channel.set_qos(prefetch_count=settings.prefetch)
            q = await consume_channel.declare_queue(queue, auto_delete=False)

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                on_handled()
                await message.ack()

            await q.consume(on_message)
            window = asyncio.Semaphore(settings.publish_window)

            async def send() -> None:
                async with window:
                    begun = time.perf_counter()
                    live.sent += 1
                    await publish_channel.default_exchange.publish(
                        aio_pika.Message(body), routing_key=queue
                    )
                    live.confirmed_since(begun)

            started, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(send() for _ in range(messages)))
            await asyncio.wait_for(done.wait(), 120)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            await q.delete(if_unused=False, if_empty=False)
        finally:
            await connection.close()
    else:
        custom = settings.model_copy(update={"coalesce_writes": client == "layer"})
        async with AsyncClient(settings=custom) as layer:
            await layer.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))

            async def handle(_: Delivery) -> None:
                on_handled()

            await layer.consume(queue, handle)
            before = layer.socket_writes or (0, 0)

            async def publish() -> None:
                begun = time.perf_counter()
                live.sent += 1
                await layer.publish(OutgoingMessage(body, "", queue))
                live.confirmed_since(begun)

            started, cpu = time.perf_counter(), time.process_time()
            await asyncio.gather(*(publish() for _ in range(messages)))
            await asyncio.wait_for(done.wait(), 120)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            after = layer.socket_writes
            if after is not None:
                writes = (after[0] - before[0], after[1] - before[1])
            await layer.delete_queue(queue)
    return _row(client, messages, size, elapsed, cpu, writes)


def sync_transport_cell(
    settings: Settings, client: str, *, messages: int, size: int, live: Live | None = None
) -> dict[str, Any]:
    """The sync face's cell: publish ``messages`` confirmed one by one (a blocking
    channel's confirms), then consume them back with acks, on one connection."""
    live = live or Live(client)
    if client not in SYNC_CLIENTS:
        raise ValueError(f"client must be one of {', '.join(SYNC_CLIENTS)}, got {client!r}")
    queue = f"bench-transport-{uuid.uuid4().hex[:8]}"
    body = b"x" * size
    handled = 0
    if client == "raw-pika":
        host, port, _ = settings.nodes[0]
        credentials = pika.PlainCredentials(settings.username, settings.password.get_secret_value())
        connection = pika.BlockingConnection(
            pika.ConnectionParameters(
                host, port, virtual_host=settings.vhost, credentials=credentials
            )
        )
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            channel.queue_declare(queue)
            channel.basic_qos(prefetch_count=settings.prefetch)

            def on_message(ch: Any, method: Any, _props: Any, _body: bytes) -> None:
                nonlocal handled
                handled += 1
                live.consumed += 1
                ch.basic_ack(method.delivery_tag)

            started, cpu = time.perf_counter(), time.process_time()
            for _ in range(messages):
                begun = time.perf_counter()
                live.sent += 1
                channel.basic_publish("", queue, body, mandatory=True)
                live.confirmed_since(begun)
            channel.basic_consume(queue, on_message)
            while handled < messages and time.perf_counter() - started < 120:
                connection.process_data_events(time_limit=0.1)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            channel.queue_delete(queue)
        finally:
            connection.close()
    else:
        with SyncClient(settings=settings) as layer:
            balanced = client == "balanced-sync"
            queues = replica_names(queue, 2) if balanced else [queue]
            for name in queues:
                layer.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC))
            send: Callable[[], object] = functools.partial(
                layer.publish, OutgoingMessage(body, "", queue)
            )
            if balanced:
                publisher = SyncBalancedPublisher(layer, topic=queue, replicas=2).start()
                send = functools.partial(publisher.publish, body)

            def handle(_: Delivery) -> None:
                nonlocal handled
                handled += 1
                live.consumed += 1

            started, cpu = time.perf_counter(), time.process_time()
            for _ in range(messages):
                begun = time.perf_counter()
                live.sent += 1
                send()
                live.confirmed_since(begun)
            for name in queues:
                layer.consume(name, handle)
            layer.run(120, until=lambda: handled >= messages)
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
            for name in queues:
                layer.delete_queue(name)
    if handled < messages:
        raise RuntimeError(f"{client}: {handled} of {messages} messages came back")
    return _row(client, messages, size, elapsed, cpu, None)


def _row(
    client: str,
    messages: int,
    size: int,
    elapsed: float,
    cpu: float,
    writes: tuple[int, int] | None,
) -> dict[str, Any]:
    return {
        "client": client,
        "messages": messages,
        "size": size,
        "per_s": round(messages / elapsed, 1),
        "cpu_us_per_message": round(1e6 * cpu / messages, 1),
        "frames_per_write": round(writes[0] / writes[1], 2) if writes and writes[1] else None,
    }


def run_transport(
    settings: Settings,
    *,
    clients: list[str],
    messages: int,
    size: int,
    repeats: int,
    report: Any = print,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 1.0,
) -> list[dict[str, Any]]:
    """Every client once per repeat (order rotated per repeat); one record per cell.
    ``progress``: told a live line every ``interval_s`` inside each cell."""
    rows = []
    for repeat in range(repeats):
        shift = repeat % len(clients)
        for client in [*clients[shift:], *clients[:shift]]:
            name, loop = split_client(client)
            if name in SYNC_CLIENTS:
                if loop is not None:
                    raise ValueError(f"{name} runs no event loop: drop @{loop}")
                with Live(client, progress, interval_s).running() as live:
                    row = sync_transport_cell(
                        settings, name, messages=messages, size=size, live=live
                    )
                row.update(event_loop=None)
                rows.append({"repeat": repeat, **row})
                report(rows[-1])
                continue
            if loop is not None and loop not in LOOPS:
                raise ValueError(f"event loop must be one of {', '.join(LOOPS)}, got {loop!r}")
            event_loop = settings.event_loop if loop is None else cast(EventLoopName, loop)
            with Live(client, progress, interval_s).running() as live:
                row = runtime.run(
                    transport_cell(settings, name, messages=messages, size=size, live=live),
                    event_loop=event_loop,
                )
            row.update(client=client, event_loop=runtime.loop_name(event_loop))
            rows.append({"repeat": repeat, **row})
            report(rows[-1])
    return rows
