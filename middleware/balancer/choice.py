"""What a balanced publisher decides, without I/O: which replica takes the next
message, what a load report changes, which replicas are left out (gone, stalled) and
when they come back.  Both faces hold one (``BalancedPublisher`` on the asyncio core,
``SyncBalancedPublisher`` on pika) and only send and receive (STYLE: one core, two
thin faces)."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import Counter
from typing import TypedDict

from ..errors import EntityNotFound, InvalidArgument, MiddlewareError, Unroutable
from . import metrics
from .factors import (
    ALGORITHMS,
    PredictiveChooser,
    ReplicaReport,
    WeightedPicker,
    inverse_factors,
    paper_factors,
)
from .reports import LoadReport, replica_names

__all__ = ["Choice", "ChoiceOptions"]

log = logging.getLogger(__name__)


class ChoiceOptions(TypedDict, total=False):
    """What a publisher of either face passes on to its ``Choice``."""

    algorithm: str  # one of ALGORITHMS (default predictive)
    stale_after: float | None  # default: 3 x the report period
    rng: random.Random | None
    recheck_s: float  # how often a missing replica is looked for (default 1 s)
    stall_s: float  # how long an unconfirmed publish waits before it stalls (3 s)


class Choice:
    """The replicas of one topic and the state the choice among them keeps.

    Reports older than ``stale_after`` (default 3 x the report period) are ignored: the
    choice falls back to equal weights (round robin) until a fresh report arrives.  A
    replica whose queue is gone (``gone``) or that did not confirm within ``stall_s``
    (``stall``) leaves the choice until it is ``back`` or ``unstall``-ed; one that
    refused a publish (``nacked``: a full queue with ``reject-publish``) leaves it for
    ``recheck_s``.  A stalled or refusing one is still chosen when no other is left."""

    def __init__(
        self,
        *,
        topic: str,
        replicas: int,
        algorithm: str = "predictive",
        stale_after: float | None = None,
        rng: random.Random | None = None,
        recheck_s: float = 1.0,
        stall_s: float = 3.0,
    ) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose from {ALGORITHMS}")
        if not stall_s > 0:
            raise InvalidArgument(f"stall_s must be > 0, got {stall_s!r}")
        self.topic, self.algorithm = topic, algorithm
        self.queues = replica_names(topic, replicas)
        self.stale_after = stale_after
        self.rng = rng or random.Random()
        self.recheck_s, self.stall_s = recheck_s, stall_s
        self.stalled: set[int] = set()  # replicas with a publish unconfirmed past stall_s
        self._stalls: Counter[int] = Counter()  # per replica: its publishes still stalled
        self.resent = 0  # messages sent to a second replica after a stall
        self.nacked = 0  # publishes a replica refused (sent to another)
        self._refusing: dict[int, float] = {}  # replica: until when it is left out
        self.chooser = PredictiveChooser(replicas, self.rng)
        self.picker: WeightedPicker | None = None
        self.report: LoadReport | None = None
        self.received_at = 0.0
        self.routed = [0] * replicas
        self.fallbacks = 0
        self.missing: set[int] = set()  # replicas whose queue is gone
        self.returned = 0  # publishes a missing replica returned (sent again elsewhere)
        self.reports_refused = 0
        self._rr = 0
        self._factors: list[float] | None = None

    # ------------------------------------------------------------- choosing
    def choose(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """A replica by the algorithm, among the live ones not in ``exclude``;
        ``Unroutable`` when none is left."""
        blocked = self.missing | exclude
        allowed = [i for i in range(len(self.queues)) if i not in blocked]
        now = time.monotonic()
        if self._refusing:
            self._refusing = {i: t for i, t in self._refusing.items() if t > now}
        if live := [i for i in allowed if i not in self.stalled and i not in self._refusing]:
            allowed = live  # (a stalled or refusing replica only when no other is left)
        if not allowed:
            raise Unroutable(
                f"topic {self.topic!r}: no replica can take the message "
                f"(missing: {', '.join(self.queues[i] for i in sorted(self.missing)) or '-'})"
            )
        stale = self.report is None or (
            self.stale_after is not None and now - self.received_at > self.stale_after
        )
        if stale and self.algorithm == "predictive" and self.report is not None:
            # forget the stale lengths: choices on own counts alone spread evenly
            self.chooser.reports = [None] * len(self.queues)
            self.fallbacks += 1
        if self.algorithm == "round_robin" or (stale and self.algorithm != "predictive"):
            if self.algorithm != "round_robin":
                self.fallbacks += 1
            index = allowed[self._rr % len(allowed)]
            self._rr += 1
        elif self.algorithm == "predictive":
            index = self.chooser.choose(now, allowed)
        else:
            index = self._pick(allowed)
        self.routed[index] += 1
        return index

    def choosable(self, tried: set[int]) -> bool:
        """Whether a replica not in ``tried`` can still be chosen."""
        blocked = self.missing | tried
        return any(i not in blocked for i in range(len(self.queues)))

    def _pick(self, allowed: list[int]) -> int:
        """The weighted pick over the live replicas (a blocked one weighs 0)."""
        if len(allowed) == len(self.queues) and self.picker is not None:
            return self.picker.pick()
        factors = self._factors or [1.0] * len(self.queues)
        weights = [factors[i] if i in allowed else 0.0 for i in range(len(self.queues))]
        if not any(weights):
            return allowed[self.rng.randrange(len(allowed))]
        return WeightedPicker(weights, self.rng).pick()

    def resending(self) -> None:
        """A message goes to a second replica after its first stalled."""
        self.resent += 1
        metrics.BALANCED_RESENT.labels(self.topic).inc()

    # ------------------------------------------------------ left out, back
    def refused(self, index: int) -> None:
        """``index`` answered a publish with ``basic.nack`` (the broker did not take
        it: a full queue that rejects publishes): out of the choice for ``recheck_s``,
        and the message goes to another replica."""
        self.nacked += 1
        metrics.BALANCED_NACKED.labels(self.topic).inc()
        if index not in self._refusing:
            queue, left_out = self.queues[index], self.recheck_s
            log.info("replica %s refused a publish: left out for %g s", queue, left_out)
        self._refusing[index] = time.monotonic() + self.recheck_s

    def stall(self, index: int) -> None:
        """A publish to ``index`` was not confirmed within ``stall_s``: the replica
        leaves the choice until every such publish ended (``unstall``)."""
        self._stalls[index] += 1
        if index not in self.stalled:
            self.stalled.add(index)
            metrics.BALANCED_STALLED.labels(self.topic).set(len(self.stalled))
            log.warning(
                "replica %s confirmed nothing within %g s: left out until it does",
                self.queues[index],
                self.stall_s,
            )

    def unstall(self, index: int) -> None:
        """One stalled publish to ``index`` ended (confirmed or failed)."""
        if self._stalls[index] > 0:
            self._stalls[index] -= 1
        if index in self.stalled and self._stalls[index] == 0:
            self.stalled.discard(index)
            metrics.BALANCED_STALLED.labels(self.topic).set(len(self.stalled))
            log.warning("replica %s answers again: chosen again", self.queues[index])

    def gone(self, index: int) -> None:
        """``index``'s queue returned a publish (or does not exist): out of the choice."""
        self.returned += 1
        if index not in self.missing:
            self.missing.add(index)
            metrics.BALANCED_MISSING.labels(self.topic).set(len(self.missing))
            log.warning(
                "replica %s is gone: left out until its queue exists again", self.queues[index]
            )

    def back(self, index: int) -> None:
        """``index``'s queue exists again: chosen again."""
        if index in self.missing:
            self.missing.discard(index)
            metrics.BALANCED_MISSING.labels(self.topic).set(len(self.missing))
            log.warning("replica %s exists again: chosen again", self.queues[index])

    def rechecked(self, index: int, error: MiddlewareError | None) -> None:
        """A missing replica's queue looked for (a passive declare): ``error`` None, it
        exists again (``back``); ``EntityNotFound``, still gone; another error, not
        known either way (looked at again at the next recheck)."""
        if error is None:
            self.back(index)
        elif not isinstance(error, EntityNotFound):
            log.debug("replica %s not checked: %s", self.queues[index], error)

    # -------------------------------------------------------------- reports
    def take_report(self, body: bytes) -> bool:
        """A load report's body taken into the choice; False (counted, logged) for one
        that is malformed or names other replicas."""
        try:
            report = LoadReport.decode(body)
            lengths = {r.queue: r for r in report.replicas}
            if set(lengths) != set(self.queues):
                raise InvalidArgument(f"report for {report.topic} names other replicas")
            ordered = [lengths[q] for q in self.queues]
            factors: list[float] = (
                list(map(float, paper_factors([r.length for r in ordered])))
                if self.algorithm == "paper"
                else inverse_factors([r.length for r in ordered])
            )
        except InvalidArgument as exc:
            self.reports_refused += 1
            metrics.BALANCED_REPORTS_REFUSED.labels(self.topic).inc()
            log.warning("load report ignored: %s", exc)
            return False
        now = time.monotonic()
        self.report, self.received_at = report, now
        if self.stale_after is None:
            self.stale_after = 3 * report.period_s
        for i, r in enumerate(ordered):
            self.chooser.report(i, ReplicaReport(r.length, r.arrival_rate, r.service_rate, now))
            if r.exists:
                self.back(i)
            elif i not in self.missing:
                self.gone(i)
                self.returned -= 1  # reported, not returned
        self._factors = factors
        with contextlib.suppress(ValueError):
            self.picker = WeightedPicker(factors, self.rng)
        return True
