"""Routing across the ring: a subscription made at A for a type B owns, events published
at C. Three clusters of real role processes; B has two routing and two match slaves.
One run (the module fixture), one claim per test."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing, FilterError
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import (
    attribute,
    collect,
    event,
    owned_by,
    running,
    until_delivered,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
BURST = 800
FANOUT = 8  # the burst also goes to FANOUT more queues, so that matching and delivering,
# not routing, is the slow step: B's match inbox is where the backlog forms


@dataclass
class Run:
    event_type: str
    got: list[dict[str, Any]]  # what the subscriber queue received
    refused: bool  # a malformed filter was refused at subscribe

    def named(self, *prefixes: str) -> list[str]:
        return [attribute(m) for m in self.got if attribute(m).startswith(prefixes)]


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "quotes")
    queue = f"{name}.subscriber"
    slaves = {
        c: {"match_slaves": 2 * (c == "B"), "routing_slaves": 2 * (c == "B")} for c in CLUSTERS
    }

    async def scenario(topology) -> Run:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            at_c = PhoenixClient(client, topology=topology, cluster="C")
            try:
                await at_a.subscribe(event_type, [("price", "~", 1)], 1, queue)
                refused = False
            except FilterError:
                refused = True
            await at_a.subscribe(
                event_type, [("price", "<", 10), ("symbol", "prefix", "AB")], 1, queue
            )
            for k in range(FANOUT):
                await at_a.subscribe(event_type, [("symbol", "=", "ABZ")], 1, f"{queue}.fan{k}")
            got = await until_delivered(
                client,
                queue,
                lambda k: at_c.publish(event(event_type, price=1, symbol="ABC", n=f"p{k}")),
                "event at the subscriber",
            )
            for i in range(10):
                for price, symbol, n in (
                    (i, "ABX", f"yes{i}"),
                    (50 + i, "ABX", f"no{i}"),
                    (i, "XYZ", f"no-s{i}"),
                ):
                    await at_c.publish(event(event_type, price=price, symbol=symbol, n=n))
            # a burst: a backlog forms in B's match inbox, the master sees it (q is measured
            # per 0.5 s window) and sends events to the slaves whose predicted T is smaller
            await asyncio.gather(
                *(
                    at_c.publish(event(event_type, price=2, symbol="ABZ", n=f"burst{i}"))
                    for i in range(BURST)
                )
            )
            got += await collect(
                client,
                queue,
                lambda so_far: (
                    sum(attribute(m).startswith("burst") for m in [*got, *so_far]) >= BURST
                ),
                "whole burst",
                strict=False,
            )
            for k in range(FANOUT):
                await client.delete_queue(f"{queue}.fan{k}")
            await client.delete_queue(queue)
            return Run(event_type, got, refused)

    with running(
        tmp_path_factory.mktemp("ring"), name, settings, ",".join(brokers.urls), slaves
    ) as deployed:
        return asyncio.run(scenario(deployed.topology))


def test_a_malformed_filter_is_refused_at_subscribe(run: Run) -> None:
    assert run.refused


def test_events_follow_the_ring_route_from_the_publishers_cluster_to_the_owner(run: Run) -> None:
    assert {tuple(m["hops"]) for m in run.got} == {
        tuple(ChordRing(CLUSTERS).route("C", run.event_type))
    }


def test_exactly_the_events_the_filter_matches_are_delivered_each_once(run: Run) -> None:
    assert sorted(run.named("yes", "no")) == sorted(f"yes{i}" for i in range(10))


def test_a_burst_is_delivered_exactly_once(run: Run) -> None:
    assert sorted(run.named("burst")) == sorted(f"burst{i}" for i in range(BURST))


def test_a_burst_is_matched_by_more_than_one_of_the_owners_match_brokers(run: Run) -> None:
    """Predicted-T dispatch inside B: the backlog makes the slaves sooner."""
    brokers = {m["broker"] for m in run.got if attribute(m).startswith("burst")}
    assert len(brokers) >= 2, brokers
    assert all(RoleId.from_owner(b).master == RoleId.match("B", 0) for b in brokers), brokers
