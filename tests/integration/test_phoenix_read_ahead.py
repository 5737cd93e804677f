"""A leave whose subscriptions were read ahead: when a router suspects a cluster (a flood
for it found no way), the successor's match master reads the cluster's subscriptions at
once, so that a leave declared later finds them read. A subscription confirmed between
that read and the leave must be restored too: the read is checked against the store's
fingerprint at the leave, and done again when it changed.

Three clusters, every inter-cluster link through a fault proxy. The links into C are cut
until the successor reports a read ahead, then healed; a subscription for a type C owns
is made at A and confirmed; then C leaves (its roles SIGKILLed, its links cut). Events of
that type published at A afterwards must reach the subscriber queue, counted there by
the test. On a slow machine this happened at start-up: the neighbour checks failed
before every role was up, the read ahead found no subscription, and the leave ten
seconds later restored none of the five C had by then."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from qosmq_bench.phoenix_recovery import _serving
from tests.integration.phoenix_support import (
    event,
    eventually,
    owned_by,
    proxied,
    role_metrics,
    sample,
    until_delivered,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
GONE = "C"
SUCCESSOR = ChordRing(CLUSTERS).successors(GONE, 1)[0]
EVENT_TYPE = owned_by(CLUSTERS, GONE, "ahead")


def _outcome(deployed, role: RoleId, outcome: str) -> float:
    value = sample(role_metrics(deployed, role), "qosmq_phoenix_events_total", outcome=outcome)
    return value or 0.0


def test_a_subscription_made_after_the_read_ahead_is_restored_at_the_leave(
    settings, brokers, tmp_path, name, monkeypatch
) -> None:
    monkeypatch.setenv("QOSMQ_METRICS_PORT", "0")  # each role process: a free port
    queue = f"{name}.subscriber"
    deploying = proxied(
        tmp_path / "deployment",
        name,
        brokers.urls,
        CLUSTERS,
        routing_slaves=0,
        match_slaves=1,
        # the cut below makes C suspected, never gone: only the leave does that
        fields={"leave_after_s": 10.0},
    )
    with deploying as (deployment, proxies):
        phoenix = deployment.phoenix()
        master = RoleId.match(SUCCESSOR, 0)
        into = [proxy for (_, to), proxy in proxies.items() if to == GONE]
        for proxy in into:
            proxy.cut()
        try:  # a router suspects C: the successor reads C's subscriptions now
            eventually(
                lambda: _outcome(phoenix, master, "prepared") >= 1,
                f"read ahead of {GONE}'s subscriptions at {master}",
                timeout=8.0,
                interval=0.25,
            )
        finally:
            for proxy in into:
                proxy.heal()

        async def subscribe() -> None:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployment.topology, cluster="A")
                await at_a.subscribe(EVENT_TYPE, [("v", ">=", 0)], 1, queue, wait_s=60)

        asyncio.run(subscribe())  # confirmed by C's match master, after the read

        for role, (_, pid) in _serving(phoenix).items():  # C leaves
            if role.cluster == GONE:
                os.kill(pid, signal.SIGKILL)
        for (a, b), proxy in proxies.items():
            if GONE in (a, b):
                proxy.cut()

        async def delivered() -> list:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=deployment.topology, cluster="A")
                got = await until_delivered(
                    client,
                    queue,
                    lambda k: at_a.publish(event(EVENT_TYPE, v=k, n=f"after{k}")),
                    f"event of {GONE}'s type after {GONE} left",
                    seconds=90.0,
                )
                await client.delete_queue(queue)
                return got

        assert asyncio.run(delivered())
        assert _outcome(phoenix, master, "restored") >= 1
