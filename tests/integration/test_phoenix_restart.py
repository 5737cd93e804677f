"""A whole deployment stopped and started again (how a deployment is upgraded when its
roles' messages changed, docs/phoenix.md "Upgrading a deployment") loses no event: the
ones published before the stop, in flight at it, while no role runs (the brokers take
them into the entry router's inbox) and after the start all reach both subscribers, a
broker-confirmed queue and an e2e subscriber on the pika face that stays connected
throughout, and the e2e handler is given none twice (what was matched but not receipted
before the stop is matched and sent again after it).

Both client faces publish: the asyncio one before and after, the pika one while the
deployment is down. Real role processes stopped by ``phoenix down`` (SIGTERM by PID) and
started by ``up``; the events counted by the test's own queue reads and handler."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import eventually, sync_e2e_subscriber
from tests.integration.test_phoenix_quiet_beats import _collect
from tests.integration.test_phoenix_recovery import _deployment, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]

EVENTS = 300


def test_a_deployment_stopped_and_started_again_loses_no_event(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {}}
    )
    queue, e2e_queue = f"{name}.sub", f"{name}.e2e"
    handled: list[int] = []
    stop = threading.Event()
    e2e = threading.Thread(
        target=sync_e2e_subscriber, args=(settings, topology, e2e_queue, handled, stop), daemon=True
    )

    async def publish(numbers: range, gap_s: float = 0.01) -> None:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            for n in numbers:  # each confirmed by the broker before the next
                await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                await asyncio.sleep(gap_s)

    def publish_sync(numbers: range) -> None:
        with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
            for n in numbers:
                at_a.publish({"event_type": event_type, "attributes": {"n": n}})

    async def subscribe_e2e() -> None:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            await at_a.subscribe(event_type, [("n", ">=", -1)], 1, e2e_queue, confirm="e2e")

    deployment.up()
    try:
        asyncio.run(subscribe_e2e())
        e2e.start()
        asyncio.run(_subscribe(settings, topology, event_type, queue))  # probes both
        eventually(lambda: -1 in handled, "the probe at the e2e subscriber", 30)
        first = threading.Thread(target=lambda: asyncio.run(publish(range(100))), daemon=True)
        first.start()
        eventually(lambda: 30 in handled, "event 30 at the e2e subscriber", 30)
        stopped = time.monotonic()
        deployment.down()  # while the first 100 are still being published and routed
        took_down = time.monotonic() - stopped
        before = len({n for n in handled if n >= 0})  # the rest was on its way at the stop
        first.join(30)
        publish_sync(range(100, 200))  # no role runs
        started = time.monotonic()
        deployment.up()
        took_up = time.monotonic() - started
        asyncio.run(publish(range(200, EVENTS)))
        got = asyncio.run(_collect(settings, queue, EVENTS))
        eventually(
            lambda: set(range(EVENTS)) <= set(handled), "all at the e2e one", 30, strict=False
        )
        time.sleep(1.0)  # late duplicates show here
    finally:
        stop.set()
        deployment.down()
    e2e.join(10)
    counts = Counter(n for n in handled if n >= 0)
    print(
        f"\ndown in {took_down:.1f} s ({before} of 100 handled e2e by then), up again in"
        f" {took_up:.1f} s; {len(got)} of {EVENTS}"
        f" at the broker-confirmed subscriber, {len(counts)} at the e2e one"
    )
    missing = sorted(set(range(EVENTS)) - got)
    assert not missing, f"{len(missing)} events lost: {missing[:20]}"
    missing_e2e = sorted(set(range(EVENTS)) - set(counts))
    assert not missing_e2e, f"{len(missing_e2e)} lost at the e2e subscriber: {missing_e2e[:20]}"
    twice = sorted(n for n, k in counts.items() if k > 1)
    assert not twice, f"the e2e handler was given {len(twice)} twice: {twice[:20]}"
