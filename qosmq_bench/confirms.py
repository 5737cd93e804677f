"""One benchmark cell of the confirm modes: P producers and C consumers per queue, for D seconds.

The paper's set-up (003 §4): queues bound to one durable direct exchange (two
above 15 queues), 2 producers and 3 consumers per queue, 1500-byte messages.
Every producer and consumer is its own connection, spread over the cluster's
nodes.  The ``raw`` cell does the ``broker`` mode's work with plain aio-pika
(publisher confirms, consumer acks, no layer) in the same run, so the layer's
cost is a ratio measured on the same noisy machine.

A cell returns a summary record and, optionally, per-message records
(publish, confirm and first-handle times) for the Spark pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aio_pika

from middleware import runtime
from middleware.confirms import AsyncConfirmConsumer, AsyncConfirmPublisher, ConfirmMode
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
)

from .cpu import CpuMeter
from .stats import percentile

__all__ = ["MODES", "CellSpec", "run_cell", "run_cell_sync"]

log = logging.getLogger(__name__)
MODES = ("raw", *[m.value for m in ConfirmMode])
DRAIN_S = 15.0


@dataclass(frozen=True, slots=True)
class CellSpec:
    mode: str
    queues: int
    producers_per_queue: int = 2
    consumers_per_queue: int = 3
    size: int = 1500
    duration_s: float = 10.0
    window: int = 64  # in-flight publishes per producer

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.queues < 1 or self.producers_per_queue < 1 or self.consumers_per_queue < 1:
            raise ValueError("queues, producers and consumers per queue must be >= 1")
        if self.size < 1 or self.duration_s <= 0 or self.window < 1:
            raise ValueError("size, duration and window must be positive")


@dataclass
class _Tally:
    sent: dict[str, float] = field(default_factory=dict)
    confirmed: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    handled: dict[tuple[str, str], float] = field(default_factory=dict)
    duplicates: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    def on_handled(self, queue: str, message_id: str) -> None:
        key = (queue, message_id)
        if key in self.handled:
            self.duplicates += 1
        else:
            self.handled[key] = time.perf_counter()


def run_cell_sync(settings: Settings, spec: CellSpec, *, records: bool = False) -> dict[str, Any]:
    """Run one cell in a fresh event loop (for Spark executors and the CLI)."""
    return runtime.run(run_cell(settings, spec, records=records), event_loop=settings.event_loop)


async def run_cell(settings: Settings, spec: CellSpec, *, records: bool = False) -> dict[str, Any]:
    """Run one cell against the cluster in ``settings``; return its summary (and records)."""
    run_id = uuid.uuid4().hex[:8]
    exchanges = [f"qosmq.bench.{run_id}.x{i}" for i in range(1 if spec.queues <= 15 else 2)]
    queues = [f"qosmq.bench.{run_id}.q{i}" for i in range(spec.queues)]
    route = {q: exchanges[i % len(exchanges)] for i, q in enumerate(queues)}
    kind = QueueKind.CLASSIC if spec.mode == "raw" else ConfirmMode(spec.mode).profile.queue_kind
    tally = _Tally()
    admin = await AsyncClient(settings=settings).connect()
    closers: list[Callable[[], Awaitable[None]]] = []
    try:
        for x in exchanges:
            await admin.declare_exchange(ExchangeSpec(x, ExchangeType.DIRECT))
        for q in queues:
            await admin.declare_queue(QueueSpec(q, kind=kind))
            await admin.bind(BindingSpec(q, route[q], q))
        closers += await _start_consumers(settings, spec, queues, tally)
        producers, closers_p = await _start_producers(settings, spec, queues, route, exchanges)
        closers += closers_p
        started = time.perf_counter()
        deadline = started + spec.duration_s
        with CpuMeter({"client": os.getpid()}) as cpu:
            await asyncio.gather(*(p(deadline, tally) for p in producers))
        elapsed = time.perf_counter() - started
        await _drain(tally, spec)
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                await close()
        for q in queues:
            with contextlib.suppress(Exception):
                await admin.delete_queue(q)
        for x in exchanges:
            with contextlib.suppress(Exception):
                await admin.delete_exchange(x)
        await admin.close()
    return _summarise(spec, tally, elapsed, records) | _cpu_fields(cpu.result, elapsed, tally)


def _cpu_fields(cpu: dict[str, Any], elapsed: float, tally: _Tally) -> dict[str, Any]:
    """Where the cell's CPU went: the client process (every producer and consumer of the
    cell runs in it) in % of one core, its wait for a core, the machine's busy %, and the
    client's CPU per confirmed message (steadier than messages/s on a shared machine)."""
    client = cpu["processes"]["client"]
    confirmed = len(tally.confirmed)
    return {
        "client_cpu_pct": client,
        "client_wait_pct": cpu["waiting"]["client"],
        "machine_pct": cpu["machine_pct"],
        "steal_pct": cpu["steal_pct"],
        "cores": cpu["cores"],
        "client_cpu_us_per_msg": (
            round(client / 100 * elapsed / confirmed * 1e6, 1)
            if client is not None and confirmed
            else None
        ),
    }


async def _start_consumers(
    settings: Settings, spec: CellSpec, queues: list[str], tally: _Tally
) -> list[Callable[[], Awaitable[None]]]:
    closers: list[Callable[[], Awaitable[None]]] = []
    n = 0
    for q in queues:
        for _ in range(spec.consumers_per_queue):
            node_settings = settings.starting_at(n)
            n += 1
            if spec.mode == "raw":
                closers.append(await _raw_consumer(node_settings, q, tally))
                continue
            client = await AsyncClient(settings=node_settings).connect()

            async def handler(d: Delivery) -> None:
                tally.on_handled(d.queue, d.message_id or "")

            if ConfirmMode(spec.mode).profile.receipts:
                consumer = AsyncConfirmConsumer(client)
                await consumer.consume(q, handler)
                closers.append(consumer.close)
            else:
                await client.consume(q, handler)
            closers.append(client.close)
    return closers


async def _start_producers(
    settings: Settings,
    spec: CellSpec,
    queues: list[str],
    route: dict[str, str],
    exchanges: list[str],
) -> tuple[list[Callable[[float, _Tally], Awaitable[None]]], list[Callable[[], Awaitable[None]]]]:
    body = b"x" * spec.size
    producers: list[Callable[[float, _Tally], Awaitable[None]]] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    n = 1000
    for q in queues:
        for _ in range(spec.producers_per_queue):
            node_settings = settings.starting_at(n)
            n += 1
            if spec.mode == "raw":
                send, close = await _raw_producer(node_settings, route[q], q, body)
                closers.append(close)
            else:
                client = await AsyncClient(settings=node_settings).connect()
                for x in exchanges:
                    client.topology.add(ExchangeSpec(x, ExchangeType.DIRECT))
                client.topology.add(BindingSpec(q, route[q], q))
                publisher = await AsyncConfirmPublisher(client, mode=spec.mode).start()
                send = _layer_sender(publisher, route[q], q, body)
                closers += [publisher.close, client.close]
            producers.append(_producer_loop(send, spec.window))
    return producers, closers


def _layer_sender(
    publisher: AsyncConfirmPublisher, exchange: str, queue: str, body: bytes
) -> Callable[[str], Awaitable[None]]:
    async def send(message_id: str) -> None:
        await publisher.publish(body, exchange=exchange, routing_key=queue, message_id=message_id)

    return send


def _producer_loop(
    send: Callable[[str], Awaitable[None]], window: int
) -> Callable[[float, _Tally], Awaitable[None]]:
    """Keep ``window`` publishes in flight until the deadline."""

    async def run(deadline: float, tally: _Tally) -> None:
        slots = asyncio.Semaphore(window)
        tasks: set[asyncio.Task[None]] = set()

        async def one(message_id: str) -> None:
            try:
                await send(message_id)
                tally.confirmed[message_id] = time.perf_counter()
            except Exception as exc:
                tally.failed += 1
                tally.errors[type(exc).__name__] = tally.errors.get(type(exc).__name__, 0) + 1
            finally:
                slots.release()

        while time.perf_counter() < deadline:
            await slots.acquire()
            message_id = uuid.uuid4().hex
            tally.sent[message_id] = time.perf_counter()
            task = asyncio.create_task(one(message_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    return run


async def _drain(tally: _Tally, spec: CellSpec) -> None:
    """Wait until every confirmed message was handled (or handling stops progressing)."""
    deadline = time.monotonic() + DRAIN_S
    last, still = -1, 0
    while time.monotonic() < deadline:
        done = len(tally.handled)
        if done >= len(tally.sent):
            return
        still = still + 1 if done == last else 0
        if still >= 20 and spec.mode in ("none", "raw", "broker", "persistent"):
            return
        last = done
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ raw
async def _raw_consumer(
    settings: Settings, queue: str, tally: _Tally
) -> Callable[[], Awaitable[None]]:
    connection = await aio_pika.connect(_raw_url(settings))
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=settings.prefetch)
    q = await channel.get_queue(queue, ensure=False)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        tally.on_handled(queue, message.message_id or "")
        await message.ack()

    await q.consume(on_message)
    return connection.close


async def _raw_producer(
    settings: Settings, exchange: str, queue: str, body: bytes
) -> tuple[Callable[[str], Awaitable[None]], Callable[[], Awaitable[None]]]:
    connection = await aio_pika.connect(_raw_url(settings))
    channel = await connection.channel(publisher_confirms=True)
    x = await channel.get_exchange(exchange, ensure=False)

    async def send(message_id: str) -> None:
        await x.publish(aio_pika.Message(body, message_id=message_id), routing_key=queue)

    return send, connection.close


def _raw_url(settings: Settings) -> str:
    host, port, _ = settings.nodes[0]
    user, password = settings.username, settings.password.get_secret_value()
    return f"amqp://{user}:{password}@{host}:{port}/"


# -------------------------------------------------------------- summary
def _summarise(spec: CellSpec, tally: _Tally, elapsed: float, records: bool) -> dict[str, Any]:
    confirm_ms = [(tally.confirmed[m] - tally.sent[m]) * 1000 for m in tally.confirmed]
    handled_ids = {m for (_, m) in tally.handled}
    e2e_ms = [(t - tally.sent[m]) * 1000 for (_, m), t in tally.handled.items() if m in tally.sent]
    lost = sum(1 for m in tally.confirmed if m not in handled_ids)
    summary: dict[str, Any] = {
        **{k: v for k, v in asdict(spec).items() if k != "duration_s"},
        "producers": spec.producers_per_queue * spec.queues,
        "consumers": spec.consumers_per_queue * spec.queues,
        "duration_s": round(elapsed, 3),
        "published": len(tally.sent),
        "confirmed": len(tally.confirmed),
        "failed": tally.failed,
        "errors": tally.errors,
        "handled": len(tally.handled),
        "lost": lost,
        "duplicates": tally.duplicates,
        "confirmed_per_s": round(len(tally.confirmed) / elapsed, 1),
        "handled_per_s": round(len(tally.handled) / elapsed, 1),
    }
    for p in (50, 95, 99, 99.9):
        label = str(p).replace(".", "")
        summary[f"confirm_p{label}_ms"] = round(percentile(confirm_ms, p), 3)
        summary[f"e2e_p{label}_ms"] = round(percentile(e2e_ms, p), 3)
    if records:
        first = {m: t for (_, m), t in sorted(tally.handled.items(), key=lambda kv: kv[1])}
        summary["records"] = [
            (m, sent, tally.confirmed.get(m), first.get(m)) for m, sent in tally.sent.items()
        ]
    return summary
