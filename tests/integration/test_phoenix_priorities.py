"""Latency priorities (the outer mechanism): urgent events overtake a backlog of bulk ones
in RabbitMQ's priority inboxes, and do not once the priorities are switched off live.

Both types are owned by B; C's client subscribes (urgent: level 1, bulk: level 5, ten
subscriptions that match every bulk event), publishes a burst of bulk events and then
urgent ones. The bench's deployment (the one the timeliness figures come from) runs the
roles. One run (the module fixture), one claim per test."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass

import pytest

from middleware import runtime
from middleware.errors import EntityNotFound
from middleware.phoenix.ids import RoleId, role_queues
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from qosmq_bench.phoenix_deploy import Deployment, phoenix_cli
from tests.integration.phoenix_support import (
    attribute,
    event,
    eventually_async,
    take,
    until_delivered,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
BULK, URGENT, COPIES = 300, 10, 10


@dataclass
class Run:
    overtaken: list[float]  # per urgent event: the share of bulk delivered after it
    fifo: list[float]  # ... once the priorities were switched off live
    configured: str  # what ``qosmq phoenix configure`` printed
    counters: str  # C's router log: its counters at stop, its event loop
    left: list[str]  # the deployment's role queues still in the broker after it


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    deployment = Deployment(
        tmp_path_factory.mktemp("priorities"),
        prefix=name,
        amqp_urls=brokers.urls,
        routing_slaves=0,
        match_slaves=0,
    )
    owned_by_b = [f"kind{i}" for i in range(2000) if deployment.ring.owner(f"kind{i}") == "B"]
    bulk_type, urgent_type = owned_by_b[:2]
    queue = f"{name}.subscriber"
    copies = [f"{queue}.{k}" for k in range(COPIES)]

    async def scenario() -> list[str]:
        async with AsyncClient(settings=settings) as client:
            at_c = PhoenixClient(client, topology=deployment.topology, cluster="C")
            await at_c.subscribe(urgent_type, [("n", "exists")], 1, queue)
            await at_c.subscribe(bulk_type, [("n", "exists")], 5, queue)
            for copy in copies:  # ten subscriber queues: ten deliveries per bulk event
                await at_c.subscribe(bulk_type, [("n", "exists")], 5, copy)
            for event_type in (bulk_type, urgent_type):  # until both paths are live
                await until_delivered(
                    client,
                    queue,
                    lambda k, t=event_type: at_c.publish(event(t, n="probe")),
                    f"{event_type} delivered",
                    accept=lambda m, t=event_type: m["event_type"] == t,
                )
            await asyncio.sleep(1)
            for q in (queue, *copies):
                await take(client, q)
            await asyncio.gather(*(at_c.publish(event(bulk_type, n=f"b{i}")) for i in range(BULK)))
            await asyncio.gather(
                *(at_c.publish(event(urgent_type, n=f"u{i}")) for i in range(URGENT))
            )
            order: list[str] = []  # arrivals at the queue that gets both types

            async def arrived() -> bool:
                order.extend(attribute(m) for m in await take(client, queue))
                return len(order) >= BULK + URGENT

            await eventually_async(arrived, "every event", 90, strict=False)
            await asyncio.sleep(1)
            for q in (queue, *copies):
                await client.delete_queue(q)
            return order

    def positions() -> list[float]:
        order = asyncio.run(scenario())
        bulk = [i for i, n in enumerate(order) if n.startswith("b")]
        urgent = [i for i, n in enumerate(order) if n.startswith("u")]
        assert (len(bulk), len(urgent)) == (BULK, URGENT), order
        return [sum(b > u for b in bulk) / len(bulk) for u in urgent]

    deployment.configure(outer=True, inner=False)
    with deployment.running():
        overtaken = positions()
        # the same roles with the priorities switched off live (qosmq phoenix configure)
        configured = phoenix_cli(
            "configure",
            deployment.topology_file,
            deployment.state_dir,
            brokers.urls,
            "--outer",
            "off",
            "--batch-max",
            "1",
        )
        fifo = positions()
    counters = (deployment.state_dir / RoleId.router("C").log_file).read_text()
    return Run(overtaken, fifo, configured, counters, _queues_left(settings, deployment))


def _queues_left(settings, deployment: Deployment) -> list[str]:
    """The deployment's role queues that still exist in the broker."""

    async def check() -> list[str]:
        left = []
        async with AsyncClient(settings=settings) as client:
            for queue in role_queues(deployment.topology):
                try:
                    await client.queue_length(queue)
                    left.append(queue)
                except EntityNotFound:
                    pass
        return left

    return asyncio.run(check())


def test_every_urgent_event_overtakes_a_quarter_of_the_bulk_backlog(run: Run) -> None:
    assert min(run.overtaken) >= 0.25, run.overtaken


def test_without_priorities_urgent_events_wait_behind_more_of_the_backlog(run: Run) -> None:
    assert max(run.fifo) < min(run.overtaken), (run.fifo, run.overtaken)
    print(f"urgent ahead of >= {min(run.overtaken):.0%} of the bulk ({max(run.fifo):.0%} without)")


def test_a_live_switch_is_confirmed_by_every_master(run: Run) -> None:
    assert "configured live (6 masters)" in run.configured, run.configured  # 3 + 3


def test_a_burst_leaves_the_router_in_batches(run: Run) -> None:
    """Role messages sent vs AMQP messages sent, logged at stop."""
    sent = int(re.search(r"'sent': (\d+)", run.counters).group(1))
    amqp_sent = int(re.search(r"'amqp_sent': (\d+)", run.counters).group(1))
    assert amqp_sent < sent, run.counters


def test_roles_run_on_the_event_loop_their_settings_give(run: Run) -> None:
    """``auto``: uvloop, a dependency."""
    assert f"event loop: {runtime.loop_name('auto')}" in run.counters, run.counters


def test_the_bench_deployment_removes_its_role_queues(run: Run) -> None:
    assert run.left == []
