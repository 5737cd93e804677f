"""A master's replicas as the driver keeps them: the pure :class:`~.replicas.ReplicaLog`'s
effects performed (store writes in threads, sends to the slaves), W-of-N waits as
futures, and the R-of-N read at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Hashable, Iterable
from typing import TYPE_CHECKING, Any

from ..errors import RetryableError
from ..phoenix.ids import RoleId
from .messages import Ack, Heartbeat, Read, Snapshot
from .performing import Performer
from .replicas import Effect, GaveUp, Persist, ReplicaLog, Written
from .store import StateStore
from .wiring import Handler

if TYPE_CHECKING:
    from .peer import Role

__all__ = ["ReplicaSet", "ReplicaTimeout", "answer_read"]

log = logging.getLogger(__name__)


class ReplicaTimeout(RetryableError, TimeoutError):
    """A replica write was given up before W of N replicas acknowledged it."""


class ReplicaSet:
    """The driver of a master's replicated table (``replicas.ReplicaLog`` decides): its
    own store plus one replica per slave (over RabbitMQ).

    ``write`` persists locally and sends the versioned entry to every slave; the
    entry counts as written once W of N acknowledged it (the future resolves then).
    ``read`` asks the slaves for snapshots and merges R of N replies, newest version
    per key, repairing the master's own copy.  ``persist_loop`` also writes the whole
    table to the store periodically (besides every change), off the event loop.
    """

    PAGE = 5000

    def __init__(self, role: Role, store: StateStore, kind: str) -> None:
        self.role, self.store, self.kind, self.owner = role, store, kind, role.id.owner
        spec = role.topology.cluster(role.cluster)
        self.log = ReplicaLog(
            owner=self.owner,
            kind=kind,
            # the slaves the topology gives this master, less the one it was promoted from
            replicas=[r for r in role.id.slaves(spec) if r != role.promoted_from],
            # N as the topology has it: a promoted master's read still needs R of those N
            n=len(role.id.slaves(spec)) + 1,
            # where acks and snapshots come back: this process's own queue, not the
            # master's control queue, which a frozen master replaced by this one may
            # still consume
            reply_to=role.connections.process_queue,
        )
        self.written: dict[int, asyncio.Future[None]] = {}  # versions waiting for W
        self._reads: dict[str, asyncio.Event] = {}
        self._dirty = False

    @property
    def entries(self) -> dict[str, tuple[int, dict[str, Any]]]:
        return self.log.entries

    async def _apply(self, effects: Iterable[Effect]) -> None:
        """The replica log's effects, by the role's performer (its sends go ahead of any
        event backlog in a slave's inbox); the store writes and the W-of-N waits are
        this set's."""
        await self.role.enact(effects, here=self.performers)

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {Persist: self._persist, Written: self._resolve, GaveUp: self._resolve}

    async def _persist(self, effect: Persist) -> None:
        """In a thread: the store may be busy (a snapshot, another process's
        transaction), and the loop goes on meanwhile; stores keep the newest version
        whatever the order."""
        await asyncio.to_thread(
            self.store.save, self.owner, self.kind, effect.key, effect.document, effect.version
        )
        self._dirty = True

    def _resolve(self, effect: Written | GaveUp) -> None:
        future = self.written.pop(effect.version, None)
        if isinstance(effect, Written):
            self.role.count("replicated")
            if future is not None and not future.done():
                future.set_result(None)
            return
        self.role.count("unacknowledged")
        if future is not None and not future.done():
            future.set_exception(ReplicaTimeout(f"{self.owner}: entry v{effect.version} below W"))
            future.exception()  # retrieved: nobody has to await it

    async def persist_once(self) -> bool:
        """Snapshot the table to the store (in a thread); False when nothing changed."""
        if not self._dirty:
            return False
        self._dirty = False
        copy = dict(self.entries)
        await asyncio.to_thread(self.store.snapshot, self.owner, self.kind, copy)
        for key, (version, document) in list(self.entries.items()):  # changed meanwhile
            if copy.get(key, (None, None))[0] != version:
                await asyncio.to_thread(
                    self.store.save, self.owner, self.kind, key, document, version
                )
        self.role.count("snapshots")
        return True

    @contextlib.asynccontextmanager
    async def persisting(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While a master is served: the periodic snapshots beside it; then one last
        snapshot, and the store closed."""
        persist = asyncio.create_task(
            self.persist_loop(self.role.topology.persist_interval_s, stop)
        )
        try:
            yield
        finally:
            stop.set()  # ends the persist loop after one last snapshot
            await persist
            self.store.close()

    async def persist_loop(self, interval_s: float, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            try:
                await self.persist_once()
            except Exception as exc:
                log.warning("%s: periodic snapshot failed: %s", self.owner, exc)

    async def read(self, timeout_s: float) -> dict[str, tuple[int, dict[str, Any]]]:
        own = self.store.load(self.owner, self.kind)
        promoted = self.role.promoted_from
        # the replica it held as a slave is the read's first reply, with the master's
        # own copy (if this store has one) merged in
        held = self.store.load(promoted.owner, self.kind) if promoted is not None else None
        request = uuid.uuid4().hex
        changed = self._reads[request] = asyncio.Event()
        try:
            await self._apply(self.log.begin_read(request, own, held))
            async with asyncio.timeout(timeout_s):
                while not self.log.complete(request):
                    await changed.wait()
                    changed.clear()
        except TimeoutError:
            pass
        finally:
            del self._reads[request]
        result = self.log.finish_read(request, own)
        if result.degraded:
            self.role.count("degraded_reads")
            log.warning(
                "%s: read quorum R=%d not reached in %.0f s (%d replies); "
                "starting from what answered",
                self.owner,
                self.log.quorum.read,
                timeout_s,
                result.replies,
            )
        for repair in result.repairs:  # read repair of the master's copy
            self.store.save(self.owner, self.kind, repair.key, repair.document, repair.version)
            self.role.count("read_repairs")
        return result.entries

    async def adopt(self, documents: dict[str, dict[str, Any]]) -> None:
        """Entries taken over from a departed cluster: this master's own from now on,
        persisted in one snapshot (a leave may bring 200 000 of them: one write and one
        replication round each would hold the master for minutes).  They are not
        replicated to its slaves: a slave promoted later reads them back from this
        master's persisted copy (``read``), which a store shared by the host holds."""
        self.log.adopt(documents)
        self._dirty = True
        await self.persist_once()

    async def write(
        self,
        key: str,
        document: dict[str, Any] | None,
        tag: Hashable = None,
        *,
        behind: bool = False,
    ) -> asyncio.Future[None]:
        """Persist and replicate one entry (None: delete, as a tombstone); the future
        resolves once W of N replicas hold it (``tag``, ``behind``: see
        ``ReplicaLog.write``)."""
        written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        version, effects = self.log.write(key, document, tag, behind=behind)
        self.written[version] = written
        await self._apply(effects)
        return written

    async def admit(self, slave: RoleId, held: int | None) -> None:
        """Replicate to ``slave`` from now on, after sending it the whole table, ahead of
        any event in its inbox."""
        log.warning(
            "%s: admitting %s (it holds up to v%s): %d entries to catch up",
            self.owner,
            slave,
            held,
            len(self.entries),
        )
        await self._apply(self.log.admit(slave))
        self.role.count("slaves_admitted")

    @property
    def replicas(self) -> list[RoleId]:
        return self.log.replicas

    def slave(self, message: Heartbeat | Ack | Snapshot) -> int:
        """The slave number of the sender (``DeadLetter`` for one not in the set)."""
        return self.log.sender(message).slave

    async def on_ack(self, message: Ack) -> None:
        await self._apply(self.log.on_ack(message))

    async def on_snapshot(self, message: Snapshot) -> None:
        if self.log.page(message):
            changed = self._reads.get(message.request)
            if changed is not None:
                changed.set()

    def handlers(self) -> dict[type, Handler]:
        """The master's control-queue handlers for its replicas' answers."""
        return {Ack: self.on_ack, Snapshot: self.on_snapshot}


async def answer_read(role: Role, store: StateStore, owner: str, message: Read) -> None:
    """The whole table ``owner`` holds of the kind asked for, in pages, to the
    reader's queue."""
    table = await asyncio.to_thread(store.load, owner, message.state_kind)
    entries = list(table.items())
    size = ReplicaSet.PAGE
    pages = [entries[i : i + size] for i in range(0, len(entries), size)] or [[]]
    for n, page in enumerate(pages):
        await role.send(
            role.cluster,
            message.reply_to,
            Snapshot(
                request=message.request,
                state_kind=message.state_kind,
                entries=dict(page),
                last=n == len(pages) - 1,
                broker=owner,
            ),
        )
