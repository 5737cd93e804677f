"""One benchmark cell of the confirm modes: P producers and C consumers per queue, for D seconds.

The paper's set-up (003 §4): queues bound to one durable direct exchange (two
above 15 queues), 2 producers and 3 consumers per queue, 1500-byte messages.
Every producer and consumer is its own connection, spread over the cluster's
nodes.  The ``raw`` cell does the ``broker`` mode's work with plain aio-pika
(publisher confirms, consumer acks, no layer) in the same run, so the layer's
cost is a ratio measured on the same noisy machine.

A cell returns a summary record and, optionally, per-message records
(publish, confirm and first-handle times) for the Spark pipeline.

A cell may be one :class:`Part` of several processes (the Spark job's
``--tasks-per-cell``): part *i* of *n* runs the producers and consumers whose number
is *i* modulo *n*, part 0 declares and deletes the cell's queues, and the parts meet at
barriers (before the producers start, while draining, before the queues go) through a
:class:`Coordinator` (Spark's ``BarrierTaskContext``).  Each part then returns its raw
records on the wall clock (:func:`merge_parts` makes one cell of them): a latency from a
publish in one process to a handle in another needs the executors' clocks to agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aio_pika

from middleware import runtime
from middleware.confirms import AsyncConfirmConsumer, AsyncConfirmPublisher, ConfirmMode
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
)

from .cpu import CpuMeter
from .live import live_line
from .parts import Part, measure_clock_offset, serve_clock
from .stats import percentile

__all__ = [
    "MODES",
    "CellSpec",
    "merge_parts",
    "receipt_share",
    "run_cell",
    "run_cell_sync",
]

log = logging.getLogger(__name__)
MODES = ("raw", *[m.value for m in ConfirmMode])
DRAIN_S = 15.0


@dataclass(frozen=True, slots=True)
class CellSpec:
    mode: str
    queues: int
    producers_per_queue: int = 2
    consumers_per_queue: int = 3
    size: int = 1500
    duration_s: float = 10.0
    window: int = 64  # in-flight publishes per producer

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose from {', '.join(MODES)}")
        if self.queues < 1 or self.producers_per_queue < 1 or self.consumers_per_queue < 1:
            raise ValueError("queues, producers and consumers per queue must be >= 1")
        if self.size < 1 or self.duration_s <= 0 or self.window < 1:
            raise ValueError("size, duration and window must be positive")


@dataclass
class _Tally:
    clock: Callable[[], float] = time.perf_counter
    sent: dict[str, float] = field(default_factory=dict)
    confirmed: dict[str, float] = field(default_factory=dict)
    failed: int = 0
    handled: dict[tuple[str, str], float] = field(default_factory=dict)
    duplicates: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    consumers: list[AsyncConfirmConsumer] = field(default_factory=list)
    merged_receipts: tuple[int, int] = (0, 0)  # from the parts of a cell

    def receipts(self) -> tuple[int, int]:
        """(receipts, receipt messages) the cell's e2e consumers sent."""
        cores = [c.core for c in self.consumers]
        return (
            self.merged_receipts[0] + sum(c.receipts_sent for c in cores),
            self.merged_receipts[1] + sum(c.batches_sent for c in cores),
        )

    def on_handled(self, queue: str, message_id: str) -> None:
        key = (queue, message_id)
        if key in self.handled:
            self.duplicates += 1
        else:
            self.handled[key] = self.clock()


def run_cell_sync(
    settings: Settings,
    spec: CellSpec,
    *,
    records: bool = False,
    part: Part | None = None,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 1.0,
) -> dict[str, Any]:
    """Run one cell (or one part of it) in a fresh event loop (for Spark executors and
    the CLI).  ``progress``: told a line every ``interval_s`` while the cell runs."""
    return runtime.run(
        run_cell(
            settings, spec, records=records, part=part, progress=progress, interval_s=interval_s
        ),
        event_loop=settings.event_loop,
    )


def progress_line(tally: _Tally, since: float, last: tuple[int, int, int], dt: float) -> str:
    """PerfTest's live line: rates over the last interval, confirm latency so far."""
    now = (len(tally.sent), len(tally.confirmed), len(tally.handled))
    latencies = [
        (t - tally.sent[m]) * 1000 for m, t in list(tally.confirmed.items()) if m in tally.sent
    ]
    rates = tuple((n - before) / dt for n, before in zip(now, last, strict=True))
    return live_line(since, rates, latencies)


async def _report(
    tally: _Tally, progress: Callable[[str], None], interval_s: float, started: float
) -> None:
    last, at = (0, 0, 0), time.perf_counter()
    while True:
        await asyncio.sleep(interval_s)
        now = time.perf_counter()
        progress(progress_line(tally, now - started, last, now - at))
        last, at = (len(tally.sent), len(tally.confirmed), len(tally.handled)), now


async def run_cell(
    settings: Settings,
    spec: CellSpec,
    *,
    records: bool = False,
    part: Part | None = None,
    progress: Callable[[str], None] | None = None,
    interval_s: float = 1.0,
) -> dict[str, Any]:
    """Run one cell against the cluster in ``settings``; return its summary (and records).
    As one ``part`` of several processes: this part's share, and its raw records."""
    run_id = part.run_id if part else uuid.uuid4().hex[:8]
    exchanges = [f"qosmq.bench.{run_id}.x{i}" for i in range(1 if spec.queues <= 15 else 2)]
    queues = [f"qosmq.bench.{run_id}.q{i}" for i in range(spec.queues)]
    route = {q: exchanges[i % len(exchanges)] for i, q in enumerate(queues)}
    kind = QueueKind.CLASSIC if spec.mode == "raw" else ConfirmMode(spec.mode).profile.queue_kind
    # across processes every time is on the wall clock (the executors' clocks must agree)
    tally = _Tally(clock=time.time if part else time.perf_counter)
    owner = part is None or part.index == 0
    clock_queue = f"qosmq.bench.{run_id}.clock"
    clock: tuple[float, float] | None = (0.0, 0.0)  # (offset from part 0, error) s
    admin = await AsyncClient(settings=settings).connect()
    closers: list[Callable[[], Awaitable[None]]] = []
    try:
        if owner:
            for x in exchanges:
                await admin.declare_exchange(ExchangeSpec(x, ExchangeType.DIRECT))
            for q in queues:
                await admin.declare_queue(QueueSpec(q, kind=kind))
                await admin.bind(BindingSpec(q, route[q], q))
            if part:  # part 0's clock is the cell's: the others measure theirs against it
                await admin.declare_queue(QueueSpec(clock_queue, kind=QueueKind.CLASSIC))
                closers.append(await serve_clock(admin, clock_queue))
        if part:
            await part.barrier()  # the queues exist
            if not owner:
                clock = await measure_clock_offset(admin, clock_queue)
        closers += await _start_consumers(settings, spec, queues, tally, part)
        producers, closers_p = await _start_producers(
            settings, spec, queues, route, exchanges, part
        )
        closers += closers_p
        if part:
            await part.barrier()  # every consumer is up: the producers start together
        started = time.perf_counter()
        deadline = started + spec.duration_s
        reporter = (
            asyncio.create_task(_report(tally, progress, interval_s, started))
            if progress is not None
            else None
        )
        try:
            with CpuMeter({"client": os.getpid(), **_brokers()}) as cpu:
                await asyncio.gather(*(p(deadline, tally) for p in producers))
        finally:
            if reporter is not None:
                reporter.cancel()
        elapsed = time.perf_counter() - started
        await (_drain_parts(tally, spec, part) if part else _drain(tally, spec))
    finally:
        for close in reversed(closers):
            with contextlib.suppress(Exception):
                await close()
        if part:
            with contextlib.suppress(Exception):
                await part.barrier()  # every part is done with the queues
        if owner:
            for q in [*queues, *([clock_queue] if part else [])]:
                with contextlib.suppress(Exception):
                    await admin.delete_queue(q)
            for x in exchanges:
                with contextlib.suppress(Exception):
                    await admin.delete_exchange(x)
        await admin.close()
    fields = _cpu_fields(cpu.result, elapsed, tally)
    if part:
        return _part_result(spec, tally, elapsed, part) | fields | {"clock": clock}
    return _summarise(spec, tally, elapsed, records) | fields


def _brokers() -> dict[str, int]:
    """RabbitMQ nodes running on this machine (``beam.smp``), by PID: their CPU beside
    the client's tells a broker-bound cell from a client-bound one.  None on a client
    machine apart from the brokers (the report then says so)."""
    found: dict[str, int] = {}
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", encoding="ascii", errors="replace") as fh:
                if fh.read().strip() != "beam.smp":
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"rabbit" in b" ".join(argv):
            found[f"broker-{pid}"] = pid
    return found


def _part_result(spec: CellSpec, tally: _Tally, elapsed: float, part: Part) -> dict[str, Any]:
    """One part's share, for :func:`merge_parts`: what it published (sent, confirmed) and
    handled (first time; later copies in ``duplicates``), on the wall clock."""
    return {
        "part": part.index,
        "parts": part.count,
        "duration_s": round(elapsed, 3),
        "failed": tally.failed,
        "errors": tally.errors,
        "sent": [(m, t, tally.confirmed.get(m)) for m, t in tally.sent.items()],
        "handled": [(q, m, t) for (q, m), t in tally.handled.items()],
        "duplicates": tally.duplicates,
        "receipts": tally.receipts(),
    }


def merge_parts(
    spec: CellSpec, parts: Sequence[dict[str, Any]], *, records: bool
) -> dict[str, Any]:
    """One cell from its parts: the union of their records (a message handled in two
    parts counts as a duplicate), throughput over the longest part, and each part's CPU
    (the busiest client is what a client-bound cell is bound by)."""
    tally = _Tally()
    for p in parts:
        for m, sent, confirmed in p["sent"]:
            tally.sent[m] = sent
            if confirmed is not None:
                tally.confirmed[m] = confirmed
        for q, m, t in p["handled"]:
            key = (q, m)
            if key in tally.handled:
                tally.duplicates += 1
                tally.handled[key] = min(tally.handled[key], t)
            else:
                tally.handled[key] = t
        tally.duplicates += p["duplicates"]
        tally.failed += p["failed"]
        receipts = p.get("receipts", (0, 0))
        tally.merged_receipts = (
            tally.merged_receipts[0] + receipts[0],
            tally.merged_receipts[1] + receipts[1],
        )
        for name, n in p["errors"].items():
            tally.errors[name] = tally.errors.get(name, 0) + n
    elapsed = max(p["duration_s"] for p in parts)
    summary = _summarise(spec, tally, elapsed, records)
    cpu = [p.get("client_cpu_pct") for p in parts]
    known = [c for c in cpu if c is not None]
    clocks = [p["clock"] for p in parts[1:] if p.get("clock")]
    summary.update(
        parts=len(parts),
        # how far the other tasks' clocks were from task 0's, and within what
        clock_offset_ms=round(max(abs(o) for o, _ in clocks) * 1000, 3) if clocks else None,
        clock_error_ms=round(max(e for _, e in clocks) * 1000, 3) if clocks else None,
        client_cpu_pct=max(known) if known else None,
        client_cpu_pct_parts=cpu,
        client_wait_pct=max(parts, key=lambda p: p.get("client_cpu_pct") or 0.0).get(
            "client_wait_pct"
        ),  # the busiest client's
        machine_pct=max((p.get("machine_pct") or 0.0) for p in parts),
        steal_pct=max((p.get("steal_pct") or 0.0) for p in parts),
        broker_cpu_pct=max((p.get("broker_cpu_pct") or 0.0) for p in parts) or None,
        run_queue=max((p.get("run_queue") or 0.0) for p in parts),
        cores=parts[0].get("cores"),
        client_cpu_us_per_msg=(
            round(sum(known) / 100 * elapsed / len(tally.confirmed) * 1e6, 1)
            if known and tally.confirmed
            else None
        ),
    )
    return summary


def _cpu_fields(cpu: dict[str, Any], elapsed: float, tally: _Tally) -> dict[str, Any]:
    """Where the cell's CPU went: the client process (every producer and consumer of the
    cell runs in it) in % of one core, its wait for a core, the machine's busy %, and the
    client's CPU per confirmed message (steadier than messages/s on a shared machine)."""
    client = cpu["processes"]["client"]
    brokers = [v for k, v in cpu["processes"].items() if k != "client" and v is not None]
    confirmed = len(tally.confirmed)
    return {
        "client_cpu_pct": client,
        "broker_cpu_pct": round(sum(brokers), 1) if brokers else None,
        "run_queue": cpu.get("run_queue"),
        "client_wait_pct": cpu["waiting"]["client"],
        "machine_pct": cpu["machine_pct"],
        "steal_pct": cpu["steal_pct"],
        "cores": cpu["cores"],
        "client_cpu_us_per_msg": (
            round(client / 100 * elapsed / confirmed * 1e6, 1)
            if client is not None and confirmed
            else None
        ),
    }


async def _start_consumers(
    settings: Settings, spec: CellSpec, queues: list[str], tally: _Tally, part: Part | None
) -> list[Callable[[], Awaitable[None]]]:
    closers: list[Callable[[], Awaitable[None]]] = []
    n = 0
    for q in queues:
        for _ in range(spec.consumers_per_queue):
            node_settings = settings.starting_at(n)
            n += 1
            if part and not part.mine(n - 1):
                continue
            if spec.mode == "raw":
                closers.append(await _raw_consumer(node_settings, q, tally))
                continue
            client = await AsyncClient(settings=node_settings).connect()

            async def handler(d: Delivery) -> None:
                tally.on_handled(d.queue, d.message_id or "")

            if ConfirmMode(spec.mode).profile.receipts:
                consumer = AsyncConfirmConsumer(client)
                tally.consumers.append(consumer)
                await consumer.consume(q, handler)
                closers.append(consumer.close)
            else:
                await client.consume(q, handler)
            closers.append(client.close)
    return closers


async def _start_producers(
    settings: Settings,
    spec: CellSpec,
    queues: list[str],
    route: dict[str, str],
    exchanges: list[str],
    part: Part | None,
) -> tuple[list[Callable[[float, _Tally], Awaitable[None]]], list[Callable[[], Awaitable[None]]]]:
    body = b"x" * spec.size
    producers: list[Callable[[float, _Tally], Awaitable[None]]] = []
    closers: list[Callable[[], Awaitable[None]]] = []
    n = 1000
    for q in queues:
        for _ in range(spec.producers_per_queue):
            node_settings = settings.starting_at(n)
            n += 1
            if part and not part.mine(n - 1001):
                continue
            if spec.mode == "raw":
                send, close = await _raw_producer(node_settings, route[q], q, body)
                closers.append(close)
            else:
                client = await AsyncClient(settings=node_settings).connect()
                for x in exchanges:
                    client.topology.add(ExchangeSpec(x, ExchangeType.DIRECT))
                client.topology.add(BindingSpec(q, route[q], q))
                publisher = await AsyncConfirmPublisher(client, mode=spec.mode).start()
                send = _layer_sender(publisher, route[q], q, body)
                closers += [publisher.close, client.close]
            producers.append(_producer_loop(send, spec.window))
    return producers, closers


def _layer_sender(
    publisher: AsyncConfirmPublisher, exchange: str, queue: str, body: bytes
) -> Callable[[str], Awaitable[None]]:
    async def send(message_id: str) -> None:
        await publisher.publish(body, exchange=exchange, routing_key=queue, message_id=message_id)

    return send


def _producer_loop(
    send: Callable[[str], Awaitable[None]], window: int
) -> Callable[[float, _Tally], Awaitable[None]]:
    """Keep ``window`` publishes in flight until the deadline."""

    async def run(deadline: float, tally: _Tally) -> None:
        slots = asyncio.Semaphore(window)
        tasks: set[asyncio.Task[None]] = set()

        async def one(message_id: str) -> None:
            try:
                await send(message_id)
                tally.confirmed[message_id] = tally.clock()
            except Exception as exc:
                tally.failed += 1
                tally.errors[type(exc).__name__] = tally.errors.get(type(exc).__name__, 0) + 1
            finally:
                slots.release()

        while time.perf_counter() < deadline:
            await slots.acquire()
            message_id = uuid.uuid4().hex
            tally.sent[message_id] = tally.clock()
            task = asyncio.create_task(one(message_id))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    return run


async def _drain(tally: _Tally, spec: CellSpec) -> None:
    """Wait until every confirmed message was handled (or handling stops progressing)."""
    deadline = time.monotonic() + DRAIN_S
    last, still = -1, 0
    while time.monotonic() < deadline:
        done = len(tally.handled)
        if done >= len(tally.sent):
            return
        still = still + 1 if done == last else 0
        if still >= 20 and spec.mode in ("none", "raw", "broker", "persistent"):
            return
        last = done
        await asyncio.sleep(0.1)


async def _drain_parts(tally: _Tally, spec: CellSpec, part: Part) -> None:
    """``_drain`` over every part of a cell: each round they share what they sent and
    handled, and all stop in the same round (each decides from the same numbers)."""
    rounds = int(DRAIN_S / 0.1)
    last, still = -1, 0
    for _ in range(rounds):
        shares = await part.gather([len(tally.sent), len(tally.handled)])
        sent, done = sum(s for s, _ in shares), sum(h for _, h in shares)
        if done >= sent:
            return
        still = still + 1 if done == last else 0
        if still >= 20 and spec.mode in ("none", "raw", "broker", "persistent"):
            return
        last = done
        await asyncio.sleep(0.1)


# ------------------------------------------------------------------ raw
async def _raw_consumer(
    settings: Settings, queue: str, tally: _Tally
) -> Callable[[], Awaitable[None]]:
    connection = await aio_pika.connect(_raw_url(settings))
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=settings.prefetch)
    q = await channel.get_queue(queue, ensure=False)

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        tally.on_handled(queue, message.message_id or "")
        await message.ack()

    await q.consume(on_message)
    return connection.close


async def _raw_producer(
    settings: Settings, exchange: str, queue: str, body: bytes
) -> tuple[Callable[[str], Awaitable[None]], Callable[[], Awaitable[None]]]:
    connection = await aio_pika.connect(_raw_url(settings))
    channel = await connection.channel(publisher_confirms=True)
    x = await channel.get_exchange(exchange, ensure=False)

    async def send(message_id: str) -> None:
        await x.publish(aio_pika.Message(body, message_id=message_id), routing_key=queue)

    return send, connection.close


def _raw_url(settings: Settings) -> str:
    host, port, _ = settings.nodes[0]
    user, password = settings.username, settings.password.get_secret_value()
    return f"amqp://{user}:{password}@{host}:{port}/"


# -------------------------------------------------------------- summary
def _summarise(spec: CellSpec, tally: _Tally, elapsed: float, records: bool) -> dict[str, Any]:
    confirm_ms = [(tally.confirmed[m] - tally.sent[m]) * 1000 for m in tally.confirmed]
    handled_ids = {m for (_, m) in tally.handled}
    e2e_ms = [(t - tally.sent[m]) * 1000 for (_, m), t in tally.handled.items() if m in tally.sent]
    lost = sum(1 for m in tally.confirmed if m not in handled_ids)
    summary: dict[str, Any] = {
        **{k: v for k, v in asdict(spec).items() if k != "duration_s"},
        "producers": spec.producers_per_queue * spec.queues,
        "consumers": spec.consumers_per_queue * spec.queues,
        "duration_s": round(elapsed, 3),
        "published": len(tally.sent),
        "confirmed": len(tally.confirmed),
        "failed": tally.failed,
        "errors": tally.errors,
        "handled": len(tally.handled),
        "lost": lost,
        "duplicates": tally.duplicates,
        "confirmed_per_s": round(len(tally.confirmed) / elapsed, 1),
        "handled_per_s": round(len(tally.handled) / elapsed, 1),
        # e2e: receipts and the messages that carried them (a receipt message costs
        # about what a data message does: their share is what batching saves)
        "receipts": tally.receipts()[0],
        "receipt_messages": tally.receipts()[1],
    }
    for p in (50, 95, 99, 99.9):
        label = str(p).replace(".", "")
        summary[f"confirm_p{label}_ms"] = round(percentile(confirm_ms, p), 3)
        summary[f"e2e_p{label}_ms"] = round(percentile(e2e_ms, p), 3)
    if records:
        first = {m: t for (_, m), t in sorted(tally.handled.items(), key=lambda kv: kv[1])}
        summary["records"] = [
            (m, sent, tally.confirmed.get(m), first.get(m)) for m, sent in tally.sent.items()
        ]
    return summary


def receipt_share(row: dict[str, Any]) -> str:
    """Receipt messages per 100 data messages handled (e2e modes), else -."""
    if not row.get("receipt_messages") or not row.get("handled"):
        return "-"
    return f"{100 * row['receipt_messages'] / row['handled']:.1f}"
