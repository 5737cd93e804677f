"""Prometheus metrics of the transport (process-wide, served by observability's endpoint)."""

from prometheus_client import Counter

PUBLISHED = Counter("qosmq_published_total", "messages published", ["kind"])
DELIVERIES = Counter("qosmq_deliveries_total", "deliveries settled by handlers", ["outcome"])
RECONNECTS = Counter("qosmq_failovers_total", "connections re-established after a loss")
