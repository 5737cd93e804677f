"""The Prometheus metrics of Phoenix roles (one definition each, per process)."""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Iterator

from prometheus_client import REGISTRY, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily

from ..phoenix.ids import RoleId

__all__ = [
    "DETOURS",
    "FLOOD_MESSAGES",
    "HOPS",
    "INBOX_LENGTH",
    "LEAVE_S",
    "LINKS_DOWN",
    "PREDICTED_T",
    "RECOVERY_S",
    "REROUTE_S",
    "ROLE_EVENTS",
    "served_again",
]


class RoleEvents:
    """``qosmq_phoenix_events_total``: Phoenix messages by role and outcome, counted in a
    plain dict (an add per message; a Prometheus counter's locked increment was 3-4 % of
    a loaded router's CPU, cProfile) and read when the metrics are scraped."""

    NAME = "qosmq_phoenix_events"
    HELP = "Phoenix messages by role and outcome"
    LABELS = ("cluster", "role", "outcome")

    def __init__(self) -> None:
        self.counts: defaultdict[tuple[str, str, str], float] = defaultdict(float)

    def describe(self) -> list[CounterMetricFamily]:
        return [CounterMetricFamily(self.NAME, self.HELP, labels=self.LABELS)]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self.NAME, self.HELP, labels=self.LABELS)
        for labels, value in list(self.counts.items()):
            family.add_metric(labels, value)
        yield family


ROLE_EVENTS = RoleEvents()
REGISTRY.register(ROLE_EVENTS)
INBOX_LENGTH = Gauge(
    "qosmq_phoenix_inbox_length",
    "AMQP messages waiting in a role's inbox, as the broker counts them (a batch is one)",
    ["cluster", "role", "inbox"],
)
PREDICTED_T = Gauge(
    "qosmq_phoenix_predicted_seconds",
    "a match broker's predicted mean processing time T = (q + 1) / (2 mu)",
    ["cluster", "broker"],
)
RECOVERY_S = Histogram(
    "qosmq_phoenix_recovery_seconds",
    "A failed master's recovery: detection (from the last beat its slaves heard to the "
    "election's start), election (its start to the winner's win, observed by the winner) "
    "and recovery (from the last beat heard to the winner serving the master's role)",
    ["cluster", "kind", "phase"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0),
)
LEAVE_S = Histogram(
    "qosmq_phoenix_leave_recovery_seconds",
    "a departed cluster's arc taken over: from the leave to every match master restored",
    ["cluster"],
    buckets=(0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0),
)
HOPS = Histogram(
    "qosmq_phoenix_hops",
    "ring hops of delivered events",
    ["cluster"],
    buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
)

# a routing master's links to other clusters (detours.py)
LINKS_DOWN = Gauge(
    "qosmq_phoenix_links_down", "links to other clusters a routing master found down", ["cluster"]
)
DETOURS = Gauge(
    "qosmq_phoenix_detours", "clusters a routing master reaches over a detour now", ["cluster"]
)
FLOOD_MESSAGES = PromCounter(
    "qosmq_phoenix_flood_messages_total",
    "PROBE and FOUND messages a routing master sent",
    ["cluster"],
)
REROUTE_S = Histogram(
    "qosmq_phoenix_reroute_seconds",
    "from a link's failed send to the detour its flood found",
    ["cluster"],
    buckets=(0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0),
)


def served_again(role: RoleId, failed_at: float, began: float, prepared: float) -> None:
    """An elected master serves: how long after its predecessor's last beat (monotonic
    times: ``began`` this role, ``prepared`` its tables read back)."""
    now = time.monotonic()
    took = now - failed_at
    RECOVERY_S.labels(role.cluster, role.kind.value, "recovery").observe(took)
    logging.getLogger("middleware.routing.serving").warning(
        "%s served again %.2f s after its last beat (this role began %.3f s, "
        "tables read back %.3f s, inboxes consumed %.3f s after it)",
        role,
        took,
        began - failed_at,
        prepared - failed_at,
        now - failed_at,
    )
