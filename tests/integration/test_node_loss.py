"""Confirm modes through a lost RabbitMQ node: e2e confirms go on while it is down.

Each scenario runs the node-loss benchmark's three workloads side by side (e2e on the
asyncio and on the sync publisher over a fanout to three quorum queues, and publisher
confirms to a quorum queue), kills (or gracefully stops) a node for longer than
``receipt_timeout`` and counts
every publish and every delivery itself.  Before the watched channel, no e2e message
reached a consumer until the killed node was back: the first confirm came after the
restart and publishes failed with ``ReceiptTimeout``.
"""

from __future__ import annotations

import asyncio

import pytest

from qosmq_bench.node_loss import run_node_loss

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]

DOWN_S = 8.0  # longer than the receipt timeout below


@pytest.mark.parametrize(
    ("scenario", "fault"),
    [
        ("publisher-node", "kill"),
        ("leader-node", "kill"),
        ("two-nodes", "kill"),
        ("publisher-node", "stop"),  # a graceful stop, as a rolling restart does
    ],
)
def test_e2e_confirms_go_on_while_a_node_is_down(scenario, fault, settings, local_cluster) -> None:
    fast = settings.model_copy(
        update={"confirms": settings.confirms.model_copy(update={"receipt_timeout": 5.0})}
    )
    rows = asyncio.run(
        run_node_loss(
            local_cluster,
            fast,
            scenario=scenario,
            rate=20,
            down_s=DOWN_S,
            warmup_s=3,
            after_s=3,
            fault=fault,
        )
    )
    by = {(r["workload"], r["phase"]): r for r in rows}
    for row in rows:
        assert row["errors"] == {}, row  # no ReceiptTimeout, no publish failed
        assert row["confirmed"] == row["published"], row
        if row["phase"].startswith("outage"):
            # confirmed while the node was still down, not after it came back
            assert row["first_confirm_s"] is not None, row
            assert row["first_confirm_s"] < DOWN_S - 2, row
            assert row["longest_gap_s"] < DOWN_S - 2, row
    for workload in ("e2e-async", "e2e-sync", "broker-async"):
        assert by[(workload, "after")]["lost"] == 0
