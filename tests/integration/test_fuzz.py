"""The seeded bad-input corpus against real brokers (issue #21, item 13): outbound
messages, deliveries from plain AMQP clients, receipts, on both faces.  For every case:
refused with a named error, or carried and handled (or dead-lettered with its reason);
the good message after each case arrives; no connection is killed.  The counts are the
test's own (what it sent, what its handler saw, what the dead-letter queue holds)."""

from __future__ import annotations

import reprlib
import time
from typing import Any

import pika
import pytest

from middleware.errors import MalformedMessage
from middleware.transport import OutgoingMessage, QueueSpec
from middleware.transport.codec import layer_codec
from tests import fuzz_corpus as corpus
from tests.integration.test_bad_input import _dead, _plain_pika, dead_letters  # noqa: F401
from tests.integration.test_confirms import E2E, _fanout, _fast

pytestmark = pytest.mark.rabbit

OUTBOUND_CASES = 150
PLAIN_CASES = 80
RECEIPT_CASES = 40


def test_fuzzed_outbound_messages_are_refused_by_name_or_arrive_intact(face, name) -> None:
    face.call("declare_queue", QueueSpec(name))
    got: dict[str, bytes] = {}
    face.consume(name, lambda d: got.__setitem__(str(d.message_id), bytes(d.body)))
    expected: dict[str, bytes] = {}
    may_expire: dict[str, bytes] = {}
    refused: list[str] = []
    for i in range(OUTBOUND_CASES):
        fields = corpus.message_fields(corpus.rng(f"outbound-{face.kind}", i))
        where = f"seed {corpus.SEED} case {i} ({face.kind}): {_short(fields)}"
        message = OutgoingMessage(routing_key=name, **fields)
        try:
            face.call("publish", message, confirm=i % 2 == 0)
        except MalformedMessage as exc:  # named, before sending: nothing went out
            assert str(exc) and "unexpected" not in str(exc), f"{where}: {exc!r}"
            refused.append(str(exc))
        except Exception as exc:
            pytest.fail(f"{where}: {type(exc).__name__}: {exc}")
        else:
            if fields.get("expiration_ms", None) is not None and fields["expiration_ms"] < 60_000:
                may_expire[str(fields["message_id"])] = bytes(fields["body"])  # a TTL it asked
            else:
                expected[str(fields["message_id"])] = bytes(fields["body"])
        face.call("publish", OutgoingMessage(b"good", "", name, message_id=f"good-{i}"))
        expected[f"good-{i}"] = b"good"
    face.pump(30, until=lambda: expected.keys() <= got.keys())
    assert refused and len(expected) > OUTBOUND_CASES  # the corpus holds both kinds
    arrived_of_expiring = {k: v for k, v in got.items() if k in may_expire}
    assert arrived_of_expiring.items() <= may_expire.items()
    # each accepted message arrived, as sent; nothing else did
    assert {k: v for k, v in got.items() if k not in may_expire} == expected
    assert face.client.reconnects == 0
    face.call("delete_queue", name)


def _short(fields: dict[str, Any]) -> str:
    brief = reprlib.Repr()
    brief.maxlevel, brief.maxstring, brief.maxother = 3, 40, 40
    return brief.repr(fields)[:300]


def _publish_plain(settings, queue: str, cases: int, klass: str) -> list[str]:
    """Publish ``cases`` deliveries with random properties, each followed by a good one;
    return the case bodies.  pika alone cannot encode a float: with the layer's field
    codec this plain client sends the doubles and byte arrays other clients send."""
    with layer_codec():
        return _publish_plain_cases(settings, queue, cases, klass)


def _publish_plain_cases(settings, queue: str, cases: int, klass: str) -> list[str]:
    bodies = []
    plain = _plain_pika(settings)
    try:
        ch = plain.channel()
        ch.confirm_delivery()  # the count starts with what the broker took
        for i in range(cases):
            props = corpus.plain_properties(corpus.rng(klass, i))
            body = f"case-{i}"
            ch.basic_publish("", queue, body.encode(), pika.BasicProperties(**props))
            ch.basic_publish("", queue, f"good-{i}".encode())
            bodies.append(body)
    finally:
        plain.close()
    return bodies


def test_fuzzed_plain_deliveries_are_handled_or_dead_lettered(
    face,
    name,
    dead_letters,  # noqa: F811
) -> None:
    face.call("declare_queue", QueueSpec(name))
    handled: list[str] = []
    face.consume(name, lambda d: handled.append(d.body.decode()))
    cases = _publish_plain(face.settings, name, PLAIN_CASES, f"plain-{face.kind}")
    goods = [f"good-{i}" for i in range(PLAIN_CASES)]
    face.pump(20, until=lambda: all(g in handled for g in goods))
    dead = {d.body.decode(): str(d.headers["x-qosmq-reason"]) for d in _dead_all(face, name)}
    left = face.call("queue_length", name)
    missing = sorted(set(goods) - set(handled))
    assert sorted(h for h in handled if h.startswith("good-")) == sorted(goods), (missing, left)
    case_handled = [h for h in handled if h.startswith("case-")]
    assert len(case_handled) == len(set(case_handled))
    assert sorted(case_handled + list(dead)) == sorted(cases)  # handled or dead, never both
    assert all(reason for reason in dead.values())
    assert face.client.reconnects == 0
    assert face.call("queue_length", name) == 0
    face.call("delete_queue", name)


def _dead_all(face, queue: str) -> list:
    found = _dead(face, f"{queue}.dl", queue, 10_000, seconds=2)
    return found


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_fuzzed_receipts_and_plain_deliveries_leave_e2e_confirms_exact(
    kind, settings, name
) -> None:
    """Garbage on a publisher's receipt address and plain-client deliveries (some asking
    for receipts they cannot get) around e2e publishes: every e2e publish is confirmed
    once its handler ran, each handled once; the garbage is counted, never confirms."""
    queues = [f"{name}.0"]
    e2e = E2E(kind, _fast(settings, receipt_timeout=5.0), _fanout(name, queues))
    handled: list[str] = []
    reply_to: list[str] = []

    def handler(d) -> None:
        handled.append(d.body.decode(errors="replace"))
        if d.reply_to and d.body.startswith(b"e2e-"):
            reply_to.append(str(d.reply_to))

    try:
        e2e.consume(queues, handler)
        e2e.publish(b"e2e-first", exchange=name)
        host, port, _ = settings.nodes[0]  # the publisher's node (its first)
        plain = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
        try:
            ch = plain.channel()
            ch.confirm_delivery()
            for i in range(RECEIPT_CASES):
                ch.basic_publish("", reply_to[0], corpus.receipt_body(corpus.rng("receipt", i)))
                props = corpus.plain_properties(corpus.rng("plain-e2e", i))
                with layer_codec():  # floats as other clients send them (see _publish_plain)
                    ch.basic_publish(
                        "", queues[0], f"case-{i}".encode(), pika.BasicProperties(**props)
                    )
                e2e.publish(f"e2e-{i}".encode(), exchange=name)  # confirmed: handled
                assert f"e2e-{i}" in handled
        finally:
            plain.close()
        assert e2e.publisher.core.malformed_receipts <= RECEIPT_CASES
        e2e_handled = [h for h in handled if h.startswith("e2e-")]
        sent = ["e2e-first"] + [f"e2e-{i}" for i in range(RECEIPT_CASES)]
        assert sorted(e2e_handled) == sorted(sent)
    finally:
        e2e.close()


PHOENIX_CASES = 90


@pytest.mark.slow
def test_fuzzed_phoenix_messages_leave_roles_alive_and_events_exact(
    settings, brokers, tmp_path, name
) -> None:
    """Garbage and forged role messages in every master's inbox, between real events:
    each role process lives, every inbox drains (nothing wedged), what a role could not
    use is dead-lettered with a reason, and the subscriber gets each real event once."""
    import asyncio
    import json
    import os

    from middleware.phoenix.ids import RoleId
    from middleware.routing import ChordRing
    from middleware.routing.client import PhoenixClient
    from middleware.transport import (
        AsyncClient,
        BindingSpec,
        ExchangeSpec,
        ExchangeType,
        QueueKind,
    )
    from middleware.transport.delivery import DEAD_LETTER_EXCHANGE
    from qosmq_bench.phoenix_deploy import phoenix_cli
    from tests.integration.phoenix_support import write_topology
    from tests.integration.test_phoenix_bad_input import _take

    ring = ChordRing(["A", "B", "C"])
    event_type = next(f"bids{i}" for i in range(1000) if ring.owner(f"bids{i}") == "B")
    topology_file, topology = write_topology(
        tmp_path, name, {c: {"match_slaves": 1 if c == "B" else 0} for c in "ABC"}
    )
    urls = list(brokers.urls)
    state = tmp_path / "state"
    inboxes = [RoleId.router(c).inbox(topology.prefix) for c in "ABC"]
    master = RoleId.match("B", 0)
    inboxes += [master.inbox(topology.prefix), master.control(topology.prefix)]
    r = corpus.rng("phoenix")
    host, port, _ = settings.nodes[0]

    async def scenario() -> tuple[list[int], dict[str, int], list[str]]:
        client = await AsyncClient(settings=settings).connect()
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        dl = f"{name}.dl"
        await client.declare_exchange(ExchangeSpec(DEAD_LETTER_EXCHANGE, ExchangeType.FANOUT))
        await client.declare_queue(QueueSpec(dl, kind=QueueKind.CLASSIC))
        await client.bind(BindingSpec(dl, DEAD_LETTER_EXCHANGE))
        plain = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
        try:
            queue = f"{name}.sub"
            await at_a.subscribe(event_type, [("price", ">=", 0)], 1, queue, wait_s=60)
            ch = plain.channel()
            ch.confirm_delivery()
            real = 0
            for i in range(PHOENIX_CASES):
                ch.basic_publish("", r.choice(inboxes), corpus.phoenix_body(r, name))
                if i % 3 == 0:
                    await at_c.publish({"event_type": event_type, "attributes": {"price": real}})
                    real += 1
            got = await _take(client, queue, real, 60)
            prices = sorted(m["event"]["attributes"]["price"] for m in got)
            backlog: dict[str, int] = {}
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                backlog = {q: await client.queue_length(q) for q in inboxes}
                if not any(backlog.values()):
                    break
                await asyncio.sleep(0.5)
            reasons = []
            while (d := await client.get(dl)) is not None:
                if d.headers.get("x-qosmq-queue") in inboxes:
                    reasons.append(str(d.headers.get("x-qosmq-reason", "")))
            assert prices == list(range(real)), prices  # each real event once, none lost
            return prices, backlog, reasons
        finally:
            plain.close()
            await client.delete_queue(f"{name}.dl")
            await client.close()

    try:
        phoenix_cli("up", topology_file, state, urls)
        pids: dict[str, int] = json.loads((state / "phoenix.json").read_text())
        _, backlog, reasons = asyncio.run(scenario())
        dead = []
        for role, pid in pids.items():
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                dead.append(role)
        assert dead == [], f"role processes gone: {dead}"
        for log in state.glob("*.log"):  # refused with a warning, never an exception
            text = log.read_text(errors="replace")
            assert "Traceback" not in text and " ERROR " not in text, (log.name, text[-2000:])
        assert not any(backlog.values()), backlog  # every inbox drained: nothing wedged
        assert reasons and all(reasons), reasons  # the refused, each with its reason
    finally:
        if (state / "phoenix.json").exists():
            phoenix_cli("down", topology_file, state, urls)
