"""Replicated topics and the publisher that spreads a topic's messages over its replicas."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import Self

from ..errors import ConfirmTimeout, EntityNotFound, InvalidArgument, MiddlewareError, Unroutable
from ..settings import Settings
from ..transport import (
    AsyncClient,
    AsyncHandler,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
)
from ..transport.message import new_message_id
from . import metrics
from .factors import (
    ALGORITHMS,
    PredictiveChooser,
    ReplicaReport,
    WeightedPicker,
    inverse_factors,
    paper_factors,
)
from .reports import REPORT_EXCHANGE, LoadReport, replica_names

__all__ = ["BalancedPublisher", "declare_replicated_topic", "subscribe_replicated"]

log = logging.getLogger(__name__)


async def declare_replicated_topic(
    settings: Settings, topic: str, replicas: int, *, kind: QueueKind = QueueKind.QUORUM
) -> list[str]:
    """Declare R replica queues, replica i led by node i mod N (client-local placement)."""
    names = replica_names(topic, replicas)
    for i, name in enumerate(names):
        async with AsyncClient(settings=settings.starting_at(i)) as client:
            await client.declare_queue(QueueSpec(name, kind=kind, leader_locator="client-local"))
    return names


async def subscribe_replicated(
    client: AsyncClient,
    topic: str,
    replicas: int,
    handler: AsyncHandler,
    *,
    prefetch: int | None = None,
) -> list[str]:
    """Consume every replica of ``topic`` with ``handler``; return the consumer tags."""
    return [
        await client.consume(queue, handler, prefetch=prefetch)
        for queue in replica_names(topic, replicas)
    ]


class BalancedPublisher:
    """Sends each message of a topic to exactly one replica, chosen by ``algorithm``.

    Reports older than ``stale_after`` (default 3 x the report period) are
    ignored: the publisher falls back to equal weights (round robin) until a
    fresh report arrives.

    A replica whose queue is gone leaves the choice at once: publishes are mandatory,
    and a returned one (or a report saying the queue does not exist) takes the replica
    out and sends the message to a live one, within the same ``publish_timeout``.  A
    missing replica is looked for every ``recheck_s`` (a passive declare) and comes
    back once its queue exists again.  No publish outlives ``publish_timeout``: past
    it, ``ConfirmTimeout``.

    A replica that does not confirm within ``stall_s`` while the client's own node
    answers a round trip (``AsyncClient.answers``: the replica's node frozen, which the
    broker still counts as up, so nothing is returned) is *stalled*: the message goes to
    a live replica as well, and the stalled one leaves the choice until its publish is
    confirmed (or fails).  The first confirm answers the caller.  Such a message may
    then be delivered twice, from both replicas, with the same message id (at least
    once, as every confirm mode across a fault); ``resent`` counts them.
    """

    def __init__(
        self,
        client: AsyncClient,
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
        self.client, self.topic, self.algorithm = client, topic, algorithm
        self.queues = replica_names(topic, replicas)
        self.stale_after = stale_after
        self.rng = rng or random.Random()
        self.recheck_s = recheck_s
        if not stall_s > 0:
            raise InvalidArgument(f"stall_s must be > 0, got {stall_s!r}")
        self.stall_s = stall_s
        self.stalled: set[int] = set()  # replicas with a publish unconfirmed past stall_s
        self.resent = 0  # messages sent to a second replica after a stall
        self._stalls: dict[asyncio.Task[str], int] = {}  # stalled publishes: their replica
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
        self._recheck: asyncio.Task[None] | None = None

    async def start(self) -> Self:
        self._recheck = asyncio.create_task(self._recheck_missing())
        if self.algorithm == "round_robin":
            return self
        inbox = f"qosmq.balancer.inbox.{self.topic}.{id(self):x}"
        await self.client.declare_exchange(ExchangeSpec(REPORT_EXCHANGE, ExchangeType.DIRECT))
        await self.client.declare_queue(
            QueueSpec(inbox, kind=QueueKind.CLASSIC, durable=False, exclusive=True, max_length=1)
        )
        await self.client.bind(BindingSpec(inbox, REPORT_EXCHANGE, self.topic))
        await self.client.consume(inbox, self._on_report, prefetch=1)
        return self

    async def close(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recheck
        for task in list(self._stalls):  # (their callers were answered by another replica)
            task.cancel()
        await asyncio.gather(*self._stalls, return_exceptions=True)

    async def publish(self, body: bytes, **fields: object) -> str:
        """Publish to a chosen live replica with broker confirms; return its queue."""
        limit = self.client.settings.publish_timeout
        message_id = str(fields.pop("message_id", None) or new_message_id())
        tried: set[int] = set()
        pending: dict[asyncio.Task[str], int] = {}  # this message's stalled publishes
        try:
            async with asyncio.timeout(limit):
                while True:
                    if pending and not self._choosable(tried):
                        # every other replica tried: wait for a stalled one's confirm
                        done, _ = await asyncio.wait(pending, return_when="FIRST_COMPLETED")
                        for task in done:
                            pending.pop(task)
                            if not task.cancelled() and task.exception() is None:
                                return task.result()
                        continue
                    index = self.choose(exclude=tried)
                    tried.add(index)
                    if pending:
                        self.resent += 1
                        metrics.BALANCED_RESENT.labels(self.topic).inc()
                    message = OutgoingMessage(
                        body,
                        "",
                        self.queues[index],
                        message_id=message_id,
                        mandatory=True,
                        **fields,  # type: ignore[arg-type]
                    )
                    task = asyncio.ensure_future(self._send(index, message))
                    done, _ = await asyncio.wait({task}, timeout=self.stall_s)
                    while not done and not await self.client.answers(self.stall_s):
                        # not the replica: the client's own node or link is silent (its
                        # failover resends this publish): sending elsewhere would only
                        # add copies
                        done, _ = await asyncio.wait({task}, timeout=self.stall_s)
                    if not task.done():
                        pending[task] = index
                        self._stall(index, task)
                        continue
                    try:
                        return task.result()
                    except (Unroutable, EntityNotFound):
                        self._gone(index)
        except TimeoutError:
            metrics.BALANCED_TIMEOUTS.labels(self.topic).inc()
            raise ConfirmTimeout(
                f"topic {self.topic!r}: message {message_id} not confirmed within "
                f"publish_timeout = {limit} s"
            ) from None

    async def _send(self, index: int, message: OutgoingMessage) -> str:
        await self.client.publish(message)
        return self.queues[index]

    def _choosable(self, tried: set[int]) -> bool:
        blocked = self.missing | tried
        return any(i not in blocked for i in range(len(self.queues)))

    def _stall(self, index: int, task: asyncio.Task[str]) -> None:
        """``index`` did not confirm within ``stall_s``: out of the choice until ``task``
        (that publish, running on) ends, which the caller may no longer wait for."""
        self._stalls[task] = index
        if index not in self.stalled:
            self.stalled.add(index)
            metrics.BALANCED_STALLED.labels(self.topic).set(len(self.stalled))
            log.warning(
                "replica %s confirmed nothing within %g s: left out until it does",
                self.queues[index],
                self.stall_s,
            )
        task.add_done_callback(lambda done: self._unstall(index, done))

    def _unstall(self, index: int, task: asyncio.Task[str]) -> None:
        self._stalls.pop(task, None)
        if not task.cancelled():
            task.exception()  # (retrieved: a stalled publish's failure is not the caller's)
        if index in self.stalled and index not in self._stalls.values():
            self.stalled.discard(index)
            metrics.BALANCED_STALLED.labels(self.topic).set(len(self.stalled))
            log.warning("replica %s answers again: chosen again", self.queues[index])

    def choose(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """A replica by the algorithm, among the live ones not in ``exclude``;
        ``Unroutable`` when none is left."""
        blocked = self.missing | exclude
        allowed = [i for i in range(len(self.queues)) if i not in blocked]
        if live := [i for i in allowed if i not in self.stalled]:
            allowed = live  # (a stalled replica only when no other is left)
        if not allowed:
            raise Unroutable(
                f"topic {self.topic!r}: no replica can take the message "
                f"(missing: {', '.join(self.queues[i] for i in sorted(self.missing)) or '-'})"
            )
        now = time.monotonic()
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

    def _pick(self, allowed: list[int]) -> int:
        """The weighted pick over the live replicas (a blocked one weighs 0)."""
        if len(allowed) == len(self.queues) and self.picker is not None:
            return self.picker.pick()
        factors = self._factors or [1.0] * len(self.queues)
        weights = [factors[i] if i in allowed else 0.0 for i in range(len(self.queues))]
        if not any(weights):
            return allowed[self.rng.randrange(len(allowed))]
        return WeightedPicker(weights, self.rng).pick()

    def _gone(self, index: int) -> None:
        self.returned += 1
        if index not in self.missing:
            self.missing.add(index)
            metrics.BALANCED_MISSING.labels(self.topic).set(len(self.missing))
            log.warning(
                "replica %s is gone: left out until its queue exists again", self.queues[index]
            )

    async def _recheck_missing(self) -> None:
        while True:
            await asyncio.sleep(self.recheck_s)
            for index in sorted(self.missing):
                try:
                    await self.client.queue_length(self.queues[index])
                except EntityNotFound:
                    continue
                except MiddlewareError as exc:  # not known either way: looked at again
                    log.debug("replica %s not checked: %s", self.queues[index], exc)
                    continue
                self._back(index)

    def _back(self, index: int) -> None:
        if index in self.missing:
            self.missing.discard(index)
            metrics.BALANCED_MISSING.labels(self.topic).set(len(self.missing))
            log.warning("replica %s exists again: chosen again", self.queues[index])

    async def _on_report(self, delivery: Delivery) -> None:
        try:
            report = LoadReport.decode(delivery.body)
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
            return
        now = time.monotonic()
        self.report, self.received_at = report, now
        if self.stale_after is None:
            self.stale_after = 3 * report.period_s
        for i, r in enumerate(ordered):
            self.chooser.report(i, ReplicaReport(r.length, r.arrival_rate, r.service_rate, now))
            if r.exists:
                self._back(i)
            elif i not in self.missing:
                self._gone(i)
                self.returned -= 1  # reported, not returned
        self._factors = factors
        with contextlib.suppress(ValueError):
            self.picker = WeightedPicker(factors, self.rng)
