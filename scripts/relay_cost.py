"""The CPU one Python AMQP hop costs per message: a diagnostic, not a benchmark of the layer.

A relay process consumes ``bench-relay.in`` (prefetch 64), publishes each body on to
``bench-relay.out`` with a publisher confirm and acknowledges the delivery once it is
confirmed: what a Phoenix role does with each message.  This process feeds it at a
fixed rate and drains the output.  Printed per cell: the relay's CPU per message, summed
over its threads from ``/proc/PID/task/*/schedstat`` (Linux), and its context switches
per message.  ``raw``: the relay on plain aio-pika; ``layer``: on ``AsyncClient``;
``lean``: on a minimal AMQP connection with pamqp framing (``lean_relay.py``, a floor).
A hop's halves apart: ``layer-in`` and ``lean-in`` consume and ack each delivery at
once (no publish); ``layer-out`` and ``lean-out`` publish at the rate with confirms
themselves (nothing consumed; the output queue is purged after the cell).
``aiormq-in`` and ``aiormq-out`` are the same halves on aiormq alone (the protocol
library under aio-pika and the layer): what the layer's own machinery adds is
``layer-*`` minus ``aiormq-*``.

    QOSMQ_AMQP_URLS=amqp://127.0.0.1:5682/ python scripts/relay_cost.py 40,170,1000 15 raw,layer
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import subprocess
import sys
import time
from typing import Any

from middleware import runtime
from middleware.settings import Settings
from middleware.transport import AsyncClient, Delivery, OutgoingMessage, QueueKind, QueueSpec

IN, OUT = "bench-relay.in", "bench-relay.out"
BODY = b'{"kind": "publish", "event": {"event_type": "x", "attributes": {"a": 1, "b": "%s"}}}' % (
    b"x" * 50
)


async def _declare(client: AsyncClient) -> None:
    for queue in (IN, OUT):
        await client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))


async def relay(kind: str) -> None:
    settings = Settings()
    if kind == "raw":
        import aio_pika

        host, port, _ = settings.nodes[0]
        password = settings.password.get_secret_value()
        connection = await aio_pika.connect(f"amqp://{settings.username}:{password}@{host}:{port}/")
        channel = await connection.channel(publisher_confirms=True)
        await channel.set_qos(prefetch_count=64)
        queue = await channel.declare_queue(IN, durable=True)
        await channel.declare_queue(OUT, durable=True)

        async def on_raw(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await channel.default_exchange.publish(
                aio_pika.Message(message.body, delivery_mode=2), routing_key=OUT
            )
            await message.ack()

        await queue.consume(on_raw)
    elif kind in ("aiormq-in", "aiormq-out"):
        await _aiormq(settings, kind)
        return
    elif kind == "layer-out":
        client = await AsyncClient(settings=settings).connect()
        await _declare(client)
        print("ready", flush=True)
        while (line := await asyncio.to_thread(sys.stdin.readline)).startswith("go"):
            seconds, rate = (float(x) for x in line.split()[1:3])
            print(f"done {await _publish_at(client, OUT, rate, seconds)}", flush=True)
        return
    else:
        client = await AsyncClient(settings=settings).connect()
        await _declare(client)

        async def on_layer(delivery: Delivery) -> None:
            await client.publish(OutgoingMessage(delivery.body, "", OUT))

        async def on_layer_in(delivery: Delivery) -> None:
            pass  # return: ack

        await client.consume(IN, on_layer_in if kind == "layer-in" else on_layer, prefetch=64)
    print("ready", flush=True)
    await asyncio.Event().wait()


async def _aiormq(settings: Settings, kind: str) -> None:
    """A hop's half on aiormq alone: consume and ack at once, or publish with confirms."""
    import aiormq

    host, port, _ = settings.nodes[0]
    password = settings.password.get_secret_value()
    connection = await aiormq.connect(f"amqp://{settings.username}:{password}@{host}:{port}/")
    channel = await connection.channel(publisher_confirms=kind == "aiormq-out")
    for queue in (IN, OUT):
        await channel.queue_declare(queue, durable=True)
    if kind == "aiormq-in":
        await channel.basic_qos(prefetch_count=64)

        async def on_message(message: aiormq.abc.DeliveredMessage) -> None:
            assert message.delivery_tag is not None
            await channel.basic_ack(message.delivery_tag)

        await channel.basic_consume(IN, on_message)
        print("ready", flush=True)
        await asyncio.Event().wait()
    print("ready", flush=True)
    properties = aiormq.spec.Basic.Properties(delivery_mode=2)
    while (line := await asyncio.to_thread(sys.stdin.readline)).startswith("go"):
        seconds, rate = (float(x) for x in line.split()[1:3])
        pending: set[asyncio.Future[Any]] = set()
        started, sent = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            while sent < int((time.monotonic() - started) * rate):
                confirm: asyncio.Future[Any] = asyncio.ensure_future(
                    channel.basic_publish(BODY, routing_key=OUT, properties=properties)
                )
                pending.add(confirm)
                confirm.add_done_callback(pending.discard)
                sent += 1
            await asyncio.sleep(0.002)
        await asyncio.gather(*pending)
        print(f"done {sent}", flush=True)


async def _publish_at(client: AsyncClient, queue: str, rate: float, seconds: float) -> int:
    """Publish ``rate`` confirmed messages a second to ``queue`` for ``seconds``; return
    how many, once all were confirmed."""
    pending: set[asyncio.Task[None]] = set()
    started, sent = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        while sent < int((time.monotonic() - started) * rate):
            task = asyncio.create_task(client.publish(OutgoingMessage(BODY, "", queue)))
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.sleep(0.002)
    await asyncio.gather(*pending)
    return sent


async def feed_in(rate: float, seconds: float) -> int:
    """Publish ``rate`` messages a second for ``seconds``; return once the relay took
    them all (the input queue empty)."""
    async with AsyncClient(settings=Settings()) as client:
        await _declare(client)
        sent = await _publish_at(client, IN, rate, seconds)
        while await client.queue_length(IN):  # noqa: ASYNC110 - a diagnostic, polled
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # the last acks
    return sent


async def _purge_out() -> None:
    async with AsyncClient(settings=Settings()) as client:
        await client.delete_queue(OUT)
        await _declare(client)


async def feed(rate: float, seconds: float) -> int:
    """Publish ``rate`` messages a second for ``seconds``; return once all came out."""
    arrived = [0]
    async with AsyncClient(settings=Settings()) as client:
        await _declare(client)

        async def sink(_delivery: Delivery) -> None:
            arrived[0] += 1

        await client.consume(OUT, sink, prefetch=256)
        sent = await _publish_at(client, IN, rate, seconds)
        while arrived[0] < sent:  # noqa: ASYNC110 - a diagnostic, polled
            await asyncio.sleep(0.05)
    return sent


def _threads(pid: int) -> tuple[float, int]:
    """(CPU seconds, context switches) summed over the process's threads."""
    cpu, switches = 0.0, 0
    for task in glob.glob(f"/proc/{pid}/task/*"):
        with open(f"{task}/schedstat") as fh:
            cpu += int(fh.read().split()[0]) / 1e9
        with open(f"{task}/status") as fh:
            switches += sum(int(n) for n in re.findall(r"ctxt_switches:\s+(\d+)", fh.read()))
    return cpu, switches


async def _declared() -> None:
    async with AsyncClient(settings=Settings()) as client:
        await _declare(client)


def cell(kind: str, rate: float, seconds: float) -> str:
    runtime.run(_declared())
    here = os.path.dirname(os.path.abspath(__file__))
    base, _, half = kind.partition("-")
    command = (
        [sys.executable, os.path.join(here, "lean_relay.py")]
        + (["--mode", half, str(rate)] if half else [])
        if base == "lean"
        else [sys.executable, __file__, "--relay", kind]
    )
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None and process.stdout is not None

    def run(for_s: float) -> int:
        if half == "out":
            process.stdin.write(f"go {for_s} {rate}\n")  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
            return int(process.stdout.readline().split()[1])  # type: ignore[union-attr]
        return runtime.run(feed_in(rate, for_s) if half == "in" else feed(rate, for_s))

    try:
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {kind} relay did not start")
        run(3)  # warm up
        cpu0, switches0 = _threads(process.pid)
        sent = run(seconds)
        cpu1, switches1 = _threads(process.pid)
    finally:
        process.kill()
        process.wait()
        if half == "out":
            runtime.run(_purge_out())
    return (
        f"{kind:9s} {rate:6.0f}/s: {1e6 * (cpu1 - cpu0) / sent:5.0f} us CPU per message, "
        f"{(switches1 - switches0) / sent:.2f} context switches per message ({sent} messages)"
    )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--relay"]:
        runtime.run(relay(sys.argv[2]))
    else:
        rates = [float(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "170").split(",")]
        duration = float(sys.argv[2]) if len(sys.argv) > 2 else 15.0
        kinds = (sys.argv[3] if len(sys.argv) > 3 else "raw,layer").split(",")
        assert os.path.exists("/proc/self/task"), "needs Linux /proc"
        for rate in rates:
            for kind in kinds:
                print(cell(kind, rate, duration), flush=True)
