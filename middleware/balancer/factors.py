"""Load factors for weighted dispatch over queue replicas (paper 001), and better ones.

Pure functions and small state objects; no I/O.  Inputs are each replica's
average waiting-queue length over the last report period (``b_n``).

``paper`` - the paper's algorithm exactly (§3.1):
  1. c = gcd(b_1 … b_n); T_n = b_n / c.
  2. sort the (replica, T) pairs by T ascending; hand the T values back in
     descending order, so the shortest queue gets the largest T.  That T is L_n.

  Edge cases, defined here because the paper does not:
  * non-integer averages are rounded half-up to integers first (the paper's
    B_n are sums of integer samples; averaging makes them fractional);
  * all zero (or all rounding to zero): every replica gets factor 1;
  * one or more zeros: gcd(0, x) = x, so an empty replica has T = 0, ranks
    first and receives the largest T; the *longest* replica receives the
    smallest T, which is 0 when any replica is empty - it gets no messages
    until the next report (literal, and the reason the better algorithms exist);
  * ties: replicas with equal T get the largest value handed to their group, so
    equal queues get equal factors.

``inverse`` - weight proportional to 1 / (1 + b_n).

``predictive`` - power of two choices on *predicted* lengths: between reports
each replica's length is extrapolated with its measured arrival and service
rates, q(t) = max(0, q(t') + (a - mu)(t - t')) (paper 000 §3), plus the
messages this publisher sent there since the report; each message goes to
the shorter of two random replicas.

``round_robin`` - no balancing (the baseline).

Dispatch for weight vectors is the paper's §3.2: a uniform random integer mod
sum(L), first prefix sum above it - by bisection, O(log R) per message.
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import InvalidArgument

__all__ = [
    "ALGORITHMS",
    "PredictiveChooser",
    "ReplicaReport",
    "WeightedPicker",
    "inverse_factors",
    "paper_factors",
]

ALGORITHMS = ("round_robin", "paper", "inverse", "predictive")


def _checked(values: Sequence[float], what: str) -> list[float]:
    """``values`` as floats, refused unless every one is finite and >= 0: a NaN or an
    infinity would pass a ``< 0`` check and turn every weight after it into noise."""
    if not values:
        raise InvalidArgument(f"{what}: need at least one replica")
    out = []
    for value in values:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise InvalidArgument(f"{what}: {value!r} is not a number") from None
        if not math.isfinite(number) or number < 0:
            raise InvalidArgument(f"{what}: {value!r} is not a finite number >= 0")
        out.append(number)
    return out


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def paper_factors(averages: Sequence[float]) -> list[int]:
    """The paper's load factors L_n for average lengths b_n (see the module docstring)."""
    b = [_round_half_up(x) for x in _checked(averages, "queue length averages")]
    if not any(b):
        return [1] * len(b)
    c = math.gcd(*b)
    t = [x // c for x in b]
    order = sorted(range(len(t)), key=lambda i: (t[i], i))
    handed = sorted((t[i] for i in order), reverse=True)
    factors = [0] * len(t)
    for value, group in itertools.groupby(range(len(order)), key=lambda pos: t[order[pos]]):
        positions = list(group)
        share = max(handed[pos] for pos in positions)
        for pos in positions:
            factors[order[pos]] = share
        del value
    return factors


def inverse_factors(averages: Sequence[float]) -> list[float]:
    """Weights proportional to 1 / (1 + b_n)."""
    return [1.0 / (1.0 + x) for x in _checked(averages, "queue length averages")]


class WeightedPicker:
    """Pick replica n with probability L_n / sum(L): the paper's §3.2, O(log R) per pick."""

    def __init__(self, weights: Sequence[float], rng: random.Random | None = None) -> None:
        checked = _checked(weights, "weights")
        if not any(checked):
            raise InvalidArgument(f"weights must have a positive sum, got {list(weights)}")
        self.weights = [int(w) if float(w).is_integer() else w for w in checked]
        self._prefix = list(itertools.accumulate(self.weights))
        self._integral = all(float(w).is_integer() for w in self.weights)
        self._rng = rng or random.Random()

    @property
    def total(self) -> float:
        return self._prefix[-1]

    def pick(self) -> int:
        if self._integral:
            i = self._rng.getrandbits(62) % int(self.total)  # uniform int mod L, as the paper
        else:
            i = self._rng.random() * self.total  # type: ignore[assignment]
        return bisect.bisect_right(self._prefix, i)


@dataclass
class ReplicaReport:
    """What the balancer sidecar reports for one replica."""

    length: float  # average waiting messages over the report period
    arrival_rate: float  # messages/s entering the replica (all publishers)
    service_rate: float  # messages/s leaving it (acked by consumers)
    at: float  # when the publisher received it (its monotonic clock)


@dataclass
class PredictiveChooser:
    """Power of two choices on predicted lengths between reports.

    predicted(n, t) = max(0, q_n + (others_n - mu_n)(t - t') + mine_n), where mine_n
    is what this publisher sent to n since the report (known exactly) and
    others_n = a_n - (this publisher's own send rate to n in the last period), so
    its own traffic is not counted twice.
    """

    replicas: int
    rng: random.Random = field(default_factory=random.Random)
    reports: list[ReplicaReport | None] = field(default_factory=list)
    sent_since: list[int] = field(default_factory=list)
    own_rate: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("need at least one replica")
        self.reports = [None] * self.replicas
        self.sent_since = [0] * self.replicas
        self.own_rate = [0.0] * self.replicas

    def report(self, index: int, report: ReplicaReport) -> None:
        previous = self.reports[index]
        if previous is not None and report.at > previous.at:
            self.own_rate[index] = self.sent_since[index] / (report.at - previous.at)
        self.reports[index] = report
        self.sent_since[index] = 0

    def predicted(self, index: int, now: float) -> float:
        r = self.reports[index]
        mine = self.sent_since[index]
        if r is None:
            return float(mine)
        others = max(0.0, r.arrival_rate - self.own_rate[index])
        elapsed = max(0.0, now - r.at)
        return max(0.0, r.length + (others - r.service_rate) * elapsed + mine)

    def choose(self, now: float, allowed: Sequence[int] | None = None) -> int:
        """The shorter predicted of two random replicas among ``allowed`` (default all)."""
        pool = range(self.replicas) if allowed is None else allowed
        if len(pool) == 1:
            chosen = pool[0]
        else:
            a, b = self.rng.sample(pool, 2)
            chosen = a if self.predicted(a, now) <= self.predicted(b, now) else b
        self.sent_since[chosen] += 1
        return chosen
