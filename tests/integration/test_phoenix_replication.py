"""Replication and read repair: a confirmed subscription is held by the owner's match
master and its slaves, its latencyMap entry by the routing master and its slaves; after
every role restarts with the masters' own copies lost, the masters read their tables back
from R of N replicas, match as before, and repair their own copies.

One run (the module fixture): the test counts with the shared store and its own
subscriber queues, never with the roles' own counters."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient
from middleware.routing.records import LatencyEntry, SubscriptionRecord
from middleware.routing.replicas import live
from middleware.routing.store import open_store
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import (
    attribute,
    collect,
    event,
    eventually,
    owned_by,
    running,
    until_delivered,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
QUEUES = 3  # subscriptions at A, each its own queue


@dataclass
class Run:
    event_type: str
    queues: list[str]
    before: dict[str, Any]  # the store after the subscriptions were confirmed
    after: dict[str, Any]  # the store after the restart and the traffic
    got: list[dict[str, Any]]  # what the first queue received after the restart


def _tables(store: Any, event_type: str) -> dict[str, Any]:
    """Per role owner: the queues of its live subscriptions, or its latencyMap entry."""
    tables: dict[str, Any] = {}
    for role in (RoleId.match("B", 0), *(RoleId.match_slave("B", 0, j) for j in (0, 1))):
        held = live(store.load(role.owner, "subscription")).values()
        tables[role.owner] = sorted(SubscriptionRecord.from_document(d).queue for _, d in held)
    for role in (RoleId.router("B"), *(RoleId.router_slave("B", j) for j in (0, 1))):
        entry = live(store.load(role.owner, "routing_table")).get(event_type)
        tables[role.owner] = None if entry is None else LatencyEntry.from_document(entry[1])
    return tables


def _settled(store: Any, event_type: str, queues: list[str]) -> dict[str, Any]:
    """The tables once every replica holds all the subscriptions and the latencyMap entry
    that counts them all (the confirmation waited for W of N: the last replica's write
    may still be on its way), or after 15 s."""
    entry = LatencyEntry(len(queues), len(queues))  # every subscription at level 1
    with contextlib.suppress(AssertionError):
        eventually(
            lambda: (
                (tables := _tables(store, event_type))
                and all(v is not None and v != [] for v in tables.values())
                and all(v == sorted(queues) for v in tables.values() if isinstance(v, list))
                and all(v == entry for v in tables.values() if isinstance(v, LatencyEntry))
            ),
            "every replica",
            timeout=15,
        )
    return _tables(store, event_type)


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "quotes")
    queues = [f"{name}.subscriber{k}" for k in range(QUEUES)]
    slaves = {c: {"match_slaves": 2 * (c == "B"), "routing_slaves": 2 * (c == "B")} for c in "ABC"}
    directory = tmp_path_factory.mktemp("replication")
    store = open_store(str(directory / "state.sqlite3"))

    async def subscribe(topology) -> None:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            for queue in queues:  # each confirmed: the owner and W of its N replicas hold it
                await at_a.subscribe(event_type, [("price", "<", 10)], 1, queue)

    async def publish(topology) -> list[dict[str, Any]]:
        async with AsyncClient(settings=settings) as client:
            at_c = PhoenixClient(client, topology=topology, cluster="C")
            got = await until_delivered(
                client,
                queues[0],
                lambda k: at_c.publish(event(event_type, price=1, n=f"p{k}")),
                "probe",
            )
            for i in range(10):
                await at_c.publish(event(event_type, price=i, n=f"yes{i}"))
                await at_c.publish(event(event_type, price=50 + i, n=f"no{i}"))
            got += await collect(
                client,
                queues[0],
                lambda so_far: sum(attribute(m).startswith("yes") for m in [*got, *so_far]) >= 10,
                "ten matching events",
                strict=False,
            )
            for queue in queues:
                await client.delete_queue(queue)
            return got

    try:
        with running(directory, name, settings, ",".join(brokers.urls), slaves) as deployed:
            asyncio.run(subscribe(deployed.topology))
            before = _settled(store, event_type, queues)
            deployed.down()
            # the masters' own copies are lost
            store.snapshot(RoleId.match("B", 0).owner, "subscription", {})
            store.snapshot(RoleId.router("B").owner, "routing_table", {})
            deployed.up()
            got = asyncio.run(publish(deployed.topology))
        return Run(event_type, queues, before, _tables(store, event_type), got)
    finally:
        store.close()


def test_a_confirmed_subscription_is_held_by_the_owners_match_slaves(run: Run) -> None:
    for j in (0, 1):
        assert run.before[RoleId.match_slave("B", 0, j).owner] == sorted(run.queues)


def test_the_routing_slaves_hold_the_latency_map_entry(run: Run) -> None:
    for j in (0, 1):
        assert run.before[RoleId.router_slave("B", j).owner] == LatencyEntry(QUEUES, QUEUES)


def test_masters_that_lost_their_copies_match_as_before_after_a_restart(run: Run) -> None:
    names = [attribute(m) for m in run.got if not attribute(m).startswith("p")]
    assert sorted(names) == sorted(f"yes{i}" for i in range(10))


def test_the_read_repairs_the_match_masters_own_copy(run: Run) -> None:
    assert run.after[RoleId.match("B", 0).owner] == sorted(run.queues)


def test_the_read_repairs_the_routing_masters_own_copy(run: Run) -> None:
    assert run.after[RoleId.router("B").owner] == LatencyEntry(QUEUES, QUEUES)
