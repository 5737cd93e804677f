"""Every RabbitMQ node stopped and started again under Phoenix load (an operator's
full-cluster restart, or a RabbitMQ upgrade that needs one), with the default topology
(classic role queues on one node each): no event whose publish the broker confirmed is
lost, and the e2e handler is given none twice.

Until 2026-12-06 every Phoenix message was transient (delivery mode 1): a restarted
node dropped what its queues held (in one run 609 of 943 confirmed events lost,
events waiting in the subscriber queue and in role inboxes alike). Role messages and
copies are persistent now; signals that expire stay transient.

Both client faces publish at A at once (their own number ranges) while every node is
stopped gracefully, one by one, and all are started again; a broker-confirmed queue
(read by the test) and an e2e subscriber on the asyncio face (its handler counted)
subscribe at A. Real broker nodes (the chaos fixture), real role processes, the test's
own counters."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import quote

import pytest

from middleware.errors import MiddlewareError
from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.routing.matching import Filter
from middleware.routing.messages import Subscribe, encode
from middleware.routing.wiring import role_inbox_spec
from middleware.transport import AsyncClient, OutgoingMessage, QueueKind, QueueSpec
from middleware.transport.delivery import DEAD_LETTER_QUEUE
from middleware.transport.management import management_get
from tests.integration.phoenix_support import (
    attribute,
    event,
    take,
    until_delivered,
)
from tests.integration.test_phoenix_recovery import _deployment, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
RATE = 40  # events/s on the asyncio face; the pika face publishes half as many
SECONDS = 45.0  # the stream; the restart starts 1 s in and takes about 30 s (and on
# a slow machine the stream goes on until 2 s of events were confirmed after it)
SYNC_FROM = 100_000  # the pika face's numbers


async def _dead_lettered(client: AsyncClient) -> dict[int, str]:
    """What a role dead-lettered (the layer's dead-letter queue, read empty): event ->
    why."""
    dead: dict[int, str] = {}
    with contextlib.suppress(MiddlewareError):  # (no dead letter yet: no queue)
        while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
            reason = str((d.headers or {}).get("x-qosmq-reason", "?"))
            for n in re.findall(rb'"n":\s*(-?\d+)', d.body):
                dead[int(n)] = reason[:300]
    return dead


@pytest.mark.parametrize("restarted", ["every node", "the inbox's node"])
def test_rabbitmq_nodes_restarted_under_load_lose_no_confirmed_event(
    restarted, settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """``every node``: all stopped one by one, then started together; ``the inbox's
    node``: only the node that holds B's routing master's inbox (a rolling restart's
    step), so the events bound for B wait there. Where A's router inbox is on that
    node too, publishes into it may be refused while it is down, each with a named
    error (``EntityNotFound``, ``Unroutable``: the publisher knows; not lost), or wait
    for it (docs/transport.md, "Failover and recovery": the known gap)."""
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 1}}
    )
    queue, e2e_queue = f"{name}.sub", f"{name}.e2e"
    handled: list[int] = []
    took: dict[str, float] = {}
    nodes = [n.short_name for n in local_cluster.layout.nodes]

    def restart_all() -> None:
        start = time.monotonic()
        for node in reversed(nodes):  # as an operator does, one by one
            local_cluster.stop(node)
        took["stop"] = time.monotonic() - start
        time.sleep(2.0)
        start = time.monotonic()
        local_cluster.up()  # together: a node with data waits for its peers
        took["up"] = time.monotonic() - start

    crashed: list[BaseException] = []  # anything but a named error ends the pika stream
    dead: dict[int, str] = {}  # event -> why a role dead-lettered it

    def sync_stream(confirmed: set[int], errors: list[str], stop: threading.Event) -> None:
        try:
            with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
                n = SYNC_FROM
                while not stop.is_set():
                    try:
                        at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                        confirmed.add(n)
                    except MiddlewareError as exc:  # refused: the publisher knows, not lost
                        errors.append(f"pika: {type(exc).__name__}: {exc}"[:200])
                    n += 1
                    time.sleep(2 / RATE)
        except BaseException as exc:  # a traceback in the pika face: the test fails on it
            crashed.append(exc)

    async def scenario() -> tuple[set[int], set[int], list[str], int]:
        confirmed: set[int] = set()
        after = 0  # confirmed on the asyncio face once every node was up again
        modes: set[bool] = set()  # the copies' persistent flags
        errors: list[str] = []
        stop = threading.Event()
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            await at_a.subscribe(event_type, [("n", ">=", -1)], 1, e2e_queue, confirm="e2e")

            async def handler(ev, _message) -> None:
                handled.append(ev.attributes["n"])

            await at_a.consume(e2e_queue, handler, e2e=True)
            sync = threading.Thread(target=sync_stream, args=(confirmed, errors, stop))
            sync.start()
            start, n, restart = time.monotonic(), 0, None
            while (elapsed := time.monotonic() - start) < SECONDS or (
                after < 2 * RATE and elapsed < 120
            ):
                if n == RATE:  # one second in
                    restart = asyncio.create_task(asyncio.to_thread(restart_all))
                try:
                    await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                    confirmed.add(n)
                    after += restart is not None and restart.done()
                except MiddlewareError as exc:
                    errors.append(f"asyncio: {type(exc).__name__}: {exc}"[:200])
                n += 1
                await asyncio.sleep(1 / RATE)
            stop.set()
            assert restart is not None
            await restart
            await asyncio.to_thread(sync.join, 60)
            got: set[int] = set()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                confirmed <= got and confirmed <= set(handled)
            ):
                with contextlib.suppress(MiddlewareError):  # the test's reads may fail over
                    while (d := await client.get(queue)) is not None:
                        got.add(json.loads(d.body)["event"]["attributes"]["n"])
                        modes.add(d.persistent)
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # late duplicates show here
            dead.update(await _dead_lettered(client))
            await at_a.close()
        assert modes == {True}, f"copies persistent: {modes}"
        return confirmed, got, errors, after

    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        if restarted != "every node":
            inbox = RoleId.router("B").inbox(topology.prefix)
            held_by = management_get(settings, f"/api/queues/%2F/{quote(inbox, safe='')}")
            nodes = [
                n.short_name for n in local_cluster.layout.nodes if n.node_name == held_by["node"]
            ]
            assert nodes, held_by
        confirmed, got, errors, after = asyncio.run(scenario())
    finally:
        deployment.down()
    counts = Counter(n for n in handled if n >= 0)
    print(
        f"\n{restarted} stopped in {took.get('stop', 0):.1f} s, up again in"
        f" {took.get('up', 0):.1f} s; {len(confirmed)} confirmed ({len(errors)} refused),"
        f" {len(got & confirmed)} at the queue, {len(set(counts) & confirmed)} handled e2e;"
        f" {after} confirmed after the restart"
    )
    for face in ("asyncio", "pika"):
        theirs = [e for e in errors if e.startswith(face)]
        print(f"   {face}: {len(theirs)} refused", *theirs[:2], sep="\n     ")
    assert not crashed, f"the pika face's stream died: {crashed[0]!r}"
    lost = sorted(confirmed - got)
    if lost:  # where they went: the dead letters, and what the roles warned of
        for n in lost[:5]:
            print(f"   lost {n}: dead-lettered: {dead.get(n, 'no')}")
        for log_file in sorted((tmp_path / "state").glob("*.log")):
            warned = [line for line in log_file.read_text().splitlines() if "WARNING" in line]
            print(f"   {log_file.name}: {len(warned)} warnings", *warned[:15], sep="\n     ")
    assert not lost, f"{len(lost)} confirmed events lost (queue): {lost[:20]}"
    lost_e2e = sorted(confirmed - set(counts))
    assert not lost_e2e, f"{len(lost_e2e)} confirmed events lost (e2e): {lost_e2e[:20]}"
    twice = sorted(n for n, k in counts.items() if k > 1)
    assert not twice, f"the e2e handler was given {len(twice)} twice: {twice[:20]}"
    assert after >= 2 * RATE, "the stream did not go on once every node was up again"
    assert any(n >= SYNC_FROM for n in confirmed), "the pika face confirmed nothing"


WAITING = 15  # events each face publishes while the node is down


@pytest.mark.parametrize("fault", ["stop", "kill"])
@pytest.mark.parametrize("held", ["the match master's inbox", "the subscriber's queues"])
def test_events_wait_for_a_queue_on_a_node_that_is_down(
    held, fault, settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """One node holds only B's match master's inbox, or only the subscriber's two
    queues (broker-confirmed and e2e; declared there first); it is stopped (or
    SIGKILLed) and both client faces publish at A.  The role before the queue cannot pass
    the events on: it holds each (handled again after a pause, then given back to its
    own inbox; a copy is carried to the home's router, which holds it), and none is
    dead-lettered or dropped; once the node is back every event reaches the
    broker-confirmed queue and the e2e subscriber, once.  Until 2026-12-06 B's router
    dead-lettered every event (its handler raised ``Unroutable``), and the match master
    took a copy returned by a queue whose node is down for a deleted queue's: dropped."""
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {}}
    )
    queue, e2e_queue = f"{name}.sub", f"{name}.e2e"
    node = local_cluster.layout.nodes[-1]
    far = settings.model_copy(update={"amqp_urls": (brokers.urls[-1],)})
    if held == "the match master's inbox":
        inbox = RoleId.match("B", 0).inbox(topology.prefix)
        specs = [role_inbox_spec(inbox, topology, None)]
    else:
        specs = [QueueSpec(q, kind=QueueKind.CLASSIC) for q in (queue, e2e_queue)]

    async def declare_far() -> None:
        async with AsyncClient(settings=far) as client:
            for spec in specs:
                await client.declare_queue(spec)

    handled: list[int] = []
    dead: dict[int, str] = {}
    took: list[float] = []

    async def scenario() -> tuple[set[int], set[int]]:
        confirmed: set[int] = set()
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            await at_a.subscribe(event_type, [("n", ">=", 0)], 1, e2e_queue, confirm="e2e")

            async def handler(ev, _message) -> None:
                handled.append(ev.attributes["n"])

            await at_a.consume(e2e_queue, handler, e2e=True)
            fail = local_cluster.stop if fault == "stop" else local_cluster.kill
            await asyncio.to_thread(fail, node.short_name)

            def sync_face() -> None:
                with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as pika:
                    for n in range(SYNC_FROM, SYNC_FROM + WAITING):
                        pika.publish({"event_type": event_type, "attributes": {"n": n}})
                        confirmed.add(n)

            for n in range(WAITING):
                await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                confirmed.add(n)
            await asyncio.to_thread(sync_face)
            await asyncio.sleep(2.0)  # the role before the queue meets it down
            await asyncio.to_thread(local_cluster.start, node.short_name)
            back = time.monotonic()
            got: set[int] = set()
            while time.monotonic() < back + 60 and not (
                confirmed <= got and confirmed <= set(handled)
            ):
                with contextlib.suppress(MiddlewareError):  # the queue's consumer comes back
                    got |= {attribute(m) for m in await take(client, queue)}
                await asyncio.sleep(0.2)
            took.append(time.monotonic() - back)
            await asyncio.sleep(1.0)  # late duplicates show here
            dead.update(await _dead_lettered(client))
            await at_a.close()
        return confirmed, got

    asyncio.run(declare_far())
    for spec in specs:
        held_by = management_get(settings, f"/api/queues/%2F/{quote(spec.name, safe='')}")
        assert held_by["node"] == node.node_name, held_by
    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        confirmed, got = asyncio.run(scenario())
    finally:
        deployment.down()
    counts = Counter(n for n in handled if n >= 0)
    print(
        f"\n{held}, {fault}: {len(confirmed)} confirmed while the node was down,"
        f" {len(got & confirmed)} at the queue, {len(set(counts) & confirmed)} handled e2e,"
        f" {len(set(dead) & confirmed)} dead-lettered; all through {took[0]:.1f} s after"
        " the node's start"
    )
    assert not set(dead) & confirmed, f"dead-lettered: {sorted(dead.items())[:5]}"
    assert confirmed <= got, f"lost (queue): {sorted(confirmed - got)[:20]}"
    assert confirmed <= set(counts), f"lost (e2e): {sorted(confirmed - set(counts))[:20]}"
    assert all(k == 1 for k in counts.values()), f"handled twice: {counts.most_common(3)}"


def test_a_handed_subscription_waits_for_a_match_master_inbox_on_a_node_that_is_down(
    settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """One node holds only B's match master's inbox, and is stopped.  A subscription of
    an arc handed over at a join comes to B's routing master's control queue, as the
    previous owner's match master sends it (persistent; that master forgets it once
    sent); B's router cannot pass it on.  It is handled again and given back, never
    dead-lettered, and once the node is back B's match master matches events with it.
    Until 2026-12-07 the control queue's consumer dead-lettered it (``HopFailed``): the
    subscription was gone from the arc.  (A real join cannot be timed to meet the node
    down: the joiner's match master must serve before the hand-over, and stops when
    its inbox cannot be declared.)"""
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {}}
    )
    queue = f"{name}.handed"
    node = local_cluster.layout.nodes[-1]
    far = settings.model_copy(update={"amqp_urls": (brokers.urls[-1],)})
    inbox = RoleId.match("B", 0).inbox(topology.prefix)
    control = RoleId.router("B").control(topology.prefix)
    handed = Subscribe(
        subscription_id="handed-1",
        event_type=event_type,
        filter=Filter.parse([("n", ">=", 1000)]).spec(),
        queue=queue,
        latency_level=1,
        home="A",
        hops=["A"],
    )

    async def declare_far() -> None:
        async with AsyncClient(settings=far) as client:
            await client.declare_queue(role_inbox_spec(inbox, topology, None))

    async def hand_over() -> None:
        async with AsyncClient(settings=settings) as client:
            await client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))
            body = encode(handed)
            await client.publish(OutgoingMessage(body, routing_key=control, persistent=True))

    async def after() -> tuple[list[dict], list[str]]:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            got = await until_delivered(
                client,
                queue,
                lambda k: at_a.publish(event(event_type, n=1000 + k)),
                "an event for the handed subscription",
                seconds=90,
            )
            dead: list[str] = []  # this test's dead letters: what and why
            with contextlib.suppress(MiddlewareError):  # (no dead letter yet: no queue)
                while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                    why = str((d.headers or {}).get("x-qosmq-reason", "?"))[:200]
                    if event_type.encode() in d.body:
                        dead.append(f"{d.body[:80]!r}: {why}")
            return got, dead

    asyncio.run(declare_far())
    held_by = management_get(settings, f"/api/queues/%2F/{quote(inbox, safe='')}")
    assert held_by["node"] == node.node_name, held_by
    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, f"{name}.sub"))
        local_cluster.stop(node.short_name)
        asyncio.run(hand_over())
        time.sleep(3.0)  # B's router meets the match master's inbox down
        local_cluster.start(node.short_name)
        back = time.monotonic()
        got, dead = asyncio.run(after())
        took = time.monotonic() - back
    finally:
        deployment.down()
    print(f"\nhanded subscription: matched {took:.1f} s after the node's start; dead: {dead}")
    assert not dead, f"dead-lettered: {dead}"
    assert any(attribute(m) >= 1000 for m in got), got


OUTAGE_S = 20.0  # the far node is down this long while events stream
OUTAGE_RATE = 25  # events/s
LIVE_BOUND_S = 5.0  # a live subscriber's copy, at most this late while the node is down


@pytest.mark.parametrize(
    ("fault", "router_killed"), [("stop", False), ("kill", False), ("stop", True)]
)
def test_a_queue_on_a_node_that_is_down_holds_up_no_other_subscriber(
    fault, router_killed, settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """Two broker-confirmed subscribers of every event at A: one queue on a node that is
    stopped (or SIGKILLed) for 20 s while 25 events/s are published at A, the other on a
    live node.  The copies for the queue that is down wait (nothing lost, none
    dead-lettered) without holding up the live subscriber: each of its copies comes
    within 5 s.  Until 2026-12-07 the home's router held those copies in its inbox
    prefetch (handled again for about 10 s, then given back, again and again), and
    every event entering at A waited behind them for as long as the node was down.
    ``router_killed``: A's routing master (with a slave) is SIGKILLed halfway through
    the outage, with copies parked; the slave that takes over tries them from the same
    parked queue."""
    a: dict[str, object] = {"routing_slaves": 1} if router_killed else {}
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": a, "B": {}}
    )
    down_queue, live_queue = f"{name}.down", f"{name}.live"
    node = local_cluster.layout.nodes[-1]
    far = settings.model_copy(update={"amqp_urls": (brokers.urls[-1],)})

    async def declare_far() -> None:
        async with AsyncClient(settings=far) as client:
            await client.declare_queue(QueueSpec(down_queue, kind=QueueKind.CLASSIC))

    live_late: list[float] = []  # seconds from publish to the live queue, while down
    took: list[float] = []
    killed: list[int] = []  # the routing master's PID, when killed
    dead: dict[int, str] = {}

    async def scenario() -> tuple[set[int], set[int], set[int]]:
        published: set[int] = set()
        live: set[int] = set()
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            fail = local_cluster.stop if fault == "stop" else local_cluster.kill
            await asyncio.to_thread(fail, node.short_name)
            begun, n = time.monotonic(), 0
            while time.monotonic() < begun + OUTAGE_S:
                if router_killed and n == int(OUTAGE_RATE * OUTAGE_S) // 2:
                    killed.append(await asyncio.to_thread(deployment.kill, RoleId.router("A")))
                await at_a.publish(event(event_type, n=n, t=time.time()))
                published.add(n)
                n += 1
                for m in await take(client, live_queue):
                    live.add(attribute(m))
                    live_late.append(time.time() - attribute(m, "t"))
                await asyncio.sleep(max(0.0, begun + n / OUTAGE_RATE - time.monotonic()))
            settle = time.monotonic() + LIVE_BOUND_S  # the node still down
            while time.monotonic() < settle and not published <= live:
                for m in await take(client, live_queue):
                    live.add(attribute(m))
                    live_late.append(time.time() - attribute(m, "t"))
                await asyncio.sleep(0.1)
            await asyncio.to_thread(local_cluster.start, node.short_name)
            got: set[int] = set()
            back = time.monotonic()
            while time.monotonic() < back + 60 and not published <= got:
                with contextlib.suppress(MiddlewareError):  # the queue comes back
                    got |= {attribute(m) for m in await take(client, down_queue)}
                await asyncio.sleep(0.2)
            took.append(time.monotonic() - back)
            dead.update(await _dead_lettered(client))
            await at_a.close()
        return published, live, got

    asyncio.run(declare_far())
    held_by = management_get(settings, f"/api/queues/%2F/{quote(down_queue, safe='')}")
    assert held_by["node"] == node.node_name, held_by
    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, down_queue))
        asyncio.run(_subscribe(settings, topology, event_type, live_queue))
        published, live, got = asyncio.run(scenario())
    finally:
        deployment.down()
    late = sorted(live_late)
    print(
        f"\n{fault}, router killed {killed}: {len(published)} published while the node was"
        f" down; the live queue got {len(live & published)} (median"
        f" {late[len(late) // 2] if late else 0:.2f} s, max {late[-1] if late else 0:.2f} s"
        f" late); the queue that was down got {len(got & published)}, all {took[0]:.1f} s"
        f" after its node's start; {len(set(dead) & published)} dead-lettered"
    )
    assert not set(dead) & published, f"dead-lettered: {sorted(dead.items())[:5]}"
    assert published <= got, f"lost (the queue that was down): {sorted(published - got)[:20]}"
    assert published <= live, f"not at the live queue: {sorted(published - live)[:20]}"
    assert late[-1] <= LIVE_BOUND_S, f"the live subscriber held up: {late[-5:]}"
    assert bool(killed) == router_killed
