"""Batched copies (``copy_batch_max``): a match broker puts the broker-confirmed copies
for one subscriber queue that come close together in one AMQP message, and the Phoenix
client hands them to the application one event at a time, on both faces: every event
once, nothing lost; in a batch, an event whose handler raised is dead-lettered alone
with its reason, one whose handler said ``Requeue`` comes back alone, a malformed
element is dead-lettered alone, and the rest are handled. The deployment's topology
says ``persistent = false``, and the copies come transient.

One run (the module fixture), one claim per test.  The independent counters: a third
subscriber queue read raw by the test (AMQP messages and the events in them, by the
broker's own ``basic.get``), and the dead-letter queue."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from middleware.errors import Requeue
from middleware.routing.batching import encode
from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.routing.messages import Publish
from middleware.routing.wiring import outgoing
from middleware.transport import DEAD_LETTER_QUEUE, AsyncClient, OutgoingMessage
from middleware.transport.delivery import DEAD_LETTER_TOPOLOGY
from tests.integration.phoenix_support import event, eventually_async, owned_by, running

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
NO_SLAVES = {c: {"routing_slaves": 0, "match_slaves": 0} for c in CLUSTERS}
EVENTS = 300  # published at once from B: the match broker gets them in batches


@dataclass
class Run:
    published: list[int] = field(default_factory=list)
    handled: dict[str, list[Any]] = field(default_factory=dict)  # per face: n in order
    amqp_messages: int = 0  # into the raw queue (the broker's deliveries)
    raw_events: list[int] = field(default_factory=list)  # the events in them
    largest: int = 0  # events in the largest AMQP message
    dead: list[tuple[str, str, Any]] = field(default_factory=list)  # (queue, reason, n)
    modes: set[bool] = field(default_factory=set)  # the raw deliveries' persistent flags


def _n(body: bytes) -> Any:
    try:
        return json.loads(body)["event"]["attributes"]["n"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


def _handmade(event_type: str) -> bytes:
    """A batch as a match broker sends one, with one element of every fate."""

    def copy(n: str) -> bytes:
        message = Publish(event_type=event_type, event=event(event_type, n=n), broker="test")
        return outgoing(message, "").body

    return encode([copy("h1"), copy("bad"), b'{"kind": "publish", "n": 1}', copy("again")])


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "copies")
    queues = {face: f"{name}.{face}" for face in ("async", "sync", "raw")}
    run = Run(handled={"async": [], "sync": []})

    def handler_for(face: str) -> Any:
        requeued = set()

        def handle(ev: Any, message: Publish) -> None:
            n = ev.attributes["n"]
            run.handled[face].append(n)
            if n == "bad":
                raise ValueError(f"bad event at {face}")
            if n == "again" and face not in requeued:
                requeued.add(face)
                raise Requeue("not now")

        return handle

    def sync_face(topology: Any, stop: threading.Event) -> None:
        with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
            at_a.consume(queues["sync"], handler_for("sync"))
            at_a.run(until=stop.is_set)

    async def scenario(topology: Any) -> Run:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            at_b = PhoenixClient(client, topology=topology, cluster="B")
            for queue in queues.values():
                await at_a.subscribe(event_type, [("n", "exists")], 1, queue)
            handle = handler_for("async")

            async def on_event(ev: Any, message: Publish) -> None:
                handle(ev, message)

            await at_a.consume(queues["async"], on_event)
            stop = threading.Event()
            sync = threading.Thread(target=sync_face, args=(topology, stop), daemon=True)
            sync.start()

            async def probe() -> bool:
                if "probe" in run.handled["async"] and "probe" in run.handled["sync"]:
                    return True
                await at_b.publish(event(event_type, n="probe"))
                await asyncio.sleep(0.4)
                return False

            await eventually_async(probe, "probes handled", 60, interval=0)
            run.published = list(range(EVENTS))
            await asyncio.gather(*(at_b.publish(event(event_type, n=n)) for n in run.published))
            # one hand-made batch into each client's queue: every fate, deterministically
            for face in ("async", "sync"):
                body = _handmade(event_type)
                await client.publish(OutgoingMessage(body, "", queues[face]))

            def complete(face: str) -> bool:
                got = run.handled[face]
                return set(run.published) <= set(got) and got.count("again") == 2

            async def raw() -> bool:
                while (d := await client.get(queues["raw"])) is not None:
                    body = json.loads(d.body)
                    copies = body if isinstance(body, list) else [body]
                    run.amqp_messages += 1
                    run.modes.add(d.persistent)
                    run.largest = max(run.largest, len(copies))
                    for copy in copies:
                        n = copy["event"]["attributes"]["n"]
                        if n != "probe":
                            run.raw_events.append(n)
                return complete("async") and complete("sync") and len(run.raw_events) >= EVENTS

            await eventually_async(raw, "every event at every queue", 60, interval=0.2)
            await asyncio.sleep(1.0)  # a duplicate would come in this second
            await raw()
            stop.set()
            await asyncio.to_thread(sync.join, 10)
            await client.declare_exchange(DEAD_LETTER_TOPOLOGY[0])
            await client.declare_queue(DEAD_LETTER_TOPOLOGY[1])
            await client.bind(DEAD_LETTER_TOPOLOGY[2])

            async def dead_letters() -> bool:
                while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                    queue = d.headers.get("x-qosmq-queue")
                    if queue in queues.values():
                        run.dead.append((queue, d.headers["x-qosmq-reason"], _n(d.body)))
                return len(run.dead) >= 4

            await eventually_async(dead_letters, "four dead letters", 15, strict=False)
            for queue in queues.values():
                await client.delete_queue(queue)
            return run

    directory = tmp_path_factory.mktemp("copies")
    # and ``persistent = false``: the copies transient (the default's copies are
    # persistent: test_phoenix_broker_restart.py)
    fields = {"copy_batch_max": 32, "batch_linger_ms": 20.0, "persistent": False}
    with running(directory, name, settings, ",".join(brokers.urls), NO_SLAVES, fields) as d:
        return asyncio.run(scenario(d.topology))


def test_copies_for_one_queue_leave_together(run: Run) -> None:
    assert run.amqp_messages < len(run.raw_events) and run.largest > 1, (
        run.amqp_messages,
        run.largest,
    )


def test_every_event_reaches_a_raw_reader_once(run: Run) -> None:
    assert sorted(run.raw_events) == run.published


def test_a_transient_topology_sends_transient_copies(run: Run) -> None:
    assert run.modes == {False}, run.modes


@pytest.mark.parametrize("face", ["async", "sync"])
def test_each_face_hands_every_event_over_once(run: Run, face: str) -> None:
    published = [n for n in run.handled[face] if isinstance(n, int)]
    assert sorted(published) == run.published


@pytest.mark.parametrize("face", ["async", "sync"])
def test_an_event_whose_handler_raised_is_dead_lettered_alone(run: Run, face: str) -> None:
    dead = [(reason, n) for queue, reason, n in run.dead if queue.endswith(f".{face}")]
    assert [n for _, n in dead if n == "bad"] == ["bad"], run.dead
    assert any(f"bad event at {face}" in reason for reason, n in dead if n == "bad")


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_malformed_element_is_dead_lettered_alone(run: Run, face: str) -> None:
    dead = [(reason, n) for queue, reason, n in run.dead if queue.endswith(f".{face}")]
    assert len([n for _, n in dead if n != "bad"]) == 1, run.dead


@pytest.mark.parametrize("face", ["async", "sync"])
def test_an_event_whose_handler_said_requeue_comes_back_alone(run: Run, face: str) -> None:
    got = run.handled[face]
    assert got.count("again") == 2 and got.count("h1") == 1 and got.count("bad") == 1, got
