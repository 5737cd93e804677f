"""Phoenix trusts nothing it is told (issue #21, item 8), with real role processes: a
sender the topology does not have is dead-lettered, never counted or dispatched to; a
filter the index cannot hold is refused at the client and at the owner, and the
subscriptions around it go on."""

from __future__ import annotations

import asyncio
import json
import time

import pika
import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing, FilterError
from middleware.routing.client import ClientCore, PhoenixClient
from middleware.routing.messages import (
    Ack,
    Beat,
    Heartbeat,
    Message,
    Retire,
    Subscribe,
    encode,
    parse,
)
from middleware.transport import (
    AsyncClient,
    BindingSpec,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
)
from middleware.transport.delivery import DEAD_LETTER_EXCHANGE
from qosmq_bench.phoenix_deploy import phoenix_cli
from tests.integration.phoenix_support import write_topology

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]


async def _take(client: AsyncClient, queue: str, want: int, seconds: float) -> list[dict]:
    got: list[dict] = []
    deadline = time.monotonic() + seconds
    while len(got) < want and time.monotonic() < deadline:
        while (d := await client.get(queue)) is not None:
            got.append(json.loads(d.body))
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)  # and nothing more arrives
    while (d := await client.get(queue)) is not None:
        got.append(json.loads(d.body))
    return got


async def _dead(client: AsyncClient, dl: str, queue: str, want: int, seconds: float) -> list[str]:
    reasons: list[str] = []
    deadline = time.monotonic() + seconds
    while len(reasons) < want and time.monotonic() < deadline:
        d = await client.get(dl)
        if d is None:
            await asyncio.sleep(0.1)
        elif d.headers.get("x-qosmq-queue") == queue:
            reasons.append(str(d.headers.get("x-qosmq-reason")))
    return reasons


def test_forged_senders_and_unholdable_filters_touch_nothing_else(
    settings, brokers, tmp_path, name
) -> None:
    ring = ChordRing(["A", "B", "C"])
    event_type = next(f"bids{i}" for i in range(1000) if ring.owner(f"bids{i}") == "B")
    topology_file, topology = write_topology(
        tmp_path, name, {c: {"match_slaves": 1 if c == "B" else 0} for c in "ABC"}
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    master = RoleId.match("B", 0)
    master_inbox, control = master.inbox(topology.prefix), master.control(topology.prefix)
    host, port, _ = settings.nodes[0]

    def forge(queue: str, message: Message) -> None:
        plain = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
        try:
            plain.channel().basic_publish("", queue, encode(message))
        finally:
            plain.close()

    phantom = Heartbeat(  # "I am idle": drew a third of the events to an inbox nobody serves
        broker=RoleId.match_slave("B", 0, 99).owner, predicted_t=0.0, queue=0, service_rate=1e6
    )
    forged_ack = Ack(version=1, broker="B/evil")
    huge = [["x", "!=", 2**70]]

    async def scenario() -> None:
        client = await AsyncClient(settings=settings).connect()
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        dl, reply = f"{name}.dl", f"{name}.reply"
        await client.declare_exchange(ExchangeSpec(DEAD_LETTER_EXCHANGE, ExchangeType.FANOUT))
        for q in (dl, reply):
            await client.declare_queue(QueueSpec(q, kind=QueueKind.CLASSIC))
        await client.bind(BindingSpec(dl, DEAD_LETTER_EXCHANGE))
        try:
            first = f"{name}.first"
            await at_a.subscribe(event_type, [("price", "<", 100)], 1, first, wait_s=60)
            # refused at the client, before anything is sent
            for bad in (5, "price", {"price": 1}, huge, [("x", "<", float("nan"))]):
                with pytest.raises(FilterError):
                    await at_a.subscribe(event_type, bad, 1, f"{name}.never", wait_s=5)  # type: ignore[arg-type]
            with pytest.raises(FilterError, match="beyond 64 bits"):
                await at_c.publish({"event_type": event_type, "attributes": {"x": 2**70}})

            # at the owner: a subscribe that did not come through the client, along the ring
            request = Subscribe(
                event_type=event_type,
                home="A",
                latency_level=1,
                queue=f"{name}.forged",
                subscription_id="forged-1",
                filter=huge,
                reply_to=reply,
            )
            forge(RoleId.router("A").inbox(topology.prefix), request)
            answer = None
            deadline = time.monotonic() + 30
            while answer is None and time.monotonic() < deadline:
                answer = await client.get(reply)
                await asyncio.sleep(0.1)
            assert answer is not None, "the owner did not answer the refused subscribe"
            core = ClientCore(settings, topology, "A")
            with pytest.raises(FilterError, match="beyond 64 bits"):
                core.outcome(request, parse(answer.body))  # type: ignore[arg-type]
            assert any(
                "forged-1" in r and "64 bits" in r
                for r in await _dead(client, dl, master_inbox, 1, 15)
            )

            # forged senders on the master's control queue, then 30 events
            for _ in range(3):
                forge(control, phantom)
            forge(control, forged_ack)
            reasons = await _dead(client, dl, control, 4, 15)
            assert len(reasons) == 4 and all(f"not a replica of {master}" in r for r in reasons)
            # a beat naming the master's inbox as its lease: a slave must not consume it
            slave_control = RoleId.match_slave("B", 0, 0).control(topology.prefix)
            forge(slave_control, Beat(broker=master.owner, lease=master_inbox))
            reasons = await _dead(client, dl, slave_control, 1, 15)
            assert len(reasons) == 1 and "not a lease queue" in reasons[0], reasons
            # a RETIRE not from the slave's master: the slave does not stop
            slave = RoleId.match_slave("B", 0, 0)
            forge(slave_control, Retire(broker="B/evil", slave=slave.owner))
            forge(slave_control, Retire(broker=master.owner, slave="B/match-0/slave-9"))
            reasons = await _dead(client, dl, slave_control, 2, 15)
            assert len(reasons) == 2 and all("not B/match-0/slave-0's master" in r for r in reasons)
            second = f"{name}.second"  # subscribed after all that: works as the first
            await at_a.subscribe(event_type, [("price", ">=", 0)], 1, second, wait_s=60)
            for i in range(30):
                if i % 10 == 0:
                    forge(control, phantom)  # the phantom keeps "reporting" meanwhile
                await at_c.publish({"event_type": event_type, "attributes": {"price": i}})
            for queue in (first, second):
                got = await _take(client, queue, 30, 30)
                prices = sorted(m["event"]["attributes"]["price"] for m in got)
                assert prices == list(range(30)), (queue, prices)  # each once, none lost
        finally:
            for q in (dl, reply):
                await client.delete_queue(q)
            await client.close()

    try:
        phoenix_cli("up", topology_file, state, urls.split(","))
        asyncio.run(scenario())
    finally:
        if (state / "phoenix.json").exists():
            phoenix_cli("down", topology_file, state, urls.split(","))
