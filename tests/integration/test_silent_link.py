"""Confirms through a silent link: a blackholed route to the publisher's or a consumer's
node (the TCP proxy forwards nothing and closes nothing, as a partition does).

Before ``transport/silence.py`` the connection stayed open until aiormq's rule (33 s
of silence at ``heartbeat`` 10, 9 s at the tests' 2) or pika's (``heartbeat + 5`` s,
checked once or twice): every confirm through it waited that long.  Now a connection
that hears nothing for 1.5 heartbeats (a live one is silent one at most) is closed and the
client fails over, so confirms go on while the link is still silent (a consumer's
messages held by its silent connection come back by the publisher's resend after
``receipt_timeout``, 5 s).  Every publish and every handling is counted by the
test's own handlers.  For a silent consumer, ``face`` is the consumer's: the sync e2e
consumer's receipts leave on a replies connection of their own, beside its consumer
connection; while its watchdog waited on the silent link, nothing looked at the replies
connection, its late look excused the silence, and the receipts sent there were lost 3 s
more (the longest confirm 10.3-10.5 s in 4 runs, 5.0 s since the sync face looks at the
socket first: ``transport/silence.py``).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest

from middleware import runtime
from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmConsumer,
    SyncConfirmPublisher,
)
from middleware.localcluster.manager import LocalCluster
from middleware.localcluster.proxy import FaultProxy
from middleware.settings import Settings
from middleware.transport import (
    AsyncClient,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.cluster, pytest.mark.chaos]

RATE = 20.0
BEFORE_S, SILENT_S, AFTER_S = 3.0, 12.0, 2.0


@dataclass
class _Counts:
    published: dict[str, tuple[float, float, str | None]] = field(default_factory=dict)
    handled: dict[str, Counter[str]] = field(default_factory=dict)

    def record(self, mid: str, started: float, error: BaseException | None) -> None:
        self.published[mid] = (started, time.monotonic(), None if error is None else repr(error))


def _urls(settings: Settings, *urls: str) -> Settings:
    return settings.model_copy(update={"amqp_urls": tuple(urls)})


async def _topology(client: AsyncClient, exchange: str, queues: list[str], kind: QueueKind) -> None:
    await client.declare_exchange(ExchangeSpec(exchange, ExchangeType.FANOUT))
    for q in queues:
        await client.declare_queue(QueueSpec(q, kind=kind))
        await client.bind(BindingSpec(q, exchange))


def _publish_sync(
    settings: Settings, mode: str, exchange: str, queues: list[str], counts: _Counts, until: float
) -> None:
    """Publishes at ``RATE`` on the pika face.  Between two, the e2e publisher runs the
    client (its receipts arrive there); the broker-confirm one sleeps, as a plain loop
    would, so the client's silence rule runs only inside its blocking publishes (before
    it ticked on pika's deferred timers there: pika's own rule found the silence after
    14 s)."""
    client = SyncClient(settings=settings).connect()
    kind = QueueKind.QUORUM if mode == "e2e" else QueueKind.CLASSIC
    try:
        client.declare_exchange(ExchangeSpec(exchange, ExchangeType.FANOUT))
        for q in queues:
            client.declare_queue(QueueSpec(q, kind=kind))
            client.bind(BindingSpec(q, exchange))
        publisher = SyncConfirmPublisher(client, mode=mode)
        i = 0
        while time.monotonic() < until:
            mid, started = f"m{i}", time.monotonic()
            try:
                publisher.publish(b"x" * 100, exchange=exchange, message_id=mid)
                counts.record(mid, started, None)
            except Exception as exc:
                counts.record(mid, started, exc)
            i += 1
            if mode == "e2e":
                client.run(1 / RATE)
            else:
                time.sleep(1 / RATE)
    finally:
        client.close()


async def _publish_async(
    settings: Settings, mode: str, exchange: str, queues: list[str], counts: _Counts, until: float
) -> None:
    client = await AsyncClient(settings=settings).connect()
    kind = QueueKind.QUORUM if mode == "e2e" else QueueKind.CLASSIC
    await _topology(client, exchange, queues, kind)
    publisher = await AsyncConfirmPublisher(client, mode=mode).start()
    tasks: set[asyncio.Task[None]] = set()

    async def one(mid: str) -> None:
        started = time.monotonic()
        try:
            await publisher.publish(b"x" * 100, exchange=exchange, message_id=mid)
            counts.record(mid, started, None)
        except Exception as exc:
            counts.record(mid, started, exc)

    i = 0
    while time.monotonic() < until:
        task = asyncio.create_task(one(f"m{i}"))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        i += 1
        await asyncio.sleep(1 / RATE)
    await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await publisher.close()
    await client.close()


def _consume_sync(
    settings: Settings,
    mode: str,
    queue: str,
    handled: Counter[str],
    ready: threading.Event,
    stop: threading.Event,
) -> None:
    """The consumer of ``queue`` on the pika face, run in a thread until ``stop``: its
    silence rule ticks inside ``run`` (pika's I/O timers), and a failover subscribes it
    again on the next node."""
    client = SyncClient(settings=settings).connect()

    def handle(d: Delivery) -> None:
        handled[d.message_id or ""] += 1

    try:
        if mode == "e2e":
            consumer = SyncConfirmConsumer(client)
            consumer.consume(queue, handle)
            ready.set()
            consumer.run(until=stop.is_set)
        else:
            client.consume(queue, handle)
            ready.set()
            client.run(until=stop.is_set)
    finally:
        client.close()


@pytest.mark.parametrize(
    ("silent", "face", "mode"),
    [
        ("publisher", "async", "e2e"),
        ("publisher", "sync", "e2e"),
        ("publisher", "async", "broker"),
        ("publisher", "sync", "broker"),
        ("consumer", "async", "e2e"),
        ("consumer", "sync", "e2e"),  # for a consumer, the face is the silent consumer's
        ("consumer", "async", "broker"),
        ("consumer", "sync", "broker"),
    ],
)
def test_confirms_go_on_while_a_link_is_silent(silent, face, mode, settings, brokers, name) -> None:
    ports = [int(u.rstrip("/").rsplit(":", 1)[1]) for u in brokers.urls]
    proxy = FaultProxy(ports[0])
    via = _urls(settings, proxy.url, brokers.urls[-1])  # the silent one, then another node
    direct = _urls(settings, brokers.urls[-1])
    queues = [f"{name}.{i}" for i in range(3 if mode == "e2e" else 1)]
    kind = QueueKind.QUORUM if mode == "e2e" else QueueKind.CLASSIC
    counts = _Counts()
    events: dict[str, float] = {}

    def blackhole() -> None:
        time.sleep(BEFORE_S)
        events["silent"] = time.monotonic()
        proxy.blackhole()
        proxy.refusing = True
        time.sleep(SILENT_S)
        events["heal"] = time.monotonic()
        proxy.heal()

    stop_consumer = threading.Event()
    sync_consumer: threading.Thread | None = None

    async def run() -> None:
        nonlocal sync_consumer
        clients = []
        for i, q in enumerate(queues):
            at = via if (silent == "consumer" and i == 0) else direct
            client = await AsyncClient(settings=at if face == "async" else direct).connect()
            clients.append(client)
            await _topology(client, name, queues, kind)
            handled = counts.handled[q] = Counter()
            if at is via and face == "sync":  # the silent consumer on the pika face
                ready = threading.Event()
                args = (at, mode, q, handled, ready, stop_consumer)
                sync_consumer = threading.Thread(target=_consume_sync, args=args, daemon=True)
                sync_consumer.start()
                assert await asyncio.to_thread(ready.wait, 30), "the sync consumer did not start"
                continue

            async def handle(d: Delivery, handled: Counter[str] = handled) -> None:
                handled[d.message_id or ""] += 1

            if mode == "e2e":
                await AsyncConfirmConsumer(client).consume(q, handle)
            else:
                await client.consume(q, handle)
        until = time.monotonic() + BEFORE_S + SILENT_S + AFTER_S
        threading.Thread(target=blackhole, daemon=True).start()
        publishing = via if silent == "publisher" else direct
        if face == "sync" and silent == "publisher":
            await asyncio.to_thread(_publish_sync, publishing, mode, name, queues, counts, until)
        else:
            await _publish_async(publishing, mode, name, queues, counts, until)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(  # noqa: ASYNC110 - the test's counters
            len(h) < len(counts.published) for h in counts.handled.values()
        ):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # late redeliveries of the silent consumer's messages
        stop_consumer.set()
        if sync_consumer is not None:
            await asyncio.to_thread(sync_consumer.join, 30)
        for q in queues:
            await clients[-1].delete_queue(q)
        for client in clients:
            await client.close()

    try:
        runtime.run(run())
    finally:
        stop_consumer.set()
        proxy.close()
    failed = {m: e for m, (_, _, e) in counts.published.items() if e is not None}
    assert failed == {}, failed
    assert len(counts.published) > RATE * (BEFORE_S + AFTER_S)
    # confirms went on while the link was still silent: a message published after the
    # route went silent was confirmed before the heal
    during = [
        done
        for started, done, _ in counts.published.values()
        if events["silent"] <= started and done < events["heal"]
    ]
    assert during, "no confirm while the link was silent"
    # and sooner than the AMQP clients' own rules would have closed the connection
    # (aiormq: 3 * (heartbeat + 1) s of silence; pika: heartbeat + 5 s, checked twice)
    longest = max(done - started for started, done, _ in counts.published.values())
    print(f"\n{silent} {face} {mode}: {len(counts.published)} confirmed, longest {longest:.1f} s")
    assert longest < 3 * (settings.heartbeat + 1) - 1.5, f"a confirm waited {longest:.1f} s"
    for q, handled in counts.handled.items():
        assert set(handled) >= set(counts.published), f"{q}: confirmed but never handled"
        if mode == "e2e":
            assert max(handled.values()) == 1, f"{q}: handled twice"


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_blocked_connection_is_not_taken_for_a_silent_one(face, settings, brokers, name) -> None:
    """A memory alarm blocks every publishing connection for as long as it lasts (here 8 s,
    more than twice the 3 s the rule allows at ``heartbeat`` 2).  RabbitMQ's heartbeat
    sender goes on beating to a blocked connection (``rabbit_heartbeat.erl``: only the
    receiver's monitor pauses), so the client hears it and does not fail over: the
    publish waits for the alarm's end on its own connection, and is confirmed.  The test
    counts the client's reconnects and times the publish itself."""
    if brokers.cluster is None:
        pytest.skip("needs rabbitmqctl on the local cluster's nodes")
    cluster = brokers.cluster
    node = cluster.layout.nodes[0].short_name
    alarm_s = 8.0
    one = _urls(settings, brokers.urls[0])
    message = OutgoingMessage(b"x", "", name, message_id="blocked")
    try:
        if face == "async":

            async def run() -> tuple[float, int]:
                async with AsyncClient(settings=one) as client:
                    await client.declare_queue(QueueSpec(name))
                    await asyncio.to_thread(cluster.ctl, node, "set_vm_memory_high_watermark", "0")
                    threading.Timer(alarm_s, _unblock, (cluster, node)).start()
                    started = time.monotonic()
                    await asyncio.wait_for(client.publish(message), 60)
                    took, reconnects = time.monotonic() - started, client.reconnects
                    await client.delete_queue(name)
                    return took, reconnects

            took, reconnects = runtime.run(run())
        else:
            client = SyncClient(settings=one).connect()
            try:
                client.declare_queue(QueueSpec(name))
                cluster.ctl(node, "set_vm_memory_high_watermark", "0")
                threading.Timer(alarm_s, _unblock, (cluster, node)).start()
                started = time.monotonic()
                client.publish(message)
                took, reconnects = time.monotonic() - started, client.reconnects
                client.delete_queue(name)
            finally:
                client.close()
    finally:
        _unblock(cluster, node)
    assert took >= alarm_s - 1.0, f"confirmed after {took:.1f} s: the alarm did not block it"
    assert reconnects == 0, f"{reconnects} reconnects while blocked (taken for silent)"


def _unblock(cluster: LocalCluster, node: str) -> None:
    cluster.ctl(node, "set_vm_memory_high_watermark", "0.4")  # RabbitMQ's default
