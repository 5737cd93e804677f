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
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.cliargs import integer, names, number, numbers
from middleware.routing import (
    ChordRing,
    PhoenixClient,
    PhoenixDeployment,
    PhoenixTopology,
    SubscriptionRecord,
    role_queues,
)
from middleware.runtime import EventLoopName
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, OutgoingMessage, QueueKind, QueueSpec

from .cpu import CpuMeter, busiest_by_kind
from .parts import Part
from .stats import percentile

__all__ = [
    "MECHANISMS",
    "Deployment",
    "Workload",
    "measure",
    "phoenix_cli",
    "remeasure_while_stolen",
    "run_experiment",
    "steal_arguments",
    "steal_limits",
    "summarize",
    "warm_up",
]

#: name -> the live switches (``qosmq phoenix configure``); with ``inner`` off the match
#: masters take turns over themselves and their slaves (the paper's base system)
MECHANISMS: dict[str, dict[str, Any]] = {
    "none": {"outer": False, "inner": False, "blind_dispatch": "round_robin"},
    "inner": {"outer": False, "inner": True},
    "outer": {"outer": True, "inner": False, "blind_dispatch": "round_robin"},
    "both": {"outer": True, "inner": True},
    # not paper mechanisms, to measure one thing in the same run: "none" with the match
    # masters matching every event themselves (no slaves), and "none" with every role
    # message in an AMQP message of its own (batch_max = 1)
    "none-master": {"outer": False, "inner": False, "blind_dispatch": "master"},
    "none-unbatched": {
        "outer": False,
        "inner": False,
        "blind_dispatch": "round_robin",
        "batch_max": 1,
    },
}
CLUSTERS = ("A", "B", "C")
CLIENTS = ("A", "C")  # the clusters the two clients connect to


@dataclass
class Workload:
    """Event types (levels 1..5 round robin), subscriptions and the event stream."""

    subscriptions: int
    types: int = 30
    symbols_per_type: int = 0  # 0: subscriptions per type / 2 (about one match per event)
    seed: int = 7
    event_types: list[str] = field(init=False)
    levels: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.event_types = [f"ev{i}" for i in range(self.types)]
        self.levels = {t: 1 + i % 5 for i, t in enumerate(self.event_types)}
        if not self.symbols_per_type:
            self.symbols_per_type = max(1, self.subscriptions // self.types // 2)

    def subscription_docs(self, prefix: str) -> Iterator[tuple[str, str, SubscriptionRecord]]:
        """(id, subscriber's cluster, record) for every subscription, plus one probe each."""
        rng = random.Random(self.seed)
        for i in range(self.subscriptions):
            event_type = self.event_types[i % self.types]
            at = CLIENTS[i % 2]
            yield (
                f"s{i}",
                at,
                SubscriptionRecord(
                    event_type=event_type,
                    filter=[
                        ["symbol", "=", f"S{rng.randrange(self.symbols_per_type)}"],
                        ["price", "<", rng.randrange(1, 1000)],
                    ],
                    queue=subscriber_queue(prefix, at),
                    latency_level=self.levels[event_type],
                    home=at,
                ),
            )
        for event_type in self.event_types:  # readiness probes
            yield (
                f"probe-{event_type}",
                CLIENTS[0],
                SubscriptionRecord(
                    event_type=event_type,
                    filter=[["probe", "exists"]],
                    queue=f"{prefix}.probe",
                    latency_level=self.levels[event_type],
                    home=CLIENTS[0],
                ),
            )

    def thresholds(self, prefix: str) -> dict[tuple[str, str], dict[str, int]]:
        """Per (event type, symbol), per subscriber queue, the highest price bound of its
        subscriptions: an event goes to a queue when its price is below that bound (the
        workload's own arithmetic, apart from the match brokers' index: the loss count's
        expectation)."""
        bounds: dict[tuple[str, str], dict[str, int]] = defaultdict(dict)
        for _, _, record in self.subscription_docs(prefix):
            if record.queue.endswith(".probe"):
                continue
            (_, _, symbol), (_, _, price) = record.filter
            at = bounds[(record.event_type, str(symbol))]
            at[record.queue] = max(at.get(record.queue, 0), int(price))
        return dict(bounds)

    def event(self, rng: random.Random, seq: int) -> dict[str, Any]:
        event_type = self.event_types[rng.randrange(self.types)]
        return {
            "event_type": event_type,
            "attributes": {
                "symbol": f"S{rng.randrange(self.symbols_per_type)}",
                "price": rng.randrange(1000),
                "seq": seq,
                "t0": time.time(),
            },
        }


def subscriber_queue(prefix: str, cluster: str) -> str:
    return f"{prefix}.sub.{cluster}"


class Deployment:
    """A local 3-cluster Phoenix deployment in ``directory`` over the given brokers."""

    def __init__(
        self,
        directory: Path,
        *,
        prefix: str,
        amqp_urls: Sequence[str],
        routing_slaves: int = 2,
        match_slaves: int = 2,
        clusters: Sequence[str] = CLUSTERS,
        inbox_mirrors: int = 0,
        fields: Mapping[str, float] | None = None,
        links: Mapping[tuple[str, str], str] | None = None,
        match_masters: Mapping[str, int] | None = None,
        role_queues: str = "classic",
    ) -> None:
        self.directory, self.prefix = directory, prefix
        self.role_queues = role_queues  # the role inboxes' queue type (topology field)
        self.match_masters = dict(match_masters or {})  # cluster -> masters (default 1)
        self.links = dict(links or {})  # (from, to) -> the URL that link takes
        self.inbox_mirrors = inbox_mirrors  # nodes per role queue (topology field)
        self.fields = dict(fields or {})  # more top-level topology fields (heartbeats)
        self.amqp_urls = list(amqp_urls)
        self.routing_slaves, self.match_slaves = routing_slaves, match_slaves
        self.clusters = list(clusters)
        self.ring = ChordRing(self.clusters)
        self.store_path = directory / "state.sqlite3"
        self.topology_file = directory / "phoenix.toml"
        self.state_dir = directory / "state"
        directory.mkdir(parents=True, exist_ok=True)
        self.configure(outer=True, inner=True)

    def configure(self, *, outer: bool, inner: bool) -> PhoenixTopology:
        topology = PhoenixTopology.model_validate(
            {
                "prefix": self.prefix,
                "state_store": str(self.store_path),
                "outer": outer,
                "inner": inner,
                "inbox_mirrors": self.inbox_mirrors,
                "role_queues": self.role_queues,
                **self.fields,
                "clusters": [
                    {
                        "id": c,
                        "routing_slaves": self.routing_slaves,
                        "match_slaves": self.match_slaves,
                        "match_masters": self.match_masters.get(c, 1),
                    }
                    for c in self.clusters
                ],
                "links": [
                    {"from": a, "to": b, "amqp_urls": [url]}
                    for (a, b), url in sorted(self.links.items())
                ],
            }
        )
        topology.write(self.topology_file)
        self.topology = PhoenixTopology.load(self.topology_file)
        return self.topology

    def preload(self, subscriptions: Iterator[tuple[str, str, SubscriptionRecord]]) -> int:
        """Write subscriptions and latency tables as the roles would hold them."""
        return self.phoenix().preload(subscriptions)

    def processes(self) -> dict[str, int]:
        """The running roles' PIDs by process key (``A/router``, ...)."""
        return {role.key: pid for role, pid in self.phoenix().pids().items()}

    def phoenix(self) -> PhoenixDeployment:
        """The library's deployment API over this topology (roles reach these brokers)."""
        urls = ",".join(self.amqp_urls)
        return PhoenixDeployment(
            self.topology_file,
            self.state_dir,
            settings=Settings(amqp_urls=urls),
            env={**os.environ, "QOSMQ_AMQP_URLS": urls},
        )

    def up(self) -> None:
        self.phoenix().up()

    def down(self) -> None:
        deployment = self.phoenix()
        if deployment.state_file.exists():
            deployment.down()

    @contextlib.contextmanager
    def running(self) -> Iterator[Deployment]:
        """The roles up for the block; then down, and the deployment's queues deleted (a
        benchmark's deployment is thrown away: its inboxes would pile up in the broker)."""
        self.up()
        try:
            yield self
        finally:
            self.down()
            try:
                runtime.run(self.delete_queues())
            except Exception as exc:  # the measured cells stand; say what was left behind
                print(f"phoenix bench: queues of {self.prefix} not deleted: {exc}", file=sys.stderr)

    async def delete_queues(self) -> int:
        """Delete the roles' inboxes and control queues and the clients' queues; how many."""
        names = role_queues(self.topology)
        names += [subscriber_queue(self.prefix, at) for at in CLIENTS]
        names.append(f"{self.prefix}.probe")
        settings = Settings(amqp_urls=",".join(self.amqp_urls))
        async with AsyncClient(settings=settings) as client:
            for name in names:
                await client.delete_queue(name)
        return len(names)


def phoenix_cli(
    command: str,
    topology_file: Path,
    state_dir: Path,
    amqp_urls: Sequence[str],
    *arguments: str,
    timeout_s: float = 120,
) -> str:
    """Run ``qosmq phoenix COMMAND`` for a topology (a subprocess, as a user would); stdout."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "middleware.cli",
            "phoenix",
            command,
            "--topology",
            str(topology_file),
            "--state-dir",
            str(state_dir),
            *arguments,
        ],
        env={**os.environ, "QOSMQ_AMQP_URLS": ",".join(amqp_urls)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=True,
    ).stdout


@contextlib.asynccontextmanager
async def _clients(
    settings: Settings,
    deployment: Deployment | tuple[PhoenixTopology, str],
    batch_max: int | None = None,
) -> AsyncIterator[tuple[AsyncClient, dict[str, PhoenixClient]]]:
    """One connection, a Phoenix client at each of CLIENTS on it, the subscriber queues
    declared; ``deployment``: the running one, or (its topology, its prefix)."""
    if isinstance(deployment, Deployment):
        topology, prefix = deployment.topology, deployment.prefix
    else:
        topology, prefix = deployment
    if batch_max is not None:  # the clients batch their publishes as the roles do
        topology = topology.model_copy(update={"batch_max": batch_max})
    client = await AsyncClient(settings=settings).connect()
    try:
        for at in CLIENTS:
            await client.declare_queue(
                QueueSpec(subscriber_queue(prefix, at), kind=QueueKind.CLASSIC)
            )
        await client.declare_queue(QueueSpec(f"{prefix}.probe", kind=QueueKind.CLASSIC))
        yield (
            client,
            {at: PhoenixClient(client, topology=topology, cluster=at) for at in CLIENTS},
        )
    finally:
        await client.close()


def messages_of(body: bytes) -> list[dict[str, Any]]:
    """The messages a subscriber-queue delivery carries: one, or a batch of copies
    (``copy_batch_max``)."""
    message = json.loads(body)
    return message if isinstance(message, list) else [message]


async def wait_ready(
    settings: Settings, deployment: Deployment, workload: Workload, timeout_s: float = 300
) -> float:
    """Probe every event type from both clients until each probe is delivered."""
    started = time.monotonic()
    async with _clients(settings, deployment) as (client, at):
        missing = {(c, t) for c in CLIENTS for t in workload.event_types}
        probe = f"{deployment.prefix}.probe"
        while missing:
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"Phoenix not ready after {timeout_s:.0f} s: {sorted(missing)}")
            for c, t in sorted(missing):
                await at[c].publish({"event_type": t, "attributes": {"probe": f"{c}|{t}"}})
            await asyncio.sleep(1.0)
            while (d := await client.get(probe)) is not None:
                for message in messages_of(d.body):
                    c, t = message["event"]["attributes"]["probe"].split("|")
                    missing.discard((c, t))
        await asyncio.sleep(1.0)
        await client.delete_queue(probe)  # late duplicate probes
    return time.monotonic() - started


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
    async with _clients(settings, deployment, batch_max) as (client, at):
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
            async with _clients(settings, (topology, command["prefix"]), share.batch_max) as (
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


def timeliness_arguments(
    p: argparse.ArgumentParser,
    *,
    repeats: int | None,
    repeats_help: str = "mechanism passes (rotated)",
) -> None:
    """The cell arguments the bench command and the Spark job share: rates, mechanisms,
    duration, repeats, warm-up and the steal rule."""
    p.add_argument(
        "--rates",
        type=numbers(0, 1e6, above=True),
        help="events/s, comma list (default rate: 100,200,400; subscriptions: 200)",
    )
    p.add_argument(
        "--mechanisms",
        type=names(MECHANISMS),
        default="none,inner,outer,both",
        help="the timeliness mechanisms compared (comma list)",
    )
    p.add_argument(
        "--duration", type=number(0, 86_400, above=True), default=10.0, help="seconds per cell"
    )
    p.add_argument("--repeats", type=integer(1, 10_000), default=repeats, help=repeats_help)
    p.add_argument(
        "--warmup", type=number(0, 3600), default=3.0, help="unmeasured seconds per cell"
    )
    p.add_argument(
        "--inbox-mirrors",
        type=integer(0, 16),
        default=0,
        help="RabbitMQ nodes holding each role queue (0: no mirroring policy)",
    )
    p.add_argument(
        "--role-queues",
        choices=("classic", "quorum"),
        default="classic",
        help="the role inboxes' queue type (quorum: replicated by RabbitMQ, no broker "
        "priorities on 3.x)",
    )
    steal_arguments(p)


def steal_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-steal",
        type=number(-100, 100),
        default=5.0,
        help="re-measure a cell during which the hypervisor took more than this %% of the "
        "CPU (steal); the disturbed cell is kept in the results as discarded (< 0: off)",
    )
    p.add_argument(
        "--steal-retries", type=integer(0, 100), default=2, help="re-measurements per cell at most"
    )


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
