"""The relay of ``relay_cost.py`` on a minimal AMQP 0-9-1 connection: a diagnostic of what
a hop's CPU could be in Python with pamqp framing and no per-frame machinery.

One ``asyncio.Protocol`` that parses every complete frame of a read in place (pamqp's
``frame.unmarshal``), assembles each delivery, publishes it on with a publisher confirm
(pamqp's ``frame.marshal``) and acknowledges the delivery once its publish is confirmed;
everything one read causes leaves in one socket write.  No reconnection, no flow
control, no error handling beyond stopping: a floor to set beside ``raw`` and ``layer``,
not a client.  ``python scripts/relay_cost.py 1000 15 lean`` runs it as a cell.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys

from pamqp import commands as spec
from pamqp import frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader

IN, OUT = "bench-relay.in", "bench-relay.out"
FRAME_END = 0xCE
_HEAD = struct.Struct(">BHI")


class LeanRelay(asyncio.Protocol):
    def __init__(self, user: str, password: str, ready: asyncio.Future[None]) -> None:
        self.user, self.password, self.ready = user, password, ready
        self.buffer = bytearray()
        self.out: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.deliver: spec.Basic.Deliver | None = None
        self.header: ContentHeader | None = None
        self.body = bytearray()
        self.seq = 0  # publishes sent on channel 1 (confirm sequence numbers)
        self.pending: dict[int, int] = {}  # publish seq -> the delivery tag it relays
        self.started = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(frame.marshal(ProtocolHeader(), 0))

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        buffer += data
        at = 0
        while len(buffer) - at >= 8:
            _, _, size = _HEAD.unpack_from(buffer, at)
            end = at + 8 + size
            if len(buffer) < end:
                break
            _, channel, value = frame.unmarshal(bytes(buffer[at:end]))
            at = end
            self.on_frame(channel, value)
        del buffer[:at]
        if self.out and self.transport is not None:
            self.transport.write(b"".join(self.out))
            self.out.clear()

    def send(self, value: object, channel: int = 1) -> None:
        self.out.append(frame.marshal(value, channel))  # type: ignore[arg-type]

    def on_frame(self, channel: int, value: object) -> None:
        if isinstance(value, ContentBody):
            self.body += value.value
            self._maybe_complete()
        elif isinstance(value, ContentHeader):
            self.header = value
            self._maybe_complete()
        elif isinstance(value, spec.Basic.Deliver):
            self.deliver, self.header, self.body = value, None, bytearray()
        elif isinstance(value, spec.Basic.Ack):
            self._confirmed(value.delivery_tag, value.multiple)
        else:
            self._handshake(value)

    def _maybe_complete(self) -> None:
        header, deliver = self.header, self.deliver
        if header is None or deliver is None or len(self.body) < header.body_size:
            return
        body = bytes(self.body)
        self.deliver, self.header = None, None
        self.seq += 1
        self.pending[self.seq] = deliver.delivery_tag or 0
        props = spec.Basic.Properties(delivery_mode=2, message_id=os.urandom(8).hex())
        self.send(spec.Basic.Publish(exchange="", routing_key=OUT))
        self.send(ContentHeader(0, len(body), props))
        self.send(ContentBody(body))

    def _confirmed(self, tag: int, multiple: bool) -> None:
        seqs = [s for s in self.pending if s <= tag] if multiple else [tag]
        for seq in sorted(seqs):
            delivery = self.pending.pop(seq, None)
            if delivery is not None:
                self.send(spec.Basic.Ack(delivery_tag=delivery))

    def _handshake(self, value: object) -> None:
        if isinstance(value, spec.Connection.Start):
            response = f"\0{self.user}\0{self.password}"
            self.send(spec.Connection.StartOk(client_properties={}, response=response), 0)
        elif isinstance(value, spec.Connection.Tune):
            self.send(spec.Connection.TuneOk(value.channel_max, value.frame_max, 0), 0)
            self.send(spec.Connection.Open(virtual_host="/"), 0)
        elif isinstance(value, spec.Connection.OpenOk):
            self.send(spec.Channel.Open())
        elif isinstance(value, spec.Channel.OpenOk):
            self.send(spec.Confirm.Select())
        elif isinstance(value, spec.Confirm.SelectOk):
            self.send(spec.Basic.Qos(prefetch_count=64))
        elif isinstance(value, spec.Basic.QosOk):
            self.send(spec.Basic.Consume(queue=IN))
        elif isinstance(value, spec.Basic.ConsumeOk):
            self.ready.set_result(None)
        else:
            raise RuntimeError(f"lean relay: unexpected {value!r}")


async def relay(host: str, port: int, user: str, password: str) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    await loop.create_connection(lambda: LeanRelay(user, password, ready), host, port)
    await ready
    print("ready", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    from middleware import runtime
    from middleware.settings import Settings

    settings = Settings()
    host, port, _ = settings.nodes[0]
    runtime.run(relay(host, port, settings.username, settings.password.get_secret_value()))
    sys.exit(0)
