"""The paper 001 experiment on real brokers: weighted dispatch vs round robin.

Two replicas of one topic, each with one consumer of equal speed, except that
replica 0's consumer also spends ``slow_extra_ms`` per message (the paper's broker
that serves a second topic).  Poisson arrivals at ``rate`` msg/s.  Per message:
publish -> handled latency; every 0.5 s: each replica's length.  A message not
handled when the cell ends counts in ``backlog`` and not in the percentiles.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from middleware.balancer import (
    ALGORITHMS,
    BalancedPublisher,
    BalancerSidecar,
    declare_replicated_topic,
)
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, QueueKind

from .stats import percentile

__all__ = ["BalanceCell", "run_balance_cell"]

SAMPLE_S = 0.5
TAIL_S = 3.0


@dataclass(frozen=True, slots=True)
class BalanceCell:
    algorithm: str
    rate: float
    duration_s: float = 30.0
    replicas: int = 2
    service_ms: float = 2.0
    slow_extra_ms: float = 6.0
    sample_interval: float = 0.25
    report_interval: float = 1.0
    seed: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {self.algorithm!r}; choose from {ALGORITHMS}")
        if self.rate <= 0 or self.duration_s <= 0 or self.replicas < 2:
            raise ValueError("rate and duration must be positive, replicas >= 2")


async def run_balance_cell(
    settings: Settings, cell: BalanceCell, *, records: bool = False
) -> dict[str, Any]:
    """One cell; with ``records`` its row also carries one record per message: (message
    id, seconds from the first send, publish -> handled ms or None if not handled)."""
    topic = f"qosmq.bench.balance.{uuid.uuid4().hex[:8]}"
    queues = await declare_replicated_topic(settings, topic, cell.replicas, kind=QueueKind.CLASSIC)
    sent: dict[str, float] = {}
    handled: dict[str, float] = {}
    clients: list[AsyncClient] = []
    stop = asyncio.Event()
    sidecar = BalancerSidecar(
        settings=settings,
        topic=topic,
        replicas=cell.replicas,
        sample_interval=cell.sample_interval,
        report_interval=cell.report_interval,
    )
    sidecar_task = asyncio.create_task(sidecar.run(stop=stop))
    lengths: list[tuple[float, list[int]]] = []
    try:
        for i, queue in enumerate(queues):
            delay = (cell.service_ms + (cell.slow_extra_ms if i == 0 else 0.0)) / 1000
            clients.append(await _consumer(settings, queue, delay, handled))
        pub_client = await AsyncClient(settings=settings).connect()
        clients.append(pub_client)
        publisher = await BalancedPublisher(
            pub_client,
            topic=topic,
            replicas=cell.replicas,
            algorithm=cell.algorithm,
            rng=random.Random(cell.seed),
        ).start()
        if cell.algorithm != "round_robin":
            deadline = time.monotonic() + 5 * cell.report_interval
            while publisher.report is None and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        sampler = asyncio.create_task(_sample_lengths(pub_client, queues, lengths))
        started = time.perf_counter()
        await _poisson(publisher, cell, sent, started)
        await asyncio.sleep(TAIL_S)
        elapsed = time.perf_counter() - started
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await sidecar_task
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
        async with AsyncClient(settings=settings) as admin:
            for queue in queues:
                with contextlib.suppress(Exception):
                    await admin.delete_queue(queue)
    row = _summary(cell, sent, handled, lengths, publisher.routed, elapsed)
    if records:
        t0 = min(sent.values(), default=0.0)
        row["records"] = [
            (m, t - t0, (handled[m] - t) * 1000 if m in handled else None) for m, t in sent.items()
        ]
    return row


async def _consumer(
    settings: Settings, queue: str, delay: float, handled: dict[str, float]
) -> AsyncClient:
    client = await AsyncClient(settings=settings).connect()

    async def handle(d: Delivery) -> None:
        await asyncio.sleep(delay)
        handled[d.message_id or ""] = time.perf_counter()

    # prefetch 1: waiting messages stay in the broker's queue, where the sidecar sees them
    await client.consume(queue, handle, prefetch=1)
    return client


async def _poisson(
    publisher: BalancedPublisher, cell: BalanceCell, sent: dict[str, float], started: float
) -> None:
    rng = random.Random(cell.seed)
    tasks: set[asyncio.Task[str]] = set()
    next_at = started
    while True:
        next_at += rng.expovariate(cell.rate)
        if next_at - started >= cell.duration_s:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        message_id = uuid.uuid4().hex
        sent[message_id] = time.perf_counter()
        task = asyncio.create_task(publisher.publish(b"x" * 256, message_id=message_id))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sample_lengths(
    client: AsyncClient, queues: list[str], out: list[tuple[float, list[int]]]
) -> None:
    start = time.perf_counter()
    while True:
        out.append(
            (round(time.perf_counter() - start, 2), [await client.queue_length(q) for q in queues])
        )
        await asyncio.sleep(SAMPLE_S)


def _summary(
    cell: BalanceCell,
    sent: dict[str, float],
    handled: dict[str, float],
    lengths: list[tuple[float, list[int]]],
    routed: list[int],
    elapsed: float,
) -> dict[str, Any]:
    done = [(sent[m], (handled[m] - sent[m]) * 1000) for m in sent if m in handled]
    latency = [ms for _, ms in done]
    t0 = min(sent.values()) if sent else 0.0
    third = cell.duration_s / 3

    def p99_between(lo: float, hi: float) -> float:
        return percentile([ms for t, ms in done if lo <= t - t0 < hi], 99)

    return {
        **asdict(cell),
        "published": len(sent),
        "handled": len(done),
        "backlog": len(sent) - len(done),
        "handled_per_s": round(len(done) / elapsed, 1),
        "latency_p50_ms": round(percentile(latency, 50), 2),
        "latency_p95_ms": round(percentile(latency, 95), 2),
        "latency_p99_ms": round(percentile(latency, 99), 2),
        "p99_first_third_ms": round(p99_between(0, third), 2),
        "p99_last_third_ms": round(p99_between(2 * third, cell.duration_s + 1), 2),
        "max_queue_length": max((max(ls) for _, ls in lengths), default=0),
        "routed": routed,
        "queue_lengths": lengths,
    }
