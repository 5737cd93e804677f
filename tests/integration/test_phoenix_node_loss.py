"""A RabbitMQ node dies under Phoenix load (issue #23, item 6): with ``inbox_mirrors = 2``
the role queues are classic queues mirrored over two nodes by the policy ``phoenix up``
sets (RabbitMQ 3.10's quorum queues have no priorities), so SIGKILL of the node that
holds B's routing master's inbox loses no event whose publish the broker confirmed; nor
does a graceful stop, or a freeze (SIGSTOP for 15 s: the node still counts as a member,
the mirror is not promoted, and the stream waits for the thaw, then goes on).

Real broker nodes (the test's own local cluster: the chaos fixture), a real SIGKILL by
PID, and the test's own counter of what reached the subscriber queue."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from middleware.errors import MiddlewareError
from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient, SyncPhoenixClient
from middleware.transport import AsyncClient, QueueKind, QueueSpec
from middleware.transport.management import management_get
from tests.integration.test_phoenix_recovery import _deployment, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
RATE = 100
FROZEN_S = 15.0


@pytest.mark.parametrize(
    ("fault", "face"),
    # a graceful stop, as a rolling restart does; a freeze (SIGSTOP for FROZEN_S, a paused
    # VM): the node stays a member, so the mirrors wait for it rather than take over
    [("kill", "async"), ("stop", "sync"), ("freeze", "async")],
)
def test_a_rabbitmq_node_lost_under_load_loses_no_confirmed_event(
    fault, face, settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 1}}, {"inbox_mirrors": 2}
    )
    queue = f"{name}.sub"
    inbox = RoleId.router("B").inbox(topology.prefix)
    deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        path = f"/api/queues/%2F/{urllib.parse.quote(inbox, safe='')}"
        deadline = time.monotonic() + 90
        info = management_get(settings, path)
        # a synchronised mirror is the policy's effect, read from the queue's own record;
        # the management API's statistics lag (every 5 s; on a loaded CI runner a fresh
        # queue showed its synchronised mirror but no "policy" field after 90 s), so the
        # policy is read from the policies the broker holds
        while not info.get("synchronised_slave_nodes"):
            assert time.monotonic() < deadline, f"{inbox} is not mirrored: {info}"
            time.sleep(0.5)
            info = management_get(settings, path)
        policy = management_get(settings, f"/api/policies/%2F/qosmq-phoenix-{topology.prefix}")
        assert policy["definition"]["ha-mode"] == "exactly", policy
        assert info.get("policy") in (None, f"qosmq-phoenix-{topology.prefix}"), info
        victim = info["node"]  # where B's routing master's inbox lives

        confirmed, got, failed = asyncio.run(
            _stream(settings, topology, event_type, queue, local_cluster, victim, fault, face)
        )
        lost = sorted(confirmed - got)
        assert not lost, f"{len(lost)} confirmed events lost after {victim} ({fault}): {lost[:20]}"
        # the stream went on through the failover (publishes stall while it runs)
        assert len(confirmed) >= 2 * RATE and max(confirmed) >= 2 * RATE  # (_going)
        print(
            f"\n{victim} ({fault}, {face} publisher): {len(confirmed)} confirmed, 0 lost, "
            f"{failed} refused"
        )
    finally:
        if fault == "freeze":
            local_cluster.thaw(victim)  # (the timer's, at the latest)
        deployment.down()


def test_quorum_role_queues_survive_the_node_of_an_inbox_leader(
    settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """``role_queues = "quorum"``: RabbitMQ replicates every role inbox itself (the HA
    that does not depend on classic mirroring, which RabbitMQ 4.0 removed; on 3.10
    without broker priorities).  SIGKILL of the node that leads B's routing master's
    inbox loses no event whose publish the broker confirmed."""
    event_type, topology, deployment = _quorum_deployment(settings, brokers, tmp_path, name)
    assert topology.role_queues == "quorum"
    queue = f"{name}.sub"
    inbox = RoleId.router("B").inbox(topology.prefix)
    deployment.up()
    try:
        info = _queue_info(settings, inbox)
        assert info["type"] == "quorum" and len(info.get("members") or []) >= 2, info
        victim = info["leader"]
        # the subscriber's classic queue on another node (it would die with the victim)
        elsewhere = next(n for n in local_cluster.layout.nodes if n.node_name != victim)
        asyncio.run(_declare_subscriber_queue(settings, elsewhere.amqp_url, queue))
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        confirmed, got, failed = asyncio.run(
            _stream(settings, topology, event_type, queue, local_cluster, victim)
        )
        lost = sorted(confirmed - got)
        assert not lost, f"{len(lost)} confirmed events lost after {victim} died: {lost[:20]}"
        assert len(confirmed) >= 2 * RATE and max(confirmed) >= 2 * RATE  # (_going)
        print(
            f"\n{victim} (inbox leader) killed: {len(confirmed)} confirmed, 0 lost, {failed} failed"
        )
    finally:
        deployment.down()


def _quorum_deployment(settings: Any, brokers: Any, tmp_path: Path, name: str) -> Any:
    """Clusters A and B (B's match master with a slave), every role queue a quorum queue."""
    return _deployment(
        settings,
        brokers,
        tmp_path,
        name,
        {"A": {}, "B": {"match_slaves": 1}},
        {"role_queues": "quorum"},
    )


def _queue_info(settings: Any, queue: str) -> Any:
    return management_get(settings, f"/api/queues/%2F/{urllib.parse.quote(queue, safe='')}")


async def _declare_subscriber_queue(settings, url: str, queue: str) -> None:
    async with AsyncClient(settings=settings.model_copy(update={"amqp_urls": (url,)})) as client:
        await client.declare_queue(QueueSpec(queue, kind=QueueKind.CLASSIC))


def _going(elapsed: float, published: int, at_least: float = 6.0) -> bool:
    """Whether a stream publishes on: for 6 s, and on a slow machine until it passed
    ``2 * RATE`` events (the fault comes at ``RATE``), at most 30 s. The tests then
    check that events after the fault were confirmed (the stream went on through the
    failover), not how fast it went."""
    return elapsed < at_least or (published <= 2 * RATE and elapsed < 30.0)


def _sync_stream(settings, topology, event_type, local_cluster, victim, fault):
    """As ``_stream``'s publishing, on the pika face: (confirmed, failed)."""
    confirmed: set[int] = set()
    failed = 0
    losing = None
    with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
        start = time.monotonic()
        n = 0
        while _going(time.monotonic() - start, n):
            if n == RATE:  # one second in
                losing = threading.Thread(target=getattr(local_cluster, fault), args=(victim,))
                losing.start()
            try:
                at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                confirmed.add(n)
            except MiddlewareError:
                failed += 1  # refused or failed: the publisher knows, not lost
            n += 1
            time.sleep(1 / RATE)
    assert losing is not None
    losing.join(120)
    return confirmed, failed


async def _stream(
    settings, topology, event_type, queue, local_cluster, victim, fault="kill", face="async"
):
    """Events at A (``_going``: 6 s, or until ``2 * RATE`` were published), ``victim``
    killed (or stopped gracefully: ``fault``) one second in, the events going on while
    it stops; (confirmed, got, failed)."""
    confirmed: set[int] = set()
    failed = 0
    async with AsyncClient(settings=settings) as client:
        if face == "sync":
            confirmed, failed = await asyncio.to_thread(
                _sync_stream, settings, topology, event_type, local_cluster, victim, fault
            )
        else:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            start = time.monotonic()
            n = 0
            losing = None
            at_least = FROZEN_S + 4.0 if fault == "freeze" else 6.0  # (on after the thaw)
            gaps: list[float] = []
            last = start
            while _going(time.monotonic() - start, n, at_least):
                if n == RATE:  # one second in
                    lose = getattr(local_cluster, fault)
                    losing = asyncio.create_task(asyncio.to_thread(lose, victim))
                    if fault == "freeze":  # let go on by the clock, whatever the loop does
                        threading.Timer(FROZEN_S, local_cluster.thaw, args=(victim,)).start()
                try:
                    await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                    confirmed.add(n)
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
                except MiddlewareError:
                    failed += 1  # refused or failed: the publisher knows, not lost
                n += 1
                await asyncio.sleep(1 / RATE)
            assert losing is not None
            await losing
            print(f"\nlongest wait for a confirm at A: {max(gaps, default=0):.2f} s")
        got: set[int] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not confirmed <= got:
            try:  # the test's own reads may meet the failover too: read again
                while (d := await client.get(queue)) is not None:
                    got.add(json.loads(d.body)["event"]["attributes"]["n"])
            except MiddlewareError:
                pass
            await asyncio.sleep(0.2)
        return confirmed, got, failed


class _QuorumLoss:
    """A ``local_cluster`` stand-in for ``_stream``'s fault: ``lose(queue)`` stops the
    members of the quorum queue ``queue`` on every node but the first
    (``test_quorum_lost._quorum``: every node and link stays up) and gives them back
    ``QUORUM_LOST_S`` later, by the clock."""

    def __init__(self, cluster: Any, settings: Any) -> None:
        self.cluster, self.settings = cluster, settings
        self.back: threading.Timer | None = None

    def lose(self, queue: str) -> None:
        from tests.integration.test_quorum_lost import _back_after, _quorum

        _quorum(self.cluster, self.settings, queue, "stop_server")
        self.back = _back_after(QUORUM_LOST_S, self.cluster, self.settings, queue)
        self.back.start()


QUORUM_LOST_S = 8.0


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_quorum_role_inbox_without_its_quorum_loses_no_confirmed_event(
    face, settings, brokers, local_cluster, tmp_path: Path, name: str
) -> None:
    """``role_queues = "quorum"``: B's routing master's inbox loses its quorum (two of its
    three members stopped) for 8 s under the stream at A.  RabbitMQ then neither
    confirms nor refuses what A's router sends there; since a confirm timeout is no
    longer sent again by the transport (``publish_timeout``), the roles' own handling
    (requeue, detours, duplicate checks) is what carries those events.  No confirmed
    event is lost, and the stream goes on once the quorum is back."""
    event_type, topology, deployment = _quorum_deployment(settings, brokers, tmp_path, name)
    queue = f"{name}.sub"
    inbox = RoleId.router("B").inbox(topology.prefix)
    deployment.up()
    loss = _QuorumLoss(local_cluster, settings)
    try:
        info = _queue_info(settings, inbox)
        assert info["type"] == "quorum" and len(info.get("members") or []) == 3, info
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        confirmed, got, failed = asyncio.run(
            _stream(settings, topology, event_type, queue, loss, inbox, "lose", face)
        )
        lost = sorted(confirmed - got)
        print(
            f"\n{inbox} without its quorum ({face}): {len(confirmed)} confirmed, {len(lost)} lost, "
            f"{failed} failed"
        )
        assert not lost, f"{len(lost)} confirmed events lost: {lost[:20]}"
        assert len(confirmed) >= 2 * RATE and max(confirmed) >= 2 * RATE  # (_going)
    finally:
        if loss.back is not None:
            loss.back.join()
        deployment.down()
