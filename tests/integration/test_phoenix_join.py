"""Join and hand-over: a cluster that joins the ring takes over its arc from its
successor with the subscriptions in it; an unsubscribe afterwards reaches the new owner
and every router that counted the subscription's level.

One run (the module fixture); the test counts with its own subscriber queue and the
shared store."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing
from middleware.routing.client import PhoenixClient
from middleware.routing.records import LatencyEntry
from middleware.routing.replicas import live
from middleware.routing.store import open_store
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import (
    attribute,
    cli,
    event,
    eventually,
    joining,
    running,
    until_delivered,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
RING = ChordRing(["A", "B", "C"])
JOINER, EVENT_TYPE = joining(["A", "B", "C"], "B", "ticks")
PATH = [RoleId.router(c).owner for c in RING.route("A", EVENT_TYPE)]  # where it was subscribed
ROUTERS = [*PATH, RoleId.router(JOINER).owner]


@dataclass
class Run:
    first: dict[str, Any]  # an event delivered before the join
    moved: dict[str, Any]  # ... and after it
    joined: str  # what ``qosmq phoenix join`` printed
    counted: dict[str, LatencyEntry | None]  # the path's routers before the join
    removed: bool  # the unsubscribe after the join was confirmed
    forgotten: dict[str, LatencyEntry | None]  # every router after it


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    queue = f"{name}.subscriber"
    directory = tmp_path_factory.mktemp("join")
    clusters = {"A": {}, "B": {}, "C": {}, JOINER: {"joined": False}}

    def counted(routers: list[str]) -> dict[str, LatencyEntry | None]:
        """The latencyMap entry of the type in each router's store."""
        store = open_store(str(directory / "state.sqlite3"))
        try:
            entries = {r: live(store.load(r, "routing_table")).get(EVENT_TYPE) for r in routers}
        finally:
            store.close()
        return {r: e and LatencyEntry.from_document(e[1]) for r, e in entries.items()}

    async def delivered(topology, client: AsyncClient, tag: str) -> dict[str, Any]:
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        got = await until_delivered(
            client,
            queue,
            lambda k: at_c.publish(event(EVENT_TYPE, v=1, n=f"{tag}{k}")),
            f"{tag} event",
            accept=lambda m: attribute(m).startswith(tag),
        )
        return next(m for m in got if attribute(m).startswith(tag))

    async def before_join(topology) -> tuple[str, dict[str, Any]]:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            sid = await at_a.subscribe(EVENT_TYPE, [("v", "=", 1)], 2, queue)
            return sid, await delivered(topology, client, "before")

    async def after_join(topology, sid: str) -> tuple[dict[str, Any], bool]:
        async with AsyncClient(settings=settings) as client:
            moved = await delivered(topology, client, "after")
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            removed = await at_a.unsubscribe(EVENT_TYPE, sid)
            await client.delete_queue(queue)
            return moved, removed

    with running(directory, name, settings, ",".join(brokers.urls), clusters) as deployed:
        sid, first = asyncio.run(before_join(deployed.topology))
        joined = cli(deployed, "join", "--cluster", JOINER)
        before = counted(PATH)
        moved, removed = asyncio.run(after_join(deployed.topology, sid))
        # routers apply the removal from their inboxes, beside the client's confirmation
        forgets = lambda: not any(counted(ROUTERS).values())  # noqa: E731
        eventually(forgets, "routers forgetting", 15, strict=False)
        return Run(first, moved, joined, before, removed, counted(ROUTERS))


def test_before_the_join_the_successor_matches_the_type(run: Run) -> None:
    assert run.first["hops"][-1] == "B" and RoleId.from_owner(run.first["broker"]).cluster == "B"


def test_the_cli_reports_the_join(run: Run) -> None:
    assert f"{JOINER} joined" in run.joined


def test_every_router_on_the_subscriptions_path_counted_its_level(run: Run) -> None:
    assert run.counted == dict.fromkeys(PATH, LatencyEntry(2, 1))


def test_after_the_join_the_newcomer_matches_the_subscription_made_before(run: Run) -> None:
    assert run.moved["hops"][-1] == JOINER
    assert RoleId.from_owner(run.moved["broker"]).cluster == JOINER


def test_an_unsubscribe_after_the_join_is_confirmed_by_the_new_owner(run: Run) -> None:
    assert run.removed is True


def test_every_router_that_counted_the_level_forgets_it(run: Run) -> None:
    """The path's routers and the newcomer's, which took the count over at the join."""
    assert run.forgotten == dict.fromkeys(ROUTERS), run.forgotten
