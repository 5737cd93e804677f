"""OpenTelemetry traces of the layer's traffic, against the real brokers, read from the
SDK's in-memory exporter: an e2e publish's span tree on both faces, a spooled message
drained under the context it was accepted in, a traceparent that does not parse."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

import pika
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from middleware import tracing
from middleware.localcluster.proxy import FaultProxy
from middleware.queues import EnqueueStatus, SyncQueues
from middleware.routing import PhoenixTopology, RoleId
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient, QueueKind, QueueSpec, SyncClient
from tests.integration.phoenix_support import owned_by, running
from tests.integration.test_confirms import E2E, _fanout, _fast
from tests.integration.test_queues import _via

pytestmark = pytest.mark.rabbit


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    try:
        yield exporter
    finally:
        tracing.use(None)
        provider.shutdown()


def _finished(exporter: InMemorySpanExporter, count: int, name_part: str) -> list[Any]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [s for s in exporter.get_finished_spans() if name_part in s.name]
        if len(found) >= count:
            return found
        time.sleep(0.05)
    return [s for s in exporter.get_finished_spans() if name_part in s.name]


@pytest.mark.parametrize("face", ["async", "sync"])
def test_an_e2e_publish_is_one_tree_publish_process_receipt(face, settings, name, spans) -> None:
    queues = [f"{name}.a", f"{name}.b"]
    e2e = E2E(face, _fast(settings), _fanout(name, queues))
    try:
        e2e.consume(queues, lambda d: None)
        e2e.publish(b"traced", exchange=name, message_id=f"{name}-m")
    finally:
        e2e.close()
    mine = lambda s: s.attributes.get("messaging.message.id") == f"{name}-m"  # noqa: E731
    publishes = [s for s in _finished(spans, 1, f"{name} publish") if mine(s)]
    assert len(publishes) == 1, [s.name for s in spans.get_finished_spans()]
    publish = publishes[0]
    assert publish.kind is trace.SpanKind.PRODUCER
    assert publish.attributes["messaging.system"] == "rabbitmq"
    assert publish.attributes["messaging.destination.name"] == name
    processes = [s for s in _finished(spans, 2, " process") if mine(s)]
    receipts = [s for s in _finished(spans, 2, " receipt") if mine(s)]
    assert sorted(s.name for s in processes) == [f"{q} process" for q in queues]
    for process in processes:
        assert process.kind is trace.SpanKind.CONSUMER
        assert process.parent is not None
        assert process.parent.span_id == publish.context.span_id
        assert process.context.trace_id == publish.context.trace_id
    by_process = {p.context.span_id: p for p in processes}
    assert sorted(s.name for s in receipts) == [f"{q} receipt" for q in queues]
    for receipt in receipts:
        owner = by_process[receipt.parent.span_id]
        assert owner.name == receipt.name.replace(" receipt", " process")


def test_a_spooled_message_is_drained_in_the_context_it_was_accepted_in(
    settings, brokers, tmp_path, name, spans
) -> None:
    proxy = FaultProxy(int(brokers.urls[0].rstrip("/").rsplit(":", 1)[1]))
    try:
        queues = SyncQueues(SyncClient(settings=_via(proxy, settings, tmp_path))).start()
        queues.create_queue(name)
        proxy.cut(refuse=True)
        with tracing._tracer().start_as_current_span("app order") as app:
            result = queues.enqueue(name, b"later", message_id=f"{name}-s")
        assert result.status is EnqueueStatus.SPOOLED
        proxy.heal()
        assert queues.recover().replayed == 1
        drained = [
            s
            for s in _finished(spans, 1, " publish")
            if s.attributes.get("messaging.message.id") == f"{name}-s"
            and s.status.is_ok
            and s.end_time is not None
        ]
        assert drained, [s.name for s in spans.get_finished_spans()]
        last = drained[-1]  # the drain's publish (the failed attempt came first)
        assert last.context.trace_id == app.get_span_context().trace_id
        assert last.parent.span_id == app.get_span_context().span_id
        queues.destroy_queue(name)
        queues.client.close()
    finally:
        proxy.close()


def test_a_traceparent_that_does_not_parse_is_ignored_in_one_line(
    settings, name, spans, caplog
) -> None:
    caplog.set_level(logging.WARNING, logger="middleware.tracing")
    client = SyncClient(settings=settings).connect()
    queue = f"{name}.odd"
    client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))
    host, port, _ = settings.nodes[0]
    plain = pika.BlockingConnection(pika.ConnectionParameters(host=host, port=port))
    try:
        channel = plain.channel()
        for value in ("garbage", "00-zz-zz-01", "also garbage"):
            channel.basic_publish(
                "", queue, value.encode(), pika.BasicProperties(headers={"traceparent": value})
            )
    finally:
        plain.close()
    handled: list[bytes] = []
    client.consume(queue, lambda d: handled.append(d.body))
    client.run(10, until=lambda: len(handled) >= 3)
    client.delete_queue(queue)
    client.close()
    assert len(handled) == 3  # every delivery handled
    processes = _finished(spans, 3, f"{queue} process")
    assert len(processes) == 3 and all(p.parent is None for p in processes)
    lines = [r for r in caplog.records if "does not parse" in r.getMessage()]
    assert len(lines) == 1 and queue in lines[0].getMessage()


def test_one_phoenix_event_is_one_trace_through_every_hop(
    settings, brokers, tmp_path, name, spans, monkeypatch
) -> None:
    """Client at A, an event type B owns, the subscriber homed at A: the event's trace
    runs client publish -> A's router -> B's router -> B's match broker (a ``match`` span
    naming the subscription) -> the copy to the subscriber's queue, each role's spans
    written by its own process (``trace_file``)."""
    trace_file = tmp_path / "roles.jsonl"
    monkeypatch.setenv("QOSMQ_TRACE_FILE", str(trace_file))  # the roles' environment
    event_type = owned_by(["A", "B"], "B", "traced")
    queue = f"{name}.sub"
    fields = {"routing_slaves": 0, "match_slaves": 0}
    with running(tmp_path, name, settings, ",".join(brokers.urls), {"A": fields, "B": fields}):
        topology = PhoenixTopology.load(tmp_path / "phoenix.toml")

        async def scenario() -> Any:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                sid = await at_a.subscribe(event_type, [("n", ">=", 0)], 1, queue, wait_s=60)
                with tracing._tracer().start_as_current_span("app event") as app:
                    await at_a.publish({"event_type": event_type, "attributes": {"n": 1}})
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    delivered = await client.get(queue)
                    if delivered is not None:
                        return app.get_span_context(), delivered, sid
                    await asyncio.sleep(0.1)
                raise AssertionError("the event never reached the subscriber")

        app, delivered, sid = asyncio.run(scenario())
        time.sleep(0.5)  # the roles' last spans
    trace_id = f"0x{app.trace_id:032x}"
    assert f"{app.trace_id:032x}" in delivered.headers["traceparent"]  # one trace end to end
    role_spans = [json.loads(line) for line in trace_file.read_text().splitlines() if line]
    mine = {s["context"]["span_id"]: s for s in role_spans if s["context"]["trace_id"] == trace_id}
    local = {f"0x{s.context.span_id:016x}": s for s in spans.get_finished_spans()}
    # walk back from the copy the subscriber got to the application's span
    parent = "0x" + delivered.headers["traceparent"].split("-")[2]
    chain, matched = [], None
    while parent in mine:
        span = mine[parent]
        chain.append(span["name"])
        if span["name"] == f"{event_type} match":
            matched = span["attributes"]["qosmq.phoenix.matched"]
        parent = span["parent_id"]
    while parent in local:
        chain.append(local[parent].name)
        parent = (
            f"0x{local[parent].parent.span_id:016x}" if local[parent].parent is not None else ""
        )
    prefix = topology.prefix
    route = " <- ".join(chain)
    print(f"\nthe event's trace, from the copy back: {route}")
    assert chain[-1] == "app event", route
    for hop in (
        RoleId.router("A").inbox(prefix),
        RoleId.router("B").inbox(prefix),
        RoleId.match("B", 0).inbox(prefix),
    ):
        assert f"{hop} process" in chain, f"{hop} missing from {route}"
    assert matched == [sid], (matched, sid)  # the match names the subscription
