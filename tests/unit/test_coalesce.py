"""CoalescingWriter on a real loopback socket: one transport write per loop turn, in order,
nothing kept back (a lone frame leaves on the next turn, close flushes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from yarl import URL

from middleware.transport.coalesce import CoalescingTransportFactory, CoalescingWriter


@asynccontextmanager
async def _peer() -> AsyncIterator[tuple[CoalescingWriter, asyncio.Queue[bytes]]]:
    """A loopback server that records each chunk it receives, and a writer connected to it."""
    received: asyncio.Queue[bytes] = asyncio.Queue()
    served = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while chunk := await reader.read(65536):
            received.put_nowait(chunk)
        writer.close()
        await writer.wait_closed()
        served.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    factory = CoalescingTransportFactory()
    _, writer = await factory.create(URL(f"amqp://127.0.0.1:{port}/"))
    assert factory.writer is writer
    try:
        yield writer, received
    finally:
        writer.close()
        await writer.wait_closed()
        await asyncio.wait_for(served.wait(), 5)  # the server saw the end and closed its side
        server.close()
        await server.wait_closed()


async def _collect(received: asyncio.Queue[bytes], size: int) -> bytes:
    data = b""
    while len(data) < size:
        data += await asyncio.wait_for(received.get(), 5)
    return data


def test_one_turns_writes_leave_in_one_transport_write_in_order() -> None:
    async def main() -> None:
        async with _peer() as (writer, received):
            frames = [f"frame-{i};".encode() for i in range(50)]
            for frame in frames:
                writer.write(frame)
            assert writer.flushes == 0  # nothing written to the socket yet in this turn
            await writer.drain()
            assert await _collect(received, sum(map(len, frames))) == b"".join(frames)
            assert (writer.frames, writer.flushes) == (50, 1)

    asyncio.run(main())


def test_a_lone_write_leaves_on_the_next_turn_without_a_timer() -> None:
    async def main() -> None:
        async with _peer() as (writer, received):
            writer.write(b"alone")
            await asyncio.sleep(0)  # one turn: the flush ran
            assert writer.flushes == 1
            assert await _collect(received, 5) == b"alone"
            writer.write(b"again")  # a later turn: a write of its own
            await asyncio.sleep(0)
            assert await _collect(received, 5) == b"again"
            assert (writer.frames, writer.flushes) == (2, 2)

    asyncio.run(main())


def test_close_flushes_what_was_written_before_it() -> None:
    async def main() -> None:
        async with _peer() as (writer, received):
            writer.writelines([b"last", b"-words"])
            writer.close()  # same turn as the writes
            assert await _collect(received, 10) == b"last-words"

    asyncio.run(main())


def test_tls_urls_are_refused_not_silently_sent_in_clear() -> None:
    with pytest.raises(ValueError, match="amqp://"):
        asyncio.run(CoalescingTransportFactory().create(URL("amqps://127.0.0.1:5671/")))
