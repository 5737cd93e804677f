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
``heartbeat_misses`` silent intervals.  A clean stop (SIGTERM, ``phoenix down``, a slave
switching to its master's role) acknowledges the token first: nothing is signalled, and
the beats decide as before.  A process that is only frozen keeps its
connection and its token: the beats still decide that case.  Each beat names the lease
(``Beat.lease``) so its watchers know which queue to consume; a new connection (the old
one lost) takes a new lease under a new name.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..errors import MiddlewareError
from ..settings import Settings
from ..transport import Action, OutgoingMessage, QueueKind, QueueSpec, SyncClient

__all__ = ["LEASE_TOKEN", "Beater", "is_lease"]

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


class Beater:
    """Publishes ``body`` (or what it returns, read at each beat) to every queue of
    ``queues`` every ``interval_s`` until stopped; :meth:`add` beats to one more queue."""

    def __init__(
        self,
        settings: Settings,
        queues: Sequence[str],
        body: bytes | Callable[[], bytes],
        *,
        interval_s: float,
        ttl_ms: int,
        priority: int,
        name: str,
        lease: str | None = None,
    ) -> None:
        """``lease``: the name (``<process queue>.lease``) under which to hold a lease;
        None: no lease."""
        self.settings, self.queues, self.body = settings, list(queues), body
        self.lease_prefix = lease
        self.lease: str | None = None  # the lease queue held now (beats name it)
        self._lease_at = -1  # the client's reconnect count when it was taken
        self._refreshed = 0.0
        self._release: Callable[[Action], None] | None = None  # settles the held token
        self.interval_s, self.ttl_ms, self.priority = interval_s, ttl_ms, priority
        self.sent = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beats of {name}", daemon=True)

    def add(self, queue: str) -> None:
        if queue not in self.queues:
            self.queues = [*self.queues, queue]  # a new list: the thread reads the old whole

    def start(self) -> Beater:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
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
        return QueueSpec(
            name,
            kind=QueueKind.CLASSIC,
            durable=False,
            arguments={"x-expires": LEASE_EXPIRES_MS},
        )

    def _run(self) -> None:
        client: SyncClient | None = None
        while not self._halt.is_set():
            try:
                if client is None:
                    client = SyncClient(settings=self.settings).connect()
                if self.lease_prefix is not None:
                    self._hold_lease(client)
                body = self.body() if callable(self.body) else self.body
                for queue in self.queues:
                    client.publish(
                        OutgoingMessage(
                            body,
                            "",
                            queue,
                            content_type="application/json",
                            priority=self.priority,
                            expiration_ms=self.ttl_ms,
                            mandatory=False,
                        ),
                        confirm=False,
                        retry=False,
                    )
                    self.sent += 1
                client.run(self.interval_s)  # handles the connection's I/O meanwhile
            except MiddlewareError as exc:
                log.info("beats not sent (%s); trying again", exc)
                self._halt.wait(self.interval_s)
            except Exception:  # a beat thread must never die of one failure
                log.exception("beat thread: unexpected error; trying again")
                self._halt.wait(self.interval_s)
        if client is not None:
            try:
                if self._release is not None and client.reconnects == self._lease_at:
                    self._release(Action.ACK)  # a clean stop: no watcher is told
                client.close()
            except Exception as exc:
                log.info("beat connection not closed cleanly: %s", exc)
