"""Subscriptions' lifecycle across the ring: an e2e subscription confirms delivery only
once the subscriber handled it (a rejected event dead-lettered with its reason), and an
unsubscribe stops deliveries at once and takes its level out of every latencyMap.

Two runs (module fixtures), one claim per test; the test counts with its own queues, the
dead-letter queue and the shared store."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from middleware.errors import Reject
from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing, FilterError
from middleware.routing.client import PhoenixClient
from middleware.routing.records import LatencyEntry
from middleware.routing.replicas import live
from middleware.routing.store import open_store
from middleware.transport import DEAD_LETTER_QUEUE, AsyncClient, QueueKind, QueueSpec
from middleware.transport.delivery import DEAD_LETTER_TOPOLOGY
from middleware.transport.management import management_get
from tests.integration.phoenix_support import (
    attribute,
    collect,
    event,
    eventually_async,
    owned_by,
    running,
    take,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
NO_SLAVES = {c: {"routing_slaves": 0, "match_slaves": 0} for c in CLUSTERS}


@dataclass
class E2E:
    queue: str  # the subscriber's
    refused: bool  # confirm="maybe" refused at subscribe
    handled: list[str] = field(default_factory=list)  # what the handler was given
    brokers: set[str] = field(default_factory=set)  # who matched what it was given
    dead: list[dict[str, Any]] = field(default_factory=list)  # dead letters from B's matcher
    kind: str = ""  # the subscriber queue's type, as the broker holds it


@pytest.fixture(scope="module")
def e2e(brokers, module_settings, module_name, tmp_path_factory) -> E2E:
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "e2e")
    queue = f"{name}.e2e"
    inbox = RoleId.match("B", 0).inbox(name)

    async def scenario(topology) -> E2E:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            try:
                await at_a.subscribe(event_type, None, 1, queue, confirm="maybe")
                run = E2E(queue, refused=False)
            except FilterError:
                run = E2E(queue, refused=True)
            quorum = QueueSpec(queue, kind=QueueKind.QUORUM)  # one that outlives its node
            await at_a.subscribe(
                event_type, [("n", "exists")], 1, queue, confirm="e2e", queue_spec=quorum
            )
            run.kind = management_get(settings, f"/api/queues/%2F/{queue}")["type"]

            async def handler(event, message) -> None:
                run.brokers.add(message.broker)
                run.handled.append(event.attributes["n"])
                if event.attributes["n"] == "bad":
                    raise Reject("bad event")

            await at_a.consume(queue, handler, e2e=True)
            at_c = PhoenixClient(client, topology=topology, cluster="C")

            async def probe() -> bool:
                if "probe" in run.handled:
                    return True
                await at_c.publish(event(event_type, n="probe"))
                await asyncio.sleep(0.4)
                return False

            await eventually_async(probe, "probe handled", 60, interval=0)
            for n in ("ok1", "bad", "ok2"):
                await at_c.publish(event(event_type, n=n))

            # declared as the role's first dead letter declares it (a fresh broker: the
            # polling would otherwise meet no queue at all)
            await client.declare_exchange(DEAD_LETTER_TOPOLOGY[0])
            await client.declare_queue(DEAD_LETTER_TOPOLOGY[1])
            await client.bind(DEAD_LETTER_TOPOLOGY[2])

            async def dead_lettered() -> bool:
                while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                    if d.headers.get("x-qosmq-queue") == inbox:
                        reason = d.headers["x-qosmq-reason"]
                        run.dead.append({"reason": reason, **json.loads(d.body)})
                return bool(run.dead)

            await eventually_async(dead_lettered, "dead letter", 30, interval=0.5, strict=False)
            await asyncio.sleep(1)  # a redelivery of the rejected event would be here
            await at_a.close()  # its receipts consumer first, then the connection
            return run

    directory = tmp_path_factory.mktemp("e2e")
    fields = {"inner": False}
    with running(directory, name, settings, ",".join(brokers.urls), NO_SLAVES, fields) as deployed:
        return asyncio.run(scenario(deployed.topology))


def test_a_confirm_mode_nobody_knows_is_refused_at_subscribe(e2e: E2E) -> None:
    assert e2e.refused


def test_the_subscriber_queue_is_declared_as_the_subscriber_asked(e2e: E2E) -> None:
    """``subscribe(..., queue_spec=QueueSpec(queue, kind=QUORUM))``: before 2026-12-07
    every subscriber queue was a classic one (one node's), and a queue declared
    beforehand as another type failed the subscribe with ``PreconditionFailed``."""
    assert e2e.kind == "quorum"


def test_an_e2e_subscriber_is_given_every_event_matched_by_the_owner(e2e: E2E) -> None:
    assert {"ok1", "ok2", "bad"} <= set(e2e.handled), e2e.handled
    assert {RoleId.from_owner(b).master for b in e2e.brokers} == {RoleId.match("B", 0)}


def test_an_event_the_subscriber_rejects_is_not_redelivered(e2e: E2E) -> None:
    assert e2e.handled.count("bad") == 1


def test_an_event_the_subscriber_rejects_is_dead_lettered_with_its_reason(e2e: E2E) -> None:
    assert [attribute(d) for d in e2e.dead] == ["bad"], e2e.dead
    assert "bad event" in e2e.dead[0]["reason"] and e2e.queue in e2e.dead[0]["reason"]


# ----------------------------------------------------------------- unsubscribe
@dataclass
class Unsubscribe:
    before: dict[str, LatencyEntry | None]  # per router (and B's slave): both levels
    after: dict[str, LatencyEntry | None]  # ... once the urgent one was removed
    gone: dict[str, LatencyEntry | None]  # ... once the last one was removed
    removed: bool  # the first removal confirmed
    again: bool  # the same removal a second time
    last: bool  # the last removal confirmed
    kept: list[int]  # what the kept subscription received afterwards
    stray: list[dict[str, Any]]  # what the removed one received afterwards
    subscriptions: dict[str, dict[str, Any]]  # B's match master and slave: live ones


@pytest.fixture(scope="module")
def unsubscribe(brokers, module_settings, module_name, tmp_path_factory) -> Unsubscribe:
    """Two subscriptions made at A to a type owned by B (levels 1 and 5); the first is
    removed, then the second."""
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "ticks")
    path = ChordRing(CLUSTERS).route("A", event_type)  # the routers a subscription passes
    owners = [RoleId.router(c).owner for c in path] + [RoleId.router_slave("B", 0).owner]
    kept, dropped = f"{name}.kept", f"{name}.dropped"
    directory = tmp_path_factory.mktemp("unsubscribe")
    store = open_store(str(directory / "state.sqlite3"))

    def levels() -> dict[str, LatencyEntry | None]:
        entries = {o: live(store.load(o, "routing_table")).get(event_type) for o in owners}
        return {o: e and LatencyEntry.from_document(e[1]) for o, e in entries.items()}

    async def settled(expected: LatencyEntry | None) -> dict[str, LatencyEntry | None]:
        """The stored levels once every router (and the slave's replica) shows
        ``expected`` (routers apply a change from their inboxes, beside the client's
        confirmation), or after 15 s."""
        await eventually_async(
            lambda: all(v == expected for v in levels().values()), "levels", 15, strict=False
        )
        return levels()

    async def scenario(topology) -> Unsubscribe:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            at_c = PhoenixClient(client, topology=topology, cluster="C")
            urgent = await at_a.subscribe(event_type, [("price", "<", 10)], 1, dropped)
            bulk = await at_a.subscribe(event_type, [("price", "<", 10)], 5, kept)
            before = await settled(LatencyEntry(6, 2))
            removed = await at_a.unsubscribe(event_type, urgent)
            again = await at_a.unsubscribe(event_type, urgent)
            after = await settled(LatencyEntry(5, 1))
            for i in range(5):
                await at_c.publish(event(event_type, price=i))
            got = await collect(
                client, kept, lambda so_far: len(so_far) >= 5, "five events", strict=False
            )
            stray = await take(client, dropped)
            last = await at_a.unsubscribe(event_type, bulk)
            gone = await settled(None)
            for queue in (kept, dropped):
                await client.delete_queue(queue)
            held = {
                role.owner: live(store.load(role.owner, "subscription"))
                for role in (RoleId.match("B", 0), RoleId.match_slave("B", 0, 0))
            }
            kept_prices = [attribute(m, "price") for m in got]
            return Unsubscribe(before, after, gone, removed, again, last, kept_prices, stray, held)

    clusters = {
        c: {"match_slaves": int(c == "B"), "routing_slaves": int(c == "B")} for c in CLUSTERS
    }
    try:
        with running(directory, name, settings, ",".join(brokers.urls), clusters) as deployed:
            return asyncio.run(scenario(deployed.topology))
    finally:
        store.close()


def test_every_router_on_the_path_counts_both_levels(unsubscribe: Unsubscribe) -> None:
    assert unsubscribe.before == dict.fromkeys(unsubscribe.before, LatencyEntry(6, 2))


def test_an_unsubscribe_is_confirmed_by_the_owner(unsubscribe: Unsubscribe) -> None:
    assert unsubscribe.removed is True


def test_the_same_unsubscribe_again_is_not_confirmed(unsubscribe: Unsubscribe) -> None:
    assert unsubscribe.again is False  # the owner no longer knows it


def test_every_router_takes_the_removed_level_out(unsubscribe: Unsubscribe) -> None:
    assert unsubscribe.after == dict.fromkeys(unsubscribe.after, LatencyEntry(5, 1))


def test_the_removed_subscription_gets_nothing_and_the_other_everything(
    unsubscribe: Unsubscribe,
) -> None:
    assert sorted(unsubscribe.kept) == list(range(5)) and unsubscribe.stray == []


def test_removing_the_last_subscription_leaves_no_latency_map_entry(
    unsubscribe: Unsubscribe,
) -> None:
    assert unsubscribe.last is True
    assert unsubscribe.gone == dict.fromkeys(unsubscribe.gone), unsubscribe.gone


def test_the_owner_and_its_replica_hold_only_tombstones(unsubscribe: Unsubscribe) -> None:
    assert all(held == {} for held in unsubscribe.subscriptions.values())
