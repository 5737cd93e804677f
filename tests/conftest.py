"""Session fixtures: a real RabbitMQ cluster, settings pointing at it, and both client faces.

Where the brokers come from, first that applies:
1. ``QOSMQ_AMQP_URLS`` is set: use that cluster (chaos tests skip: they need node control).
2. ``QOSMQ_TEST_DOCKER=1`` and a Docker engine answers: one RabbitMQ container
   (testcontainers); cluster and chaos tests skip.
3. Otherwise: a local 3-node cluster of plain processes (the embedded default)
   in a temporary state dir on its own ports, torn down by PID at the end.
Every path returns only after a real AMQP handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from middleware.localcluster import ClusterLayout, LocalCluster
from middleware.localcluster.manager import _amqp_handshake
from middleware.runtime import EventLoopName, loop_factory
from middleware.settings import Settings
from middleware.transport import AsyncClient, SyncClient
from middleware.transport.management import management_get

TEST_BASE_PORT = int(os.environ.get("QOSMQ_TEST_BASE_PORT", "5790"))


@dataclass
class Brokers:
    urls: tuple[str, ...]
    cluster: LocalCluster | None
    source: str

    def node_of_url(self, url: str) -> str:
        assert self.cluster is not None
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        for node in self.cluster.layout.nodes:
            if node.amqp_port == port:
                return node.short_name
        raise KeyError(url)


def _wait_handshake(urls: tuple[str, ...], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    for url in urls:
        port = int(url.rstrip("/").rsplit(":", 1)[1])
        while not _amqp_handshake(port, 2.0):
            if time.monotonic() > deadline:
                raise RuntimeError(f"no AMQP handshake from {url} within {timeout} s")
            time.sleep(0.5)


def _docker_answers() -> bool:
    if os.environ.get("QOSMQ_TEST_DOCKER") != "1" or not shutil.which("docker"):
        return False
    try:
        import docker  # type: ignore[import-untyped]

        docker.from_env().ping()
    except Exception:
        return False
    return True


@pytest.fixture(scope="session")
def brokers() -> Iterator[Brokers]:
    env_urls = os.environ.get("QOSMQ_AMQP_URLS")
    if env_urls:
        urls = tuple(Settings.load(amqp_urls=env_urls).amqp_urls)
        given = Brokers(urls, None, "QOSMQ_AMQP_URLS")
        yield given
        _delete_leftover_queues(given)
        return
    if _docker_answers():
        from testcontainers.rabbitmq import RabbitMqContainer

        with RabbitMqContainer("rabbitmq:3.13-management") as container:
            port = int(container.get_exposed_port(5672))
            urls = (f"amqp://127.0.0.1:{port}/",)
            _wait_handshake(urls)
            yield Brokers(urls, None, "testcontainers")
        return
    state = Path(tempfile.mkdtemp(prefix="qosmq-test-cluster-"))
    cluster = LocalCluster(ClusterLayout(state_dir=state, size=3, base_port=TEST_BASE_PORT))
    started = time.monotonic()
    try:
        status = cluster.up()
        urls = tuple(status["amqp_urls"])
        _wait_handshake(urls)
        print(f"\nlocal test cluster up in {time.monotonic() - started:.1f} s: {urls}")
        yield Brokers(urls, cluster, "local cluster")
    finally:
        cluster.down(purge=True)


@pytest.fixture
def settings(brokers: Brokers) -> Settings:
    """Settings for the test brokers with fast failure detection."""
    return broker_settings(brokers)


@pytest.fixture(scope="module")
def module_settings(brokers: Brokers) -> Settings:
    """``settings`` for a module's shared fixtures (a deployment and its traffic)."""
    return broker_settings(brokers)


@pytest.fixture(scope="module")
def module_name() -> str:
    """``name`` for a module's shared fixtures."""
    return _new_name()


def broker_settings(brokers: Brokers) -> Settings:
    return Settings.load(
        amqp_urls=",".join(brokers.urls),
        heartbeat=2,
        connect_timeout=3,
        retry={"attempts": 30, "initial_delay": 0.1, "max_delay": 1.0, "jitter": 0.05},
        publish_timeout=20,
        consumer_check_s=1.0,
    )


@pytest.fixture
def local_cluster(brokers: Brokers) -> Iterator[LocalCluster]:
    """The local cluster for chaos tests; every node is running again afterwards."""
    if brokers.cluster is None:
        pytest.skip(f"chaos tests need the local cluster (brokers from {brokers.source})")
    yield brokers.cluster
    brokers.cluster.up()


@pytest.fixture
def name() -> str:
    """A unique name for this test's queues and exchanges."""
    return _new_name()


_NAMES: list[str] = []  # every name handed out this session


def _new_name() -> str:
    _NAMES.append(f"t-{uuid.uuid4().hex[:10]}")
    return _NAMES[-1]


def _delete_leftover_queues(brokers: Brokers) -> None:
    """On brokers the tests did not start (``QOSMQ_AMQP_URLS``), delete at the end the
    queues named after this session's test names: thousands of idle queues left behind
    by earlier runs slow the brokers (and every benchmark run on them).  Needs the
    management API to list them; without it they stay.  (Called by ``brokers`` when it
    ends, so a session of tests that need no broker starts none.)"""
    if brokers.cluster is not None or not _NAMES:
        return
    settings = broker_settings(brokers)
    try:
        queues = management_get(settings, "/api/queues?columns=name,vhost", timeout=30)
    except (OSError, ValueError):
        return
    names = tuple(_NAMES)
    leftover = [
        q["name"] for q in queues if q["vhost"] == settings.vhost and q["name"].startswith(names)
    ]
    if not leftover:
        return
    with contextlib.suppress(Exception), SyncClient(settings=settings) as client:
        for queue in leftover:
            client.delete_queue(queue)


# ------------------------------------------------------------- both faces
class LoopThread:
    """An event loop in a thread, so one test body can drive the async client."""

    def __init__(self, event_loop: EventLoopName = "asyncio") -> None:
        factory = loop_factory(event_loop)
        self.loop = factory() if factory else asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Cancel what is still pending (consumer iterators, timers), then close the loop."""

        async def cancel_pending() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_pending(), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class Face:
    """One blocking API over either client (aio-pika's connection_fabric idea)."""

    kind: str

    def __init__(self, kind: str, settings: Settings) -> None:
        """``kind``: ``sync``, ``async`` (asyncio's loop) or ``async-uvloop``; or the test
        doubles of ``middleware.testing``, ``double-async`` and ``double-sync``, each on an
        in-memory broker of its own (the same contract must hold for them)."""
        self.double = kind.startswith("double-")
        kind = kind.removeprefix("double-")
        self.kind = "async" if kind.startswith("async") else kind
        self.settings = settings
        factories: tuple[Any, Any] = (AsyncClient, SyncClient)
        extra: dict[str, Any] = {}
        if self.double:
            from middleware.testing import InMemoryBroker, InMemoryClient, InMemorySyncClient

            factories, extra = (InMemoryClient, InMemorySyncClient), {"broker": InMemoryBroker()}
        self.factory = factories[0] if self.kind == "async" else factories[1]
        self.extra = extra
        if self.kind == "async":
            self.loop = LoopThread("uvloop" if kind == "async-uvloop" else "asyncio")
        self.client: Any = self.new_client()

    def new_client(self) -> Any:
        """Another client of the same kind (on the same in-memory broker for a double)."""
        return self.factory(settings=self.settings, **self.extra)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        result = getattr(self.client, method)(*args, **kwargs)
        return self.loop.run(result) if self.kind == "async" else result

    def consume(self, queue: str, handler: Callable[[Any], None], **kwargs: Any) -> str:
        if self.kind == "async":

            async def ahandler(delivery: Any) -> None:
                handler(delivery)

            return str(self.loop.run(self.client.consume(queue, ahandler, **kwargs)))
        return str(self.client.consume(queue, handler, **kwargs))

    def pump(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Let deliveries flow for up to ``seconds`` (stop early when ``until()``)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and until()):
            if self.kind == "async":
                time.sleep(0.05)
            else:
                self.client.run(0.1)

    def close(self) -> None:
        self.call("close")
        if self.kind == "async":
            self.loop.stop()


@pytest.fixture(params=["async", "sync"])
def face(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Face]:
    f = Face(request.param, settings)
    f.call("connect")
    yield f
    f.close()


@pytest.fixture(params=["async", "sync", "double-async", "double-sync"])
def contract_face(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Face]:
    """Both real faces and both test doubles: the contract a service may rely on."""
    f = Face(request.param, settings)
    f.call("connect")
    yield f
    f.close()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``last`` (they load the whole machine) run after every other test,
    so none of them sets the scene for a timing-sensitive one."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)
