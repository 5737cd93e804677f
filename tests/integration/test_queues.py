"""Persistent queues (EMQ) against the real cluster: result codes, spool, recovery."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from middleware.errors import (
    ConnectionNotEstablished,
    MessageMalformed,
    QueueDoesNotExist,
    QueueSaveFailed,
    WindowExceeded,
)
from middleware.localcluster.proxy import FaultProxy
from middleware.queues import AsyncQueues, EnqueueStatus, NodePool, SyncQueues
from middleware.settings import Settings
from middleware.transport import AsyncClient, QueueKind, SyncClient
from tests.conftest import LoopThread

pytestmark = pytest.mark.rabbit


def _settings(settings: Settings, tmp_path: Path, **queues: Any) -> Settings:
    q = settings.queues.model_copy(update={"spool_path": tmp_path / "spool.sqlite3", **queues})
    return settings.model_copy(update={"queues": q})


def _via(proxy: FaultProxy, settings: Settings, tmp_path: Path) -> Settings:
    """The queue settings of this test, reaching the broker through ``proxy`` only, with
    two connect attempts (a cut link fails the enqueue fast, so it spools)."""
    return _settings(settings, tmp_path).model_copy(
        update={
            "amqp_urls": (proxy.url,),
            "retry": settings.retry.model_copy(update={"attempts": 2}),
        }
    )


def test_verbs_and_explicit_ack(settings, tmp_path, name) -> None:
    async def scenario() -> None:
        queues = await AsyncQueues(AsyncClient(settings=_settings(settings, tmp_path))).start()
        await queues.create_queue(name)
        results = [await queues.enqueue(name, f"m{i}".encode()) for i in range(3)]
        assert {r.status for r in results} == {EnqueueStatus.CONFIRMED}
        first = await queues.dequeue(name, timeout=10)
        assert first is not None and first.body == b"m0"
        await first.reject("try again", requeue=True)
        rest = [await queues.dequeue(name, timeout=10) for _ in range(3)]
        for m in rest:
            await m.ack()
        assert sorted(m.body for m in rest) == [b"m0", b"m1", b"m2"]
        assert [m.delivery.redelivered for m in rest if m.body == b"m0"] == [True]
        assert await queues.dequeue(name, timeout=0.5) is None
        assert (await queues.recover()).remaining == 0
        await queues.destroy_queue(name)
        await queues.client.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("decision", ["ack", "requeue"])
def test_a_copy_that_comes_while_the_first_is_in_hand_gets_the_first_ones_decision(
    decision, settings, tmp_path, name
) -> None:
    """Two copies of one message id (a resend, or a redelivery after the first's
    connection was lost) can both be delivered before the application settles the
    first: the copy waits, then is acked silently (first acked) or handed over (first
    requeued).  The test counts the hand-overs itself; the broker's queue counts what
    is left."""

    async def scenario() -> tuple[list[str], int]:
        queues = await AsyncQueues(AsyncClient(settings=_settings(settings, tmp_path))).start()
        await queues.create_queue(name)
        for body in (b"first", b"copy"):
            await queues.enqueue(name, body, message_id="same-id")
        handed: list[str] = []
        first = await queues.dequeue(name, timeout=10)
        assert first is not None
        handed.append(first.body.decode())
        # both are delivered now (prefetch > 1): the copy must not be handed over yet
        held = await queues.dequeue(name, timeout=1.5)
        if held is not None:
            handed.append(held.body.decode())
        if decision == "ack":
            await first.ack()
        else:
            await first.reject("again", requeue=True)
        while (later := await queues.dequeue(name, timeout=1.5)) is not None:
            handed.append(later.body.decode())
            await later.ack()
        await asyncio.sleep(0.5)  # the last settle leaves
        async with AsyncClient(settings=settings) as counter:
            left = await counter.queue_length(name)
        await queues.destroy_queue(name)
        await queues.client.close()
        return handed, left

    handed, left = asyncio.run(scenario())
    if decision == "ack":
        assert handed == ["first"], "a copy was handed over while the first was in hand"
    else:
        assert handed == ["first", "copy"], handed
    assert left == 0


@pytest.mark.cluster
def test_load_sharing_learns_the_cluster_and_spreads_enqueues(
    settings, brokers, tmp_path, name
) -> None:
    if brokers.cluster is None:
        pytest.skip("needs the local cluster's management API")
    first_only = _settings(settings, tmp_path).model_copy(update={"amqp_urls": brokers.urls[:1]})

    async def scenario() -> tuple[dict[str, int], int]:
        pool = NodePool(first_only, discover_every=60)
        queues = await AsyncQueues(AsyncClient(settings=first_only), pool=pool).start()
        await queues.create_queue(name)
        for i in range(30):
            await queues.enqueue(name, b"x", message_id=f"s{i}")
        length = await queues.client.queue_length(name)
        await queues.destroy_queue(name)
        await queues.close()
        await queues.client.close()
        return dict(pool.sent), length

    sent, length = asyncio.run(scenario())
    assert set(sent) == set(brokers.urls)  # learned nodes 2 and 3 from the cluster
    assert sorted(sent.values()) == [10, 10, 10] and length == 30


def _sample(series: str, path: str) -> float:
    """A spool series as a scrape would read it (the spool's file is the label)."""
    value = REGISTRY.get_sample_value(series, {"path": path})
    assert value is not None, series
    return value


@pytest.mark.parametrize("fault", ["cut", "blackhole"])
def test_sync_face_verbs_spool_and_recover(fault, settings, brokers, tmp_path, name) -> None:
    """``blackhole``: the link stays open and silent, new ones are refused: the enqueue
    waits for the missed heartbeats (2 s here) and spools."""
    proxy = FaultProxy(int(brokers.urls[0].rstrip("/").rsplit(":", 1)[1]))
    try:
        via = _via(proxy, settings, tmp_path).model_copy(update={"heartbeat": 2})
        queues = SyncQueues(SyncClient(settings=via)).start()
        queues.create_queue(name)
        assert queues.enqueue(name, b"a", message_id="a").status is EnqueueStatus.CONFIRMED
        if fault == "cut":
            proxy.cut(refuse=True)
        else:
            proxy.blackhole()
            proxy.refusing = True
        assert queues.enqueue(name, b"b", message_id="b").status is EnqueueStatus.SPOOLED
        assert queues.enqueue(name, b"c", message_id="c").status is EnqueueStatus.SPOOLED
        assert len(queues.spool) == 2
        path = str(queues.spool.path)
        assert _sample("qosmq_spool_messages", path) == 2
        time.sleep(0.2)
        assert _sample("qosmq_spool_oldest_age_seconds", path) >= 0.2
        assert _sample("qosmq_spool_appended_total", path) == 2
        proxy.heal()
        report = queues.recover()
        assert (report.replayed, report.remaining) == (2, 0)
        assert _sample("qosmq_spool_drained_total", path) == 2
        assert _sample("qosmq_spool_messages", path) == 0
        assert _sample("qosmq_spool_oldest_age_seconds", path) == 0
        got = []
        while (m := queues.dequeue(name, timeout=5)) is not None and len(got) < 3:
            got.append(m.message_id)
            m.ack()
        assert got == ["a", "b", "c"]
        with pytest.raises(MessageMalformed):
            queues.enqueue(name, b"x" * (settings.queues.max_message_bytes + 1))
        queues.destroy_queue(name)
        with pytest.raises(QueueDoesNotExist):
            queues.enqueue(name, b"x")
        queues.client.close()
    finally:
        proxy.close()


def test_each_result_code_from_a_real_situation(settings, brokers, tmp_path, name) -> None:
    async def scenario() -> dict[int, Exception]:
        seen: dict[int, Exception] = {}
        tight = _settings(settings, tmp_path, max_message_bytes=100)
        tight = tight.model_copy(update={"publish_window": 1})
        queues = await AsyncQueues(AsyncClient(settings=tight)).start()
        await queues.create_queue(name)
        await queues.destroy_queue(name)
        with pytest.raises(QueueDoesNotExist) as e1:  # 1: destroyed queue
            await queues.enqueue(name, b"x")
        seen[1] = e1.value
        full = f"{name}.full"
        await queues.create_queue(
            full, kind=QueueKind.CLASSIC, max_length=1, overflow="reject-publish"
        )
        await queues.enqueue(full, b"first")
        with pytest.raises(QueueSaveFailed) as e3:  # 3: the broker refuses to store it
            await queues.enqueue(full, b"second")
        seen[3] = e3.value
        with pytest.raises(MessageMalformed) as e4:  # 4: oversize, bad header, bad schema
            await queues.enqueue(full, b"x" * 101)
        with pytest.raises(MessageMalformed):
            await queues.enqueue(full, b"x", headers={"x-qosmq-receipt": 1})
        with pytest.raises(MessageMalformed):
            await queues.enqueue(full, b"not json", schema=json.loads)
        seen[4] = e4.value
        slow = asyncio.create_task(queues.enqueue(full, b"third"))  # holds the window of 1
        await asyncio.sleep(0)
        with pytest.raises(WindowExceeded) as e5:  # 5: window full, caller would not wait
            await queues.enqueue(full, b"fourth", block=False)
        seen[5] = e5.value
        with pytest.raises(QueueSaveFailed):
            await slow
        await queues.destroy_queue(full)
        await queues.client.close()
        # 2: no node reachable and no spool
        proxy = FaultProxy(int(brokers.urls[0].rstrip("/").rsplit(":", 1)[1]))
        try:
            lonely = _settings(settings, tmp_path, spool_enabled=False).model_copy(
                update={"amqp_urls": (proxy.url,)}
            )
            queues = await AsyncQueues(AsyncClient(settings=lonely)).start()
            await queues.create_queue(name)
            proxy.cut(refuse=True)
            await asyncio.sleep(0.5)
            with pytest.raises(ConnectionNotEstablished) as e2:
                await queues.enqueue(name, b"x")
            seen[2] = e2.value
            proxy.heal()
            await queues.client.close()
        finally:
            proxy.close()
        async with AsyncClient(settings=settings) as admin:
            await admin.delete_queue(name)
        return seen

    seen = asyncio.run(scenario())
    assert {code: err.code for code, err in seen.items()} == {1: 1, 2: 2, 3: 3, 4: 4, 5: 5}
    for err in seen.values():
        assert f"code {err.code}" in str(err)


@pytest.mark.chaos
@pytest.mark.slow
@pytest.mark.parametrize("fault", ["cut", "blackhole"])
def test_every_link_cut_mid_stream_loses_nothing_and_keeps_order(
    fault, settings, brokers, tmp_path, name
) -> None:
    """``cut``: every connection reset and refused; ``blackhole``: every connection
    stays open and silent (a partition), new ones refused: the enqueue in flight waits
    for the missed heartbeats (2 s here), then every enqueue spools."""
    total = 10_000
    proxies = [FaultProxy(int(u.rstrip("/").rsplit(":", 1)[1])) for u in brokers.urls]
    producer_settings = _settings(settings, tmp_path).model_copy(
        update={"amqp_urls": tuple(p.url for p in proxies), "heartbeat": 2}
    )
    loop = LoopThread()
    received: list[str] = []

    async def consume(queues: AsyncQueues) -> None:
        async for message in queues.messages(name):
            received.append(message.message_id or "")
            await message.ack()

    async def produce() -> tuple[dict[str, int], int]:
        consumer = await AsyncQueues(AsyncClient(settings=settings), spool=None).start()
        await consumer.create_queue(name)
        consuming = asyncio.create_task(consume(consumer))
        producer = await AsyncQueues(AsyncClient(settings=producer_settings)).start()
        statuses = {"confirmed": 0, "spooled": 0}
        for i in range(total):
            if i == 3000:
                for p in proxies:  # every link to every node, at once
                    if fault == "cut":
                        p.cut(refuse=True)
                    else:
                        p.blackhole()
                        p.refusing = True
            if i == 7000:
                for p in proxies:
                    p.heal()
            result = await producer.enqueue(name, str(i).encode(), message_id=f"m{i:05d}")
            statuses[result.status.value] += 1
        deadline = time.monotonic() + 120
        while (len(received) < total or len(producer.spool)) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        left = len(producer.spool)
        consuming.cancel()
        await producer.close()
        await producer.client.close()
        await consumer.destroy_queue(name)
        await consumer.client.close()
        return statuses, left

    try:
        statuses, left = loop.run(produce(), timeout=300)
    finally:
        loop.stop()
        for p in proxies:
            p.close()
    assert statuses["spooled"] > 0 and statuses["confirmed"] >= 3000
    assert left == 0, "the spool did not drain"
    assert received == [f"m{i:05d}" for i in range(total)], "lost, duplicated or reordered"


@pytest.mark.chaos
@pytest.mark.slow
def test_producer_killed_mid_drain_recovers_without_loss(settings, brokers, tmp_path, name) -> None:
    total = 3000
    spool = tmp_path / "producer-spool.sqlite3"
    proxies = [FaultProxy(int(u.rstrip("/").rsplit(":", 1)[1])) for u in brokers.urls]
    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(p.url for p in proxies)}
    root = Path(__file__).resolve().parents[2]

    def producer(mode: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.queue_producer_process",
                mode,
                str(spool),
                name,
                str(total),
            ],
            env=env,
            cwd=root,
            stdout=subprocess.PIPE,
            text=True,
        )

    loop = LoopThread()
    received: list[str] = []
    consumer = AsyncQueues(AsyncClient(settings=_settings(settings, tmp_path, spool_enabled=False)))
    background: list[asyncio.Future[None]] = []

    async def consume() -> None:
        await consumer.start()
        await consumer.create_queue(name)
        background.append(asyncio.ensure_future(_collect(consumer, name, received)))

    loop.run(consume())
    procs: list[subprocess.Popen[str]] = []
    try:
        for p in proxies:
            p.cut(refuse=True)  # the producer starts with no broker reachable
        procs.append(producer("produce"))
        line = procs[0].stdout.readline()
        assert line.startswith("enqueued") and json.loads(line.split(" ", 1)[1]) == {
            "spooled": total
        }
        for p in proxies:
            p.heal()
        deadline = time.monotonic() + 60
        while len(received) < 500 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(procs[0].pid, signal.SIGKILL)  # mid-drain
        procs[0].wait(10)
        assert len(received) < total, "drain finished before the kill; the test proves nothing"
        procs.append(producer("recover"))
        report = json.loads(procs[1].stdout.readline())
        procs[1].wait(60)
        deadline = time.monotonic() + 60
        while len(received) < total and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        for p in proxies:
            p.close()
        loop.run(consumer.destroy_queue(name))
        loop.run(consumer.client.close())
        loop.stop()
    assert report["remaining"] == 0 and report["replayed"] > 0
    assert received == [f"p{i}" for i in range(total)], "lost, duplicated or reordered"


async def _collect(queues: AsyncQueues, name: str, out: list[str]) -> None:
    async for message in queues.messages(name):
        out.append(message.message_id or "")
        await message.ack()
