"""What a role process says to others (driver): its connections, batched sends to inboxes,
control messages that expire when stale, the beat thread, counters and background work.
:class:`~middleware.routing.roles.Role` serves on top of it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import LinkDown, MiddlewareError, Unroutable
from ..phoenix.effects import Box, Send, Sent, Signal
from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY, PhoenixTopology
from ..settings import Settings
from ..transport import AsyncClient
from .batching import Batcher
from .beats import Beater
from .messages import (
    Beat,
    Message,
    Read,
    Snapshot,
    encode,
)
from .replica_set import ReplicaSet
from .role_metrics import ROLE_EVENTS
from .store import StateStore
from .wiring import (
    Connections,
    cluster_settings,
    outgoing,
    outgoing_body,
    role_inbox_spec,
)

__all__ = ["Peer", "beat_thread", "signal_ttl_ms"]

log = logging.getLogger(__name__)


class Peer:
    """One role's voice: sends, tells and beats over its process's connections."""

    id: RoleId  # set by each role before it serves

    def __init__(
        self,
        *,
        settings: Settings,
        topology: PhoenixTopology,
        cluster: str,
        connections: Connections | None = None,
        beater: Beater | None = None,
    ) -> None:
        """``beater``: the process's beat thread (``RoleNode``: it stays, with its
        connection and lease, when the process serves another role); None: the role
        starts its own while it beats."""
        self.topology, self.cluster = topology, cluster
        self.settings = settings
        self.connections = connections or Connections(settings, topology, cluster)
        self.side_tasks: set[asyncio.Future[Any]] = set()  # held, not awaited by anyone
        self.process_beater = beater
        self.beater: Beater | None = None  # beating for this role (while it beats)
        self.counters: Counter[str] = Counter()
        self._counted: dict[str, tuple[str, str, str]] = {}  # outcome -> its metric labels
        self.role = type(self).__name__
        self.batcher = Batcher.of(self._publish_body, topology)

    def count(self, outcome: str, n: int = 1) -> None:
        self.counters[outcome] += n
        key = self._counted.get(outcome)
        if key is None:
            key = self._counted[outcome] = (self.cluster, self.role, outcome)
        ROLE_EVENTS.counts[key] += n

    async def client_for(self, cluster: str) -> AsyncClient:
        """One connection per cluster's RabbitMQ (the process's own when not configured),
        shared by the clusters on the same RabbitMQ and vhost."""
        return await self.connections.client_for(cluster)

    async def send(self, cluster: str, inbox: str, message: Message, priority: int = 0) -> None:
        client = await self.client_for(cluster)
        # a process queue (a reply: ack, snapshot) is its process's: never declared here
        if inbox not in client.topology.queues and not self._is_process_queue(inbox):
            if cluster != self.cluster and not client.ready:  # fail fast, as a send would:
                raise LinkDown(f"no connection to cluster {cluster}'s RabbitMQ")  # (detours)
            await client.declare_queue(role_inbox_spec(inbox, self.topology, client))
        # with the others sent to the same inbox and priority in this loop turn
        self.count("sent")
        await self.batcher.send(cluster, inbox, encode(message), priority)

    def _is_process_queue(self, queue: str) -> bool:
        return queue.startswith(f"{self.topology.prefix}.process.")

    async def _publish_body(self, cluster: str, inbox: str, body: bytes, priority: int) -> None:
        self.count("amqp_sent")  # sent / amqp_sent: the mean batch size
        client = await self.client_for(cluster)
        try:
            await client.publish(outgoing_body(body, inbox, priority=priority))
        except Unroutable:
            if not self._is_process_queue(inbox):
                raise
            self.count("replies_unroutable")  # its process is gone: nobody waits for it

    def inbox_of(self, role: RoleId) -> str:
        return role.inbox(self.topology.prefix)

    def control_of(self, role: RoleId) -> str:
        return role.control(self.topology.prefix)

    async def beating(
        self,
        queues: list[str],
        beat: Callable[[], Beat],
        meanwhile: Awaitable[None],
        interval_s: float,
    ) -> None:
        """Beat to ``queues`` from a thread of its own while ``meanwhile`` runs (``beat``
        is read at each beat); the thread's connection holds this process's lease, which
        every beat names (beats.py).  The process's beater is aimed here and left
        holding the lease after (the next role aims it); a role without one starts its
        own and stops it after."""

        def body() -> bytes:
            return encode(beat().model_copy(update={"lease": beater.lease}))

        beater = self.process_beater or beat_thread(
            self.settings, self.topology, self.cluster, self.connections, str(self.id),
            queues=queues, body=body, interval_s=interval_s,
        )  # fmt: skip
        sent = beater.sent
        if beater is self.process_beater:
            beater.aim(queues, body, interval_s)  # started by the first aim
        else:
            beater.start()
        self.beater = beater
        try:
            await meanwhile
        finally:
            self.beater = None
            if beater is self.process_beater:
                beater.aim([], None, interval_s)  # quiet until the next role aims it
            else:
                await asyncio.to_thread(beater.stop)
            self.count("beats", beater.sent - sent)

    def _signal_ttl_ms(self) -> int:
        """How long a beat or vote stays worth reading: the detection timeout."""
        return signal_ttl_ms(self.topology)

    async def perform(self, effect: Send | Signal) -> Sent | None:
        """A machine's message to another role (``phoenix/effects.py``): addressed and
        published here, as the effect says; a send with ``then`` answers how it ended
        (the input to give back to its machine) instead of raising."""
        if isinstance(effect, Signal):
            if isinstance(effect.to, RoleId):
                await self.signal(effect.to, effect.message)
            else:
                await self.tell(effect.to, effect.message)
            return None
        to = effect.to
        queue = self.inbox_of(to) if effect.box is Box.INBOX else self.control_of(to)
        send = self.send(effect.via or to.cluster, queue, effect.message, effect.priority)
        if effect.bound_s is None and effect.then is None:
            await send
            return None
        try:
            await asyncio.wait_for(send, effect.bound_s)
        except (MiddlewareError, TimeoutError) as exc:
            if effect.missed is not None:
                self.count(effect.missed)
            kind = effect.message.kind.value
            if effect.then is not None:  # its machine decides what a miss means
                log.info("%s: %s to %s not sent: %s", self.id, kind, queue, exc)
                return Sent(effect.then, str(exc) or repr(exc))
            log.warning("%s: %s to %s not sent: %s", self.id, kind, queue, exc)
            return None
        return None if effect.then is None else Sent(effect.then)

    async def signal(self, role: RoleId, message: Message) -> None:
        """A control message to ``role``'s control queue (see :meth:`tell`)."""
        await self.tell(self.control_of(role), message, role.cluster)

    async def tell(self, queue: str, message: Message, cluster: str | None = None) -> None:
        """A control message to ``queue``, ahead of any backlog, that expires when it
        would be stale (beats and votes of a dead peer do not pile up); a queue nobody
        declared yet (a role not started) or gone (a process queue of a process that
        died) is not an error."""
        try:
            client = await self.client_for(cluster or self.cluster)
            await client.publish(
                outgoing(message, queue, priority=MAX_PRIORITY, expiration_ms=self._signal_ttl_ms())
            )
        except Unroutable:
            pass
        except MiddlewareError as exc:
            log.info("%s to %s not sent: %s", message.kind.value, queue, exc)

    def _background(self, work: Awaitable[Any]) -> None:
        """Run ``work`` beside serving (stores, recoveries, replacements), held until it
        ends."""
        task = asyncio.ensure_future(work)
        self.side_tasks.add(task)
        task.add_done_callback(self.side_tasks.discard)

    async def answer_read(self, store: StateStore, owner: str, message: Read) -> None:
        """The whole table ``owner`` holds of the kind asked for, in pages, to the
        reader's queue."""
        table = await asyncio.to_thread(store.load, owner, message.state_kind)
        entries = list(table.items())
        pages = [
            entries[i : i + ReplicaSet.PAGE] for i in range(0, len(entries), ReplicaSet.PAGE)
        ] or [[]]
        for n, page in enumerate(pages):
            await self.send(
                self.cluster,
                message.reply_to,
                Snapshot(
                    request=message.request,
                    state_kind=message.state_kind,
                    entries=dict(page),
                    last=n == len(pages) - 1,
                    broker=owner,
                ),
            )


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
    body: bytes | Callable[[], bytes] | None,
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
