"""One socket write per event-loop turn instead of one per AMQP frame (logic + a small driver).

aiormq hands every outgoing frame set (a publish's method + header + body, an ack, a
qos...) to ``StreamWriter.write`` on its own, and each becomes a ``send`` syscall.  A
role that forwards or delivers messages writes a publish and an ack per message; on a
loaded machine those syscalls were the largest single cost of a Phoenix router (py-spy:
a third of its CPU).  :class:`CoalescingWriter` buffers what one turn of the loop writes
and hands it to the transport in one write at the start of the next turn
(``loop.call_soon``): nothing waits for a timer, a lone frame leaves as soon as it would
have, and frames written in the same turn (a burst of acks after a multi-confirm, the
publishes of the deliveries that arrived in one read) share one syscall.

Flow control is unchanged: ``drain`` still waits while the transport's buffer is above
its high-water mark; the buffer holds at most one turn's frames more.  ``close`` and
``write_eof`` flush first, so nothing written before them is lost.

aiormq takes the writer through its public ``TransportFactory``; aio-pika passes only
the connection parameters it knows, so :class:`CoalescingConnection` names the factory
among them (``aio_pika.connect(..., connection_class=CoalescingConnection)``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import aio_pika
from aio_pika.abc import ConnectionParameter
from aiormq.connection import TCPTransportFactory, TLSTransportFactory, TransportFactory
from aiormq.exceptions import AMQPConnectionError
from yarl import URL

from . import codec
from .silence import watch_reader

__all__ = [
    "CoalescingConnection",
    "CoalescingTransportFactory",
    "CoalescingWriter",
    "WatchedConnection",
    "WatchedTransportFactory",
]

STREAM_LIMIT = 2**16  # asyncio.open_connection's default reader limit


class CoalescingWriter(asyncio.StreamWriter):
    """A ``StreamWriter`` whose writes of one loop turn leave in one transport write."""

    def __init__(
        self,
        transport: asyncio.WriteTransport,
        protocol: asyncio.StreamReaderProtocol,
        reader: asyncio.StreamReader,
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        super().__init__(transport, protocol, reader, loop)
        self._turns = loop
        self._pending: list[bytes] = []
        self._scheduled = False
        self.flushes = 0  # transport writes made
        self.frames = 0  # writes asked for

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.frames += 1
        self._pending.append(bytes(data))
        if not self._scheduled:
            self._scheduled = True
            self._turns.call_soon(self.flush)

    def writelines(self, data: Any) -> None:
        for chunk in data:
            self.write(chunk)

    def flush(self) -> None:
        """Hand everything written so far to the transport (one write)."""
        self._scheduled = False
        if not self._pending:
            return
        payload = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if self.transport.is_closing():
            return  # as StreamWriter.write on a closing transport: dropped, the reader reports
        self.flushes += 1
        self.transport.write(payload)

    def write_eof(self) -> None:
        self.flush()
        super().write_eof()

    def close(self) -> None:
        self.flush()
        super().close()


class CoalescingTransportFactory(TransportFactory):
    """aiormq's TCP connection, with a :class:`CoalescingWriter` (``writer``: the last)."""

    writer: CoalescingWriter | None = None

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, CoalescingWriter]:
        if url.scheme == "amqps":  # TLS connections keep aiormq's own writer (not measured)
            raise ValueError("CoalescingTransportFactory: plain amqp:// connections only")
        kwargs.pop("ssl_context_provider", None)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=kwargs.pop("limit", STREAM_LIMIT), loop=loop)
        protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
        try:
            transport, _ = await loop.create_connection(
                lambda: protocol, url.host or "localhost", url.port or 5672, **kwargs
            )
        except OSError as exc:
            raise AMQPConnectionError(*exc.args) from exc
        self.writer = CoalescingWriter(transport, protocol, reader, loop)
        return reader, self.writer


class WatchedTransportFactory(TransportFactory):
    """Another factory's transport, its reader watched for silence (``silence.py``) at
    the heartbeat the connection asks for (``?heartbeat=``, as aiormq reads it)."""

    def __init__(self, inner: TransportFactory) -> None:
        self.inner = inner

    @property
    def writer(self) -> CoalescingWriter | None:
        """The inner factory's last :class:`CoalescingWriter` (None: aiormq's own)."""
        return getattr(self.inner, "writer", None)

    async def create(
        self, url: URL, **kwargs: Any
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await self.inner.create(url, **kwargs)
        watch_reader(reader, writer.transport, float(url.query.get("heartbeat", "60")))
        return reader, writer


def _factory(value: Any) -> Any:
    return value


class WatchedConnection(aio_pika.Connection):
    """An aio-pika connection on aiormq's own TCP or TLS transport, watched for silence."""

    PARAMETERS = (
        *aio_pika.Connection.PARAMETERS,
        ConnectionParameter(name="transport_factory", parser=_factory, is_kwarg=True),
    )

    def __init__(self, url: URL, **kwargs: Any) -> None:
        inner = TLSTransportFactory() if url.scheme == "amqps" else TCPTransportFactory()
        kwargs.setdefault("transport_factory", WatchedTransportFactory(inner))
        super().__init__(url, **kwargs)


class CoalescingConnection(WatchedConnection):
    """An aio-pika connection whose frames leave through a :class:`CoalescingWriter`."""

    def __init__(self, url: URL, **kwargs: Any) -> None:
        kwargs.setdefault(
            "transport_factory", WatchedTransportFactory(CoalescingTransportFactory())
        )
        super().__init__(url, **kwargs)

    async def connect(self, timeout: Any = None) -> None:  # noqa: ASYNC109  (aio-pika's signature)
        """aio-pika's connect with the layer's codec: aiormq's reader and writer tasks,
        started here, decode and encode every frame of this connection with it."""
        with codec.layer_codec():
            await super().connect(timeout)
