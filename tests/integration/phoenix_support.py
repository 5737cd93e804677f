"""What the Phoenix integration tests share: a topology file, a deployment of real role
processes (``PhoenixDeployment``, the API ``qosmq phoenix`` is made of), the CLI as a
user runs it, and one polling helper.

Each test file holds one behaviour; a file's deployment and traffic are a module fixture
when its tests check several claims about one run, so that each test states one claim
without starting thirteen processes again."""

from __future__ import annotations

import asyncio
import base64
import inspect
import json
import os
import re
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from middleware.localcluster import FaultProxy
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.routing import ChordRing, PhoenixDeployment
from middleware.routing.client import SyncPhoenixClient
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery
from qosmq_bench.phoenix_deploy import Deployment, phoenix_cli
from qosmq_bench.phoenix_recovery import _wait_all_served

T = TypeVar("T")


def write_topology(
    directory: Path,
    name: str,
    clusters: dict[str, dict[str, object]],
    fields: dict[str, object] | None = None,
) -> tuple[Path, PhoenixTopology]:
    """The test's topology file (top-level ``fields``, clusters with their own TOML
    fields) and its model; the shared store beside it."""
    topology = PhoenixTopology.model_validate(
        {
            "prefix": name,
            "state_store": str(directory / "state.sqlite3"),
            **(fields or {}),
            "clusters": [{"id": cluster, **own} for cluster, own in clusters.items()],
        }
    )
    return topology.write(directory / "phoenix.toml"), topology


def deployment(
    topology_file: Path, state: Path, settings: Settings, urls: str
) -> PhoenixDeployment:
    """A deployment whose role processes connect to ``urls`` (the test's brokers)."""
    env = {**os.environ, "QOSMQ_AMQP_URLS": urls}
    return PhoenixDeployment(topology_file, state, settings=settings, env=env)


@contextmanager
def running(
    directory: Path,
    name: str,
    settings: Settings,
    urls: str,
    clusters: dict[str, dict[str, object]],
    fields: dict[str, object] | None = None,
) -> Iterator[PhoenixDeployment]:
    """A deployment of ``clusters`` that is up inside the block and down after it, however
    the block ends (every role process stopped by its PID)."""
    topology_file, _ = write_topology(directory, name, clusters, fields)
    deployed = deployment(topology_file, directory / "state", settings, urls)
    deployed.up()
    try:
        yield deployed
    finally:
        if deployed.state_file.exists():
            deployed.down()


@contextmanager
def proxied(
    directory: Path, name: str, urls: list[str], clusters: list[str], **kwargs: Any
) -> Iterator[tuple[Deployment, dict[tuple[str, str], FaultProxy]]]:
    """A deployment of ``clusters`` whose every inter-cluster link goes through a fault
    proxy of its own (``kwargs``: ``Deployment``'s), up and every role served inside
    the block; the proxies by (from, to), closed after."""
    port = urllib.parse.urlsplit(urls[0]).port or 5672
    proxies = {(a, b): FaultProxy(port) for a in clusters for b in clusters if a != b}
    try:
        links = {pair: proxy.url for pair, proxy in proxies.items()}
        deployment = Deployment(
            directory, prefix=name, amqp_urls=urls, clusters=clusters, links=links, **kwargs
        )
        with deployment.running():
            _wait_all_served(deployment.phoenix(), 180)
            yield deployment, proxies
    finally:
        for proxy in proxies.values():
            proxy.close()


def cli(deployed: PhoenixDeployment, command: str, *arguments: str) -> str:
    """``qosmq phoenix COMMAND`` on the deployment, in a subprocess as a user runs it."""
    urls = deployed.env["QOSMQ_AMQP_URLS"].split(",")
    return phoenix_cli(command, deployed.topology_file, deployed.state_dir, urls, *arguments)


def owned_by(clusters: list[str], owner: str, prefix: str, skip: int = 0) -> str:
    """An event type (``prefix`` and a number) that ``owner`` owns on the ring."""
    ring = ChordRing(clusters)
    owned = (f"{prefix}{i}" for i in range(100_000) if ring.owner(f"{prefix}{i}") == owner)
    for _ in range(skip):
        next(owned)
    return next(owned)


def joining(clusters: list[str], carved_from: str, prefix: str) -> tuple[str, str]:
    """A newcomer whose arc is carved out of ``carved_from``'s, and an event type
    (``prefix`` and a number) inside that arc: ``carved_from``'s now, the newcomer's
    after it joins."""
    ring = ChordRing(clusters)
    joiner = next(f"D{i}" for i in range(500) if ring.owner(f"D{i}") == carved_from)
    after = ChordRing([*clusters, joiner])
    event_type = next(
        f"{prefix}{i}"
        for i in range(20000)
        if ring.owner(f"{prefix}{i}") == carved_from and after.owner(f"{prefix}{i}") == joiner
    )
    return joiner, event_type


def eventually(
    check: Callable[[], T],
    what: str,
    timeout: float = 30.0,
    interval: float = 0.1,
    *,
    strict: bool = True,
) -> T:
    """``check()`` once it is truthy; after ``timeout`` seconds an AssertionError naming
    ``what`` (and the last value seen), or with ``strict=False`` that last value, for the
    test to judge. The one polling loop of these tests."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            if not strict:
                return value
            raise AssertionError(f"no {what} in {timeout:.0f} s (last: {value!r})")
        time.sleep(interval)


async def eventually_async(
    check: Callable[[], Awaitable[T] | T],
    what: str,
    seconds: float = 30.0,
    interval: float = 0.1,
    *,
    strict: bool = True,
) -> T:
    """``eventually`` inside a running loop: ``check`` may be a coroutine function."""
    deadline = time.monotonic() + seconds
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            if not strict:
                return value  # type: ignore[return-value]
            raise AssertionError(f"no {what} in {seconds:.0f} s (last: {value!r})")
        await asyncio.sleep(interval)


async def take(client: AsyncClient, queue: str) -> list[dict[str, Any]]:
    """Every message waiting in ``queue`` now, decoded."""
    got = []
    while (d := await client.get(queue)) is not None:
        got.append(json.loads(d.body))
    return got


async def collect(
    client: AsyncClient,
    queue: str,
    done: Callable[[list[dict[str, Any]]], bool],
    what: str,
    seconds: float = 30.0,
    settle: float = 1.0,
    *,
    strict: bool = True,
) -> list[dict[str, Any]]:
    """The messages of ``queue`` once ``done(all so far)``, and whatever arrives in
    ``settle`` more seconds (a duplicate would); with ``strict=False`` what came in
    ``seconds`` when that is not enough, for the test to judge."""
    got: list[dict[str, Any]] = []

    async def enough() -> bool:
        got.extend(await take(client, queue))
        return done(got)

    await eventually_async(enough, what, seconds, strict=strict)
    await asyncio.sleep(settle)
    got.extend(await take(client, queue))
    return got


async def count_arrivals(
    settings: Settings,
    queue: str,
    done: asyncio.Event,
    arrived: Callable[[dict[str, Any], float], None],
) -> None:
    """The test's own counter of a subscriber queue, until ``done``: a consumer of its
    own connection, each copy (alone, or one of a batch) passed to ``arrived`` with the
    wall clock of its delivery.  Not ``basic.get``: one get per message (a channel
    opened for each) drained about 110 copies/s here, so the burst a detour releases
    waited in the queue up to 0.9 s for the counter, and read as late."""
    async with AsyncClient(settings=settings) as client:

        async def delivered(d: Delivery) -> None:
            at = time.time()
            parsed = json.loads(d.body)
            for body in parsed if isinstance(parsed, list) else [parsed]:
                arrived(body, at)

        tag = await client.consume(queue, delivered, prefetch=1000)
        await done.wait()
        await client.cancel(tag)


def attribute(message: dict[str, Any], key: str = "n") -> Any:
    """An attribute of the event a subscriber received."""
    return message["event"]["attributes"][key]


async def until_delivered(
    client: AsyncClient,
    queue: str,
    publish: Callable[[int], Awaitable[object]],
    what: str,
    accept: Callable[[dict[str, Any]], bool] = lambda message: True,
    seconds: float = 60.0,
) -> list[dict[str, Any]]:
    """Publish probe after probe (``publish(k)``, every 0.4 s) until one that ``accept``
    takes reaches ``queue``: the path is live end to end. Everything taken on the way."""
    got: list[dict[str, Any]] = []
    probes = 0

    async def arrived() -> bool:
        nonlocal probes
        got.extend(await take(client, queue))
        if any(accept(m) for m in got):
            return True
        await publish(probes)
        probes += 1
        await asyncio.sleep(0.4)
        return False

    await eventually_async(arrived, what, seconds, interval=0)
    return got


def event(event_type: str, **attributes: Any) -> dict[str, Any]:
    """An event as a publisher sends it."""
    return {"event_type": event_type, "attributes": attributes}


def management(settings: Settings, method: str, path: str, body: dict | None = None) -> int:
    """One call to the management API of the test cluster's first node; the HTTP status."""
    host, port, _ = settings.nodes[0]
    request = urllib.request.Request(
        f"http://{host}:{port + settings.management_port_offset}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:  # creating a vhost waits for it to start on every node: 10 s was seen to pass
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def role_metrics(deployed: PhoenixDeployment, role: RoleId) -> str:
    """The Prometheus text of a running role (``QOSMQ_METRICS_PORT=0``: its log names it)."""
    log = deployed.log_file(role)
    found = eventually(lambda: re.search(r"metrics: (http://\S+)", log.read_text()), "metrics")
    with urllib.request.urlopen(found.group(1), timeout=5) as response:
        return response.read().decode()


def sample(text: str, metric: str, **labels: str) -> float | None:
    """The value of one sample of ``metric`` whose labels include ``labels``; None if
    the role has no such sample."""
    for line in text.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def sync_e2e_subscriber(
    settings: Settings,
    topology: PhoenixTopology,
    queue: str,
    handled: list[int],
    stop: threading.Event,
    cluster: str = "A",
) -> None:
    """An e2e subscriber on the pika face (a thread's target) until ``stop``: appends
    each event's attribute ``n`` to ``handled``."""
    with SyncPhoenixClient.connect(settings, topology=topology, cluster=cluster) as client:
        client.consume(queue, lambda ev, _m: handled.append(ev.attributes["n"]), e2e=True)
        client.run(until=stop.is_set)
