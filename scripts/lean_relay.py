"""The relay of ``relay_cost.py`` on a minimal AMQP 0-9-1 connection: a diagnostic of what
a hop's CPU could be in Python with pamqp framing and no per-frame machinery.

One ``asyncio.Protocol`` that parses every complete frame of a read in place (pamqp's
``frame.unmarshal``), assembles each delivery, publishes it on with a publisher confirm
(pamqp's ``frame.marshal``) and acknowledges the delivery once its publish is confirmed;
everything one read causes leaves in one socket write.  No reconnection, no flow
control, no error handling beyond stopping: a floor to set beside ``raw`` and ``layer``,
not a client.  ``python scripts/relay_cost.py 1000 15 lean`` runs it as a cell.

Its halves, for the cells ``lean-in`` and ``lean-out``: ``--mode in`` consumes and acks each
delivery at once (no publish); ``--mode out RATE`` consumes nothing and, on a line
``go SECONDS`` on its stdin, publishes RATE messages a second with confirms for that
long, then prints ``done N`` once all N were confirmed.
"""

from __future__ import annotations

import asyncio
import os
import struct
import sys
import time

from pamqp import commands as spec
from pamqp import frame
from pamqp.body import ContentBody
from pamqp.header import ContentHeader, ProtocolHeader

IN, OUT = "bench-relay.in", "bench-relay.out"
BODY = b'{"kind": "publish", "event": {"event_type": "x", "attributes": {"a": 1, "b": "%s"}}}' % (
    b"x" * 50
)
FRAME_END = 0xCE
_HEAD = struct.Struct(">BHI")


class LeanRelay(asyncio.Protocol):
    def __init__(
        self, user: str, password: str, ready: asyncio.Future[None], mode: str = "relay"
    ) -> None:
        self.user, self.password, self.ready, self.mode = user, password, ready, mode
        self.confirmed = 0  # ``out``: publishes the broker confirmed
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
        if self.mode == "in":
            self.send(spec.Basic.Ack(delivery_tag=deliver.delivery_tag or 0))
            return
        self.publish(body, deliver.delivery_tag or 0)

    def publish(self, body: bytes, delivery: int = 0) -> None:
        """One confirmed publish to OUT; ``delivery``: the delivery to ack once confirmed."""
        self.seq += 1
        self.pending[self.seq] = delivery
        props = spec.Basic.Properties(delivery_mode=2, message_id=os.urandom(8).hex())
        self.send(spec.Basic.Publish(exchange="", routing_key=OUT))
        self.send(ContentHeader(0, len(body), props))
        self.send(ContentBody(body))

    def _confirmed(self, tag: int, multiple: bool) -> None:
        seqs = [s for s in self.pending if s <= tag] if multiple else [tag]
        for seq in sorted(seqs):
            delivery = self.pending.pop(seq, None)
            self.confirmed += delivery is not None
            if delivery:
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
            if self.mode == "out":
                self.ready.set_result(None)
            else:
                self.send(spec.Basic.Consume(queue=IN))
        elif isinstance(value, spec.Basic.ConsumeOk):
            self.ready.set_result(None)
        else:
            raise RuntimeError(f"lean relay: unexpected {value!r}")


async def relay(host: str, port: int, user: str, password: str, mode: str, rate: float) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    _, protocol = await loop.create_connection(
        lambda: LeanRelay(user, password, ready, mode), host, port
    )
    await ready
    print("ready", flush=True)
    if mode != "out":
        await asyncio.Event().wait()
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line.startswith("go"):
            return
        seconds = float(line.split()[1])
        first, sent = protocol.confirmed, 0
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            while sent < int((time.monotonic() - started) * rate):
                protocol.publish(BODY)
                sent += 1
            if protocol.out and protocol.transport is not None:
                protocol.transport.write(b"".join(protocol.out))
                protocol.out.clear()
            await asyncio.sleep(0.002)
        while protocol.confirmed - first < sent:  # noqa: ASYNC110 - a diagnostic, polled
            await asyncio.sleep(0.01)
        print(f"done {sent}", flush=True)


if __name__ == "__main__":
    from middleware import runtime
    from middleware.settings import Settings

    settings = Settings()
    host, port, _ = settings.nodes[0]
    args = sys.argv[1:]
    mode = args[args.index("--mode") + 1] if "--mode" in args else "relay"
    rate = float(args[args.index("--mode") + 2]) if mode == "out" else 0.0
    password = settings.password.get_secret_value()
    runtime.run(relay(host, port, settings.username, password, mode, rate))
    sys.exit(0)
