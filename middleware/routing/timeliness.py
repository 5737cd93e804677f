"""Timeliness (paper 000 §3): latency levels between clusters, predicted waits inside one.

Pure functions and small state objects.

Between clusters: subscribers give a latency level 1..L per event type (smaller =
more urgent); a routing master keeps latencyMap: event type -> (level sum,
count); the mean level sets the event's AMQP priority on the forwarding path.

Inside a cluster: each match broker counts arrivals NA and completions NC over a
window t: a = NA/t, mu = NC/t; predicts its queue q(t) = max(0, q(t') + (a - mu)(t - t'));
message i waits (i - 1)/mu and takes 1/mu, so the mean processing time is
T(t) = (q(t) + 1) / (2 mu).  The master sends each event to the broker with the
smallest T (itself included).  Without it the master takes turns over itself and
its slaves (round robin, blind to load), as the paper's base system "matches an
event locally or sends it to the master's slaves".

NC/t is the service *rate* only while the broker is saturated; at light load it is
the arrival rate, which makes an idle broker look slow (T = 1/(2a)).  A broker that
reports when it starts and ends each event (``arrived(now=…)``/``completed(now=…)``)
gets mu = NC / (time it was busy in the window): its capacity, as the model means.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..phoenix.protocol import MAX_PRIORITY

__all__ = [
    "Dispatch",
    "LatencyMap",
    "QueuePredictor",
    "QuietReads",
    "RemoteBroker",
    "choose_broker",
    "mean_processing_time",
    "predicted_queue",
    "round_robin",
]

T_ = TypeVar("T_")


@dataclass
class LatencyMap:
    """eventType -> (level sum, count); levels 1 (most urgent) .. ``levels``."""

    levels: int = 5
    entries: dict[str, tuple[int, int]] = field(default_factory=dict)

    def add(self, event_type: str, level: int) -> None:
        if not 1 <= level <= self.levels:
            raise ValueError(f"latency level must be 1..{self.levels}, got {level}")
        total, count = self.entries.get(event_type, (0, 0))
        self.entries[event_type] = (total + level, count + 1)

    def remove(self, event_type: str, level: int) -> None:
        """Take one subscription's level out (an unknown type is left alone: a router
        that joined after the subscription passed never counted it)."""
        if event_type not in self.entries:
            return
        total, count = self.entries[event_type]
        if count <= 1:
            del self.entries[event_type]
        else:
            self.entries[event_type] = (max(count - 1, total - level), count - 1)

    def mean_level(self, event_type: str) -> float | None:
        total, count = self.entries.get(event_type, (0, 0))
        return total / count if count else None

    def priority(self, event_type: str) -> int:
        """AMQP priority 0..9: mean level 1 -> 9, mean level L -> 0; unknown -> 0."""
        mean = self.mean_level(event_type)
        if mean is None:
            return 0
        if self.levels == 1:
            return MAX_PRIORITY
        return round(MAX_PRIORITY * (self.levels - mean) / (self.levels - 1))


def predicted_queue(
    q_prev: float, arrival_rate: float, service_rate: float, elapsed: float
) -> float:
    """q(t) = max(0, q(t') + (a - mu)(t - t'))."""
    return max(0.0, q_prev + (arrival_rate - service_rate) * elapsed)


def mean_processing_time(queue: float, service_rate: float) -> float:
    """T = (q + 1) / (2 mu).

    Undefined in the paper for mu = 0; here: an idle broker with no measured rate
    (q = 0) has T = 0, so it gets work and a measurement; a backlog with nothing
    served (q > 0) has T = infinity.
    """
    if service_rate <= 0:
        return 0.0 if queue <= 0 else math.inf
    return (queue + 1) / (2 * service_rate)


def choose_broker(predicted: Mapping[str, float]) -> str:
    """The broker with the smallest predicted T (ties: the first name in sorted order)."""
    if not predicted:
        raise ValueError("no broker to choose from")
    return min(sorted(predicted), key=lambda b: predicted[b])


def round_robin(brokers: Sequence[T_], turn: int) -> tuple[T_, int]:
    """The broker whose turn it is and the next turn (dispatch blind to load)."""
    if not brokers:
        raise ValueError("no broker to choose from")
    return brokers[turn % len(brokers)], (turn + 1) % len(brokers)


@dataclass
class QueuePredictor:
    """One match broker's window counters and its predicted T."""

    window_s: float = 1.0
    arrivals: int = 0
    completions: int = 0
    queue: float = 0.0
    arrival_rate: float = 0.0
    service_rate: float = 0.0
    last_close: float = 0.0
    in_progress: int = 0
    busy_s: float = 0.0  # time with at least one event in progress, this window
    busy_since: float | None = None

    @property
    def quiet(self) -> bool:
        """Nothing arrived, finished or was in progress this window."""
        return not (self.arrivals or self.completions or self.busy_s or self.in_progress)

    def arrived(self, n: int = 1, *, now: float | None = None) -> None:
        self.arrivals += n
        if now is not None:
            if self.in_progress == 0:
                self.busy_since = now
            self.in_progress += n

    def completed(self, n: int = 1, *, now: float | None = None) -> None:
        self.completions += n
        if now is not None and self.in_progress > 0:
            self.in_progress -= n
            if self.in_progress <= 0 and self.busy_since is not None:
                self.in_progress = 0
                self.busy_s += now - self.busy_since
                self.busy_since = None

    def close_window(self, now: float, observed_queue: float | None = None) -> float:
        """End the window at ``now``: update a, mu and q; return T.

        ``observed_queue``: the queue as measured now (the events waiting in the broker),
        when the broker can see it; it replaces the predicted q, which then runs forward
        from it until the next window.
        """
        elapsed = now - self.last_close if self.last_close else self.window_s
        if elapsed <= 0:
            raise ValueError("windows must move forward in time")
        if self.busy_since is not None:  # still busy: count the window's share
            self.busy_s += now - max(self.busy_since, now - elapsed)
            self.busy_since = now
        self.arrival_rate = self.arrivals / elapsed
        if self.busy_s > 0 and self.completions:
            self.service_rate = self.completions / min(self.busy_s, elapsed)  # capacity
        elif self.busy_s > 0:  # busy, nothing finished: at most one per busy time
            self.service_rate = min(self.service_rate or math.inf, 1 / self.busy_s)
        elif self.completions or self.arrivals:  # an idle window keeps the last measured mu
            self.service_rate = self.completions / elapsed
        self.busy_s = 0.0
        self.queue = (
            predicted_queue(self.queue, self.arrival_rate, self.service_rate, elapsed)
            if observed_queue is None
            else max(0.0, observed_queue)
        )
        self.arrivals = self.completions = 0
        self.last_close = now
        return mean_processing_time(self.queue, self.service_rate)

    def predicted_queue(self, now: float) -> float:
        """q at ``now`` between windows, extrapolated with the last rates."""
        elapsed = max(0.0, now - self.last_close)
        return predicted_queue(self.queue, self.arrival_rate, self.service_rate, elapsed)

    def predict(self, now: float) -> float:
        """T at ``now`` between windows, extrapolating q with the last rates."""
        elapsed = max(0.0, now - self.last_close)
        q = predicted_queue(self.queue, self.arrival_rate, self.service_rate, elapsed)
        return mean_processing_time(q, self.service_rate)


@dataclass
class RemoteBroker:
    """A master's view of one slave: its last report (q, mu) plus the events the
    master sent it since, so a 0.5 s old report does not send it every event of the
    next 0.5 s (herding): q(t) = max(0, q_report + sent - mu (t - t_report))."""

    queue: float = 0.0
    service_rate: float = 0.0
    reported_at: float = 0.0
    sent: int = 0

    def report(self, queue: float, service_rate: float, now: float) -> None:
        self.queue, self.service_rate, self.reported_at, self.sent = (
            queue,
            service_rate,
            now,
            0,
        )

    def predict(self, now: float) -> float:
        q = predicted_queue(
            self.queue + self.sent, 0.0, self.service_rate, max(0.0, now - self.reported_at)
        )
        return mean_processing_time(q, self.service_rate)


@dataclass
class Dispatch:
    """A match master's choice of broker for each event (the inner mechanism), pure.

    ``choose``: None for itself, else the live slave with the smallest fresh predicted
    T.  A master with nothing waiting keeps the event (no broker can start it sooner); a
    backlogged one compares T, a slave's T counting the hop to it (the measured cost of a
    dispatch), and sends the event where it finishes soonest.  ``choose_blind`` (inner
    off): the next of the master and its live slaves in turn (``round_robin``), or the
    master every time (``mode="master"``).  ``live`` is what the failure detector says;
    a slave that sent no load report yet gets nothing.
    """

    slaves: dict[int, RemoteBroker] = field(default_factory=dict)
    hop_s: float = 0.0  # moving mean of one dispatch to a slave (publish + confirm)
    turn: int = 0  # round robin's position

    def reported(self, slave: int, queue: float, service_rate: float, now: float) -> None:
        self.slaves.setdefault(slave, RemoteBroker()).report(queue, service_rate, now)

    def dispatched(self, slave: int, took_s: float) -> None:
        """An event sent to ``slave``; the send took ``took_s``."""
        self.slaves[slave].sent += 1
        self.hop_s = took_s if not self.hop_s else 0.9 * self.hop_s + 0.1 * took_s

    def reporting(self, live: Iterable[int]) -> list[int]:
        return sorted(j for j in live if j in self.slaves)

    def choose(self, own: QueuePredictor, live: Iterable[int], now: float) -> int | None:
        if own.predicted_queue(now) < 1:
            return None
        predicted = {"self": own.predict(now)}
        for j in self.reporting(live):
            predicted[f"slave-{j}"] = self.slaves[j].predict(now) + self.hop_s
        chosen = choose_broker(predicted)
        return None if chosen == "self" else int(chosen.split("-")[1])

    def choose_blind(self, live: Iterable[int], mode: str = "round_robin") -> int | None:
        if mode == "master":
            return None
        chosen, self.turn = round_robin([None, *self.reporting(live)], self.turn)
        return chosen


@dataclass
class QuietReads:
    """Whether a periodic read of an inbox's backlog from the broker (a passive declare,
    a round trip) is worth making now, pure; a match slave's load report goes with it.

    An inbox whose last read found nothing waiting, and to which nothing was delivered
    since, holds nothing now: its consumer has room, and the broker hands a consumer
    with room what is ready within a round trip.  Such a read is skipped, and so is the
    report it would feed (the master's view of the slave, q = 0, is still right; an
    event the master sends the slave arrives, and the next window reads and reports).
    ``keepalive``: every so many windows one read is made anyway, so a consumer the
    broker stopped feeding without a word shows its backlog within ``keepalive``
    windows.  An idle deployment of 18 roles made 27 such reads and 12 reports a second
    before (docs/results.md, 2026-11-29, "Phoenix idle: quiet inboxes are not read every
    window").
    """

    keepalive: int = 10
    skipped: int = 0
    last: float | None = None  # what the last read found (None: never read, or failed)

    def due(self, active: bool) -> bool:
        """``active``: something was delivered, handled or held since the last read."""
        if active or self.last is None or self.last > 0 or self.skipped + 1 >= self.keepalive:
            self.skipped = 0
            return True
        self.skipped += 1
        return False

    def read(self, backlog: float | None) -> None:
        self.last = backlog
