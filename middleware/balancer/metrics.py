"""Prometheus series of the balanced publishers (process-wide)."""

from prometheus_client import Counter, Gauge

BALANCED_TIMEOUTS = Counter(
    "qosmq_balancer_publish_timeouts_total",
    "balanced publishes not confirmed within publish_timeout (ConfirmTimeout)",
    ["topic"],
)
BALANCED_MISSING = Gauge(
    "qosmq_balancer_missing_replicas", "replicas a publisher leaves out (queue gone)", ["topic"]
)
BALANCED_STALLED = Gauge(
    "qosmq_balancer_stalled_replicas",
    "replicas a publisher leaves out (a publish unconfirmed past stall_s)",
    ["topic"],
)
BALANCED_RESENT = Counter(
    "qosmq_balancer_resent_total",
    "balanced messages sent to a second replica after the first stalled (at least once)",
    ["topic"],
)
BALANCED_NACKED = Counter(
    "qosmq_balancer_nacked_total",
    "balanced publishes a replica refused (basic.nack: a full queue that rejects "
    "publishes, a leader election), sent to another replica",
    ["topic"],
)
BALANCED_REPORTS_REFUSED = Counter(
    "qosmq_balancer_reports_refused_total",
    "load reports a publisher ignored as malformed or forged",
    ["topic"],
)
