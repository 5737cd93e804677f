"""Replica arrival and service rates from the rabbitmq_prometheus counters (pure).

RabbitMQ 4.0 deprecated the management metrics (``message_stats`` rates) the sidecar
read on 3.x; the Prometheus plugin's detailed endpoint keeps the counters they were
made of.  Per queue:

* **arrival**: ``rabbitmq_detailed_queue_messages_published_total`` (family
  ``channel_queue_exchange_metrics``; one series per publishing channel and exchange);
* **service**: ``rabbitmq_detailed_channel_messages_acked_total`` plus
  ``rabbitmq_detailed_channel_messages_delivered_total`` (automatic acknowledgement)
  (family ``channel_queue_metrics``; one series per consuming channel).

Every node counts only its own channels, so the sidecar reads every node and this module
sums.  The counters are per channel: a channel that closes takes its series away, one
that opens brings a new one.  A rate is therefore the sum of per-series increases
between two scrapes of the same node, never the difference of two sums (a closed
channel would read as a negative rate).  A series new since the older scrape counts from
zero; one of a node that did not answer then is skipped (its baseline is unknown).  The
channels publish their counters every ``collect_statistics_interval`` (5 s by default),
so :class:`RateWindow` measures over a window of about 10 s, as the management API's
rates are smoothed over its samples.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["FAMILIES", "RateWindow", "Scrape", "parse_scrape", "scrape_path"]

PUBLISHED = "rabbitmq_detailed_queue_messages_published_total"
ACKED = "rabbitmq_detailed_channel_messages_acked_total"
DELIVERED_NO_ACK = "rabbitmq_detailed_channel_messages_delivered_total"
FAMILIES = ("channel_queue_exchange_metrics", "channel_queue_metrics")

# (node, queue, what, series) -> value; what: "in" or "out"
Key = tuple[str, str, str, str]


def scrape_path(vhost: str) -> str:
    """The detailed endpoint's path for the two families, filtered to ``vhost``."""
    families = "".join(f"&family={f}" for f in FAMILIES)
    return f"/metrics/detailed?vhost={quote(vhost, safe='')}{families}"


@dataclass(frozen=True)
class Scrape:
    """One reading of every node: the counters of the queues asked for, by series, and
    which nodes answered."""

    at: float
    values: dict[Key, float]
    nodes: frozenset[str]


def parse_scrape(
    at: float, texts: dict[str, str | Exception], queues: Iterable[str], vhost: str
) -> Scrape:
    """The counters of ``queues`` in ``vhost`` from each node's text (an exception: the
    node did not answer).  Text that is not the exposition format counts as no answer."""
    wanted = set(queues)
    values: dict[Key, float] = {}
    answered = set()
    for node, text in texts.items():
        if isinstance(text, Exception):
            continue
        try:
            found = _node_values(node, text, wanted, vhost)
        except ValueError:
            continue
        values.update(found)
        answered.add(node)
    return Scrape(at, values, frozenset(answered))


def _node_values(node: str, text: str, wanted: set[str], vhost: str) -> dict[Key, float]:
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == PUBLISHED:
                what, queue_vhost = "in", sample.labels.get("queue_vhost")
            elif sample.name in (ACKED, DELIVERED_NO_ACK):
                what, queue_vhost = "out", sample.labels.get("vhost")
            else:
                continue
            queue = sample.labels.get("queue", "")
            if queue not in wanted or queue_vhost != vhost:
                continue
            series = "|".join(
                (sample.name, sample.labels.get("channel", ""), sample.labels.get("exchange", ""))
            )
            out[(node, queue, what, series)] = float(sample.value)
    return out


def increases(old: Scrape, new: Scrape) -> dict[tuple[str, str], float]:
    """(queue, "in"/"out") -> how much the counters grew from ``old`` to ``new``."""
    out: dict[tuple[str, str], float] = {}
    for key, value in new.values.items():
        node, queue, what, _ = key
        before = old.values.get(key)
        if before is None:
            if node not in old.nodes:
                continue  # that node did not answer then: no baseline
            before = 0.0  # a channel (or its first message) since the older scrape
        grown = value - before
        if grown > 0:
            out[(queue, what)] = out.get((queue, what), 0.0) + grown
    return out


@dataclass
class RateWindow:
    """Scrapes over the last ``span_s`` seconds, and the rates they show."""

    span_s: float = 10.0
    scrapes: deque[Scrape] = field(default_factory=deque)

    def add(self, scrape: Scrape) -> None:
        self.scrapes.append(scrape)
        while len(self.scrapes) > 2 and scrape.at - self.scrapes[1].at >= self.span_s:
            self.scrapes.popleft()

    def rates(self) -> dict[str, tuple[float, float]]:
        """queue -> (arrival, service) per second over the window; empty until two
        scrapes are apart."""
        if len(self.scrapes) < 2:
            return {}
        old, new = self.scrapes[0], self.scrapes[-1]
        elapsed = new.at - old.at
        if elapsed <= 0:
            return {}
        out: dict[str, tuple[float, float]] = {}
        for (queue, what), grown in increases(old, new).items():
            arrival, service = out.get(queue, (0.0, 0.0))
            if what == "in":
                arrival += grown / elapsed
            else:
                service += grown / elapsed
            out[queue] = (arrival, service)
        return out

    def published(self) -> dict[str, float]:
        """queue -> messages published by the channels open at the newest scrape."""
        if not self.scrapes:
            return {}
        out: dict[str, float] = {}
        for (_, queue, what, _), value in self.scrapes[-1].values.items():
            if what == "in":
                out[queue] = out.get(queue, 0.0) + value
        return out
