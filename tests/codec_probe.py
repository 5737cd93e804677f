"""What plain pamqp, aio-pika and pika do with every field type, printed as one JSON line.

Run as ``python -m tests.codec_probe bare|layer AMQP_URL QUEUE``: ``bare`` never imports
the layer; ``layer`` imports it first and keeps an ``AsyncClient`` and a ``SyncClient``
connected and working (floats out and back in a header, as the layer promises) while the
plain clients run.  ``tests/integration/test_codec_isolation.py`` runs both in separate
processes and compares the lines: the layer in a process must not change how the plain
libraries encode and decode.  Each probe records bytes, a repr or the exception's name.
"""

from __future__ import annotations

import asyncio
import datetime
import decimal
import json
import logging
import struct
import sys
from typing import Any

VALUES: dict[str, Any] = {
    "true": True,
    "small": 7,
    "negative": -40000,
    "big": 2**40,
    "huge": 2**70,
    "float": 0.1,
    "decimal": decimal.Decimal("1.25"),
    "text": "héllo",
    "bytes": b"\x00\xff",
    "bytearray": bytearray(b"\x01\x02"),
    "time": datetime.datetime(2026, 11, 26, 1, 2, 3, tzinfo=datetime.UTC),
    "none": None,
    "list": [1, "a", 0.5],
    "table": {"k": 1.5, "s": "v"},
}

# crafted field tables: a double, a single float, a timestamp past 9999, a key not UTF-8
ENCODED: dict[str, bytes] = {
    "double": b"\x00\x00\x00\x0b\x01dd" + struct.pack(">d", 0.1),
    "single": b"\x00\x00\x00\x07\x01ff" + struct.pack(">f", 0.1),
    "far_time": b"\x00\x00\x00\x0b\x01tT" + struct.pack(">Q", 2**64 - 1),
    "latin1_key": b"\x00\x00\x00\x04\x01\xe9b\x01",
}


def _outcome(call: Any) -> str:
    try:
        return repr(call())
    except Exception as exc:  # the probe records what the library does, errors included
        return f"raises {type(exc).__name__}"


def offline() -> dict[str, str]:
    import pamqp.decode
    import pamqp.encode
    import pika.data

    out: dict[str, str] = {}
    for name, value in VALUES.items():
        out[f"pamqp.encode.{name}"] = _outcome(lambda v=value: pamqp.encode.field_table({"v": v}))
        out[f"pika.encode.{name}"] = _outcome(lambda v=value: _pika_table(pika.data, v))
    for name, raw in ENCODED.items():
        out[f"pamqp.decode.{name}"] = _outcome(lambda r=raw: pamqp.decode.field_table(r))
        out[f"pika.decode.{name}"] = _outcome(lambda r=raw: pika.data.decode_table(r, 0))
    out["pamqp.decode.short_str"] = _outcome(lambda: pamqp.decode.short_str(b"\x02\xe9\xe9"))
    return out


def _pika_table(data: Any, value: Any) -> bytes:
    pieces: list[bytes] = []
    data.encode_table(pieces, {"v": value})
    return b"".join(pieces)


async def on_the_wire(url: str, queue: str) -> dict[str, str]:
    """Plain aio-pika publishes, plain pika reads; then the other way round."""
    import aio_pika
    import pika

    out: dict[str, str] = {}
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, auto_delete=False, durable=False)
        for name, value in VALUES.items():
            out[f"aio-pika.publish.{name}"] = await _publish(channel, queue, {name: value})
        blocking = pika.BlockingConnection(pika.URLParameters(url))
        try:
            ch = blocking.channel()
            for i in range(len(VALUES)):
                method, props, _ = ch.basic_get(queue, auto_ack=True)
                out[f"pika.get.{i}"] = repr(props.headers) if method else "empty"
            for name, value in VALUES.items():
                props = pika.BasicProperties(headers={name: value})
                out[f"pika.publish.{name}"] = _outcome(
                    lambda p=props: ch.basic_publish("", queue, b"x", p)
                )
        finally:
            blocking.close()
        plain_queue = await channel.get_queue(queue)
        for i in range(len(VALUES)):
            message = await plain_queue.get(no_ack=True, fail=False)
            out[f"aio-pika.get.{i}"] = repr(message.headers) if message else "empty"
        await channel.queue_delete(queue)
    finally:
        await connection.close()
    return out


async def _publish(channel: Any, queue: str, headers: dict[str, Any]) -> str:
    import aio_pika

    try:
        await channel.default_exchange.publish(aio_pika.Message(b"x", headers=headers), queue)
        return "sent"
    except Exception as exc:
        # what a plain client cannot send: keep the queue's count aligned for pika's reads
        await channel.default_exchange.publish(aio_pika.Message(b"x"), queue)
        return f"raises {type(exc).__name__}"


async def layer_at_work(url: str, queue: str) -> tuple[Any, Any, dict[str, str]]:
    """Connect both layer faces and check the layer's own codec: a float header out and
    back as the same double on either face."""
    from middleware.settings import Settings
    from middleware.transport import AsyncClient, OutgoingMessage, QueueKind, QueueSpec, SyncClient

    settings = Settings.load(amqp_urls=url)
    client = await AsyncClient(settings=settings).connect()
    sync = SyncClient(settings=settings).connect()
    name = f"{queue}.layer"
    await client.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC, durable=False))
    await client.publish(OutgoingMessage(b"x", routing_key=name, headers={"f": 0.1, "b": b"\x00"}))
    sync.publish(OutgoingMessage(b"y", routing_key=name, headers={"f": 0.1, "b": b"\x00"}))
    got: dict[str, str] = {}
    for face in ("async", "sync"):
        delivery = await client.get(name) if face == "async" else sync.get(name)
        got[f"layer.{face}"] = repr(None if delivery is None else dict(delivery.headers))
    await client.delete_queue(name)
    return client, sync, got


async def main(mode: str, url: str, queue: str) -> None:
    loggers = {n: logging.getLogger(n).level for n in ("aiormq", "aio_pika", "pika", "pamqp")}
    roots = list(logging.getLogger().handlers)
    report: dict[str, Any] = {}
    client = sync = None
    if mode == "layer":
        import middleware  # noqa: F401  (the import alone must change nothing)

        report["after_import"] = offline()
        client, sync, report["layer"] = await layer_at_work(url, queue)
    report["offline"] = offline()
    report["wire"] = await on_the_wire(url, queue)
    report["loggers_unchanged"] = loggers == {
        n: logging.getLogger(n).level for n in ("aiormq", "aio_pika", "pika", "pamqp")
    }
    report["root_handlers_unchanged"] = roots == list(logging.getLogger().handlers)
    if client is not None:
        report["layer_still"] = (await layer_at_work(url, f"{queue}.again"))[2]
        await client.close()
        sync.close()
    print(json.dumps(report, sort_keys=True))


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
