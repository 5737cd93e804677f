"""Real failures: nodes killed with SIGKILL, links cut and blackholed through a proxy."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from middleware.errors import MiddlewareError
from middleware.localcluster.proxy import FaultProxy
from middleware.settings import Settings
from middleware.transport import AsyncClient, OutgoingMessage, QueueKind, QueueSpec, SyncClient
from tests.conftest import Face, LoopThread
from tests.processes import spawn_ready, stop

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos, pytest.mark.slow]


def _with_urls(settings: Settings, *urls: str) -> Settings:
    return settings.model_copy(update={"amqp_urls": tuple(urls)})


class Publisher(threading.Thread):
    """Publishes numbered messages with confirms until stopped; records what was confirmed."""

    def __init__(self, settings: Settings, queue: str, interval: float = 0.004) -> None:
        super().__init__(daemon=True)
        self.client = SyncClient(settings=settings).connect()
        self.queue, self.interval = queue, interval
        self.confirmed: list[str] = []
        self.failed: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        i = 0
        while not self.stop.is_set():
            mid = f"m{i}"
            try:
                self.client.publish(OutgoingMessage(mid.encode(), "", self.queue, message_id=mid))
                self.confirmed.append(mid)
            except MiddlewareError:
                self.failed.append(mid)
            i += 1
            time.sleep(self.interval)
        self.client.close()


@pytest.mark.parametrize(
    ("kind", "fault"),
    [
        ("async", "kill"),
        ("async-uvloop", "kill"),
        ("sync", "kill"),
        ("async", "stop"),  # a graceful stop: CONNECTION_FORCED, as in a rolling restart
        ("sync", "stop"),
    ],
)
def test_consumer_keeps_receiving_after_its_node_is_lost(
    kind, fault, settings, brokers, local_cluster, name
) -> None:
    urls = brokers.urls
    consumer = Face(kind, _with_urls(settings, *urls))  # connects to node 1 first
    consumer.call("connect")
    consumer.call("declare_queue", QueueSpec(name))
    got: set[str] = set()
    consumer.consume(name, lambda d: got.add(d.text()))
    publisher = Publisher(_with_urls(settings, urls[2], urls[1]), name)
    publisher.start()
    try:
        consumer.pump(20, until=lambda: len(got) >= 100)
        victim = brokers.node_of_url(consumer.client.connected_node)
        dead = consumer.client._live.connection if consumer.kind == "async" else None
        getattr(local_cluster, fault)(victim)
        killed_at = len(got)
        consumer.pump(30, until=lambda: len(got) >= killed_at + 200)
        if dead is not None:
            # the lost connection is closed on the client's loop, not left to aio-pika's __del__
            # (which, run from another thread, makes a close() coroutine nobody awaits)
            assert dead.is_closed
        publisher.stop.set()
        publisher.join(30)
        consumer.pump(30, until=lambda: set(publisher.confirmed) <= got)
    finally:
        publisher.stop.set()
    missing = set(publisher.confirmed) - got
    assert not missing, f"{len(missing)} confirmed messages never reached the consumer"
    assert len(got) > killed_at + 100, "consumer did not resume after the kill"
    assert consumer.client.reconnects >= 1
    assert brokers.node_of_url(consumer.client.connected_node) != victim
    consumer.call("delete_queue", name)
    consumer.close()


def test_a_lost_node_is_one_line_in_a_process_that_configured_no_logging(
    settings, brokers, local_cluster, name, tmp_path
) -> None:
    """aiormq logs its reader's end with a traceback; the layer says the loss in one line."""
    urls = brokers.urls
    publisher = SyncClient(settings=_with_urls(settings, urls[1], urls[2])).connect()
    publisher.declare_queue(QueueSpec(name))  # on node 2: the consumer's node 1 dies
    handled, stderr_file = tmp_path / "handled", tmp_path / "stderr"
    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(urls)}

    def publish_and_wait(first: int, count: int) -> None:
        for i in range(first, first + count):
            publisher.publish(OutgoingMessage(b"x", "", name, message_id=f"m{i}"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if handled.exists() and len(handled.read_text().splitlines()) >= first + count:
                return
            time.sleep(0.1)
        pytest.fail(f"the consumer did not handle {first + count} messages")

    with stderr_file.open("w") as stderr:
        proc = spawn_ready(
            "tests.e2e_processes", "consumer", "async", name, str(handled), env=env, stderr=stderr
        )
        try:
            publish_and_wait(0, 50)
            local_cluster.kill(brokers.node_of_url(urls[0]))
            publish_and_wait(50, 50)
        finally:
            stop(proc)
    publisher.delete_queue(name)
    publisher.close()
    said = stderr_file.read_text()
    assert "lost" in said and "failing over" in said, said  # the fault bit, and was said
    assert "Traceback" not in said, said


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_no_confirmed_message_is_lost_when_the_publishers_node_is_killed(
    event_loop, settings, brokers, local_cluster, name
) -> None:
    loop = LoopThread(event_loop)
    client = AsyncClient(settings=settings)
    total = 4000

    async def scenario() -> tuple[list[str], int]:
        await client.connect()
        await client.declare_queue(QueueSpec(name))
        victim = brokers.node_of_url(client.connected_node)

        async def one(i: int) -> str:
            await client.publish(OutgoingMessage(b"x" * 100, "", name, message_id=f"m{i}"))
            return f"m{i}"

        tasks = [asyncio.ensure_future(one(i)) for i in range(total)]
        while sum(t.done() for t in tasks) < total // 4:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        await asyncio.get_running_loop().run_in_executor(None, local_cluster.kill, victim)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        confirmed = [r for r in results if isinstance(r, str)]
        return confirmed, len(results) - len(confirmed)

    try:
        confirmed, failed = loop.run(scenario(), timeout=240)
        stored: list[str] = []

        async def drain() -> None:
            while (d := await client.get(name)) is not None:
                stored.append(d.message_id or "")

        loop.run(drain(), timeout=120)
        loop.run(client.delete_queue(name))
        loop.run(client.close())
    finally:
        loop.stop()
    assert client.reconnects >= 1
    assert len(confirmed) + failed == total
    lost = set(confirmed) - set(stored)
    assert not lost, f"{len(lost)} of {len(confirmed)} confirmed messages are not on the broker"
    # every publish either was confirmed or raised: none vanished silently
    assert len(confirmed) == total, f"{failed} publishes failed instead of failing over"


@pytest.mark.parametrize(
    ("fault", "kind"),
    [
        ("cut", "async"),
        ("blackhole", "async"),
        ("cut", "async-uvloop"),
        ("cut", "sync"),
        ("blackhole", "sync"),
    ],
)
def test_link_failure_through_the_proxy_is_survived(fault, kind, settings, brokers, name) -> None:
    ports = [int(u.rstrip("/").rsplit(":", 1)[1]) for u in brokers.urls]
    p1, p2 = FaultProxy(ports[0]), FaultProxy(ports[-1])
    client = Face(kind, _with_urls(settings, p1.url, p2.url))
    try:
        client.call("connect")
        assert client.client.connected_node.endswith(f":{p1.port}")
        client.call("declare_queue", QueueSpec(name))
        got: set[str] = set()
        client.consume(name, lambda d: got.add(d.text()))
        for i in range(20):
            client.call("publish", OutgoingMessage(f"a{i}".encode(), "", name))
        client.pump(10, until=lambda: len(got) >= 20)
        if fault == "cut":
            p1.cut(refuse=True)
        else:
            p1.blackhole()
            p1.refusing = True
        started = time.monotonic()
        for i in range(20):
            client.call("publish", OutgoingMessage(f"b{i}".encode(), "", name))
        failover_s = time.monotonic() - started
        client.pump(20, until=lambda: len(got) >= 40)
        assert got == {f"a{i}" for i in range(20)} | {f"b{i}" for i in range(20)}
        assert client.client.connected_node.endswith(f":{p2.port}")
        assert failover_s < 30
        client.call("delete_queue", name)
    finally:
        client.close()
        p1.close()
        p2.close()


def test_cli_status_reports_members(brokers, local_cluster) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "middleware.cli",
            "cluster",
            "status",
            "--json",
            "--state-dir",
            str(local_cluster.layout.state_dir),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    status = json.loads(proc.stdout)
    assert len(status["members"]) == 3
    assert all(n["running"] and n["pid"] for n in status["nodes"])


_LEFT_OPEN = """
import logging, sys
from middleware import OutgoingMessage, QueueKind, QueueSpec, Settings, connect
from middleware.runtime import run

logging.basicConfig(level=logging.INFO, stream=sys.stderr)

async def main() -> None:
    client = await connect(Settings.load())
    await client.declare_queue(QueueSpec(sys.argv[1], kind=QueueKind.CLASSIC, exclusive=True))
    await client.publish(OutgoingMessage(b"x", "", sys.argv[1]))
    print("left open")            # no client.close(): the loop's end closes it

run(main(), event_loop=sys.argv[2])
print("loop ended")
"""


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_a_client_left_open_stops_at_the_end_of_the_loop(event_loop, brokers, name) -> None:
    """asyncio.run cancels every task at its end, aiormq's reader too, and the connection
    closes with the CancelledError a stuck (heartbeat) connection also gets: the client must
    stop there, not fail over into a closing loop (it logged "failing over", connected to the
    next node and left tasks pending). The blackhole test above covers the stuck case."""
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", _LEFT_OPEN, name, event_loop],
        env={**os.environ, "QOSMQ_AMQP_URLS": ",".join(brokers.urls)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["left", "open", "loop", "ended"]
    for sign in ("failing over", "Task was destroyed", "Traceback", "never awaited"):
        assert sign not in done.stderr, done.stderr


@pytest.mark.parametrize("step", ["connect", "reply consumer"])
def test_an_e2e_publisher_whose_first_start_meets_a_cut_link_starts_clean_after_it(
    step, settings, brokers, name
) -> None:
    """The first use of a connection broken at each step of its set-up: the connection
    itself (no node answers: the client is kept connecting in the background), or the
    reply consumer (the connection fails over while the listener waits for it, and the
    failover already consumed the replies: a second consume closed the channel with
    "reply consumer already set" and every later e2e publish failed).  After the heal
    the publisher starts, its publishes are confirmed."""
    from middleware.confirms import AsyncConfirmConsumer, AsyncConfirmPublisher
    from middleware.localcluster.proxy import FaultProxy

    port = int(brokers.urls[0].rstrip("/").rsplit(":", 1)[1])
    proxy = FaultProxy(port)
    through = _with_urls(settings, proxy.url).model_copy(update={"connect_timeout": 4.0})

    async def scenario() -> int:
        async with AsyncClient(settings=settings) as consumer_client:
            await consumer_client.declare_queue(QueueSpec(name))
            consumer = AsyncConfirmConsumer(consumer_client)
            got: list[str] = []

            async def handle(d) -> None:
                got.append(d.message_id)

            await consumer.consume(name, handle)
            client = AsyncClient(settings=through)
            if step == "connect":
                proxy.cut()
                with pytest.raises(MiddlewareError):
                    await client.connect()
                client.reconnect_in_background()
            else:
                await client.connect()
                proxy.cut()
            loop = asyncio.get_running_loop()
            loop.call_later(1.0, proxy.heal)  # within connect_timeout: start waits for it
            publisher = AsyncConfirmPublisher(client, mode="e2e")
            await publisher.start()
            await client.declare_queue(QueueSpec(name))
            for i in range(20):
                await publisher.publish(b"x", routing_key=name, message_id=f"m{i}")
            await publisher.close()
            await client.close()
            await consumer.close()
            await consumer_client.delete_queue(name)
            return len(set(got))

    try:
        handled = asyncio.run(scenario())
    finally:
        proxy.close()
    assert handled == 20


def _stop_writer(client: AsyncClient) -> None:
    """Stop the writer of ``client``'s connection (aiormq's task): nothing empties the
    connection's frame queue from now, and aiormq closes the connection, as when a
    connection is lost with its queue full (the only way to hold that moment still)."""
    underlay = client._live.connection.transport.connection  # type: ignore[union-attr]
    underlay._writer_task.cancel()


@pytest.mark.parametrize("how", ["watched", "unconfirmed"])
def test_publishes_waiting_for_room_on_a_connection_that_closes_all_end(
    how, settings, brokers, name
) -> None:
    """Unconfirmed publishes (``publish_watched``, as a Phoenix e2e copy leaves, or
    ``publish(confirm=False)``) waiting for room in the connection's frame queue when
    the connection goes: each ends with a named error, none hangs.  Only the
    connection's writer empties that queue; once the writer stopped, a publish that
    waited for room waited forever before, holding its channel's lock, and every publish
    behind it hung as well.  That is how a Phoenix match broker's copies hung when a
    link was cut under load (never settled; the copies of those events to be carried
    around the link never carried).  The moment is held still here by stopping the
    writer first (aiormq then closes the connection with the broker's handshake); the
    count is the test's own: the publisher tasks that ended."""
    publishers = 24

    async def scenario() -> tuple[int, int, list[BaseException]]:
        async with AsyncClient(settings=settings) as admin:
            await admin.declare_queue(QueueSpec(name))
            client = await AsyncClient(settings=settings).connect()
            message = OutgoingMessage(b"x" * 1024, "", name)
            await client.publish_watched(message)  # the watched channel is open

            async def publisher() -> None:
                while True:  # until a publish fails
                    if how == "watched":
                        await client.publish_watched(message)
                    else:
                        await client.publish(message, confirm=False, retry=False)

            _stop_writer(client)
            tasks = [asyncio.ensure_future(publisher()) for _ in range(publishers)]
            done, pending = await asyncio.wait(tasks, timeout=15)
            for task in pending:
                task.cancel()
            errors = [t.exception() for t in done if not t.cancelled()]
            await client.close()
            await admin.delete_queue(name)
            return len(done), len(pending), [e for e in errors if e is not None]

    ended, hung, errors = asyncio.run(scenario())
    assert hung == 0, f"{hung} of {publishers} publishers never ended ({ended} ended)"
    unnamed = [e for e in errors if not isinstance(e, MiddlewareError)]
    assert len(errors) == publishers and not unnamed, unnamed[:3]


def test_settlements_waiting_for_room_on_a_connection_that_closes_all_end(
    settings, brokers, name
) -> None:
    """The consumer's side of the test above: a handler's ack waiting for room in the
    frame queue of a connection that goes ends (the delivery comes again on the next
    connection); none is left running.  aiormq's own ``basic_ack`` waited for ever
    there, and the handler's task with it (a Phoenix role's inbox handlers were still
    running at its stop).  The count is the test's: handler tasks still running."""
    fast = settings.model_copy(update={"close_grace": 2.0})

    async def scenario() -> tuple[int, int]:
        async with AsyncClient(settings=settings) as admin:
            await admin.declare_queue(QueueSpec(name))
            for i in range(3000):
                await admin.publish(
                    OutgoingMessage(b"x", "", name, message_id=f"m{i}"), confirm=False
                )
            client = await AsyncClient(settings=fast).connect()
            handled = [0]
            going = asyncio.Event()
            first = client._live.connection  # type: ignore[union-attr]
            on_first: set[asyncio.Task[None]] = set()  # the first connection's handlers

            async def handler(delivery) -> None:
                handled[0] += 1
                live = client._live
                if getattr(live, "connection", None) is first:
                    on_first.add(asyncio.current_task())  # type: ignore[arg-type]
                if handled[0] >= 200:
                    going.set()

            await client.consume(name, handler, prefetch=500)
            await asyncio.wait_for(going.wait(), 30)
            _stop_writer(client)
            await asyncio.sleep(3.0)  # the connection closes; the client fails over
            # Only the first connection's handlers count: the next connection's deliveries
            # are handled (and settled) while the test looks, as they should be.
            running = sum(1 for task in on_first if not task.done())
            await client.close()
            await admin.delete_queue(name)
            return running, handled[0]

    running, handled = asyncio.run(scenario())
    assert handled >= 200
    assert running == 0, f"{running} handlers still running 3 s after their connection went"


def test_a_sync_consumer_whose_queue_vanishes_during_the_replay_is_restored(
    settings, brokers, name
) -> None:
    """A sync client fails over; while it replays, its exclusive queue vanishes between
    the declare and the consume (as when the broker removes a lost node's exclusive queues
    while the client declares its own again elsewhere: seen in the chaos node window, where
    ``run()`` then died of a 404).  The deletion is real, on the broker, at that moment;
    the client declares the queue again and goes on consuming."""
    ports = [int(u.rstrip("/").rsplit(":", 1)[1]) for u in brokers.urls]
    p1, p2 = FaultProxy(ports[0]), FaultProxy(ports[-1])
    client = SyncClient(settings=_with_urls(settings, p1.url, p2.url)).connect()
    queue = f"{name}.reply"
    try:
        client.declare_queue(
            QueueSpec(queue, kind=QueueKind.CLASSIC, durable=False, exclusive=True)
        )
        got: list[bytes] = []
        client.consume(queue, lambda d: got.append(d.body))
        apply, vanished = client._apply, []

        def apply_then_delete(live, spec):
            result = apply(live, spec)
            if isinstance(spec, QueueSpec) and spec.name == queue and not vanished:
                channel = live.connection.channel()
                channel.queue_delete(queue)  # gone before the consumer is replayed
                channel.close()
                vanished.append(True)
            return result

        client._apply = apply_then_delete
        p1.cut(refuse=True)
        client.run(5.0, until=lambda: client.connected_node.endswith(f":{p2.port}"))
        assert vanished, "the replay did not run"
        assert client.connected_node.endswith(f":{p2.port}")
        for i in range(5):
            client.publish(OutgoingMessage(f"m{i}".encode(), "", queue))
        client.run(10.0, until=lambda: len(got) >= 5)
        assert sorted(got) == [f"m{i}".encode() for i in range(5)]
    finally:
        client.close()
        p1.close()
        p2.close()


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_consumer_of_a_queue_gone_while_it_failed_over_waits_for_it(
    kind, settings, brokers, name
) -> None:
    """A queue the client consumes but does not declare (another service owns it) is
    deleted while the client's link is cut: the failover replays without it (no error
    out of ``run()``; the asyncio face's failover no longer fails over and over on the
    404) and the consumer is subscribed again once the queue is back."""
    ports = [int(u.rstrip("/").rsplit(":", 1)[1]) for u in brokers.urls]
    p1, p2 = FaultProxy(ports[0]), FaultProxy(ports[-1])
    owner = SyncClient(settings=settings).connect()
    client = Face(kind, _with_urls(settings, p1.url, p2.url))
    client.call("connect")
    try:
        owner.declare_queue(QueueSpec(name))
        got: list[bytes] = []
        client.consume(name, lambda d: got.append(d.body))
        p1.cut(refuse=True)
        owner.delete_queue(name)
        client.pump(5.0, until=lambda: (client.client.connected_node or "").endswith(f":{p2.port}"))
        assert client.client.connected_node.endswith(f":{p2.port}")
        client.pump(1.0)  # the queue is not there: nothing raised
        client.call("publish", OutgoingMessage(b"other", "", "", mandatory=False))  # it goes on
        owner.declare_queue(QueueSpec(name))
        for i in range(5):
            owner.publish(OutgoingMessage(f"m{i}".encode(), "", name))
        client.pump(30.0, until=lambda: len(got) >= 5)
        assert sorted(got) == [f"m{i}".encode() for i in range(5)]
    finally:
        with contextlib.suppress(MiddlewareError):
            owner.delete_queue(name)
        owner.close()
        client.close()
        p1.close()
        p2.close()
