"""``qosmq bench node-loss``: confirm modes through a lost RabbitMQ node, per phase.

Four workloads side by side at ``rate`` publishes/s each, against a local cluster the
benchmark can kill nodes of: ``e2e-async`` and ``e2e-sync`` (e2e confirms over a fanout
to three quorum queues, one consumer client per queue, the asyncio and the sync
publisher) and ``broker-async`` and ``broker-sync`` (publisher confirms to a quorum
queue, the paper's baseline mode, whose recovery the layer already had: the reference
in the same run, on both faces).

Scenarios: ``publisher-node`` (every client and every queue leader on the node that is
lost), ``leader-node`` (the queue leaders' node lost, the clients elsewhere) and
``two-nodes`` (the publisher node lost and restarted, then the node the clients failed
over to). Each node stays down ``down_s``. ``fault``: ``kill`` (SIGKILL, a crash) or
``stop`` (a graceful stop, as a rolling restart does: the node closes its clients'
connections with ``CONNECTION_FORCED`` and hands its queue leaders over) or ``freeze``
(SIGSTOP for ``down_s``, then SIGCONT: a paused VM; no socket closes, the node's peers
elect new queue leaders, and it goes on where it stopped). Every publish
is timed by the benchmark itself and every delivery counted by its own consumers: per
workload and phase, the confirm latencies, the first confirm of a publish sent after
the loss, the longest gap between confirms, errors by kind, and (over the run)
confirmed messages some queue never handled (lost) and handler runs beyond one per
queue (duplicates).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmPublisher,
)
from middleware.localcluster import LocalCluster
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
    SyncClient,
)

from .stats import percentile

__all__ = ["FAULTS", "SCENARIOS", "WORKLOADS", "run_node_loss"]
log = logging.getLogger(__name__)

SCENARIOS = ("publisher-node", "leader-node", "two-nodes")
#: how the node is lost: the ``LocalCluster`` method that loses it (SIGKILL, or a
#: graceful stop as a rolling restart does)
FAULTS = ("kill", "stop", "freeze")
WORKLOADS = ("e2e-async", "e2e-sync", "broker-async", "broker-sync")


@dataclass
class _Sent:
    sent: float
    settled: float | None = None
    error: str | None = None


@dataclass
class _Workload:
    name: str
    exchange: str
    queues: list[str]
    sent: dict[str, _Sent] = field(default_factory=dict)
    handled: dict[str, Counter[str]] = field(default_factory=dict)

    def record(self, message_id: str, started: float, error: BaseException | None) -> None:
        entry = self.sent[message_id] = _Sent(started)
        entry.settled = time.monotonic()
        entry.error = None if error is None else type(error).__name__
        if error is not None:  # the text, for the run's log: the row keeps only the kind
            log.warning("publish %s failed: %s: %s", message_id, type(error).__name__, error)


def _ordered(urls: tuple[str, ...], first: int) -> tuple[str, ...]:
    return urls[first:] + urls[:first]


class _Run:
    """One scenario: the topology, the clients, the publishing, the kills."""

    def __init__(
        self, cluster: LocalCluster, settings: Settings, *, rate: float, fault: str = "kill"
    ) -> None:
        self.cluster, self.settings, self.rate = cluster, settings, rate
        self.fault_kind = fault
        self.lose = getattr(cluster, fault)  # one of FAULTS, checked by run_node_loss
        self.urls = tuple(settings.amqp_urls)
        self.names = [n.short_name for n in cluster.layout.nodes]
        prefix = f"nodeloss-{uuid.uuid4().hex[:8]}"
        self.workloads = {
            name: _Workload(
                name,
                f"{prefix}.{name}",
                [f"{prefix}.{name}.{i}" for i in range(1 if name.startswith("broker") else 3)],
            )
            for name in WORKLOADS
        }
        self.clients: list[AsyncClient] = []
        self.events: list[tuple[str, float]] = []
        self._stop = threading.Event()

    def at(self, first: int) -> Settings:
        """Settings that try node ``first`` first, then the others in order."""
        return self.settings.model_copy(update={"amqp_urls": _ordered(self.urls, first)})

    async def client(self, first: int) -> AsyncClient:
        client = await AsyncClient(settings=self.at(first)).connect()
        self.clients.append(client)
        return client

    async def declare(self, leaders: int) -> None:
        """Every queue declared through node ``leaders`` (a quorum queue's first leader is
        the node its declaring client is on)."""
        client = await self.client(leaders)
        for w in self.workloads.values():
            kind = ExchangeType.DIRECT if w.name.startswith("broker") else ExchangeType.FANOUT
            await client.declare_exchange(ExchangeSpec(w.exchange, kind))
            for q in w.queues:
                await client.declare_queue(QueueSpec(q, kind=QueueKind.QUORUM))
                await client.bind(BindingSpec(q, w.exchange, routing_key=q))

    async def consume(self, first: int) -> list[AsyncConfirmConsumer]:
        consumers = []
        for w in self.workloads.values():
            for q in w.queues:
                counts = w.handled[q] = Counter()

                async def handle(d: Delivery, counts: Counter[str] = counts) -> None:
                    counts[d.message_id or ""] += 1

                client = await self.client(first)
                consumer = AsyncConfirmConsumer(client)
                await consumer.consume(q, handle)
                consumers.append(consumer)
        return consumers

    async def publish_async(self, w: _Workload, mode: str, first: int) -> None:
        client = await self.client(first)
        topology = [ExchangeSpec(w.exchange, ExchangeType.FANOUT)]
        if mode != "e2e":
            topology = [ExchangeSpec(w.exchange, ExchangeType.DIRECT)]
        for spec in topology:
            await client.declare_exchange(spec)
        for q in w.queues:
            await client.declare_queue(QueueSpec(q, kind=QueueKind.QUORUM))
            await client.bind(BindingSpec(q, w.exchange, routing_key=q))
        publisher = await AsyncConfirmPublisher(client, mode=mode).start()
        tasks: set[asyncio.Task[None]] = set()

        async def one(i: int) -> None:
            mid, started = f"{w.name}-{i}", time.monotonic()
            try:
                await publisher.publish(
                    b"x" * 100, exchange=w.exchange, routing_key=w.queues[0], message_id=mid
                )
                w.record(mid, started, None)
            except Exception as exc:
                w.record(mid, started, exc)

        i = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
            next_at += 1 / self.rate
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if tasks:
            await asyncio.wait(tasks)
        await publisher.close()

    def publish_sync(self, w: _Workload, mode: str, first: int) -> None:
        client = SyncClient(settings=self.at(first)).connect()
        kind = ExchangeType.FANOUT if mode == "e2e" else ExchangeType.DIRECT
        client.declare_exchange(ExchangeSpec(w.exchange, kind))
        for q in w.queues:
            client.declare_queue(QueueSpec(q, kind=QueueKind.QUORUM))
            client.bind(BindingSpec(q, w.exchange, routing_key=q))
        publisher = SyncConfirmPublisher(client, mode=mode)
        i, next_at = 0, time.monotonic()
        try:
            while not self._stop.is_set():
                mid, started = f"{w.name}-{i}", time.monotonic()
                try:
                    publisher.publish(
                        b"x" * 100, exchange=w.exchange, routing_key=w.queues[0], message_id=mid
                    )
                    w.record(mid, started, None)
                except Exception as exc:
                    w.record(mid, started, exc)
                i += 1
                next_at += 1 / self.rate
                wait = next_at - time.monotonic()
                if wait > 0:
                    client.run(wait)
                else:
                    next_at = time.monotonic()  # behind: publish the next at once
        finally:
            client.close()

    async def fault(self, name: str, down_s: float) -> None:
        if self.fault_kind == "freeze":  # RabbitMQ elects new leaders only once its
            # failure detector takes the frozen node for failed, which it does not for a
            # node that froze a few times in its first minutes (LocalCluster.freeze_detectable)
            await asyncio.to_thread(self.cluster.await_freeze_detectable, name)
        self.events.append((f"kill {name}", time.monotonic()))
        await asyncio.to_thread(self.lose, name)
        self.events.append((f"killed {name}", time.monotonic()))
        try:
            await asyncio.sleep(down_s)
        finally:  # a frozen node is never left frozen, even by a run stopped meanwhile
            if self.fault_kind == "freeze":
                self.cluster.thaw(name)
        self.events.append((f"start {name}", time.monotonic()))
        if self.fault_kind != "freeze":  # (a thawed node goes on where it stopped)
            await asyncio.to_thread(self.cluster.start, name)
        self.events.append((f"started {name}", time.monotonic()))

    async def close(self) -> None:
        self._stop.set()
        for w in self.workloads.values():
            for q in w.queues:
                for c in self.clients[:1]:
                    with contextlib.suppress(Exception):  # clean-up: best effort
                        await c.delete_queue(q)
        for client in self.clients:
            await client.close()


async def run_node_loss(
    cluster: LocalCluster,
    settings: Settings,
    *,
    scenario: str,
    rate: float = 30.0,
    down_s: float = 30.0,
    warmup_s: float = 5.0,
    after_s: float = 10.0,
    fault: str = "kill",
    progress: Callable[[str], None] = lambda _line: None,
) -> list[dict[str, Any]]:
    """Run one scenario; return a row per workload and phase (see the module doc)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
    if fault not in FAULTS:
        raise ValueError(f"fault {fault!r}: one of {', '.join(FAULTS)}")
    run = _Run(cluster, settings, rate=rate, fault=fault)
    clients_at, leaders_at = (1, 0) if scenario == "leader-node" else (0, 0)
    await run.declare(leaders_at)
    consumers = await run.consume(clients_at)
    started = time.monotonic()
    w = run.workloads
    publishers = [
        asyncio.create_task(run.publish_async(w["e2e-async"], "e2e", clients_at)),
        asyncio.create_task(run.publish_async(w["broker-async"], "persistent", clients_at)),
        asyncio.create_task(asyncio.to_thread(run.publish_sync, w["e2e-sync"], "e2e", clients_at)),
        asyncio.create_task(
            asyncio.to_thread(run.publish_sync, w["broker-sync"], "persistent", clients_at)
        ),
    ]
    try:
        await asyncio.sleep(warmup_s)
        victims = run.names[:2] if scenario == "two-nodes" else run.names[:1]
        for victim in victims:
            progress(f"{scenario}: {fault} {victim}, down {down_s:.0f} s")
            await run.fault(victim, down_s)
            await asyncio.sleep(after_s)
    finally:  # the sync publisher's thread too (a run that fails or is stopped ends it)
        run._stop.set()
    await asyncio.gather(*publishers)
    await _settled(run, within=30.0)
    rows = _rows(run, scenario, started)
    for consumer in consumers:
        await consumer.close()
    await run.close()
    return rows


async def _settled(run: _Run, *, within: float) -> None:
    """Wait until every confirmed message was handled by every queue (or ``within`` s)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_lost(w) for w in run.workloads.values()):
            return
        await asyncio.sleep(0.2)


def _lost(w: _Workload) -> list[str]:
    confirmed = [m for m, s in w.sent.items() if s.error is None]
    return [m for m in confirmed if any(w.handled[q][m] == 0 for q in w.queues)]


def _phases(run: _Run, started: float) -> list[tuple[str, float, float, float | None]]:
    """(phase, from, to, kill time) over the run's events."""
    kills = [t for e, t in run.events if e.startswith("kill ")]
    starts = [t for e, t in run.events if e.startswith("start ")]
    up = [t for e, t in run.events if e.startswith("started ")]
    phases: list[tuple[str, float, float, float | None]] = [("before", started, kills[0], None)]
    for n, kill in enumerate(kills):
        suffix = "" if len(kills) == 1 else f" {n + 1}"
        phases.append((f"outage{suffix}", kill, starts[n], kill))
        phases.append((f"rejoin{suffix}", starts[n], up[n], None))
        end = kills[n + 1] if n + 1 < len(kills) else float("inf")
        phases.append(("after" if n + 1 == len(kills) else f"between{suffix}", up[n], end, None))
    return phases


def _rows(run: _Run, scenario: str, started: float) -> list[dict[str, Any]]:
    rows = []
    for w in run.workloads.values():
        lost = _lost(w)
        dups = sum(n - 1 for q in w.queues for n in w.handled[q].values() if n > 1)
        for phase, begin, end, kill in _phases(run, started):
            mine = [s for s in w.sent.values() if begin <= s.sent < end]
            done = sorted(s.settled - s.sent for s in mine if s.error is None and s.settled)
            errors = Counter(s.error for s in mine if s.error)
            row: dict[str, Any] = {
                "scenario": scenario,
                "workload": w.name,
                "phase": phase,
                "published": len(mine),
                "confirmed": len(done),
                "errors": dict(errors),
                "p50_s": _round(percentile(done, 50)),
                "p99_s": _round(percentile(done, 99)),
                "max_s": _round(done[-1]) if done else None,
            }
            if kill is not None:  # a publish sent after the kill, its first confirm
                after = sorted(
                    s.settled
                    for s in w.sent.values()
                    if s.error is None and s.settled and s.sent >= kill
                )
                row["first_confirm_s"] = _round(after[0] - kill) if after else None
                row["longest_gap_s"] = _round(_longest_gap(w, begin, end))
            rows.append(row)
        rows[-1]["lost"] = len(lost)
        rows[-1]["duplicates"] = dups
    return rows


def _longest_gap(w: _Workload, begin: float, end: float) -> float:
    times = sorted(s.settled for s in w.sent.values() if s.error is None and s.settled)
    inside = [begin] + [t for t in times if begin <= t <= end] + [end]
    return max(b - a for a, b in itertools.pairwise(inside))


def _round(value: float) -> float | None:
    return None if value != value else round(value, 3)
