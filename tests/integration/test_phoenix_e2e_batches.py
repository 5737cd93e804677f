"""Batched e2e copies (``copy_batch_max`` with ``confirm="e2e"``): a match broker puts
the e2e copies for one subscriber queue that come close together in one e2e message
with one receipt, naming each copy's id and content (``ELEMENTS_HEADER``); the Phoenix
client hands them over one at a time, on both faces, and checks each against its
duplicate filter as the message it would be alone.

One run (the module fixture), one claim per test.  The independent counters: a third
e2e subscriber queue read raw by the test (``basic.get``: AMQP messages, the events in
them and the header that names them), the test's own e2e publisher (its receipts), the
handlers' own lists and the dead-letter queue."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from middleware.confirms import AsyncConfirmPublisher
from middleware.confirms.tracking import CONTENT_HEADER, ELEMENTS_HEADER, encode_elements
from middleware.errors import Requeue
from middleware.routing.batching import encode
from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.routing.copies import copy_id, event_content
from middleware.routing.messages import Publish
from middleware.routing.wiring import outgoing
from middleware.transport import DEAD_LETTER_QUEUE, AsyncClient
from middleware.transport.delivery import DEAD_LETTER_TOPOLOGY
from tests.integration.phoenix_support import event, eventually_async, owned_by, running

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
CLUSTERS = ["A", "B", "C"]
NO_SLAVES = {c: {"routing_slaves": 0, "match_slaves": 0} for c in CLUSTERS}
EVENTS = 300  # published at once from B: the match broker gets them in batches
AGAIN = 150  # its handler says Requeue the first time, at each face
LATE = "late"  # the test's own copy beside a forged one: Requeue the first time too
FACES = ("async", "sync")


@dataclass
class Run:
    published: list[int] = field(default_factory=list)
    handled: dict[str, list[Any]] = field(default_factory=dict)  # per face: n in order
    seen: dict[str, dict[Any, Publish]] = field(default_factory=dict)  # per face: n -> copy
    amqp_messages: int = 0  # into the raw queue (the broker's deliveries)
    raw_events: list[int] = field(default_factory=list)  # the events in them
    largest: int = 0  # events in the largest AMQP message
    unnamed: int = 0  # raw batches whose header does not name each element in order
    receipted: dict[str, list[bool]] = field(default_factory=dict)  # the test's resends
    dead: list[tuple[str, str, Any]] = field(default_factory=list)  # (queue, reason, n)


def _n(body: bytes) -> Any:
    try:
        return json.loads(body)["event"]["attributes"]["n"]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")


def _named(copy: Publish, queue: str) -> tuple[str, str]:
    """A copy's (id, content name), as the match broker names it."""
    copy_name = copy_id(copy.id, queue)
    assert copy_name is not None
    return copy_name, event_content(copy.event.model_dump_json())


def _check_raw(run: Run, body: bytes, headers: dict[str, Any], queue: str) -> None:
    copies = json.loads(body)
    copies = copies if isinstance(copies, list) else [copies]
    run.amqp_messages += 1
    run.largest = max(run.largest, len(copies))
    parsed = [Publish.model_validate(c) for c in copies]
    if len(copies) > 1:
        named = headers.get(ELEMENTS_HEADER)
        if named != encode_elements(_named(c, queue) for c in parsed):
            run.unnamed += 1
    for copy in parsed:
        n = copy.event.attributes["n"]
        if n != "probe":
            run.raw_events.append(n)


async def _resend(
    client: AsyncClient, publisher: AsyncConfirmPublisher, run: Run, queue: str, face: str
) -> None:
    """Copies of events the face handled, sent again by the test: alone, in a batch
    of its own, and one handled id with other content."""
    handled = run.seen[face]
    first, second = handled[0], handled[1]

    async def send(copies: list[Publish], names: list[tuple[str, str]], batch_id: str) -> bool:
        bodies = [outgoing(c, "").body for c in copies]
        headers: dict[str, Any] = {CONTENT_HEADER: "+".join(n for _, n in names)}
        if len(copies) > 1:
            headers[ELEMENTS_HEADER] = encode_elements(names)
        return await publisher.publish_held(
            encode(bodies),
            hold_s=10,
            taken_within=10,
            routing_key=queue,
            expect=[queue],
            message_id=batch_id,
            headers=headers,
        )

    alone = _named(first, queue)
    # alone, as an unbatched e2e copy goes: its id and content are the copy's own
    run.receipted[face] = [await send([first], [alone], alone[0])]
    pair = [_named(first, queue), _named(second, queue)]
    run.receipted[face].append(await send([first, second], pair, f"test-batch-{face}"))
    forged = first.model_copy(update={"event": second.event})
    names = [_named(second, queue), (alone[0], "other content")]
    run.receipted[face].append(await send([second, forged], names, f"test-forged-{face}"))
    # another content under the id beside a copy that asks Requeue: the batch comes
    # back whole, and the forged element is dead-lettered once, not on each coming
    attributes = {**second.event.attributes, "n": LATE}
    late = second.model_copy(
        update={
            "id": f"{second.id}-late",
            "event": second.event.model_copy(update={"attributes": attributes}),
        }
    )
    names = [(alone[0], "third content"), _named(late, queue)]
    run.receipted[face].append(await send([forged, late], names, f"test-forged-late-{face}"))


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    event_type = owned_by(CLUSTERS, "B", "e2ebatch")
    queues = {face: f"{name}.{face}" for face in (*FACES, "raw")}
    run = Run(handled={f: [] for f in FACES}, seen={f: {} for f in FACES})

    def handler_for(face: str) -> Any:
        requeued = set()

        def handle(ev: Any, message: Publish) -> None:
            n = ev.attributes["n"]
            run.handled[face].append(n)
            run.seen[face].setdefault(n, message)
            if n in (AGAIN, LATE) and (face, n) not in requeued:
                requeued.add((face, n))
                raise Requeue("not now")

        return handle

    def sync_face(topology: Any, stop: threading.Event) -> None:
        with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
            at_a.consume(queues["sync"], handler_for("sync"), e2e=True)
            at_a.run(until=stop.is_set)

    async def scenario(topology: Any) -> Run:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            at_b = PhoenixClient(client, topology=topology, cluster="B")
            for queue in queues.values():
                await at_a.subscribe(event_type, [("n", "exists")], 1, queue, confirm="e2e")
            handle = handler_for("async")

            async def on_event(ev: Any, message: Publish) -> None:
                handle(ev, message)

            await at_a.consume(queues["async"], on_event, e2e=True)
            stop = threading.Event()
            sync = threading.Thread(target=sync_face, args=(topology, stop), daemon=True)
            sync.start()

            async def probe() -> bool:
                if all("probe" in run.handled[f] for f in FACES):
                    return True
                await at_b.publish(event(event_type, n="probe"))
                await asyncio.sleep(0.4)
                return False

            await eventually_async(probe, "probes handled", 60, interval=0)
            run.published = list(range(EVENTS))
            await asyncio.gather(*(at_b.publish(event(event_type, n=n)) for n in run.published))

            def complete(face: str) -> bool:
                return set(run.published) <= set(run.handled[face])

            async def raw() -> bool:
                while (d := await client.get(queues["raw"])) is not None:
                    _check_raw(run, d.body, dict(d.headers), queues["raw"])
                return all(map(complete, FACES)) and len(run.raw_events) >= EVENTS

            await eventually_async(raw, "every event at every queue", 90, interval=0.2)
            publisher = AsyncConfirmPublisher(client, mode="e2e")
            await publisher.start()
            try:
                for face in FACES:
                    await _resend(client, publisher, run, queues[face], face)
            finally:
                await publisher.close()
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
                return len(run.dead) >= 2 * len(FACES)

            await eventually_async(dead_letters, "two dead letters per face", 15, strict=False)
            await asyncio.sleep(1.0)  # a third would come in this second
            await dead_letters()
            for queue in queues.values():
                await client.delete_queue(queue)
            return run

    directory = tmp_path_factory.mktemp("e2e-batches")
    fields = {"copy_batch_max": 32, "batch_linger_ms": 20.0}
    with running(directory, name, settings, ",".join(brokers.urls), NO_SLAVES, fields) as d:
        return asyncio.run(scenario(d.topology))


def test_e2e_copies_for_one_queue_leave_together_each_named(run: Run) -> None:
    assert run.amqp_messages < len(run.raw_events) and run.largest > 1, (
        run.amqp_messages,
        run.largest,
    )
    assert run.unnamed == 0


def test_every_event_reaches_a_raw_reader_once(run: Run) -> None:
    assert sorted(run.raw_events) == run.published


@pytest.mark.parametrize("face", FACES)
def test_each_face_hands_every_event_over_once(run: Run, face: str) -> None:
    """The batch that carried the event whose handler said Requeue came back whole: its
    other events were skipped by their own duplicate check, the requeued one handled."""
    got = [n for n in run.handled[face] if isinstance(n, int)]
    assert got.count(AGAIN) == 2, got
    got.remove(AGAIN)
    assert sorted(got) == run.published


@pytest.mark.parametrize("face", FACES)
def test_copies_sent_again_alone_or_batched_are_receipted_and_not_handed_over(
    run: Run, face: str
) -> None:
    assert run.receipted[face] == [True, True, True, True], run.receipted
    assert run.handled[face].count(0) == 1 and run.handled[face].count(1) == 1
    assert run.handled[face].count(LATE) == 2  # asked Requeue, then handled


@pytest.mark.parametrize("face", FACES)
def test_a_handled_id_with_other_content_is_dead_lettered_once_with_why(
    run: Run, face: str
) -> None:
    """Each forged element once, although the second one's batch came twice."""
    dead = [(reason, n) for queue, reason, n in run.dead if queue.endswith(f".{face}")]
    assert len(dead) == 2, run.dead
    assert all("duplicate message id" in reason for reason, _ in dead), run.dead
