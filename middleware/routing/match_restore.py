"""A match master's state, its start, and the restore of a departed cluster's arc
(driver): RECOVER's plan and the read kept ready for a suspected leave are decided by
``restoring.py``; the restored subscriptions are indexed in small steps beside serving.
``match_master.MatchMaster`` adds subscriptions, dispatch and the hand-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from .. import heap
from ..phoenix.effects import Count
from ..phoenix.protocol import MAX_PRIORITY
from ..phoenix.ring import Handover as Arc
from ..phoenix.ring import master_index
from .dispatching import matched_elsewhere
from .mastering import Master
from .match_roles import MatchBroker
from .messages import (
    Join,
    Publish,
    Recover,
    Recovered,
)
from .performing import Inputs
from .replica_set import ReplicaSet
from .replicas import live
from .restoring import Read, ReadAhead, Restore, RestorePlan, restore_plan
from .store import StateStore, open_store, ring_owner
from .subscribing import SubscriptionBook
from .timeliness import Dispatch

__all__ = ["RestoringMatcher"]

log = logging.getLogger(__name__)


#: restored subscriptions: event type -> {subscription id: document}
Restorable = dict[str, dict[str, dict[str, Any]]]
#: the departed owners' ``StateStore.fingerprint`` of their subscriptions
Prints = dict[str, tuple[int, int, int]]


@dataclass(frozen=True, slots=True)
class Reading:
    """What a read of departed masters' subscriptions found, and the store's
    fingerprints taken before it began (a read kept ahead is checked against them)."""

    found: Restorable
    prints: Prints


def _fingerprints(store: StateStore, owners: Sequence[str]) -> Prints:
    """(In a thread) the fingerprints of ``owners``' subscriptions."""
    return {owner: store.fingerprint(owner, "subscription") for owner in owners}


def _restorable(
    store: StateStore, owners: list[str], arc: Arc, masters: int, index: int
) -> Reading:
    """(In a thread) the subscriptions of ``owners`` in ``arc`` that the router sends to
    match master ``index`` of ``masters``: event type -> {sid: doc}."""
    prints = _fingerprints(store, owners)  # before: a write during the read shows later
    by_type: Restorable = {}
    mine: dict[str, bool] = {}
    for owner in owners:
        for sid, (_, doc) in live(store.load(owner, "subscription")).items():
            event_type = doc.get("event_type")
            if not isinstance(event_type, str):
                continue
            if event_type not in mine:
                mine[event_type] = (
                    arc.covers(event_type) and master_index(event_type, masters) == index
                )
            if mine[event_type]:
                by_type.setdefault(event_type, {})[sid] = doc
    return Reading(by_type, prints)


class RestoringMatcher(MatchBroker, Master):
    """A match master's state and what restores a departed cluster's arc here."""

    STANDBY_S = 60.0  # how long subscriptions read ahead for a suspected leave are kept
    INDEX_STEP = 256  # restored subscriptions indexed per event-loop turn in the background

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.store = open_store(self.topology.state_store)
        self.dispatch = Dispatch()  # the slaves' load reports; predicted-T and blind choice
        self._confirming: set[asyncio.Task[None]] = set()  # subscribe confirmations in flight
        self.replicas = ReplicaSet(self, self.store, "subscription")
        #: subscribe and unsubscribe decided (subscribing.py); its ``local_types``: event
        #: types restored from a departed cluster, matched here, never dispatched (the
        #: restored subscriptions are not replicated to the slaves, see ``adopt``)
        self.book = SubscriptionBook(
            self.registry, self.departed, link_timeout_s=self.topology.link_timeout_s
        )
        #: when this cluster last left the ring (``prepare``): see ``_matched_elsewhere``
        self.left_at: float | None = None
        #: departed clusters' subscriptions read ahead (a router suspected the departure),
        #: kept by the reads they were read by (restoring.py): read number -> result
        self.read_ahead = ReadAhead(self.STANDBY_S)
        self._readings: dict[int, asyncio.Future[Reading]] = {}

    async def _on_join_back(self, message: Join) -> None:
        """A departed cluster is back: deliver to it again; what was read ahead for it
        is not needed any more."""
        await super()._on_join_back(message)
        self.read_ahead.joined(message.cluster)

    @contextlib.asynccontextmanager
    async def lifetime(self, stop: asyncio.Event) -> AsyncIterator[None]:
        """While served: the table snapshotted, the inbox observed (``MatchBroker``)."""
        async with self.replicas.persisting(stop), super().lifetime(stop):
            yield

    async def prepare(self) -> None:
        for sid, (_, doc) in (await self.replicas.read(self.topology.read_timeout_s)).items():
            self._held(sid, doc)
        log.info("%s: %d subscriptions read back", self.owner, len(self.registry))
        self.left_at = await asyncio.to_thread(self._own_departure)
        if self.left_at is not None:
            log.warning(
                "%s: this cluster left the ring at %.3f: what its inbox held from before "
                "that and entered elsewhere was matched by its successor, and is dropped",
                self.owner,
                self.left_at,
            )

    def _own_departure(self) -> float | None:
        """When this cluster last left the ring, as the routers recorded it (None: it
        never did, or a new deployment forgot it)."""
        records = self.store.load(ring_owner(self.topology.prefix), "ring")
        _, record = records.get(self.cluster, (0, {}))
        if not isinstance(record, dict):
            return None
        at = record.get("at") if record.get("state") == "left" else record.get("left_at")
        return float(at) if isinstance(at, int | float) else None

    def _matched_elsewhere(self, message: Publish) -> bool:
        """``dispatching.matched_elsewhere`` for ``message``."""
        return matched_elsewhere(self.cluster, self.left_at, message.entered_at, message.hops)

    async def _on_recover(self, message: Recover) -> None:
        """RECOVERY: take the departed match masters' subscriptions of the arc that this
        cluster's router sends to this match master, read from the persisted state (or
        already read, when a router suspected the departure: ``prepare``), and answer at
        once: an event type is indexed when its first event comes (or by the background
        indexer, type after type, whichever is first); then they are written as this
        master's own."""
        plan = self._restore_plan(message)
        effects = self.read_ahead.recover(message.cluster, plan, prepare=message.prepare)
        restore: asyncio.Future[Reading] | None = None

        def read(effect: Read) -> None:
            self._readings[effect.reading] = self._read_departed(message)

        def take(effect: Restore) -> None:
            nonlocal restore
            restore = self._readings.pop(effect.reading)

        await self.enact(effects, self.reading_ahead, here={Read: read, Restore: take})
        self._drop_unused_reads()
        if restore is not None:
            with heap.paused():  # no cycles among them; the index task keeps it so (heap.py)
                await self._restore(message, restore)

    @functools.cached_property
    def reading_ahead(self) -> Inputs:
        """The read-ahead's timer input: a read nobody took is forgotten."""
        return Inputs(timer=self._forget_read)

    def _forget_read(self, key: Any) -> list[Count]:
        cluster, reading = key
        forgotten = self.read_ahead.forget(cluster, reading)
        self._drop_unused_reads()
        return forgotten

    def _drop_unused_reads(self) -> None:
        kept = self.read_ahead.in_use()
        for reading in [r for r in self._readings if r not in kept]:
            del self._readings[reading]

    async def _restore(self, message: Recover, reading: asyncio.Future[Reading]) -> None:
        try:
            read = await reading
        except Exception as exc:  # the read ahead failed: read now
            log.warning("%s: reading %s's state ahead failed (%s)", self.name, message.cluster, exc)
            read = await self._read_departed(message)
        owners = list(self._restore_plan(message).owners)
        if await asyncio.to_thread(_fingerprints, self.store, owners) != read.prints:
            # read ahead when a router suspected the leave, and a subscription was made
            # or removed after that: what the departed masters hold now is read again
            log.warning(
                "%s: %s's subscriptions changed since they were read ahead: reading again",
                self.name,
                message.cluster,
            )
            self.count("read_again")
            read = await self._read_departed(message)
        by_type = read.found
        self.departed.add(message.cluster)
        found, refused = self.registry.restore(by_type)
        self.book.local_types.update(by_type)
        for why in refused:
            log.warning("%s: restored subscription left out: %s", self.name, why)
        self.count("refused", len(refused))
        self.count("restored", len(found))
        await asyncio.to_thread(self._take_advertisements, message, set(by_type))
        log.warning("%s: %d subscriptions of %s restored", self.name, len(found), message.cluster)
        done = Recovered(request=message.request, broker=self.owner, restored=len(found))
        await self.send(self.cluster, message.reply_to, done, MAX_PRIORITY)
        task = asyncio.create_task(self._index_restored(found))
        self._confirming.add(task)
        task.add_done_callback(self._confirming.discard)

    def _restore_plan(self, message: Recover) -> RestorePlan:
        """restoring.restore_plan for this master (``DeadLetter`` for a RECOVER it
        cannot take)."""
        return restore_plan(
            message,
            cluster_masters=self.topology.cluster(self.cluster).match_masters,
            index=self.index,
        )

    def _take_advertisements(self, message: Recover, types: set[str]) -> None:
        """(In a thread) the departed match masters' advertisements of the arc's types
        this master now holds, kept as its own."""
        arc = Arc(message.cluster, message.cluster, *message.arc)
        plan = self._restore_plan(message)
        owners, masters = plan.owners, plan.masters
        for owner in owners:
            for event_type, (version, doc) in live(self.store.load(owner, "advertisement")).items():
                if event_type in types or (
                    arc.covers(event_type) and master_index(event_type, masters) == self.index
                ):
                    self.store.save(self.owner, "advertisement", event_type, doc, version)

    def _read_departed(self, message: Recover) -> asyncio.Future[Reading]:
        arc = Arc(message.cluster, message.cluster, *message.arc)
        plan = self._restore_plan(message)
        owners, masters = plan.owners, plan.masters

        async def read() -> Reading:
            # 200 000 documents, no cycles: without the pause, full collections of the
            # growing heap (0.3-1.2 s each, eight of them) doubled the read (heap.py)
            with heap.paused():
                return await asyncio.to_thread(
                    _restorable, self.store, list(owners), arc, masters, self.index
                )

        return asyncio.ensure_future(read())

    async def _index_restored(self, found: dict[str, dict[str, Any]]) -> None:
        """Index the restored types one by one between other work, then adopt them.
        Full collections stay off meanwhile and the tables are frozen after: with
        200 000 subscriptions each full collection took about a second, four of them
        between the leave and the arc served again (heap.py)."""
        started = time.monotonic()
        with heap.paused():
            while self.registry.unindexed:  # small steps: the arc's events go between
                self.index_type(next(iter(self.registry.unindexed)), self.INDEX_STEP)
                await asyncio.sleep(0)
            if self.settings.gc_freeze:
                heap.freeze(f"{self.name} after restoring")
        log.info(
            "%s: restored subscriptions indexed in %.2f s", self.name, time.monotonic() - started
        )
        await self.replicas.adopt(found)  # this master's own from now on
