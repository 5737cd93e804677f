"""``qosmq bench balance --rate-sources``: the replicas' rates as each source reads them.

One publisher sends ``rate`` messages/s into replica r0 of a two-replica topic, a consumer
acks each as it comes, r1 stays idle; two sidecars report at once, one reading the rates
from the management API's ``message_stats`` (RabbitMQ 3.x), one from every node's
rabbitmq_prometheus counters (4.x).  Every ``every_s`` a row: the publisher's own rate and
what each source reads for r0 and r1.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from middleware.balancer import REPORT_EXCHANGE, BalancerSidecar, declare_replicated_topic
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
)

SOURCES = ("prometheus", "management")


async def run_rate_sources(
    settings: Settings, *, rate: float, duration_s: float, every_s: float = 5.0
) -> list[dict[str, Any]]:
    topic = f"bench-rates-{uuid.uuid4().hex[:8]}"
    names = await declare_replicated_topic(settings, topic, 2, kind=QueueKind.CLASSIC)
    publisher = await AsyncClient(settings=settings).connect()
    await publisher.declare_exchange(ExchangeSpec(REPORT_EXCHANGE, ExchangeType.DIRECT))
    consumer = await AsyncClient(settings=settings).connect()

    async def handled(_delivery: Delivery) -> None:
        return None

    sidecars = {
        source: BalancerSidecar(
            settings=settings.model_copy(update={"balancer_rates": source}),
            topic=topic,
            replicas=2,
            report_interval=1.0,
        )
        for source in SOURCES
    }
    rows: list[dict[str, Any]] = []
    try:
        await consumer.consume(names[0], handled)
        for sidecar in sidecars.values():
            await sidecar.client.connect()
        sent, started, next_report, next_row = 0, time.monotonic(), 1.0, every_s
        while (elapsed := time.monotonic() - started) < duration_s:
            while sent < elapsed * rate:
                await publisher.publish(OutgoingMessage(b"x", "", names[0]))
                sent += 1
            if elapsed >= next_report:
                next_report += 1.0
                reports = {}
                for source, sidecar in sidecars.items():
                    await sidecar.sample()
                    reports[source] = await sidecar.report()
                if elapsed >= next_row:
                    next_row += every_s
                    row: dict[str, Any] = {"t_s": round(elapsed, 1), "sent_per_s": sent / elapsed}
                    for source, report in reports.items():
                        for replica in report.replicas:
                            key = f"{source}_{replica.queue.rsplit('.', 1)[1]}"
                            row[key] = (replica.arrival_rate, replica.service_rate)
                    rows.append(row)
            await asyncio.sleep(0.01)
    finally:
        await consumer.close()
        for queue in names:
            await publisher.delete_queue(queue)
        await publisher.close()
        for sidecar in sidecars.values():
            await sidecar.client.close()
    return rows


def format_rate_sources(rows: list[dict[str, Any]]) -> str:
    head = f"{'t s':>5} {'sent/s':>7} " + " ".join(
        f"{source + ' r' + str(i) + ' in/out':>24}" for source in SOURCES for i in (0, 1)
    )
    lines = [head, "-" * len(head)]
    for row in rows:
        cells = [
            f"{row[f'{source}_r{i}'][0]:>11.1f} /{row[f'{source}_r{i}'][1]:>11.1f}"
            for source in SOURCES
            for i in (0, 1)
        ]
        lines.append(f"{row['t_s']:>5.0f} {row['sent_per_s']:>7.1f} " + " ".join(cells))
    return "\n".join(lines)
