"""A process's beat thread (``routing/beats.py``) against a real broker: aimed at another
role's queues with another body (the process switched roles), it beats there from the
next beat on, on the same connection and with the same lease; aimed at nothing it only
holds the lease; stopped, it releases the lease cleanly (the token acked, not handed
back to a watcher)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from middleware.routing.beats import Beater
from middleware.transport import QueueKind, QueueSpec, SyncClient

pytestmark = pytest.mark.rabbit


def _bodies(client: SyncClient, queue: str) -> list[bytes]:
    """Every message waiting in ``queue`` (taken)."""
    got = []
    while (delivery := client.get(queue)) is not None:
        got.append(delivery.body)
    return got


def _wait(until: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not until():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.02)


def test_a_beater_aimed_anew_beats_there_with_the_same_connection_and_lease(settings) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    slave_queue, master_queue = f"{prefix}.as-slave", f"{prefix}.as-master"
    client = SyncClient(settings=settings).connect()
    for name in (slave_queue, master_queue):
        client.declare_queue(QueueSpec(name, kind=QueueKind.CLASSIC, durable=False))
    beater = Beater(
        settings,
        [slave_queue],
        b"slave beat",
        interval_s=0.05,
        ttl_ms=5_000,
        priority=9,
        name="test",
        lease=f"{prefix}.process.p1.lease",
    ).start()
    try:
        _wait(lambda: client.queue_length(slave_queue) >= 2)
        lease = beater.lease
        assert lease is not None
        beater.aim([master_queue], lambda: b"master beat", 0.05)
        _wait(lambda: client.queue_length(master_queue) >= 2)
        _bodies(client, slave_queue)  # what was sent before the aim (and one in flight)
        time.sleep(0.3)  # six beat intervals
        assert _bodies(client, slave_queue) == []  # nothing more to the old role's queue
        assert set(_bodies(client, master_queue)) == {b"master beat"}
        assert beater.lease == lease  # the same connection's lease: not taken anew

        beater.aim([], None, 0.05)  # between two roles: it only holds the lease
        time.sleep(0.1)
        _bodies(client, master_queue)  # one beat may have been in flight
        time.sleep(0.3)
        assert _bodies(client, master_queue) == []
        assert beater.lease == lease
    finally:
        beater.stop()
    # a clean stop acknowledged the token: nothing is handed to a watcher
    assert client.queue_length(lease) == 0
    for name in (slave_queue, master_queue, lease):
        client.delete_queue(name)
    client.close()


def test_the_first_aim_starts_it_and_it_beats_at_once(settings) -> None:
    """A process's beater starts with its first role's first aim (not before: no
    connection while the role starts) and beats at once then, not after its first
    interval (5 s here); its stop releases the lease cleanly."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    queue = f"{prefix}.beaten"
    client = SyncClient(settings=settings).connect()
    client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC, durable=False))
    beater = Beater(
        settings,
        [],
        None,
        interval_s=0.1,
        ttl_ms=60_000,
        priority=9,
        name="test",
        lease=f"{prefix}.process.p1.lease",
    )
    beater.stop()  # a process that never beat stops at once: nothing to release
    assert beater.lease is None  # not started: no connection, no lease
    beater.aim([queue], b"beat", 5.0)
    try:
        _wait(lambda: client.queue_length(queue) >= 1, within=4.0)  # before its interval
        assert beater.lease is not None
    finally:
        beater.stop(timeout=10.0)
    assert not beater._thread.is_alive()
    lease = beater.lease
    assert lease is not None and client.queue_length(lease) == 0  # released cleanly
    for name in (queue, lease):
        client.delete_queue(name)
    client.close()


def test_a_quiet_beater_woken_beats_at_once_not_at_the_end_of_its_pace(settings) -> None:
    """A quiet master's beat thread waits 3 s between beats here (``Beat.next_s``); its
    role's inbox gives it work: ``wake`` (from the event loop's thread) makes it beat
    within a fraction of that, read anew, and the pace it then says holds."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    queue = f"{prefix}.beaten"
    client = SyncClient(settings=settings).connect()
    client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC, durable=False))
    pace = {"body": b"quiet", "s": 3.0}
    beater = Beater(
        settings,
        [queue],
        lambda: (pace["body"], pace["s"]),
        interval_s=0.2,
        ttl_ms=60_000,
        priority=9,
        name="test",
    ).start()
    try:
        _wait(lambda: client.queue_length(queue) >= 1)  # the first beat, at once
        time.sleep(0.5)
        assert _bodies(client, queue) == [b"quiet"]  # the next is 3 s away
        pace.update(body=b"usual", s=3.0)  # the same pace: only the wake can bring it
        woken = time.monotonic()
        beater.wake()
        _wait(lambda: client.queue_length(queue) >= 1, within=2.0)
        took = time.monotonic() - woken
        assert _bodies(client, queue) == [b"usual"]
        assert took < 1.5, f"the woken beat came {took:.2f} s after the wake"
        time.sleep(1.0)
        assert _bodies(client, queue) == []  # then the pace it said: 3 s
    finally:
        beater.stop()
    client.delete_queue(queue)
    client.close()
