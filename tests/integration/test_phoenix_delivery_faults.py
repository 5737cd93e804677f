"""A match broker's deliveries under faults: each copy has its own outcome.

Across a failed link (three clusters on vhosts of their own, every directed link through
a TCP proxy of the test's): the owner X's match broker cannot reach the subscriber's
home Y, so it hands Y's copies to X's routing master, which carries them to Y's routing
master over a detour (X -> A -> Y) as it carries routed events; a second subscriber,
homed at A, is not touched.  Before, a copy to an unreachable home dead-lettered the
whole event (no subscriber got it) or waited for the heal.

A subscriber that stops consuming: its e2e copies wait in its queue, and the other
subscribers of the same match broker go on at their pace (before, every event waited
~20 s for that subscriber's receipts, and the others with it).

Every count is the test's own: events published, copies found in each queue."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable

import pytest

from middleware.errors import EntityNotFound
from middleware.phoenix.ids import RoleId, RoleKind
from middleware.routing.client import PhoenixClient
from middleware.transport import DEAD_LETTER_QUEUE, AsyncClient
from tests.integration.phoenix_support import count_arrivals, owned_by, running
from tests.integration.test_phoenix_links import RATE, links  # noqa: F401 (fixture)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow, pytest.mark.chaos]


def _stamped(arrivals: list) -> Callable[[dict, float], None]:
    """``count_arrivals``'s callback: (n, when) of each copy into ``arrivals``."""
    return lambda body, at: arrivals.append((body["event"]["attributes"]["n"], at))


async def _stream(at_a: PhoenixClient, event_type: str, rate: float) -> int:
    """Events ``n`` = 0, 1… stamped with their publish time ``t``, at ``rate`` a second
    for 8 s; how many."""
    published, start = 0, time.monotonic()
    while time.monotonic() - start < 8.0:
        event = {"n": published, "t": time.time()}
        await at_a.publish({"event_type": event_type, "attributes": event})
        published += 1
        await asyncio.sleep(1 / rate)
    return published


def _all_once(arrivals, published: int) -> int:
    """Every event arrived; how many more than once."""
    got = [n for n, _ in arrivals if n >= 0]
    missing = sorted(set(range(published)) - set(got))
    assert not missing, f"{len(missing)} of {published} events lost: {missing[:20]}"
    return len(got) - len(set(got))


@pytest.mark.parametrize(
    ("fault", "links"),
    [
        ("cut", {}),
        ("blackhole", {}),
        # the copies batched (copy_batch_max): a batch behind the link is carried whole
        ("blackhole", {"fields": {"copy_batch_max": 32}}),
    ],
    indirect=["links"],
    ids=["cut", "blackhole", "blackhole-batched"],
)
def test_copies_to_a_home_behind_a_failed_link_are_carried_around_it(links, fault) -> None:  # noqa: F811
    x, y = links.x, links.y
    at_a_queue = f"{links.name}.at-a"

    async def scenario():
        async with AsyncClient(settings=links.cluster("A")) as client:
            at_a = PhoenixClient(client, topology=links.topology, cluster="A")
            await at_a.subscribe(links.event_type, [("n", ">=", 0)], 1, at_a_queue, wait_s=60)
        done = asyncio.Event()
        at_a_arrivals: list = []
        counter = asyncio.create_task(
            count_arrivals(links.cluster("A"), at_a_queue, done, _stamped(at_a_arrivals))
        )
        # X's roles reach Y's RabbitMQ through proxies[X, Y]: that link fails, both ways
        arrivals, published, applied = await links.stream(
            6.0, [(1.5, fault), (4.5, "heal")], between=(x, y)
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len({n for n, _ in at_a_arrivals}) < published:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        done.set()
        await counter
        return arrivals, at_a_arrivals, published, applied

    arrivals, at_a_arrivals, published, applied = asyncio.run(scenario())
    # both subscribers are broker-confirmed: a copy whose confirm the fault swallowed
    # may come twice (an e2e subscriber's filter drops such a copy), none may be lost
    twice_at_y = _all_once(arrivals, published)  # behind the failed link
    assert _all_once(at_a_arrivals, published) == 0  # at A: untouched
    (_, failed_at, before), (_, healed_at, after) = applied
    # each copy's delay from its event's publish (at RATE/s from the fault on), for the
    # events published while the link was down
    first = {}
    for n, t in arrivals:
        first.setdefault(n, t)
    delays = sorted(
        first[n] - (failed_at + (n - before) / RATE) for n in range(before, after) if n in first
    )
    p50, p99 = delays[len(delays) // 2], delays[int(0.99 * (len(delays) - 1))]
    matcher_log = links.deployment.log_file(RoleId.match(x, 0)).read_text()
    assert f"at {y} carried by the ring" in matcher_log, matcher_log[-3000:]
    print(
        f"\n{fault} {x}<->{y}: {published} events, 0 lost at {y} and at A; copies to {y} "
        f"published during the fault: p50 {p50:.3f} s, p99 {p99:.3f} s, max {delays[-1]:.3f} s"
        f"; {twice_at_y} twice at {y}"
    )
    # carried around the failed link while it was down, not held until the heal: copies
    # published during the fault arrived before the link came back (their delays are
    # measured by the benchmark beside the documented bound, not asserted here: a busy
    # machine moves them, not the behaviour)
    carried = [n for n in range(before, after) if n in first and first[n] < healed_at]
    assert carried, f"no copy reached {y} before the heal (p50 {p50:.2f} s)"


def test_a_subscriber_that_stops_consuming_costs_the_others_nothing(
    settings, brokers, tmp_path, name
) -> None:
    event_type = owned_by(["A", "B"], "B", "silent")
    live, silent = f"{name}.live", f"{name}.silent"
    urls = ",".join(brokers.urls)
    with running(tmp_path, name, settings, urls, {"A": {}, "B": {}}) as deployed:

        async def scenario() -> tuple[list, int, int]:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployed.topology, cluster="A")
                await at_a.subscribe(event_type, [("n", ">=", 0)], 1, silent, confirm="e2e")
                await at_a.subscribe(event_type, [("n", ">=", 0)], 1, live, confirm="e2e")
                got: list[tuple[int, float]] = []

                async def handler(event, message) -> None:
                    got.append((event.attributes["n"], time.time() - event.attributes["t"]))

                await at_a.consume(live, handler, e2e=True)  # nobody consumes ``silent``
                published = await _stream(at_a, event_type, 50)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and len({n for n, _ in got}) < published:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
                waiting = await client.queue_length(silent)
                dead = 0
                with contextlib.suppress(EntityNotFound):  # none was ever dead-lettered
                    while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                        dead += d.headers.get("x-qosmq-queue", "").startswith(name)
                return got, published, waiting, dead

        got, published, waiting, dead = asyncio.run(scenario())
    missing = sorted(set(range(published)) - {n for n, _ in got})
    assert not missing, f"{len(missing)} events never reached the live subscriber"
    latencies = sorted(latency for _, latency in got)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    # every copy for the silent subscriber waits in its queue (the resends of the first,
    # held copies too), none is dead-lettered
    assert waiting >= published and dead == 0, (waiting, dead)
    print(
        f"\nbeside a silent e2e subscriber: {published} events, the live one's p50 "
        f"{latencies[len(latencies) // 2] * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms; "
        f"{waiting} copies wait for the silent one"
    )
    assert p99 < 1.0, f"the live subscriber's p99 {p99:.2f} s beside a silent one"


@pytest.mark.parametrize("confirm", ["broker", "e2e"])
def test_a_full_subscriber_queue_that_rejects_copies_costs_the_others_nothing(
    confirm, settings, brokers, local_cluster, tmp_path, name
) -> None:
    """A subscriber queue bounded by a policy (``max-length`` 5, ``overflow:
    reject-publish``), nobody consuming it, beside a live subscriber of the same events:
    the broker nacks the copies the full queue cannot take.  Before, the match broker's
    client retried each nack under its policy and then took the home cluster for down,
    so the live subscriber's copies waited too (probe, broker-confirmed: 111 of 500
    events in 30 s, median 12.9 s late).  Now a nacked copy waits as one for a queue
    whose node is down (parked at the home's routing master, tried again) and the
    home's other queues take theirs at once.  Once the full queue is consumed every
    event reaches it; none is dead-lettered."""
    event_type = owned_by(["A", "B"], "B", "full")
    live, full = f"{name}.live", f"{name}.full"
    bounded = '{"max-length": 5, "overflow": "reject-publish"}'
    node = local_cluster.layout.nodes[0].short_name
    local_cluster.ctl(
        node, "set_policy", f"{name}-full", f"^{full}$", bounded, "--apply-to", "queues"
    )
    urls = ",".join(brokers.urls)
    e2e = confirm == "e2e"
    late: list[float] = []
    with running(tmp_path, name, settings, urls, {"A": {}, "B": {}}) as deployed:

        async def scenario() -> tuple[int, set[int], set[int], int]:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployed.topology, cluster="A")
                for queue in (full, live):
                    await at_a.subscribe(event_type, [("n", ">=", 0)], 1, queue, confirm=confirm)
                got: dict[str, set[int]] = {live: set(), full: set()}

                def handler_for(queue: str) -> Callable:
                    async def handler(event, message) -> None:
                        got[queue].add(event.attributes["n"])
                        if queue == live:
                            late.append(time.time() - event.attributes["t"])

                    return handler

                await at_a.consume(live, handler_for(live), e2e=e2e)  # ``full``: nobody yet
                published = await _stream(at_a, event_type, 25)
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline and len(got[live]) < published:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
                await at_a.consume(full, handler_for(full), e2e=e2e)  # room again
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and len(got[full]) < published:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
                dead = 0
                with contextlib.suppress(EntityNotFound):  # none was ever dead-lettered
                    while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                        dead += d.headers.get("x-qosmq-queue", "").startswith(name)
                return published, got[live], got[full], dead

        try:
            published, at_live, at_full, dead = asyncio.run(scenario())
        finally:
            local_cluster.ctl(node, "clear_policy", f"{name}-full")
    every = set(range(published))
    slow = sorted(late)
    print(
        f"\n{confirm}: {published} events; the live subscriber got {len(at_live & every)}"
        f" (median {slow[len(slow) // 2] if slow else 0:.2f} s, max"
        f" {slow[-1] if slow else 0:.2f} s late); the full queue, once consumed,"
        f" {len(at_full & every)}; {dead} dead-lettered"
    )
    assert every <= at_live, f"not at the live subscriber: {sorted(every - at_live)[:20]}"
    assert slow[-1] <= 5.0, f"the live subscriber held up: {slow[-5:]}"
    assert every <= at_full, f"lost (the full queue): {sorted(every - at_full)[:20]}"
    assert dead == 0, f"{dead} copies dead-lettered"


@pytest.mark.parametrize("role_queues", ["classic", "quorum"])
def test_copies_parked_for_a_queue_that_stays_full_hold_up_no_other_parked_copy(
    role_queues, settings, brokers, local_cluster, tmp_path, name
) -> None:
    """Two subscriber queues bounded by a policy (``max-length`` 5, ``overflow:
    reject-publish``), nobody consuming either while 200 events flow: both queues'
    copies are parked, interleaved, at the home's routing master.  Then ``brief`` is
    consumed (room again) and ``stuck`` stays full.  Before, a parked copy that still
    could not go was given back to the head of the parked queue (``Requeue``): the
    consumer's prefetch filled with ``stuck``'s copies and ``brief``'s behind them waited
    until ``stuck`` had room.  (Now parked messages are paced by destination,
    ``routing/parked.py``.)  With quorum role queues each give-back also counted
    towards the queue's delivery limit (RabbitMQ 4.0 sets 20 on every quorum queue;
    here a policy sets 1 on 3.10's), and a copy past it was dropped.  Now a parked copy
    not passed on goes to the tail of the parked queue: ``brief`` gets every event while
    ``stuck`` is full, and ``stuck`` every one once consumed; none is dead-lettered.
    Before, measured: ``brief``'s last copy 68 s after the first event (9.6-9.9 s now);
    quorum role queues, ``stuck`` got 88 of 184 events."""
    event_type = owned_by(["A", "B"], "B", "parked")
    stuck, brief = f"{name}.stuck", f"{name}.brief"
    node = local_cluster.layout.nodes[0].short_name
    policies = {
        f"{name}-full": (
            rf"^{name}\.(stuck|brief)$",
            '{"max-length": 5, "overflow": "reject-publish"}',
        )
    }
    if role_queues == "quorum":
        policies[f"{name}-limit"] = (rf"^{name}\..*\.parked$", '{"delivery-limit": 1}')
    for policy, (pattern, definition) in policies.items():
        local_cluster.ctl(node, "set_policy", policy, pattern, definition, "--apply-to", "queues")
    urls = ",".join(brokers.urls)
    fields = {"role_queues": role_queues}
    with running(tmp_path, name, settings, urls, {"A": {}, "B": {}}, fields) as deployed:

        async def scenario() -> tuple[int, set[int], set[int], float, int]:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployed.topology, cluster="A")
                for queue in (stuck, brief):
                    await at_a.subscribe(event_type, [("n", ">=", 0)], 1, queue)
                got: dict[str, set[int]] = {stuck: set(), brief: set()}

                def handler_for(queue: str) -> Callable:
                    async def handler(event, message) -> None:
                        got[queue].add(event.attributes["n"])

                    return handler

                began = time.monotonic()
                published = await _stream(at_a, event_type, 25)
                await at_a.consume(brief, handler_for(brief))
                deadline = time.monotonic() + 30  # (before: 68 s, classic role queues)
                while time.monotonic() < deadline and len(got[brief]) < published:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
                brief_took = time.monotonic() - began
                # long enough for the give-backs of before to pass a delivery limit of 1
                await asyncio.sleep(max(0.0, 40 - (time.monotonic() - began)))
                await at_a.consume(stuck, handler_for(stuck))
                deadline = time.monotonic() + 90
                while time.monotonic() < deadline and len(got[stuck]) < published:  # noqa: ASYNC110
                    await asyncio.sleep(0.2)
                dead = 0
                with contextlib.suppress(EntityNotFound):
                    while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                        dead += d.headers.get("x-qosmq-queue", "").startswith(name)
                return published, got[brief], got[stuck], brief_took, dead

        try:
            published, at_brief, at_stuck, brief_took, dead = asyncio.run(scenario())
        finally:
            for policy in policies:
                local_cluster.ctl(node, "clear_policy", policy)
    every = set(range(published))
    print(
        f"\n{role_queues} role queues: {published} events; brief got"
        f" {len(at_brief & every)} within {brief_took:.1f} s of the first while stuck was"
        f" full; stuck, once consumed, {len(at_stuck & every)}; {dead} dead-lettered"
    )
    assert every <= at_brief, f"held behind the full queue's: {sorted(every - at_brief)[:20]}"
    assert every <= at_stuck, f"lost (the full queue): {sorted(every - at_stuck)[:20]}"
    assert dead == 0, f"{dead} copies dead-lettered"


@pytest.mark.parametrize(
    "links", [{"fields": {"leave_after_s": 1.5}, "clusters": {"match_slaves": 1}}], indirect=True
)
def test_a_rejoining_cluster_does_not_match_again_what_its_successor_matched(links) -> None:  # noqa: F811
    """X leaves while events flow (some wait in its match master's inbox); A, where they
    entered, routes them again to X's successor, which matches them.  When X comes back,
    its inbox still holds them: X drops what entered elsewhere before it left, instead of
    delivering each a second time."""
    x = links.x

    def freeze_matchers(cluster: str) -> None:  # events pile up in their inboxes
        for role, pid in links.deployment.pids().items():
            if role.cluster == cluster and role.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE):
                os.kill(pid, signal.SIGSTOP)

    links.freeze_matchers = freeze_matchers
    faults = [(1.0, "freeze_matchers"), (1.6, "remove")]
    arrivals, published, _ = asyncio.run(links.stream(5.0, faults, between=(x,)))
    # none lost; copies the frozen master had delivered, whose Matched it never sent, are
    # matched again at its successor (a broker-confirmed subscriber may see them twice)
    _all_once(arrivals, published)
    links.restore_links(x)
    links.deployment.join(x)

    async def drain(seconds: float) -> int:
        async with AsyncClient(settings=links.cluster(links.y)) as client:
            count, deadline = 0, time.monotonic() + seconds
            while time.monotonic() < deadline:
                while await client.get(links.queue) is not None:
                    count += 1
                await asyncio.sleep(0.2)
            return count

    again = asyncio.run(drain(8.0))  # X's roles are back, consuming what its inbox held
    log = links.deployment.log_file(RoleId.match(x, 0)).read_text()
    assert "this cluster left the ring at" in log, log[-3000:]
    print(f"\nafter {x} rejoined: {again} events delivered again")
    assert "dropping events from before the departure" in log, log[-3000:]
    assert again == 0, f"{again} events delivered a second time after {x} rejoined"
