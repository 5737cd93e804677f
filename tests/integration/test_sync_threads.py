"""Threads sharing one sync client, and the sync faces on it, as a threaded service does;
processes forked with a connected client, as a pre-forking server's workers are.

pika's connection is not thread-safe; before the client took turns, threads sharing one
``SyncClient`` interleaved frames (the broker closed the connection 6-36 times a run),
took each other's confirms (duplicates), and lost unconfirmed publishes silently (388 of
400 arrived).  Every count here is taken by a pika connection of the test's own.
"""

from __future__ import annotations

import collections
import os
import signal
import threading
import time
from collections.abc import Callable

import pytest

from middleware.balancer import replica_names
from middleware.balancer.sync import SyncBalancedPublisher
from middleware.confirms.sync import SyncConfirmConsumer, SyncConfirmPublisher
from middleware.errors import MiddlewareError
from middleware.queues.sync import SyncQueues
from middleware.settings import Settings
from middleware.transport import OutgoingMessage, QueueKind, QueueSpec, SyncClient
from tests.raw_pika import drained

pytestmark = [pytest.mark.rabbit]

THREADS = 8


def _in_threads(work: Callable[[int], None], threads: int = THREADS) -> collections.Counter[str]:
    """Run ``work(k)`` in ``threads`` threads at once; the errors they raised, by kind."""
    errors: collections.Counter[str] = collections.Counter()

    def guarded(k: int) -> None:
        try:
            work(k)
        except Exception as exc:  # counted, the test says which
            errors[f"{type(exc).__name__}: {str(exc)[:80]}"] += 1

    started = [threading.Thread(target=guarded, args=(k,)) for k in range(threads)]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join(120)
    assert not any(t.is_alive() for t in started), "a thread is still waiting for its turn"
    return errors


def _drained(settings: Settings, queue: str) -> list[bytes]:
    """Every body in ``queue``, taken by a plain pika connection (the independent count)."""
    return [body for _, body in drained(settings.amqp_urls[0], queue)]


def _wait_for(done: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.mark.parametrize("confirm", [True, False], ids=["confirmed", "unconfirmed"])
def test_threads_publish_on_one_client_while_another_runs_its_consumer(
    confirm: bool, settings: Settings, name: str
) -> None:
    per = 150
    total = THREADS * per
    inbox, outbox = f"{name}-in", f"{name}-out"
    client = SyncClient(settings=settings).connect()
    try:
        for queue in (inbox, outbox):
            client.declare_queue(QueueSpec(queue, kind=QueueKind.QUORUM))
        for i in range(total):  # what the consumer takes while the threads publish
            client.publish(OutgoingMessage(f"in-{i}".encode(), "", inbox))
        handled: list[bytes] = []
        client.consume(inbox, lambda delivery: handled.append(bytes(delivery.body)))
        stop = threading.Event()
        runner = threading.Thread(target=lambda: client.run(until=stop.is_set))
        runner.start()

        def publish(k: int) -> None:
            for i in range(per):
                body = f"{k}-{i}".encode()
                client.publish(OutgoingMessage(body, "", outbox), confirm=confirm)

        errors = _in_threads(publish)
        _wait_for(lambda: len(handled) >= total, 30)
        client.poll()  # the last unconfirmed publishes' acks
        stop.set()
        runner.join(10)
        stored = _drained(settings, outbox)
        assert not runner.is_alive()
        assert not errors, errors
        assert client.reconnects == 0, f"{client.reconnects} connections lost to interleaved frames"
        expected = {f"{k}-{i}".encode() for k in range(THREADS) for i in range(per)}
        duplicates = len(stored) - len(set(stored))
        assert set(stored) == expected and not duplicates, (
            f"{len(expected - set(stored))} publishes lost, {duplicates} duplicated"
        )
        assert sorted(handled) == sorted(f"in-{i}".encode() for i in range(total))
    finally:
        for queue in (inbox, outbox):
            client.delete_queue(queue)
        client.close()


@pytest.mark.parametrize("mode", ["e2e", "persistent"])
def test_threads_share_one_confirm_publisher(mode: str, settings: Settings, name: str) -> None:
    per = 40
    consuming = SyncClient(settings=settings).connect()
    publishing = SyncClient(settings=settings).connect()
    try:
        consuming.declare_queue(QueueSpec(name, kind=QueueKind.QUORUM))
        got: collections.Counter[bytes] = collections.Counter()
        consumer = SyncConfirmConsumer(consuming)
        consumer.consume(name, lambda delivery: got.update([bytes(delivery.body)]))
        stop = threading.Event()
        runner = threading.Thread(target=lambda: consumer.run(until=stop.is_set))
        runner.start()
        publisher = SyncConfirmPublisher(publishing, mode=mode)
        confirmed: list[bytes] = []

        def publish(k: int) -> None:
            for i in range(per):
                body = f"{k}-{i}".encode()
                publisher.publish(body, routing_key=name)
                confirmed.append(body)  # returned: the mode's confirm came

        errors = _in_threads(publish)
        total = THREADS * per
        _wait_for(lambda: len(got) >= total, 30)
        stop.set()
        runner.join(10)
        assert not errors, errors
        assert len(confirmed) == total
        assert publishing.reconnects == 0
        # e2e: confirmed means handled; every message once
        assert set(got) == set(confirmed) and set(got.values()) == {1}, got.most_common(3)
    finally:
        consuming.delete_queue(name)
        consuming.close()
        publishing.close()


def test_threads_share_one_sync_queues(settings: Settings, name: str, tmp_path) -> None:
    per = 60
    qs = settings.queues.model_copy(update={"spool_path": tmp_path / "spool.sqlite3"})
    queues = SyncQueues(SyncClient(settings=settings), settings=qs).start()
    try:
        queues.create_queue(name)

        def enqueue(k: int) -> None:
            for i in range(per):
                queues.enqueue(name, f"{k}-{i}".encode(), message_id=f"{k}-{i}")

        errors = _in_threads(enqueue)
        assert not errors, errors
        assert queues.client.reconnects == 0
        stored = _drained(settings, name)
        assert sorted(stored) == sorted(
            f"{k}-{i}".encode() for k in range(THREADS) for i in range(per)
        )
    finally:
        queues.destroy_queue(name)
        queues.client.close()


def test_threads_share_one_balanced_publisher(settings: Settings, name: str) -> None:
    per, replicas = 60, 3
    client = SyncClient(settings=settings).connect()
    queues = replica_names(name, replicas)
    try:
        for queue in queues:
            client.declare_queue(QueueSpec(queue, kind=QueueKind.QUORUM))
        publisher = SyncBalancedPublisher(
            client, topic=name, replicas=replicas, algorithm="round_robin"
        ).start()
        chosen: list[str] = []

        def publish(k: int) -> None:
            for i in range(per):
                chosen.append(publisher.publish(f"{k}-{i}".encode()))

        errors = _in_threads(publish)
        assert not errors, errors
        assert client.reconnects == 0
        stored = {queue: _drained(settings, queue) for queue in queues}
        everything = [body for bodies in stored.values() for body in bodies]
        assert sorted(everything) == sorted(
            f"{k}-{i}".encode() for k in range(THREADS) for i in range(per)
        )
        for queue in queues:  # each where the publisher said it went
            assert len(stored[queue]) == chosen.count(queue)
    finally:
        for queue in queues:
            client.delete_queue(queue)
        client.close()


@pytest.mark.cluster
@pytest.mark.chaos
@pytest.mark.slow
def test_threads_sharing_a_client_fail_over_together_when_its_node_is_killed(
    settings: Settings, brokers, local_cluster, name: str
) -> None:
    client = SyncClient(settings=settings).connect()
    client.declare_queue(QueueSpec(name, kind=QueueKind.QUORUM))
    victim = brokers.node_of_url(client.connected_node)
    confirmed: list[bytes] = []
    failed: list[bytes] = []
    stop = threading.Event()

    def publish(k: int) -> None:
        i = 0
        while not stop.is_set():
            body = f"{k}-{i}".encode()
            try:
                client.publish(OutgoingMessage(body, "", name))
                confirmed.append(body)
            except MiddlewareError:
                failed.append(body)
            i += 1

    killer = threading.Timer(1.0, lambda: local_cluster.kill(victim))
    stopper = threading.Timer(6.0, stop.set)
    killer.start()
    stopper.start()
    try:
        errors = _in_threads(publish, threads=4)
        killer.join()
        stopper.join()
        others = [url for url in settings.amqp_urls if brokers.node_of_url(url) != victim]
        stored = _drained(settings.model_copy(update={"amqp_urls": tuple(others)}), name)
    finally:
        stop.set()
        client.delete_queue(name)
        client.close()
    assert not errors, errors
    assert client.reconnects >= 1
    lost = set(confirmed) - set(stored)
    assert not lost, f"{len(lost)} of {len(confirmed)} confirmed messages are not in the queue"
    assert not failed, f"{len(failed)} publishes failed instead of failing over"
    assert len(confirmed) > 100


def _publish_numbered(
    client: SyncClient, queue: str, prefix: str, per: int, *, confirm: bool
) -> int:
    """``per`` publishes of ``<prefix>-<i>``; how many failed."""
    failed = 0
    for i in range(per):
        try:
            client.publish(OutgoingMessage(f"{prefix}-{i}".encode(), "", queue), confirm=confirm)
        except MiddlewareError:
            failed += 1
    return failed


@pytest.mark.parametrize("confirm", [True, False], ids=["confirmed", "unconfirmed"])
def test_processes_forked_with_a_connected_client_each_open_their_own_connection(
    confirm: bool, settings: Settings, name: str
) -> None:
    """A pre-forking server (gunicorn's ``preload_app``) forks its workers after the
    module made its client: before, parent and children wrote on one socket (the broker
    closed it, duplicates, a 15 s silence) and unconfirmed publishes were lost (23 of
    401). A thread of the parent runs the client at the fork, holding its turn."""
    kids, per = 3, 100
    client = SyncClient(settings=settings).connect()
    client.declare_queue(QueueSpec(name, kind=QueueKind.QUORUM))
    stop = threading.Event()
    runner = threading.Thread(target=lambda: client.run(until=stop.is_set))
    runner.start()
    pids = []
    try:
        time.sleep(0.3)
        for k in range(kids):
            pid = os.fork()
            if pid == 0:  # the child: never back into pytest, and gone within 60 s
                signal.alarm(60)
                status = 99
                try:  # its exit status: how many of its publishes failed
                    status = _publish_numbered(client, name, str(k), per, confirm=confirm)
                    if not confirm:  # what the watched channel owes: acked, or sent again
                        client.run(2)
                    client.close()
                finally:
                    os._exit(status)
            pids.append(pid)
        parent_failed = _publish_numbered(client, name, "p", per, confirm=confirm)
        statuses = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        client.poll()
        stop.set()
        runner.join(10)
        stored = _drained(settings, name)
    finally:
        stop.set()
        client.delete_queue(name)
        client.close()
    assert statuses == [0] * kids, f"publishes failed in the children: {statuses}"
    assert parent_failed == 0 and client.reconnects == 0
    expected = {f"{k}-{i}".encode() for k in range(kids) for i in range(per)}
    expected |= {f"p-{i}".encode() for i in range(per)}
    duplicates = len(stored) - len(set(stored))
    assert set(stored) == expected and not duplicates, (
        f"{len(expected - set(stored))} publishes lost, {duplicates} duplicated"
    )
