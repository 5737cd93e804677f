"""A master's beats, sent from a thread of their own (a driver piece, not logic).

A master busy with a burst (matching and delivering hundreds of events in one loop turn,
its publish window full) let 0.52 s pass between two beats sent from its event loop, and
its slaves elected a successor while it was alive.  Beats answer "is the process there",
so they leave from a thread with its own connection (the sync face), which runs however
busy the loop is (the GIL is handed over every few milliseconds), and stop exactly when
the process dies or the role stops.

The same connection holds the process's **lease**: one token message in a queue of its
own, taken with ``basic.get`` and never acknowledged.  When the process dies (SIGKILL,
a crash, a clean stop) its connection closes and the broker hands the token at once to
a watcher consuming that queue: a death is known in milliseconds instead of after
``heartbeat_misses`` silent intervals.  A clean stop (SIGTERM, ``phoenix down``)
acknowledges the token first: nothing is signalled, and the beats decide as before.
The thread is the process's (``node.RoleNode`` holds it): a process that switches role
(a take-over, an election won, a master fenced) keeps its connection and its lease and
only aims it (:meth:`Beater.aim`) at the new role's queues with the new role's beat, so a
switch neither waits for the thread to end nor opens a connection.  A process that is
only frozen keeps its connection and its token: the beats still decide that case.  Each
beat names the lease (``Beat.lease``) so its watchers know which queue to consume; a new
connection (the old one lost) takes a new lease under a new name.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence

from ..errors import DeadLetter, MiddlewareError
from ..phoenix.protocol import MAX_PRIORITY, PhoenixTopology
from ..settings import Settings
from ..transport import (
    Action,
    AsyncClient,
    Delivery,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)
from .wiring import Connections, cluster_settings

__all__ = ["LEASE_TOKEN", "Beater", "LeaseWatch", "beat_thread", "is_lease", "signal_ttl_ms"]

LEASE_TOKEN = b"qosmq-lease"
#: an unconsumed lease queue (its holder gone, no watcher) goes after this long; the
#: holder declares it again well within it
LEASE_EXPIRES_MS = 60_000
LEASE_REFRESH_S = 10.0
_LEASES = itertools.count(1)


def is_lease(queue: str, prefix: str) -> bool:
    """``queue`` is a lease queue of a process of the deployment ``prefix`` (a watcher
    consumes only these: a forged beat must not make it consume someone's data)."""
    head, _, number = queue.rpartition(".lease.")
    return (
        number.isdigit()
        and head.startswith(f"{prefix}.process.")
        and head[len(prefix) + 9 :].isalnum()
    )


log = logging.getLogger(__name__)


#: what a beat thread sends: a body, or a function read at each beat that returns the
#: body, or the body and how long until the next beat (a quiet master's slower pace)
BeatSource = bytes | Callable[[], bytes | tuple[bytes, float]]


class Beater:
    """Publishes ``body`` (or what it returns, read at each beat) to every queue of
    ``queues`` every ``interval_s`` (or as long as it says) until stopped; :meth:`add`
    beats to one more queue, :meth:`aim` to other queues with another body (the role a
    process serves changed: its connection and its lease stay; no queues or no body: it
    only holds the lease)."""

    def __init__(
        self,
        settings: Settings,
        queues: Sequence[str],
        body: BeatSource | None,
        *,
        interval_s: float,
        ttl_ms: int,
        priority: int,
        name: str,
        lease: str | None = None,
    ) -> None:
        """``lease``: the name (``<process queue>.lease``) under which to hold a lease;
        None: no lease."""
        self.settings = settings
        #: (queues, body): replaced whole, so the thread never mixes two roles' halves
        self._target: tuple[list[str], BeatSource | None] = (list(queues), body)
        self.lease_prefix = lease
        self.lease: str | None = None  # the lease queue held now (beats name it)
        self._lease_at = -1  # the client's reconnect count when it was taken
        self._refreshed = 0.0
        self._release: Callable[[Action], None] | None = None  # settles the held token
        self.interval_s, self.ttl_ms, self.priority = interval_s, ttl_ms, priority
        self.sent = 0
        self._client: SyncClient | None = None  # the thread's connection, while it has one
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beats of {name}", daemon=True)

    def add(self, queue: str) -> None:
        queues, body = self._target
        if queue not in queues:
            self._target = ([*queues, queue], body)  # a new list: the thread reads the old

    def aim(
        self,
        queues: Sequence[str],
        body: BeatSource | None,
        interval_s: float,
    ) -> None:
        """Beat ``body`` to ``queues`` every ``interval_s`` from the next beat on (the
        first aim starts the thread, which beats at once); a process that steps down
        to a slave beats as one after its interval, as it did with a thread of its own
        that connected first.  (Waking the thread to beat at once there made
        ``test_phoenix_frozen_master`` fail 3 runs in 4: the new master admitted the
        slave while it still drained that slave's inbox itself and dropped the
        replicas it took; fixed in ``mastering.Master._stop_draining``, the test then
        passed 3 of 3 with the wake.  Waking it at a stop, so that the process ends
        sooner, made a slave restarted at once retired as a second process by its
        master, which had not yet missed the first: ``test_phoenix_takeover``.)"""
        self._target = (list(queues), body)
        self.interval_s = interval_s
        if self._thread.ident is None:  # the first role to beat starts it (once it serves)
            self._thread.start()

    def start(self) -> Beater:
        self._thread.start()
        return self

    def wake(self) -> None:
        """From any thread: beat now (the body read anew), not once the pace the last
        beat set has passed (a quiet role that has work again: ``Beating.inbox_took``)."""
        client = self._client
        if client is not None:
            client.wake()

    def stop(self, timeout: float = 2.0) -> None:
        if self._thread.ident is None:
            return  # never started: no connection, no lease
        self._halt.set()
        self._thread.join(timeout)

    def _hold_lease(self, client: SyncClient) -> None:
        """Take a lease on this connection if it holds none (the first beat, or the
        connection was replaced and the broker gave the old token away); declare the
        held one again now and then so that it does not expire."""
        now = time.monotonic()
        if self.lease is not None and client.reconnects == self._lease_at:
            if now - self._refreshed > LEASE_REFRESH_S:
                client.declare_queue(self._lease_spec(self.lease))
                self._refreshed = now
            return
        self.lease = None
        # numbered across the process: a slave's beater and the one it starts as master
        # share the prefix, and a watcher tells leases apart by name
        name = f"{self.lease_prefix}.{next(_LEASES)}"
        client.declare_queue(self._lease_spec(name))
        client.publish(OutgoingMessage(LEASE_TOKEN, "", name, mandatory=True))
        taken = client.take(name)
        if taken is None:  # someone consumed it: try again at the next beat
            return
        self._release = taken[1]
        self.lease, self._lease_at, self._refreshed = name, client.reconnects, now

    @staticmethod
    def _lease_spec(name: str) -> QueueSpec:
        """Durable, not exclusive: watchers on other connections consume it, which an
        exclusive queue forbids, and RabbitMQ 4.3 refuses transient non-exclusive
        queues.  Its expiry removes it once neither holder nor watcher uses it; the
        token is transient (a restart of the queue's node also ends the holder's
        connection, which then takes a new lease)."""
        return QueueSpec(
            name,
            kind=QueueKind.CLASSIC,
            durable=True,
            arguments={"x-expires": LEASE_EXPIRES_MS},
        )

    def _run(self) -> None:
        client: SyncClient | None = None
        while not self._halt.is_set():
            try:
                if client is None:
                    client = self._client = SyncClient(settings=self.settings).connect()
                if self.lease_prefix is not None:
                    self._hold_lease(client)
                pace = self._beat(client)
                # handles the connection's I/O meanwhile, waking once per beat (or when
                # ``wake`` is called)
                client.run(pace, step_s=pace)
            except MiddlewareError as exc:
                log.info("beats not sent (%s); trying again", exc)
                self._halt.wait(self.interval_s)
            except Exception:  # a beat thread must never die of one failure
                log.exception("beat thread: unexpected error; trying again")
                self._halt.wait(self.interval_s)
        self._client = None
        if client is not None:
            try:
                if self._release is not None and client.reconnects == self._lease_at:
                    self._release(Action.ACK)  # a clean stop: no watcher is told
                client.close()
            except Exception as exc:
                log.info("beat connection not closed cleanly: %s", exc)

    def _beat(self, client: SyncClient) -> float:
        """One beat to every queue aimed at (none while the process serves no role yet);
        how long until the next."""
        queues, source = self._target
        pace = self.interval_s
        body = source() if callable(source) else source
        if isinstance(body, tuple):
            body, pace = body
        if body is None:
            return pace
        for queue in queues:
            # no broker ack per beat (a lost one is replaced by the next): the thread
            # wakes once per beat, not once more for each ack
            client.publish_unwatched(
                OutgoingMessage(
                    body,
                    "",
                    queue,
                    content_type="application/json",
                    priority=self.priority,
                    expiration_ms=self.ttl_ms,
                    mandatory=False,
                )
            )
            self.sent += 1
        return pace


class LeaseWatch:
    """A watcher's side of one peer's lease: consume the lease queue its beats name
    (:meth:`named`) and call ``on_lost()`` once when that lease's token comes back.

    ``client_for()`` gives the asyncio client of the peer's cluster.  A beat that names
    a lease already returned was sent before the death (:meth:`stale`); a lease named
    anew replaces the watched one; a queue that is gone is left to the beats."""

    def __init__(
        self,
        prefix: str,
        client_for: Callable[[], Awaitable[AsyncClient]],
        on_lost: Callable[[], Awaitable[None]],
        *,
        name: str,
    ) -> None:
        self.prefix, self.client_for, self.on_lost, self.name = prefix, client_for, on_lost, name
        self.lease: str | None = None  # the lease watched now
        self.lost: set[str] = set()  # leases whose token came back
        self._tag: str | None = None
        self._tasks: set[asyncio.Future[None]] = set()

    def stale(self, lease: str | None) -> bool:
        return lease is not None and lease in self.lost

    async def named(self, lease: str) -> None:
        """A beat named ``lease``: watch it (and no longer the one before)."""
        if lease == self.lease or lease in self.lost:
            return
        if not is_lease(lease, self.prefix):
            raise DeadLetter(f"beat names {lease!r}, not a lease queue of {self.prefix}")
        await self.stop()
        self.lease = lease

        async def on_token(delivery: Delivery) -> None:
            if delivery.body != LEASE_TOKEN:
                raise DeadLetter(f"not a lease token in {lease!r}")
            await self._returned(lease)

        client = await self.client_for()
        try:
            tag = await client.consume(lease, on_token, prefetch=1)
        except MiddlewareError as exc:  # gone already: the beats alone tell
            log.info("lease %s of %s not watched: %s", lease, self.name, exc)
            return
        if self.lease == lease and self._tag is None:
            self._tag = tag
        else:  # returned or named anew meanwhile
            with contextlib.suppress(MiddlewareError):
                await client.cancel(tag)

    async def stop(self) -> None:
        """Stop consuming the watched lease queue."""
        tag, self._tag = self._tag, None
        if tag is not None:
            client = await self.client_for()
            with contextlib.suppress(MiddlewareError):
                await client.cancel(tag)

    async def _returned(self, lease: str) -> None:
        if lease != self.lease:
            return  # an older lease of a peer that reconnected since
        self.lost.add(lease)
        self.lease = None
        # not from inside this consumer's own handler: cancel waits for handlers to end
        task = asyncio.ensure_future(self.stop())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        await self.on_lost()


def signal_ttl_ms(topology: PhoenixTopology) -> int:
    """How long a beat or vote stays worth reading: the detection timeout."""
    return max(1, int(topology.heartbeat_interval_s * topology.heartbeat_misses * 1000))


def beat_thread(
    settings: Settings,
    topology: PhoenixTopology,
    cluster: str,
    connections: Connections,
    name: str,
    *,
    queues: list[str],
    body: BeatSource | None,
    interval_s: float,
) -> Beater:
    """A beat thread (not started) on a connection of its own to ``cluster``'s
    RabbitMQ, holding the process's lease (named after its process queue) when the
    topology has leases."""
    return Beater(
        cluster_settings(settings, topology, cluster)[1],
        queues,
        body,
        interval_s=interval_s,
        ttl_ms=signal_ttl_ms(topology),
        priority=MAX_PRIORITY,
        name=name,
        lease=f"{connections.process_queue}.lease" if topology.leases else None,
    )
