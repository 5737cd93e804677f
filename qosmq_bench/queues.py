"""``qosmq bench queues``: the persistent-queue API's rates beside raw aio-pika (paper 004).

Cells, one after another, with ``window`` operations in flight:
``raw`` (plain aio-pika, publisher confirms, persistent messages, quorum queue) and
``enqueue`` (the queue API, broker up), each for ``duration_s``; ``dequeue`` (taking
what ``enqueue`` left, explicit acks); ``spool`` (no broker reachable: appends to the
local SQLite spool, for ``duration_s``); ``drain`` (``recover()`` sending as many spooled
messages as ``enqueue`` sent, into an empty queue, so the two rates compare).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika

from middleware.queues import AsyncQueues, EnqueueStatus
from middleware.settings import Settings
from middleware.transport import AsyncClient

from .live import Live

__all__ = ["run_queue_bench"]


async def _windowed(
    send: Callable[[int], Awaitable[None]], duration: float, window: int, live: Live
) -> tuple[int, float]:
    """Keep ``window`` calls of ``send(i)`` in flight for ``duration``; return (done, seconds)."""
    done = 0
    slots = asyncio.Semaphore(window)
    tasks: set[asyncio.Task[None]] = set()

    async def one(i: int) -> None:
        nonlocal done
        try:
            begun = time.perf_counter()
            live.sent += 1
            await send(i)
            live.confirmed_since(begun)
            done += 1
        finally:
            slots.release()

    started = time.perf_counter()
    i = 0
    while time.perf_counter() - started < duration:
        await slots.acquire()
        task = asyncio.create_task(one(i))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
    if tasks:
        await asyncio.gather(*tasks)
    return done, time.perf_counter() - started


async def run_queue_bench(
    settings: Settings,
    *,
    duration_s: float = 10.0,
    size: int = 1500,
    window: int = 256,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 1.0,
) -> list[dict[str, Any]]:
    """The cells raw, enqueue, dequeue, spool and drain, a row each; ``progress``: told
    a live line every ``interval_s`` inside each cell."""
    body = b"x" * size
    queue = f"qosmq.bench.queues.{uuid.uuid4().hex[:8]}"
    rows: list[dict[str, Any]] = []

    def row(cell: str, count: int, seconds: float, **extra: Any) -> None:
        rows.append(
            {
                "cell": cell,
                "messages": count,
                "seconds": round(seconds, 3),
                "per_s": round(count / seconds, 1),
                "size": size,
                "window": window,
                **extra,
            }
        )

    with tempfile.TemporaryDirectory(prefix="qosmq-bench-spool-") as tmp:
        up = _with_spool(settings, Path(tmp) / "spool.sqlite3")
        queues = await AsyncQueues(AsyncClient(settings=up)).start()
        await queues.create_queue(queue)
        try:

            def live(cell: str) -> Live:
                return Live(cell, progress, interval_s)

            with live("raw").running() as counted:
                row("raw", *await _raw(settings, queue, body, duration_s, window, counted))
            await queues.destroy_queue(queue)
            await queues.create_queue(queue)

            async def enqueue(i: int) -> None:
                await queues.enqueue(queue, body, message_id=f"e{i}")

            with live("enqueue").running() as counted:
                enqueued, seconds = await _windowed(enqueue, duration_s, window, counted)
            row("enqueue", enqueued, seconds)
            with live("dequeue").running() as counted:
                row("dequeue", *await _dequeue_all(queues, queue, enqueued, counted))
            # broker unreachable: a client pointed at a port nobody listens on
            down = up.model_copy(
                update={"amqp_urls": ("amqp://127.0.0.1:9/",), "connect_timeout": 0.5}
            )
            with live("spool").running() as counted:
                row(
                    "spool", *await _spool_for(down, queue, body, duration_s, window, None, counted)
                )
            # drain exactly what the enqueue cell sent, into an empty queue, to compare
            await queues.destroy_queue(queue)
            await queues.create_queue(queue)
            fill = _with_spool(down, Path(tmp) / "drain.sqlite3")
            await _spool_for(fill, queue, body, duration_s, window, enqueued, Live("fill"))
            drainer = AsyncQueues(
                AsyncClient(settings=_with_spool(up, Path(tmp) / "drain.sqlite3"))
            )
            await drainer.client.connect()
            started = time.perf_counter()
            report = await drainer.recover()
            row("drain", report.replayed, time.perf_counter() - started, remaining=report.remaining)
            await drainer.client.close()
        finally:
            with contextlib.suppress(Exception):
                await queues.destroy_queue(queue)
            await queues.close()
            await queues.client.close()
    direct = next(r["per_s"] for r in rows if r["cell"] == "enqueue")
    for r in rows:
        r["ratio_vs_raw"] = round(r["per_s"] / rows[0]["per_s"], 3)
        r["ratio_vs_enqueue"] = round(r["per_s"] / direct, 3)
    return rows


def _with_spool(settings: Settings, path: Path) -> Settings:
    return settings.model_copy(
        update={"queues": settings.queues.model_copy(update={"spool_path": path})}
    )


async def _raw(
    settings: Settings, queue: str, body: bytes, duration: float, window: int, live: Live
) -> tuple[int, float]:
    """Plain aio-pika: publisher confirms, persistent messages, same queue, no layer."""
    host, port, _ = settings.nodes[0]
    password = settings.password.get_secret_value()
    connection = await aio_pika.connect(f"amqp://{settings.username}:{password}@{host}:{port}/")
    channel = await connection.channel(publisher_confirms=True)

    async def send(i: int) -> None:
        await channel.default_exchange.publish(
            aio_pika.Message(
                body, message_id=f"raw{i}", delivery_mode=aio_pika.DeliveryMode.PERSISTENT
            ),
            queue,
        )

    try:
        return await _windowed(send, duration, window, live)
    finally:
        await connection.close()


async def _spool_for(
    settings: Settings,
    queue: str,
    body: bytes,
    duration: float,
    window: int,
    count: int | None,
    live: Live,
) -> tuple[int, float]:
    """Enqueue with no broker reachable (spooled) for ``duration``, or ``count`` messages."""
    offline = await AsyncQueues(AsyncClient(settings=settings)).start()

    async def spool(i: int) -> None:
        result = await offline.enqueue(queue, body, message_id=f"s{i}")
        assert result.status is EnqueueStatus.SPOOLED

    if count is None:
        result = await _windowed(spool, duration, window, live)
    else:
        started = time.perf_counter()
        for start in range(0, count, window):
            await asyncio.gather(*(spool(i) for i in range(start, min(start + window, count))))
        result = (count, time.perf_counter() - started)
    await offline.close()
    await offline.client.close()
    if offline.spool is not None:
        offline.spool.close()
    return result


async def _dequeue_all(
    queues: AsyncQueues, queue: str, count: int, live: Live
) -> tuple[int, float]:
    got = 0
    started = time.perf_counter()
    async for message in queues.messages(queue):
        await message.ack()
        got += 1
        live.consumed += 1
        if got >= count:
            break
    return got, time.perf_counter() - started
