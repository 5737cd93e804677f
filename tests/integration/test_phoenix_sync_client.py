"""The pika face of the Phoenix client, blocking: a confirmed subscription at A for a type
owned by C gets the matching events published at B; unsubscribed, it gets no more; what
is malformed (a filter, a cluster connection, a batch element, a delivery, a home
cluster) is refused before anything is sent or dead-lettered alone with its reason;
threads sharing one client publish every event once.

One run (the module fixture), one claim per test; the test counts what its handler was
given and what the dead-letter queue holds."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import pytest

from middleware.errors import ConfigurationError
from middleware.phoenix.ids import RoleId
from middleware.routing import FilterError
from middleware.routing.batching import encode
from middleware.routing.client import SubscriptionUnconfirmed, SyncPhoenixClient
from middleware.routing.messages import Publish, Subscribe
from middleware.routing.wiring import outgoing
from middleware.transport import DEAD_LETTER_QUEUE, OutgoingMessage, QueueKind, QueueSpec
from middleware.transport.management import management_get
from tests.integration.phoenix_support import eventually, owned_by, running

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]


@dataclass
class Run:
    refusals: list[str] = field(default_factory=list)  # errors raised before any send
    matched: list[int] = field(default_factory=list)  # the first round, filter qty >= 100
    batched: list[int] = field(default_factory=list)  # the good elements of a batch
    threaded: list[int] = field(default_factory=list)  # published by 4 threads on one client
    removed: bool = False  # the unsubscribe confirmed
    again: bool = True  # the same unsubscribe a second time
    after: list[int] = field(default_factory=list)  # delivered after it (a barrier: qty 7)
    junk_handled: list[int] = field(default_factory=list)  # a junk delivery's effect
    dead: list[tuple[str, bytes]] = field(default_factory=list)  # (reason, body)
    unconfirmed: str = ""  # a subscribe once every role is down
    own_queue: list[int] = field(default_factory=list)  # to a queue declared as asked
    own_kind: str = ""  # that queue's type, as the broker holds it


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    event_type = owned_by(["A", "B", "C"], "C", "orders")
    queue = f"{name}.subscriber"
    run = Run()
    got: list[int] = []

    def drain(client: SyncPhoenixClient, want: int) -> list[int]:
        """The events the client's consumer handled, once ``want`` arrived (and 0.5 s)."""
        client.run(30, until=lambda: len(got) >= want)
        client.run(0.5)
        taken = got[:]
        got.clear()
        return taken

    def publish(client: SyncPhoenixClient, qty: int) -> None:
        client.publish({"event_type": event_type, "attributes": {"qty": qty}})

    directory = tmp_path_factory.mktemp("sync")
    with running(directory, name, settings, ",".join(brokers.urls), {c: {} for c in "ABC"}) as d:
        topology = d.topology
        watched = (RoleId.router("A").inbox(name), RoleId.router("B").inbox(name), queue)
        with (
            SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a,
            SyncPhoenixClient.connect(settings, topology=topology, cluster="B") as at_b,
        ):
            try:
                at_a.subscribe(event_type, [("qty", "between", 1)], 1, queue)
            except FilterError as exc:
                run.refusals.append(f"filter: {exc}")
            elsewhere = topology.clusters[2].model_copy(update={"vhost": "/elsewhere"})
            other = topology.model_copy(update={"clusters": (*topology.clusters[:2], elsewhere)})
            try:
                SyncPhoenixClient(at_a.client, topology=other, cluster="C")
            except ConfigurationError as exc:
                run.refusals.append(f"connection: {exc}")
            sid = at_a.subscribe(event_type, [("qty", ">=", 100)], 2, queue)
            at_a.consume(queue, lambda event, message: got.append(event.attributes["qty"]))
            at_a.advertise(event_type)
            for qty in (50, 100, 150, 99, 200):
                publish(at_b, qty)
            run.matched = drain(at_a, 3)
            # a batch (as roles send each other under load) with a malformed element,
            # into B's router: the good ones are routed, the bad one dead-lettered alone
            good = [
                outgoing(Publish(event_type=event_type, event=e), "").body
                for e in (
                    {"event_type": event_type, "attributes": {"qty": 120}},
                    {"event_type": event_type, "attributes": {"qty": 130}},
                )
            ]
            body = encode([good[0], b'{"kind": "publish", "qty": 1}', good[1]])
            at_b.client.publish(OutgoingMessage(body, "", RoleId.router("B").inbox(name)))
            run.batched = drain(at_a, 2)
            # four threads publishing on one client (pika's connection takes turns)
            threads = [
                threading.Thread(
                    target=lambda k=k: [publish(at_b, 1000 + 25 * k + i) for i in range(25)]
                )
                for k in range(4)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
            run.threaded = drain(at_a, 100)
            run.removed = at_a.unsubscribe(event_type, sid)
            run.again = at_a.unsubscribe(event_type, sid)
            for qty in (300, 400):
                publish(at_b, qty)
            # a barrier: a second subscription's event arrives after the two above
            probe = at_a.subscribe(event_type, [("qty", "=", 7)], 2, queue)
            publish(at_b, 7)
            run.after = drain(at_a, 1)
            at_a.unsubscribe(event_type, probe)
            # a subscriber queue declared as the subscriber asks (quorum, bounded)
            own = QueueSpec(f"{queue}.own", kind=QueueKind.QUORUM, max_length=1000)
            try:  # a spec for another queue than the subscription's
                at_a.subscribe(event_type, [("qty", "=", 8)], 1, queue, queue_spec=own)
            except ConfigurationError as exc:
                run.refusals.append(f"queue_spec: {exc}")
            own_sid = at_a.subscribe(event_type, [("qty", "=", 8)], 1, own.name, queue_spec=own)
            at_a.consume(own.name, lambda event, message: got.append(event.attributes["qty"]))
            publish(at_b, 8)
            run.own_queue = drain(at_a, 1)
            run.own_kind = management_get(settings, f"/api/queues/%2F/{own.name}")["type"]
            at_a.unsubscribe(event_type, own_sid)
            at_a.client.delete_queue(own.name)
            # a body that is no Phoenix event, in the subscriber queue
            at_a.client.publish(OutgoingMessage(b"junk", "", queue))
            at_a.run(1)
            run.junk_handled = got[:]
            at_a.client.delete_queue(queue)
            # a subscribe naming a home cluster the topology does not have
            stray = Subscribe(event_type=event_type, home="Z", queue=queue, subscription_id="x")
            at_a.client.publish(outgoing(stray, RoleId.router("A").inbox(name)))

            def dead_letters() -> bool:
                while (m := at_a.client.get(DEAD_LETTER_QUEUE)) is not None:
                    if m.headers.get("x-qosmq-queue") in watched:
                        run.dead.append((m.headers["x-qosmq-reason"], m.body))
                return len(run.dead) >= 3

            eventually(dead_letters, "three dead letters", 15, interval=0.2, strict=False)
    with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
        try:
            at_a.subscribe(event_type, None, 1, f"{queue}.late", wait_s=1)
        except SubscriptionUnconfirmed as exc:
            run.unconfirmed = str(exc)
        at_a.client.delete_queue(f"{queue}.late")
    return run


def _dead(run: Run, reason: str) -> list[bytes]:
    return [body for why, body in run.dead if reason in why]


def test_a_malformed_filter_is_refused_before_anything_is_sent(run: Run) -> None:
    assert any(r.startswith("filter: ") for r in run.refusals), run.refusals


def test_a_connection_to_another_clusters_rabbitmq_is_refused(run: Run) -> None:
    assert any(r.startswith("connection: ") and "cluster 'C'" in r for r in run.refusals)


def test_a_subscriber_queue_is_declared_as_the_subscriber_asked(run: Run) -> None:
    """``queue_spec``: a quorum queue with a bound gets its events; a spec naming
    another queue is refused before anything is sent."""
    assert (run.own_queue, run.own_kind) == ([8], "quorum")
    assert any(r.startswith("queue_spec: ") for r in run.refusals), run.refusals


def test_exactly_the_matching_events_are_handled(run: Run) -> None:
    assert sorted(run.matched) == [100, 150, 200]


def test_the_good_elements_of_a_batch_are_routed(run: Run) -> None:
    assert sorted(run.batched) == [120, 130]


def test_threads_sharing_one_client_publish_every_event_once(run: Run) -> None:
    assert sorted(run.threaded) == list(range(1000, 1100))


def test_a_malformed_batch_element_is_dead_lettered_alone(run: Run) -> None:
    bodies = _dead(run, "malformed Phoenix message in a batch")
    assert [json.loads(b) for b in bodies] == [{"kind": "publish", "qty": 1}], run.dead


def test_an_unsubscribe_is_confirmed_once(run: Run) -> None:
    assert (run.removed, run.again) == (True, False)


def test_after_an_unsubscribe_no_event_arrives(run: Run) -> None:
    assert run.after == [7]  # not 300 or 400


def test_a_delivery_that_is_no_phoenix_event_is_dead_lettered_unhandled(run: Run) -> None:
    assert run.junk_handled == []
    assert len(_dead(run, "malformed Phoenix delivery")) == 1, run.dead


def test_a_subscribe_for_an_unknown_home_cluster_is_dead_lettered(run: Run) -> None:
    assert len(_dead(run, "home cluster 'Z' is not in the topology")) == 1, run.dead


def test_a_subscription_nobody_confirms_is_said_not_hung(run: Run) -> None:
    assert "did not confirm it in 1 s" in run.unconfirmed
