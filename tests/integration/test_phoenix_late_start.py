"""A cluster whose routing master has not declared its inbox yet is not taken for one
that left the ring.

On a busy machine a deployment's roles come up one by one, seconds apart. The routing
masters up first checked their ring neighbours' inboxes, found one not declared yet (404
from its RabbitMQ), took that for a failed link, flooded, and 3 s later declared the
cluster gone for good: every copy for its subscribers was dead-lettered for the rest of
the run (the chaos test's link cells, with everything held to one CPU). The link answered
all along; only the router was not there yet.

Here C's routing master is stopped and its inbox deleted, the state of a cluster whose
router has not started; the test waits well past the leave's detection time, reads the
ring records in the shared store (no router recorded C as left), starts C's router, and
an event of C's type published at A reaches the subscriber queue the test reads."""

from __future__ import annotations

import asyncio
import time

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient
from middleware.routing.store import open_store, ring_owner
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import event, owned_by, proxied, until_delivered

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
EVENT_TYPE = owned_by(CLUSTERS, "C", "late")


def test_a_cluster_whose_router_is_not_up_yet_is_not_declared_gone(
    settings, brokers, tmp_path, name
) -> None:
    queue = f"{name}.subscriber"
    # links of their own (each through a proxy that is never faulted): routers check
    # only neighbours they reach over a link of their own, not one RabbitMQ they share
    deploying = proxied(
        tmp_path / "deployment", name, brokers.urls, CLUSTERS, routing_slaves=0, match_slaves=0
    )
    with deploying as (deployment, _):
        deployed = deployment.phoenix()
        topology = deployment.topology
        detection = topology.neighbour_check_s + topology.flood_timeout_s + topology.leave_after_s

        async def subscribe() -> None:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                await at_a.subscribe(EVENT_TYPE, [("v", ">=", 0)], 3, queue, wait_s=60)
                deployed.kill(RoleId.router("C"))
                await client.delete_queue(RoleId.router("C").inbox(name))

        asyncio.run(subscribe())
        time.sleep(3 * detection)  # three times what a leave takes to be declared
        store = open_store(str(deployment.store_path))
        try:
            records = store.load(ring_owner(name), "ring")
        finally:
            store.close()
        assert records.get("C", (0, {}))[1].get("state") != "left", records
        deployed.start(RoleId.router("C"))

        async def delivered() -> list:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                got = await until_delivered(
                    client,
                    queue,
                    lambda k: at_a.publish(event(EVENT_TYPE, v=k, n=f"late{k}")),
                    "event of C's type once C's router is up",
                )
                await client.delete_queue(queue)
                return got

        assert asyncio.run(delivered())
