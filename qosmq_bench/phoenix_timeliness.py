"""Phoenix timeliness experiments (paper 000 §4, figures 9 and 10), on real processes.

The paper's set-up: 3 clusters, each 1 routing master + 2 routing slaves + 1 match
master + 2 match slaves (18 role processes, started by ``qosmq phoenix up``), and
2 clients, one at cluster A and one at C, each subscribing half of the
subscriptions and publishing half of the events.  Subscriptions are loaded into
the state store before the roles start (as if subscribed earlier: the match
masters and their slaves hold them, and every routing master on a subscription's
path holds its latency level); the masters read them back by quorum at start.

Mechanisms (table 1): ``none`` (no priorities, the match master takes turns over
itself and its slaves, blind to load), ``inner`` (predicted-T dispatch to the match
slaves), ``outer`` (latency-level priorities between clusters), ``both``, switched
live on the running masters between cells (``qosmq phoenix configure``).  Response time is
publish -> first delivery of the event to a subscriber's queue, measured by the
client (one host, one clock).  A ``raw`` row publishes the same events straight
into the subscriber queue with aio-pika: the transport's floor in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.routing import (
    PhoenixClient,
    PhoenixTopology,
)
from middleware.runtime import EventLoopName
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, OutgoingMessage

from .cpu import CpuMeter, busiest_by_kind
from .options import MECHANISMS
from .parts import Part
from .phoenix_deploy import (
    CLIENTS,
    Deployment,
    Workload,
    clients,
    messages_of,
    subscriber_queue,
    wait_ready,
)
from .stats import percentile

__all__ = [
    "measure",
    "remeasure_while_stolen",
    "run_experiment",
    "steal_limits",
    "summarize",
    "warm_up",
]


async def measure(
    settings: Settings,
    deployment: Deployment,
    workload: Workload,
    *,
    rate: float,
    duration_s: float,
    raw: bool = False,
    seed: int = 11,
    drain_s: float = 3.0,
    batch_max: int | None = None,
    records: bool = False,
    part: Part | None = None,
    count_lost: bool = False,
) -> dict[str, Any]:
    """Publish at ``rate`` events/s for ``duration_s`` (Poisson), half from each client;
    return response-time statistics of the delivered events (with ``records``, also
    ``records``: one ``(seq, latency level, response s or None)`` per published event;
    with ``count_lost``, also ``lost``, ``duplicates`` and ``unexpected`` copies: every
    (event, subscriber queue) the workload's subscriptions match against what arrived).

    As part 0 of several (``part``, the Spark job's ``--tasks-per-cell``): the other
    parts publish their shares of the rate too (:func:`serve_share`; every event's
    sequence number says whose it is), this part receives every event and counts them
    all; response times are then across processes, on the wall clock."""
    first: dict[int, float] = {}
    last_arrival = [time.monotonic()]
    arrived: Counter[tuple[int, str]] = Counter()  # (seq, queue): copies (count_lost)
    sent: dict[int, dict[str, Any]] | None = {} if count_lost and part is None else None

    async def on_delivery(delivery: Delivery) -> None:
        now = time.time()
        for message in messages_of(delivery.body):
            attributes = (message.get("event") or message)["attributes"]
            seq = attributes["seq"]
            if seq not in first:
                first[seq] = now - attributes["t0"]
            if sent is not None:
                arrived[(seq, delivery.queue)] += 1
        last_arrival[0] = time.monotonic()

    share = _Share(rate=rate, duration_s=duration_s, seed=seed, raw=raw, batch_max=batch_max)
    others_cpu: list[float | None] = []
    async with clients(settings, deployment, batch_max) as (client, at):
        for c in CLIENTS:
            await client.consume(subscriber_queue(deployment.prefix, c), on_delivery, prefetch=512)
        if part is not None:  # the others start their shares with ours
            command = {
                "share": asdict(share),
                "subscriptions": workload.subscriptions,
                "prefix": deployment.prefix,
                "topology": deployment.topology.model_dump(mode="json"),
            }
            await part.gather(command)
        level_of, sent_s = await _publish(
            client, at, workload, deployment.prefix, share, part, sent
        )
        if part is not None:
            for answer in (await part.gather(None))[1:]:
                level_of.update({int(k): v for k, v in answer["levels"].items()})
                sent_s = max(sent_s, answer["sent_s"])
                others_cpu.append(answer["client_cpu_pct"])
        while (quiet := time.monotonic() - last_arrival[0]) < drain_s:  # noqa: ASYNC110
            await asyncio.sleep(drain_s - quiet)  # until nothing arrived for drain_s
    seq = len(level_of)
    times = sorted(first.values())
    by_class: dict[str, list[float]] = defaultdict(list)
    for s, t in first.items():
        by_class["urgent" if level_of[s] <= 2 else "bulk" if level_of[s] >= 4 else "mid"].append(t)
    row: dict[str, Any] = {
        "rate": rate,
        "offered_per_s": round(seq / sent_s, 1),
        "events": seq,
        "delivered_events": len(times),
        "mean_ms": round(1000 * sum(times) / len(times), 1) if times else None,
        "p50_ms": _pct(times, 50),
        "p99_ms": _pct(times, 99),
        "urgent_mean_ms": _mean_ms(by_class["urgent"]),
        "bulk_mean_ms": _mean_ms(by_class["bulk"]),
    }
    if part is not None:
        row["parts"] = part.count
        row["other_clients_cpu_pct"] = others_cpu
    if records:
        row["records"] = [(s, level, first.get(s)) for s, level in sorted(level_of.items())]
    if sent is not None:
        row.update(_losses(workload.thresholds(deployment.prefix), sent, arrived))
    return row


def _losses(
    bounds: Mapping[tuple[str, str], Mapping[str, int]],
    sent: Mapping[int, Mapping[str, Any]],
    arrived: Counter[tuple[int, str]],
) -> dict[str, int]:
    """Copies owed (every published event against the subscriptions' bounds) and how
    they arrived: ``lost`` never, ``duplicates`` more than once, ``unexpected`` owed
    nowhere."""
    owed = set()
    for seq, event in sent.items():
        attributes = event["attributes"]
        for queue, bound in bounds.get((event["event_type"], attributes["symbol"]), {}).items():
            if attributes["price"] < bound:
                owed.add((seq, queue))
    return {
        "copies_owed": len(owed),
        "lost": len(owed - arrived.keys()),
        "duplicates": sum(n - 1 for n in arrived.values() if n > 1),
        "unexpected": len(arrived.keys() - owed),
    }


@dataclass(frozen=True)
class _Share:
    """What every part of a Phoenix cell publishes: its share of ``rate``."""

    rate: float
    duration_s: float
    seed: int
    raw: bool
    batch_max: int | None


async def _publish(
    client: AsyncClient,
    at: dict[str, PhoenixClient],
    workload: Workload,
    prefix: str,
    share: _Share,
    part: Part | None,
    sent: dict[int, dict[str, Any]] | None = None,
) -> tuple[dict[int, int], float]:
    """This part's events: ``rate / parts`` per second (Poisson), sequence numbers
    ``index, index + parts, ...``, every other one from each client; (each sequence
    number's latency level, seconds spent publishing)."""
    index, count = (part.index, part.count) if part is not None else (0, 1)
    rng = random.Random(share.seed if index == 0 else f"{share.seed}/{index}")
    rate = share.rate / count
    level_of: dict[int, int] = {}
    pending: set[asyncio.Task[None]] = set()
    started = time.monotonic()
    next_at, k = started, 0
    while next_at < started + share.duration_s:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        seq = k * count + index
        event = workload.event(rng, seq)
        level_of[seq] = workload.levels[event["event_type"]]
        if sent is not None:  # what is owed to whom, counted after the drain
            sent[seq] = event
        if share.raw:
            body = json.dumps({"event": event}).encode()
            queue = subscriber_queue(prefix, CLIENTS[k % 2])
            coro = client.publish(OutgoingMessage(body, "", queue))
        else:
            coro = at[CLIENTS[k % 2]].publish(event)
        task = asyncio.create_task(coro)
        pending.add(task)
        task.add_done_callback(pending.discard)
        k += 1
        next_at += rng.expovariate(rate)
    sent_s = time.monotonic() - started
    if pending:
        await asyncio.gather(*pending)
    return level_of, sent_s


async def serve_share(settings: Settings, part: Part) -> int:
    """A part other than 0 of a Phoenix cell: publish this part's share of each cell
    part 0 announces, report it, until part 0 says stop; return the cells served."""
    served = 0
    while True:
        command = (await part.gather(None))[0]
        if not command or command.get("stop"):
            return served
        share = _Share(**command["share"])
        topology = PhoenixTopology.model_validate(command["topology"])
        workload = Workload(command["subscriptions"])
        with CpuMeter({"client": os.getpid()}) as meter:
            async with clients(settings, (topology, command["prefix"]), share.batch_max) as (
                client,
                at,
            ):
                level_of, sent_s = await _publish(
                    client, at, workload, command["prefix"], share, part
                )
        answer = {
            "levels": level_of,
            "sent_s": sent_s,
            "client_cpu_pct": meter.result["processes"]["client"],
        }
        if (await part.gather(answer))[0]:  # part 0 stopped (it failed) instead of counting
            return served
        served += 1


def _pct(values: list[float], p: float) -> float | None:
    return round(1000 * percentile(values, p), 1) if values else None


def _mean_ms(values: list[float]) -> float | None:
    return round(1000 * sum(values) / len(values), 1) if values else None


def run_experiment(
    settings: Settings,
    *,
    directory: Path,
    subscription_counts: Sequence[int],
    rates: Sequence[float],
    mechanisms: Sequence[str],
    duration_s: float,
    repeats: int = 1,
    warmup_s: float = 3.0,
    report: Any = print,
    records: bool = False,
    max_steal_pct: float | None = None,
    steal_retries: int = 2,
    inbox_mirrors: int = 0,
    part: Part | None = None,
    role_queue_type: str = "classic",
    fields: Mapping[str, float] | None = None,
) -> list[dict[str, Any]]:
    """Every (subscriptions, repeat, rate, mechanism) cell, plus a raw row per
    (subscriptions, rate).  The roles start once per subscription count; the mechanisms
    are switched live (``reconfigure``: the masters' control queues) and alternate within
    each rate, in an order rotated per rate and repeat, so the mechanisms compared at a
    rate run seconds apart under the same conditions.  Every cell is preceded by
    ``warmup_s`` of unmeasured load at its rate.  ``records``: every measured row keeps
    its events' records (``measure``).  ``max_steal_pct``: a cell during which the
    hypervisor took more of the machine's CPU (steal) is kept as ``discarded`` and
    measured again, at most ``steal_retries`` times (:func:`remeasure_while_stolen`).
    ``part``: part 0 of several processes publishing each cell's events (the others run
    :func:`serve_share`; they are told to stop when this returns or fails).  ``fields``:
    topology fields to set (``copy_batch_max``)."""
    rows: list[dict[str, Any]] = []
    loop = settings.event_loop

    def keep(row: dict[str, Any]) -> None:
        rows.append(row)
        report(row)

    with _others_stopped(part, loop):
        for count in subscription_counts:
            workload = Workload(count)
            deployment = Deployment(
                directory / f"subs-{count}",
                prefix=f"bench-phx-{os.getpid()}-{count}",
                amqp_urls=settings.amqp_urls,
                inbox_mirrors=inbox_mirrors,
                role_queues=role_queue_type,
                fields=fields,
            )
            loaded = deployment.preload(workload.subscription_docs(deployment.prefix))
            for rate in rates:
                raw_cell = functools.partial(
                    _cell,
                    settings,
                    deployment,
                    workload,
                    {"subscriptions": count, "mechanism": "raw", "repeat": 0},
                    rate=rate,
                    duration_s=duration_s,
                    warmup_s=0.0,
                    raw=True,
                    records=records,
                    part=part,
                )
                keep(
                    remeasure_while_stolen(
                        raw_cell, max_steal_pct=max_steal_pct, retries=steal_retries, discard=keep
                    )
                )
            with deployment.running():
                ready_s = runtime.run(wait_ready(settings, deployment, workload), event_loop=loop)
                for repeat in range(repeats):
                    for r, rate in enumerate(rates):
                        shift = (repeat + r + subscription_counts.index(count)) % len(mechanisms)
                        for mechanism in [*mechanisms[shift:], *mechanisms[:shift]]:
                            switches = {
                                "batch_max": deployment.topology.batch_max,
                                **MECHANISMS[mechanism],
                            }
                            deployment.phoenix().reconfigure(**switches)
                            key = {
                                "subscriptions": count,
                                "loaded": loaded,
                                "mechanism": mechanism,
                                "repeat": repeat,
                                "ready_s": round(ready_s, 1),
                            }
                            cell = functools.partial(
                                _cell,
                                settings,
                                deployment,
                                workload,
                                key,
                                rate=rate,
                                duration_s=duration_s,
                                warmup_s=warmup_s,
                                batch_max=switches["batch_max"],
                                records=records,
                                part=part,
                            )
                            keep(
                                remeasure_while_stolen(
                                    cell,
                                    max_steal_pct=max_steal_pct,
                                    retries=steal_retries,
                                    discard=keep,
                                )
                            )
    return rows


@contextlib.contextmanager
def _others_stopped(part: Part | None, loop: EventLoopName) -> Iterator[None]:
    """As part 0 of several: tell the other parts to stop when the experiment ends,
    whether it finished or failed (they wait for part 0's next command)."""
    try:
        yield
    finally:
        if part is not None:
            runtime.run(part.gather({"stop": True}), event_loop=loop)


def _cell(
    settings: Settings,
    deployment: Deployment,
    workload: Workload,
    key: dict[str, Any],
    *,
    rate: float,
    duration_s: float,
    warmup_s: float,
    raw: bool = False,
    batch_max: int | None = None,
    records: bool = False,
    part: Part | None = None,
) -> dict[str, Any]:
    """One cell: ``warmup_s`` of unmeasured load at ``rate``, then the measured run."""
    loop = settings.event_loop
    warm_up(settings, deployment, workload, rate, warmup_s, batch_max, part)
    row = _metered(
        deployment,
        measure(
            settings,
            deployment,
            workload,
            rate=rate,
            duration_s=duration_s,
            raw=raw,
            batch_max=batch_max,
            records=records,
            part=part,
        ),
        loop,
    )
    return {**key, **row}


def warm_up(
    settings: Settings,
    deployment: Deployment,
    workload: Workload,
    rate: float,
    warmup_s: float,
    batch_max: int | None,
    part: Part | None = None,
) -> None:
    """``warmup_s`` of unmeasured load at ``rate`` (nothing for 0)."""
    if warmup_s > 0:
        runtime.run(
            measure(
                settings,
                deployment,
                workload,
                rate=rate,
                duration_s=warmup_s,
                seed=99,
                drain_s=1.0,
                batch_max=batch_max,
                part=part,
            ),
            event_loop=settings.event_loop,
        )


def remeasure_while_stolen(
    measured: Callable[[], dict[str, Any]],
    *,
    max_steal_pct: float | None,
    retries: int,
    discard: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:
    """Measure a cell; while the hypervisor took more than ``max_steal_pct`` % of the
    machine's CPU during it (``cpu.steal``: time this VM was ready to run but another
    guest had the host's core), hand the row to ``discard`` marked ``discarded`` (with
    why) and measure again, at most ``retries`` times.  The last measurement is returned,
    marked ``disturbed`` if it is still over.  ``max_steal_pct`` None: measure once.
    A discarded row goes without its per-event ``records``: they are never aggregated."""

    def stolen(row: dict[str, Any]) -> float | None:
        steal = (row.get("cpu") or {}).get("steal")
        over = max_steal_pct is not None and steal is not None and steal > max_steal_pct
        return steal if over else None

    row = measured()
    for _ in range(retries):
        steal = stolen(row)
        if steal is None:
            return row
        discarded = {k: v for k, v in row.items() if k != "records"}
        discard({**discarded, "discarded": f"steal {steal:g} % > {max_steal_pct:g} %"})
        row = measured()
    steal = stolen(row)
    if steal is not None:
        row["disturbed"] = (
            f"steal {steal:g} % > {max_steal_pct:g} % after {retries} re-measurement(s)"
        )
    return row


def steal_limits(args: argparse.Namespace) -> tuple[float | None, int]:
    """``--max-steal`` (a negative value: off) and ``--steal-retries``, validated."""
    if args.steal_retries < 0:
        raise ValueError(f"--steal-retries must be >= 0, got {args.steal_retries}")
    if args.max_steal is not None and args.max_steal > 100:
        raise ValueError(f"--max-steal is a % of the CPU (0-100, < 0: off), got {args.max_steal}")
    off = args.max_steal is None or args.max_steal < 0
    return (None if off else args.max_steal), args.steal_retries


def _metered(
    deployment: Deployment, cell: Coroutine[Any, Any, dict[str, Any]], loop: EventLoopName
) -> dict[str, Any]:
    """Run one measured cell; add where the CPU went meanwhile (``cpu``: the machine's busy
    and steal % of all cores, the client's % of one core, the busiest role of each kind's;
    ``KIND_wait``: the most-waiting process of each kind's run delay, % of the wall time)."""
    with CpuMeter({"client": os.getpid(), **deployment.processes()}) as meter:
        row = runtime.run(cell, event_loop=loop)
    row["event_loop"] = runtime.loop_name(loop)  # the client's; the roles' settings decide theirs
    cpu = meter.result
    clients = [cpu["processes"].get("client"), *row.pop("other_clients_cpu_pct", [])]
    known = [c for c in clients if c is not None]
    row["cpu"] = {
        "machine": cpu["machine_pct"],
        "steal": cpu["steal_pct"],
        **busiest_by_kind(cpu["processes"]),
        "client": max(known) if known else None,  # the busiest client process
        **{f"{kind}_wait": pct for kind, pct in busiest_by_kind(cpu["waiting"]).items()},
    }
    return row


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (subscriptions, mechanism, rate): the mean over repeats of each statistic (and
    of each CPU reading), and the lowest and highest mean and p99 of a single repeat (how
    far the repeats spread)."""
    cells: dict[tuple[int, str, float], list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row.get("discarded"):
            continue  # measured again (run_experiment's max_steal_pct)
        cells[(row["subscriptions"], row["mechanism"], row["rate"])].append(row)
    out = []
    for (count, mechanism, rate), group in cells.items():
        summary: dict[str, Any] = {
            "subscriptions": count,
            "mechanism": mechanism,
            "rate": rate,
            "repeats": len(group),
        }
        for key in ("mean_ms", "p50_ms", "p99_ms", "urgent_mean_ms", "bulk_mean_ms"):
            values = [r[key] for r in group if r.get(key) is not None]
            summary[key] = round(sum(values) / len(values), 1) if values else None
            if key in ("mean_ms", "p99_ms"):
                summary[f"{key}_range"] = [min(values), max(values)] if values else None
        cpu: dict[str, list[float]] = defaultdict(list)
        for row in group:
            for kind, pct in (row.get("cpu") or {}).items():
                if pct is not None:
                    cpu[kind].append(pct)
        summary["cpu"] = {kind: round(sum(v) / len(v), 1) for kind, v in cpu.items()}
        out.append(summary)
    return out
