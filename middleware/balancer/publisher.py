"""Replicated topics and the publisher that spreads a topic's messages over its replicas."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from typing import Self

from ..settings import Settings
from ..transport import (
    AsyncClient,
    AsyncHandler,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
)
from .factors import (
    ALGORITHMS,
    PredictiveChooser,
    ReplicaReport,
    WeightedPicker,
    inverse_factors,
    paper_factors,
)
from .reports import REPORT_EXCHANGE, LoadReport, replica_names

__all__ = ["BalancedPublisher", "declare_replicated_topic", "subscribe_replicated"]

log = logging.getLogger(__name__)


async def declare_replicated_topic(
    settings: Settings, topic: str, replicas: int, *, kind: QueueKind = QueueKind.QUORUM
) -> list[str]:
    """Declare R replica queues, replica i led by node i mod N (client-local placement)."""
    names = replica_names(topic, replicas)
    for i, name in enumerate(names):
        async with AsyncClient(settings=settings.starting_at(i)) as client:
            await client.declare_queue(QueueSpec(name, kind=kind, leader_locator="client-local"))
    return names


async def subscribe_replicated(
    client: AsyncClient,
    topic: str,
    replicas: int,
    handler: AsyncHandler,
    *,
    prefetch: int | None = None,
) -> list[str]:
    """Consume every replica of ``topic`` with ``handler``; return the consumer tags."""
    return [
        await client.consume(queue, handler, prefetch=prefetch)
        for queue in replica_names(topic, replicas)
    ]


class BalancedPublisher:
    """Sends each message of a topic to exactly one replica, chosen by ``algorithm``.

    Reports older than ``stale_after`` (default 3 x the report period) are
    ignored: the publisher falls back to equal weights (round robin) until a
    fresh report arrives.
    """

    def __init__(
        self,
        client: AsyncClient,
        *,
        topic: str,
        replicas: int,
        algorithm: str = "predictive",
        stale_after: float | None = None,
        rng: random.Random | None = None,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose from {ALGORITHMS}")
        self.client, self.topic, self.algorithm = client, topic, algorithm
        self.queues = replica_names(topic, replicas)
        self.stale_after = stale_after
        self.rng = rng or random.Random()
        self.chooser = PredictiveChooser(replicas, self.rng)
        self.picker: WeightedPicker | None = None
        self.report: LoadReport | None = None
        self.received_at = 0.0
        self.routed = [0] * replicas
        self.fallbacks = 0
        self._rr = 0

    async def start(self) -> Self:
        if self.algorithm == "round_robin":
            return self
        inbox = f"qosmq.balancer.inbox.{self.topic}.{id(self):x}"
        await self.client.declare_exchange(ExchangeSpec(REPORT_EXCHANGE, ExchangeType.DIRECT))
        await self.client.declare_queue(
            QueueSpec(inbox, kind=QueueKind.CLASSIC, durable=False, exclusive=True, max_length=1)
        )
        await self.client.bind(BindingSpec(inbox, REPORT_EXCHANGE, self.topic))
        await self.client.consume(inbox, self._on_report, prefetch=1)
        return self

    async def publish(self, body: bytes, **fields: object) -> str:
        """Publish to the chosen replica with broker confirms; return the replica's queue."""
        queue = self.queues[self.choose()]
        await self.client.publish(OutgoingMessage(body, "", queue, **fields))  # type: ignore[arg-type]
        return queue

    def choose(self) -> int:
        now = time.monotonic()
        stale = self.report is None or (
            self.stale_after is not None and now - self.received_at > self.stale_after
        )
        if stale and self.algorithm == "predictive" and self.report is not None:
            # forget the stale lengths: choices on own counts alone spread evenly
            self.chooser.reports = [None] * len(self.queues)
            self.fallbacks += 1
        if self.algorithm == "round_robin" or (stale and self.algorithm != "predictive"):
            if self.algorithm != "round_robin":
                self.fallbacks += 1
            index = self._rr % len(self.queues)
            self._rr += 1
        elif self.algorithm == "predictive":
            index = self.chooser.choose(now)
        else:
            assert self.picker is not None
            index = self.picker.pick()
        self.routed[index] += 1
        return index

    async def _on_report(self, delivery: Delivery) -> None:
        try:
            report = LoadReport.decode(delivery.body)
        except ValueError as exc:
            log.warning("ignoring %s", exc)
            return
        lengths = {r.queue: r for r in report.replicas}
        if set(lengths) != set(self.queues):
            log.warning("report for %s names other replicas; ignored", report.topic)
            return
        now = time.monotonic()
        self.report, self.received_at = report, now
        if self.stale_after is None:
            self.stale_after = 3 * report.period_s
        ordered = [lengths[q] for q in self.queues]
        for i, r in enumerate(ordered):
            self.chooser.report(i, ReplicaReport(r.length, r.arrival_rate, r.service_rate, now))
        factors: list[float] = (
            list(map(float, paper_factors([r.length for r in ordered])))
            if self.algorithm == "paper"
            else inverse_factors([r.length for r in ordered])
        )
        with contextlib.suppress(ValueError):
            self.picker = WeightedPicker(factors, self.rng)
