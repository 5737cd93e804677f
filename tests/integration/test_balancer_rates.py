"""The balancer's replica rates from rabbitmq_prometheus (RabbitMQ 4.x's source), against
the real cluster: measured against the test's own count, chosen by the broker's version,
and a source that does not answer costs the rates, never the reports."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from middleware.balancer import BalancerSidecar, declare_replicated_topic
from middleware.transport import AsyncClient, OutgoingMessage, QueueKind
from middleware.transport.broker_info import BrokerInfo
from middleware.transport.management import prometheus_scrape

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster]


def _prometheus_or_skip(settings, brokers) -> None:
    answered = [t for t in prometheus_scrape(settings, "/metrics").values() if isinstance(t, str)]
    if len(answered) < len(settings.nodes):
        if brokers.cluster is not None:  # the local cluster enables the plugin on every node
            pytest.fail(f"rabbitmq_prometheus not served by every node: {answered!r:.200}")
        pytest.skip("these brokers do not serve rabbitmq_prometheus at AMQP port + 10020")


def test_prometheus_rates_match_what_the_test_published_and_acked(settings, brokers, name) -> None:
    """20 messages/s into r0 on its own connection, consumed and acked as they come; r1
    untouched. The sidecar's report (rates from every node's counters, summed) must show
    r0's arrival and service near the test's own rate and r1 at 0."""
    _prometheus_or_skip(settings, brokers)
    forced = settings.model_copy(update={"balancer_rates": "prometheus"})
    rate, seconds = 20.0, 16.0

    async def scenario() -> tuple[dict[str, tuple[float, float]], int, int, float]:
        names = await declare_replicated_topic(settings, name, 2, kind=QueueKind.CLASSIC)
        publisher = await AsyncClient(settings=settings).connect()
        consumer = await AsyncClient(settings=settings).connect()
        acked = 0

        async def handler(_delivery) -> None:
            nonlocal acked
            acked += 1

        await consumer.consume(names[0], handler)
        sidecar = BalancerSidecar(
            settings=forced, topic=name, replicas=2, sample_interval=0.5, report_interval=1.0
        )
        await sidecar.client.connect()
        assert sidecar.rates_source() == "prometheus"
        sent, started = 0, time.monotonic()
        reports = []
        while (elapsed := time.monotonic() - started) < seconds:
            while sent < elapsed * rate:
                await publisher.publish(OutgoingMessage(b"x", "", names[0], message_id=str(sent)))
                sent += 1
            if int(elapsed) != len(reports):
                await sidecar.sample()
                reports.append(await sidecar.report())
            await asyncio.sleep(0.02)
        measured = sent / (time.monotonic() - started)
        last = reports[-1]
        await consumer.close()
        for q in names:
            await publisher.delete_queue(q)
        await publisher.close()
        await sidecar.client.close()
        rates = {r.queue: (r.arrival_rate, r.service_rate) for r in last.replicas}
        return rates, sent, acked, measured

    rates, sent, acked, measured = asyncio.run(scenario())
    assert acked >= sent - 5, (sent, acked)  # the consumer kept up: service ~ arrival
    arrival, service = rates[f"{name}.r0"]
    assert 0.6 * measured <= arrival <= 1.4 * measured, (rates, measured)
    assert 0.6 * measured <= service <= 1.4 * measured, (rates, measured)
    assert rates[f"{name}.r1"] == (0.0, 0.0)


def test_rates_source_follows_the_broker_version(settings, name) -> None:
    """auto: management message rates on 3.x (what this broker is), rabbitmq_prometheus
    from 4.0 (management metrics deprecated), forced by the 4.0 facts on the real client."""

    async def scenario() -> tuple[str, str, str]:
        await declare_replicated_topic(settings, name, 1, kind=QueueKind.CLASSIC)
        sidecar = BalancerSidecar(settings=settings, topic=name, replicas=1)
        await sidecar.client.connect()
        assert sidecar.client.server is not None
        here = sidecar.rates_source()
        sidecar.client.server = BrokerInfo.from_version("4.0.5")
        on_4 = sidecar.rates_source()
        off = BalancerSidecar(
            settings=settings.model_copy(update={"balancer_rates": "none"}), topic=name, replicas=1
        )
        await sidecar.client.delete_queue(f"{name}.r0")
        await sidecar.client.close()
        return here, on_4, off.rates_source()

    here, on_4, off = asyncio.run(scenario())
    assert (here, on_4, off) == ("management", "prometheus", "none")


def test_an_unanswering_prometheus_endpoint_costs_the_rates_not_the_report(
    settings, name, caplog
) -> None:
    """prometheus_urls pointing at a closed port: the report still goes out, with the
    lengths and rates 0, and one warning per node says why; no traceback."""
    dead = settings.model_copy(
        update={"balancer_rates": "prometheus", "prometheus_urls": ("http://127.0.0.1:9/",)}
    )

    async def scenario():
        names = await declare_replicated_topic(settings, name, 2, kind=QueueKind.CLASSIC)
        sidecar = BalancerSidecar(settings=dead, topic=name, replicas=2)
        await sidecar.client.connect()
        await sidecar.client.publish(OutgoingMessage(b"x", "", names[1]))
        reports = []
        for _ in range(3):
            await sidecar.sample()
            reports.append(await sidecar.report())
        for q in names:
            await sidecar.client.delete_queue(q)
        await sidecar.client.close()
        return reports

    with caplog.at_level(logging.WARNING, logger="middleware.balancer.sidecar"):
        reports = asyncio.run(scenario())
    assert [r.length for r in reports[-1].replicas] == [0.0, 1.0]
    assert all(r.arrival_rate == r.service_rate == 0.0 for rep in reports for r in rep.replicas)
    warned = [r for r in caplog.records if "did not answer" in r.getMessage()]
    assert len(warned) == 1 and "127.0.0.1:9" in warned[0].getMessage()
