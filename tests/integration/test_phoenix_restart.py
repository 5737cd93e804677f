"""A whole deployment stopped and started again (how a deployment is upgraded when its
roles' messages changed, docs/phoenix.md "Upgrading a deployment") loses no event: the
ones published before the stop, in flight at it, while no role runs (the brokers take
them into the entry router's inbox) and after the start all reach the subscriber.

Real role processes stopped by ``phoenix down`` (SIGTERM by PID) and started by ``up``;
the events counted in the test's own subscriber queue."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from tests.integration.test_phoenix_quiet_beats import _collect
from tests.integration.test_phoenix_recovery import _deployment, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]


def test_a_deployment_stopped_and_started_again_loses_no_event(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {}}
    )
    queue = f"{name}.sub"

    async def publish(numbers: range, gap_s: float = 0.01) -> None:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            for n in numbers:  # each confirmed by the broker before the next
                await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                await asyncio.sleep(gap_s)

    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        asyncio.run(publish(range(100)))
        stopped = time.monotonic()
        deployment.down()  # at once: the last events are still on their way
        took_down = time.monotonic() - stopped
        asyncio.run(publish(range(100, 200)))  # no role runs
        started = time.monotonic()
        deployment.up()
        took_up = time.monotonic() - started
        asyncio.run(publish(range(200, 300)))
        got = asyncio.run(_collect(settings, queue, 300))
    finally:
        deployment.down()
    print(f"\ndown in {took_down:.1f} s, up again in {took_up:.1f} s; {len(got)} of 300 got")
    missing = sorted(set(range(300)) - got)
    assert not missing, f"{len(missing)} events lost: {missing[:20]}"
