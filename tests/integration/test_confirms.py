"""End-to-end confirms against the real cluster, on both faces."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmConsumer,
    SyncConfirmPublisher,
)
from middleware.errors import NegativeReceipt, ReceiptTimeout, Reject
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
from tests.conftest import LoopThread
from tests.processes import spawn_ready, stop

pytestmark = pytest.mark.rabbit


def _fast(settings: Settings, **confirms: Any) -> Settings:
    merged = {"receipt_timeout": 2.0, "max_attempts": 2, **confirms}
    return settings.model_copy(update={"confirms": settings.confirms.model_copy(update=merged)})


def _fanout(name: str, queues: list[str]) -> list[Any]:
    specs: list[Any] = [ExchangeSpec(name, ExchangeType.FANOUT)]
    for q in queues:
        specs += [QueueSpec(q, kind=QueueKind.CLASSIC), BindingSpec(q, name)]
    return specs


class E2E:
    """Publisher and consumers of one face, consumers running in the background."""

    def __init__(self, kind: str, settings: Settings, specs: list[Any]) -> None:
        self.kind, self.settings, self.specs = kind, settings, specs
        self.stop = threading.Event()
        if kind == "async":
            self.loop = LoopThread()
            self.pub_client = AsyncClient(settings=settings)
            self.con_client = AsyncClient(settings=settings)
            self.loop.run(self._async_setup())
        else:
            self.pub_client = SyncClient(settings=settings).connect()
            for spec in specs:
                _declare_sync(self.pub_client, spec)
            self.publisher = SyncConfirmPublisher(self.pub_client, mode="e2e")

    async def _async_setup(self) -> None:
        for client in (self.pub_client, self.con_client):
            await client.connect()
            for spec in self.specs:
                await _declare_async(client, spec)
        self.publisher = await AsyncConfirmPublisher(self.pub_client, mode="e2e").start()
        self.consumer = AsyncConfirmConsumer(self.con_client)

    def consume(self, queues: list[str], handler: Callable[[Delivery], None]) -> None:
        if self.kind == "async":

            async def ahandler(d: Delivery) -> None:
                handler(d)

            for q in queues:
                self.loop.run(self.consumer.consume(q, ahandler))
            return
        ready = threading.Event()

        def run() -> None:
            client = SyncClient(settings=self.settings).connect()
            consumer = SyncConfirmConsumer(client)
            for q in queues:
                consumer.consume(q, handler)
            ready.set()
            consumer.run(until=self.stop.is_set)
            client.close()

        threading.Thread(target=run, daemon=True).start()
        assert ready.wait(30)

    def publish(self, body: bytes, **kwargs: Any) -> None:
        if self.kind == "async":
            self.loop.run(self.publisher.publish(body, **kwargs))
        else:
            self.publisher.publish(body, **kwargs)

    def close(self) -> None:
        self.stop.set()
        time.sleep(0.2)
        if self.kind == "async":
            self.loop.run(self.consumer.close())
            self.loop.run(self.publisher.close())
            self.loop.run(self.pub_client.close())
            self.loop.run(self.con_client.close())
            self.loop.stop()
        else:
            self.pub_client.close()


def _declare_sync(client: SyncClient, spec: Any) -> None:
    {
        ExchangeSpec: client.declare_exchange,
        QueueSpec: client.declare_queue,
        BindingSpec: client.bind,
    }[type(spec)](spec)


async def _declare_async(client: AsyncClient, spec: Any) -> None:
    await {
        ExchangeSpec: client.declare_exchange,
        QueueSpec: client.declare_queue,
        BindingSpec: client.bind,
    }[type(spec)](spec)


@pytest.fixture(params=["async", "sync"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_fanout_confirms_after_all_three_consumers_and_names_silent_queue(
    kind, settings, name
) -> None:
    queues = [f"{name}.{i}" for i in range(3)]
    e2e = E2E(kind, _fast(settings), _fanout(name, queues))
    handled: list[tuple[str, str]] = []
    try:
        e2e.consume(queues, lambda d: handled.append((d.queue, d.text())))
        for i in range(20):
            e2e.publish(f"m{i}".encode(), exchange=name)
        counts = Counter(q for q, _ in handled)
        assert counts == {q: 20 for q in queues}, "confirmed before every queue handled it"
        # a fourth queue bound with no layer consumer: the confirm times out naming it
        silent = f"{name}.silent"
        for spec in (QueueSpec(silent, kind=QueueKind.CLASSIC), BindingSpec(silent, name)):
            if kind == "async":
                e2e.loop.run(_declare_async(e2e.pub_client, spec))
            else:
                _declare_sync(e2e.pub_client, spec)
        started = time.monotonic()
        with pytest.raises(ReceiptTimeout) as info:
            e2e.publish(b"late", exchange=name)
        assert info.value.missing == {silent} and info.value.attempts == 2
        assert time.monotonic() - started < 15
    finally:
        e2e.close()


def test_reject_fails_the_confirm_with_queue_and_reason(kind, settings, name) -> None:
    queues = [f"{name}.ok", f"{name}.picky"]
    e2e = E2E(kind, _fast(settings), _fanout(name, queues))

    def handler(d: Delivery) -> None:
        if d.queue.endswith("picky") and d.text() == "bad":
            raise Reject("amount must be positive")

    try:
        e2e.consume(queues, handler)
        e2e.publish(b"good", exchange=name)
        with pytest.raises(NegativeReceipt) as info:
            e2e.publish(b"bad", exchange=name)
        assert info.value.queue == f"{name}.picky"
        assert info.value.reason == "amount must be positive"
    finally:
        e2e.close()


def test_confirm_waits_for_the_slowest_consumer(settings, name) -> None:
    queues = [f"{name}.{i}" for i in range(3)]
    e2e = E2E("async", _fast(settings, receipt_timeout=10), _fanout(name, queues))
    gate = asyncio.Event()
    handled: list[str] = []

    async def handler(d: Delivery) -> None:
        if d.queue.endswith(".2"):
            await asyncio.wait_for(gate.wait(), 20)
        handled.append(d.queue)

    try:
        for q in queues:
            e2e.loop.run(e2e.consumer.consume(q, handler))
        future = asyncio.run_coroutine_threadsafe(
            e2e.publisher.publish(b"x", exchange=name), e2e.loop.loop
        )
        deadline = time.monotonic() + 10
        while len(handled) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert sorted(handled) == sorted(queues[:2]) and not future.done()
        e2e.loop.loop.call_soon_threadsafe(gate.set)
        future.result(10)
        assert sorted(handled) == sorted(queues)
    finally:
        e2e.loop.loop.call_soon_threadsafe(gate.set)
        e2e.close()


def test_forced_retransmit_is_suppressed_and_still_confirmed(settings, name) -> None:
    queues = [f"{name}.a", f"{name}.b"]
    e2e = E2E("async", _fast(settings, receipt_timeout=0.3, max_attempts=5), _fanout(name, queues))
    runs: Counter[tuple[str, str]] = Counter()

    async def handler(d: Delivery) -> None:
        runs[(d.queue, d.message_id or "")] += 1
        await asyncio.sleep(0.8)  # longer than the receipt timeout: the publisher resends

    try:
        for q in queues:
            e2e.loop.run(e2e.consumer.consume(q, handler))
        e2e.publish(b"slow", exchange=name, message_id="once")
        time.sleep(1.0)  # let late resends arrive too
        assert runs == {(q, "once"): 1 for q in queues}
        assert e2e.publisher.core.resent >= 1
        assert e2e.consumer.core.suppressed >= 1
    finally:
        e2e.close()


def test_plain_messages_and_malformed_receipts_never_crash(settings, name) -> None:
    e2e = E2E("async", _fast(settings), _fanout(name, [name]))
    seen: list[Delivery] = []
    try:
        e2e.consume([name], seen.append)
        # a plain AMQP message (no layer headers) is handled as a plain message, no receipt
        e2e.loop.run(e2e.pub_client.publish(OutgoingMessage(b"plain", "", name)))
        e2e.publish(b"layer", exchange=name)
        reply_to = next(d.reply_to for d in seen if d.text() == "layer")
        # garbage sent to the publisher's reply address is dropped and counted
        e2e.loop.run(
            e2e.con_client.publish(
                OutgoingMessage(b"\x00not json", "", reply_to, mandatory=False), confirm=False
            )
        )
        e2e.publish(b"after", exchange=name)
        assert {d.text() for d in seen} == {"plain", "layer", "after"}
        assert e2e.publisher.core.malformed_receipts == 1
    finally:
        e2e.close()


@pytest.mark.chaos
@pytest.mark.slow
def test_consumer_process_killed_holding_unacked_messages(
    settings, brokers, name, tmp_path: Path
) -> None:
    out = tmp_path / "handled.txt"
    batch = 50  # receipts one batch holds: the most a killed consumer can take unsent
    env = {
        **os.environ,
        "QOSMQ_AMQP_URLS": ",".join(brokers.urls),
        "QOSMQ_CONFIRMS__RECEIPT_BATCH": str(batch),
    }

    def spawn() -> subprocess.Popen[str]:
        return spawn_ready(
            "tests.e2e_processes", "consumer", "async", name, str(out), "0.004", env=env
        )

    loop = LoopThread()
    client = AsyncClient(settings=_fast(settings, receipt_timeout=3, max_attempts=6))
    total = 1500

    async def setup() -> AsyncConfirmPublisher:
        await client.connect()
        await client.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC))
        return await AsyncConfirmPublisher(client, mode="e2e").start()

    publisher = loop.run(setup())
    first = spawn()
    second = None
    try:

        async def publish_all() -> list[BaseException | None]:
            tasks = [
                publisher.publish_nowait(b"x", routing_key=name, message_id=f"m{i}")
                for i in range(total)
            ]
            return await asyncio.gather(*tasks, return_exceptions=True)

        pending = asyncio.run_coroutine_threadsafe(publish_all(), loop.loop)
        deadline = time.monotonic() + 60
        while (
            not out.exists() or len(out.read_text().splitlines()) < 300
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGKILL)  # holds up to 50 unacked deliveries
        first.wait(10)
        second = spawn()
        results = pending.result(120)
    finally:
        for proc in (first, second):
            if proc is not None:
                stop(proc)
        loop.run(client.delete_queue(name))
        loop.run(publisher.close())
        loop.run(client.close())
        loop.stop()
    confirmed = {f"m{i}" for i, r in enumerate(results) if r is None}
    handled = Counter(line.split()[1] for line in out.read_text().splitlines())
    assert len(confirmed) == total, Counter(type(r).__name__ for r in results if r)
    assert confirmed <= set(handled), "a confirmed message was never handled"
    duplicates = sum(n - 1 for n in handled.values())
    # what runs twice: deliveries the killed process held unacked (its prefetch, 50), and
    # those it had acked but whose receipts still waited in its one batch for this
    # publisher (fewer than `batch`): the publisher resends them after its timeout
    assert duplicates < 50 + batch, duplicates


def test_confirms_bench_cell_counts_every_message_and_its_client_cpu(settings) -> None:
    """`qosmq bench confirms` cells: nothing lost, and the client's CPU per message measured."""
    from qosmq_bench.commands import format_table
    from qosmq_bench.confirms import CellSpec, run_cell_sync

    spec = CellSpec("e2e", 1, producers_per_queue=1, consumers_per_queue=1, duration_s=1.5)
    row = run_cell_sync(settings, spec)
    assert row["confirmed"] > 0 and row["lost"] == 0 and row["failed"] == 0
    seconds = row["client_cpu_pct"] / 100 * row["duration_s"]
    assert 0 < seconds <= row["duration_s"] * (row["cores"] or 1)
    assert row["client_cpu_us_per_msg"] == pytest.approx(seconds / row["confirmed"] * 1e6, rel=0.05)
    assert row["client_wait_pct"] is not None and 0 <= row["machine_pct"] <= 100
    table = format_table([{**row, "ratio_vs_persistent": None, "ratio_vs_raw": None}])
    assert "cpu µs/msg" in table and f"{row['client_cpu_us_per_msg']:.0f}" in table


def _receipts_per_message(settings: Settings, name: str, busy_rate: float) -> float:
    """Confirm a burst of 2 000 e2e publishes; the receipts each receipt message carried."""
    tuned = _fast(
        settings,
        receipt_timeout=30,
        receipt_linger_ms=0,
        receipt_linger_busy_ms=30,
        receipt_busy_rate=busy_rate,
    )
    e2e = E2E("async", tuned, _fanout(name, [name]))

    async def handler(d: Delivery) -> None:
        pass

    async def burst() -> None:
        await asyncio.gather(*(e2e.publisher.publish(b"x", exchange=name) for _ in range(2000)))

    try:
        e2e.loop.run(e2e.consumer.consume(name, handler))
        e2e.loop.run(burst(), timeout=120)
        core = e2e.consumer.core
        assert core.receipts_sent == 2000
        return core.receipts_sent / core.batches_sent
    finally:
        e2e.close()


def test_a_busy_consumer_sends_several_receipts_per_message(settings, name) -> None:
    """Above receipt_busy_rate receipts/s a batch waits receipt_linger_busy_ms, not the short
    linger: a burst is confirmed with far fewer receipt messages than receipts."""
    quiet = _receipts_per_message(settings, name + ".quiet", busy_rate=1e9)  # never busy
    busy = _receipts_per_message(settings, name + ".busy", busy_rate=100)
    assert busy >= 8 and busy >= 2 * quiet, (quiet, busy)


# ------------------------------------------------------------ bad input (issue #21)
def test_an_id_names_one_message(kind, settings, name) -> None:
    """A reused id is refused while in flight; once handled, a different body under the
    same id gets a negative receipt (never 'handled'), the same body the first receipt."""
    from middleware.errors import DuplicateMessageId

    queues = [f"{name}.0"]
    e2e = E2E(kind, _fast(settings), _fanout(name, queues))
    handled: list[bytes] = []
    try:
        e2e.consume(queues, lambda d: handled.append(d.body))
        if kind == "async":

            async def both() -> list[Any]:
                return await asyncio.gather(
                    e2e.publisher.publish(b"first", exchange=name, message_id="dup-0"),
                    e2e.publisher.publish(b"second", exchange=name, message_id="dup-0"),
                    return_exceptions=True,
                )

            results = e2e.loop.run(both())
            assert results[0] is None and isinstance(results[1], DuplicateMessageId)
        else:
            e2e.publish(b"first", exchange=name, message_id="dup-0")
        e2e.publish(b"a", exchange=name, message_id="dup-1")
        with pytest.raises(NegativeReceipt, match="duplicate message id"):
            e2e.publish(b"b, another message", exchange=name, message_id="dup-1")
        e2e.publish(b"a", exchange=name, message_id="dup-1")  # a resend: the first receipt
        time.sleep(0.3)
        assert sorted(handled) == [b"a", b"first"]
    finally:
        e2e.close()


def test_two_confirm_publishers_share_one_client(kind, settings, name) -> None:
    queues = [f"{name}.0"]
    e2e = E2E(kind, _fast(settings), _fanout(name, queues))
    handled: list[bytes] = []
    try:
        e2e.consume(queues, lambda d: handled.append(d.body))
        if kind == "async":
            second = e2e.loop.run(AsyncConfirmPublisher(e2e.pub_client, mode="e2e").start())
            e2e.loop.run(second.publish(b"from the second", exchange=name))
            e2e.publish(b"from the first", exchange=name)
            e2e.loop.run(second.close())
        else:
            second = SyncConfirmPublisher(e2e.pub_client, mode="e2e")
            second.publish(b"from the second", exchange=name)
            e2e.publish(b"from the first", exchange=name)
        assert sorted(handled) == [b"from the first", b"from the second"]
    finally:
        e2e.close()


def test_garbage_on_the_receipt_address_touches_nothing_else(kind, settings, name) -> None:
    import pika

    queues = [f"{name}.0"]
    e2e = E2E(kind, _fast(settings), _fanout(name, queues))
    reply_to: list[str] = []
    try:
        e2e.consume(queues, lambda d: reply_to.append(str(d.reply_to)))
        e2e.publish(b"learn the address", exchange=name)
        host, port, _ = settings.nodes[0]  # the publisher's node (its first)
        plain = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
        try:
            ch = plain.channel()
            for garbage in (b"[" * 100_000, b'{"v": 1, "ok": ' * 50_000, b"\xff\xfe", b"{}"):
                ch.basic_publish("", reply_to[0], garbage)
        finally:
            plain.close()
        for i in range(5):  # unrelated publishes go on, on both faces
            e2e.publish(f"after {i}".encode(), exchange=name)
        deadline = time.monotonic() + 5
        while e2e.publisher.core.malformed_receipts < 4 and time.monotonic() < deadline:
            e2e.publish(b"one more", exchange=name)
        assert e2e.publisher.core.malformed_receipts == 4
    finally:
        e2e.close()


@pytest.mark.parametrize("closing", ["the consumer", "its client alone"])
def test_closing_lets_running_handlers_finish_and_sends_their_receipts(
    closing, settings, name
) -> None:
    """Closed while its handlers run: no new delivery starts, the running ones finish and
    settle, and their receipts reach the publisher before the connection goes (before,
    the close cancelled them: the work was done, yet the publisher never heard)."""
    queues = [f"{name}.0"]
    e2e = E2E("async", _fast(settings, receipt_timeout=5), _fanout(name, queues))
    started: list[str] = []
    finished: list[str] = []

    async def handler(d: Delivery) -> None:
        started.append(d.text())
        await asyncio.sleep(0.5)
        finished.append(d.text())

    try:
        e2e.loop.run(e2e.consumer.consume(queues[0], handler))
        futures = [
            asyncio.run_coroutine_threadsafe(
                e2e.publisher.publish(f"m{i}".encode(), exchange=name), e2e.loop.loop
            )
            for i in range(5)
        ]
        deadline = time.monotonic() + 10
        while len(started) < 5 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(started) == 5 and not finished
        if closing == "the consumer":
            e2e.loop.run(e2e.consumer.close())
        else:
            e2e.loop.run(e2e.con_client.close())
        assert sorted(finished) == [f"m{i}" for i in range(5)]  # done before close returned
        for future in futures:
            future.result(10)  # confirmed: every receipt went out
        assert e2e.loop.run(e2e.pub_client.queue_length(queues[0])) == 0  # all acked
        assert sorted(started) == sorted(finished)  # none handled twice
    finally:
        e2e.close()


# ------------------------------------------- receipts per publisher process (issue #26)
def _receipt_messages(settings: Settings, name: str, scope: str) -> tuple[int, int, list]:
    """Three consumers (each its own client) of one queue in one event loop answer 300
    e2e publishes; (receipts, receipt messages, the publish times read from headers)."""
    tuned = _fast(
        settings,
        receipt_timeout=30,
        receipt_linger_ms=200,
        receipt_linger_busy_ms=200,
        receipt_batch=1000,
        receipt_scope=scope,
    )
    loop = LoopThread()
    clients: list[AsyncClient] = []
    consumers: list[AsyncConfirmConsumer] = []
    stamps: list[Any] = []

    async def handler(d: Delivery) -> None:
        stamps.append(d.headers.get("x-qosmq-receipt"))

    async def run() -> None:
        admin = await AsyncClient(settings=tuned).connect()
        clients.append(admin)
        for spec in _fanout(name, [name]):
            await _declare_async(admin, spec)
        for _ in range(3):
            client = await AsyncClient(settings=tuned).connect()
            clients.append(client)
            consumer = AsyncConfirmConsumer(client)
            await consumer.consume(name, handler, prefetch=20)
            consumers.append(consumer)
        publisher = await AsyncConfirmPublisher(admin, mode="e2e").start()
        await asyncio.gather(*(publisher.publish(b"x", exchange=name) for _ in range(300)))
        await publisher.close()
        for consumer in consumers:
            await consumer.close()
        await admin.delete_queue(name)
        for client in clients:
            await client.close()

    try:
        loop.run(run(), timeout=120)
    finally:
        loop.stop()
    receipts = sum(c.core.receipts_sent for c in consumers)
    return receipts, sum(c.core.batches_sent for c in consumers), stamps


def test_consumers_of_a_process_batch_receipts_for_a_publisher_together(settings, name) -> None:
    """receipt_scope "process": the receipts three consumers owe one publisher leave in
    one message (sent by whichever consumer's client), not one per consumer; every
    publish is confirmed either way, and the data messages carry their publish time."""
    together = _receipt_messages(settings, name + ".p", "process")
    apart = _receipt_messages(settings, name + ".c", "consumer")
    assert together[0] == apart[0] == 300
    assert together[1] * 2 <= apart[1], (together[1], apart[1])
    now_ms = time.time() * 1000
    assert all(isinstance(s, int) and now_ms - 120_000 < s <= now_ms for s in together[2])
