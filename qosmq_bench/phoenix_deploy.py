"""The Phoenix deployment the benchmarks run (the paper's three clusters): its
workload (event types, subscriptions, the stream), the deployment started and stopped
as a user would (``qosmq phoenix``), the two clients, and the wait until every event
type is delivered."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.routing import (
    ChordRing,
    PhoenixClient,
    PhoenixDeployment,
    PhoenixTopology,
    SubscriptionRecord,
    role_queues,
)
from middleware.settings import Settings
from middleware.transport import AsyncClient, QueueKind, QueueSpec

__all__ = [
    "CLIENTS",
    "CLUSTERS",
    "Deployment",
    "Workload",
    "clients",
    "messages_of",
    "phoenix_cli",
    "subscriber_queue",
    "wait_ready",
]

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
async def clients(
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
    async with clients(settings, deployment) as (client, at):
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
