"""The balancer sidecar: samples replica lengths every i1, reports averages every i2.

Sampling uses a passive ``queue.declare`` over AMQP, not the management API: the
passive declare answers with the queue's current ready count from its leader,
while the management API's figures refresh only every
``collect_statistics_interval`` (5 s by default), longer than useful i1 values.
Arrival and service rates, which change slowly, come from the management API's
``message_stats`` on brokers before 4.0 and from the rabbitmq_prometheus counters of
every node from 4.0 (management metrics are deprecated there; ``balancer_rates``
chooses otherwise; :mod:`.rates` computes them).  When the source does not answer the
rates are 0: the predictive algorithm then leans on the publisher's own counts.

Reports go to the direct exchange ``qosmq.balancer.reports`` with the topic as
routing key.  Each publisher binds its own exclusive queue with
``x-max-length: 1``, so the broker keeps only the latest report for it and
pushes it (the paper polled ZooKeeper; this needs no extra service and no
polling, and a publisher that joins late gets the next report within i2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from prometheus_client import Counter, Gauge

from ..errors import EntityNotFound
from ..settings import Settings
from ..transport import AsyncClient, ExchangeSpec, ExchangeType, OutgoingMessage
from ..transport.management import management_get, prometheus_scrape, vhost_path
from .factors import inverse_factors, paper_factors
from .rates import RateWindow, parse_scrape, scrape_path
from .reports import REPORT_EXCHANGE, LoadReport, ReplicaLoad, Sampler, replica_names

__all__ = ["BalancerSidecar"]

log = logging.getLogger(__name__)
LENGTH = Gauge("qosmq_balancer_replica_length", "average waiting messages", ["topic", "replica"])
FACTOR = Gauge("qosmq_balancer_factor", "load factor", ["topic", "replica", "algorithm"])
ROUTED = Gauge(
    "qosmq_balancer_routed",
    "messages published to the replica (management API; rabbitmq_prometheus: by the "
    "channels open now)",
    ["topic", "replica"],
)
REPORTS = Counter("qosmq_balancer_reports_total", "load reports published", ["topic"])


class BalancerSidecar:
    """Measures one replicated topic and publishes load reports."""

    def __init__(
        self,
        *,
        settings: Settings,
        topic: str,
        replicas: int,
        sample_interval: float = 0.5,
        report_interval: float = 2.0,
    ) -> None:
        if not 0 < sample_interval <= report_interval:
            raise ValueError("need 0 < i1 (sample interval) <= i2 (report interval)")
        self.settings, self.topic = settings, topic
        self.queues = replica_names(topic, replicas)
        self.i1, self.i2 = sample_interval, report_interval
        self.client = AsyncClient(settings=settings)
        self.samplers = {q: Sampler() for q in self.queues}
        self.missing: set[str] = set()  # replicas whose last sample found no queue
        self.last_report: LoadReport | None = None
        self.window = RateWindow()
        self._silent_nodes: frozenset[str] = frozenset()  # prometheus nodes that did not answer

    async def run(self, *, stop: asyncio.Event | None = None) -> None:
        """Sample and report until ``stop`` is set."""
        stop = stop or asyncio.Event()
        await self.client.connect()
        try:
            await self.check_replicas()
        except BaseException:
            await self.client.close()
            raise
        await self.client.declare_exchange(ExchangeSpec(REPORT_EXCHANGE, ExchangeType.DIRECT))
        log.info("topic %s: replica rates from %s", self.topic, self.rates_source())
        next_report = time.monotonic() + self.i2
        try:
            while not stop.is_set():
                await self.sample()
                if time.monotonic() >= next_report:
                    await self.report()
                    next_report += self.i2
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.i1)
        finally:
            await self.client.close()

    async def check_replicas(self) -> None:
        """Refuse to report on replicas that do not exist (a typo in the topic or the
        count would otherwise report idle queues that attract every publisher)."""
        absent = []
        for queue in self.queues:
            try:
                await self.client.queue_length(queue)
            except EntityNotFound:
                absent.append(queue)
        if absent:
            raise EntityNotFound(
                f"replicated topic {self.topic!r}: {', '.join(absent)} do(es) not exist "
                "(declare the topic first: qosmq sidecar balancer --declare, or "
                "declare_replicated_topic)"
            )

    async def sample(self) -> None:
        now = time.monotonic()
        for queue in self.queues:
            try:
                self.samplers[queue].add(now, await self.client.queue_length(queue))
                if queue in self.missing:
                    self.missing.discard(queue)
                    log.warning("replica %s exists again: reported as live", queue)
            except EntityNotFound:  # deleted: reported missing, not idle
                if queue not in self.missing:
                    self.missing.add(queue)
                    log.warning("replica %s does not exist: reported as missing", queue)
            except Exception as exc:  # a missing sample lowers the count, not the average
                log.info("no sample of %s: %s", queue, exc)

    async def report(self) -> LoadReport:
        source = self.rates_source()
        read = self._prometheus_rates if source == "prometheus" else self._rates
        if source == "none":
            rates: dict[str, tuple[float, float, float | None]] = {}
        else:
            rates = await asyncio.get_running_loop().run_in_executor(None, read)
        loads = []
        for queue in self.queues:
            arrival, service, published = rates.get(queue, (0.0, 0.0, None))
            loads.append(
                ReplicaLoad(
                    queue,
                    self.samplers[queue].average(),
                    arrival,
                    service,
                    exists=queue not in self.missing,
                )
            )
            self.samplers[queue].reset()
            if published is not None:
                ROUTED.labels(self.topic, queue).set(published)
        report = LoadReport(self.topic, self.i2, time.time(), tuple(loads))
        await self.client.publish(
            OutgoingMessage(report.encode(), REPORT_EXCHANGE, self.topic, mandatory=False),
            confirm=False,
        )
        self._export(report)
        self.last_report = report
        return report

    def _export(self, report: LoadReport) -> None:
        lengths = [r.length for r in report.replicas]
        REPORTS.labels(self.topic).inc()
        for algorithm, factors in (
            ("paper", paper_factors(lengths)),
            ("inverse", inverse_factors(lengths)),
        ):
            for r, f in zip(report.replicas, factors, strict=True):
                FACTOR.labels(self.topic, r.queue, algorithm).set(f)
        for r in report.replicas:
            LENGTH.labels(self.topic, r.queue).set(r.length)

    def rates_source(self) -> str:
        """management, prometheus or none: the setting, or by the broker's version."""
        chosen = self.settings.balancer_rates
        if chosen != "auto":
            return chosen
        server = self.client.server
        if server is not None and not server.management_message_stats:
            return "prometheus"
        return "management"

    def _prometheus_rates(self) -> dict[str, tuple[float, float, float | None]]:
        """(arrival, service, published count) per queue from every node's counters."""
        texts = prometheus_scrape(self.settings, scrape_path(self.settings.vhost))
        scrape = parse_scrape(time.monotonic(), texts, self.queues, self.settings.vhost)
        silent = frozenset(texts) - scrape.nodes
        if silent != self._silent_nodes:
            for node in sorted(silent - self._silent_nodes):
                why = texts[node]
                log.warning(
                    "rabbitmq_prometheus at %s did not answer (%s): its channels' messages "
                    "are left out of the rates (set prometheus_urls, or enable the plugin)",
                    node,
                    why if isinstance(why, Exception) else "not the exposition format",
                )
            self._silent_nodes = silent
        self.window.add(scrape)
        rates = self.window.rates()
        published = self.window.published()
        return {
            q: (*rates.get(q, (0.0, 0.0)), published.get(q)) for q in self.queues if scrape.nodes
        }

    def _rates(self) -> dict[str, tuple[float, float, float | None]]:
        """(arrival, service, published count) per queue from the management API, if any."""
        out: dict[str, tuple[float, float, float | None]] = {}
        try:
            listed = management_get(self.settings, f"/api/queues/{vhost_path(self.settings)}")
        except (OSError, ValueError) as exc:
            log.debug("management API unavailable (%s): rates 0", exc)
            return out
        for q in listed:
            if q.get("name") in self.samplers:
                stats: dict[str, Any] = q.get("message_stats") or {}
                out[q["name"]] = (
                    float((stats.get("publish_details") or {}).get("rate", 0.0)),
                    float((stats.get("ack_details") or {}).get("rate", 0.0)),
                    stats.get("publish"),
                )
        return out
