"""A slave's side of its cluster role (driver): it holds its master's replicated table
(store entries, acknowledge, answer reads), watches the master's beats and, when they
stop, elects with the other slaves who takes over (``follower.py`` decides).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from .. import heap
from ..recovery.fencing import Reign, Trust
from .beats import LeaseWatch
from .follower import Effect as FollowerEffect
from .follower import (
    Elected,
    Follower,
    Leader,
    NameLease,
    Promote,
    StopServing,
    Suspected,
    retire,
)
from .messages import Ack, Beat, Read, Replicate, Retire, Takeover, Vote
from .peer import Role
from .performing import Performer
from .replica_set import answer_read
from .role_metrics import RECOVERY_S
from .store import StateStore
from .wiring import Handler

__all__ = ["ReplicaHolder"]

log = logging.getLogger(__name__)


class ReplicaHolder(Role):
    """A slave's side of a replica set: store entries, acknowledge, answer reads; watch
    the master's beats and, when they stop, elect with the other slaves who takes over."""

    replica_owner = ""
    master_control = ""
    store: StateStore
    #: the master watched and elected against (follower.py), from the first look on
    follower: Follower | None = None

    @functools.cached_property
    def trust(self) -> Trust:
        """Which reign of its master this slave follows (recovery/fencing.py)."""
        return Trust(self.reign)

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {
            **super().control_handlers,
            Beat: self._on_beat,
            Vote: self._on_vote,
            Retire: self._on_retire,
        }

    async def _on_retire(self, message: Retire) -> None:
        """Its master hears another process beating as this slave, the one it counts as
        serving the role: this process stops (``follower.retire`` decides; the follower
        shares this slave's ``trust``)."""
        reign = Reign(message.epoch, message.by)
        promoted = self.follower is not None and self.follower.promoted
        sender, slave = message.broker, message.slave
        await self.enact(retire(self.id, self.trust.reign, sender, slave, reign, promoted=promoted))

    def _retired(self, effect: StopServing) -> None:
        if self.stop_event is None or self.switch_to is not None:
            return
        log.warning(
            "%s: retired by %s: another process serves this role now; stopping",
            self.id,
            effect.by,
        )
        self.retired = True
        self.stop_serving()

    held_version = 0  # the newest replica entry it stored

    def _beat(self) -> Beat:
        """What this slave's beats to its master say (read by the beat thread each time)."""
        reign = self.trust.reign
        return Beat(
            broker=self.id.owner,
            epoch=reign.epoch,
            by=reign.by,
            version=self.held_version,
            reply_to=self.connections.process_queue,  # who it is: no reply is sent
        )

    @functools.cached_property
    def master_watch(self) -> LeaseWatch:
        """The master's lease as this slave watches it (beats.py)."""
        return LeaseWatch(
            self.topology.prefix,
            lambda: self.client_for(self.cluster),
            self._master_lost,
            name=str(self.id.master),
        )

    async def recovery(self, stop: asyncio.Event) -> None:
        try:
            await self.beating(
                [self.master_control],
                self._beat,
                self._watch_master(stop),
                self.topology.slave_beat_interval_s,
            )
        finally:
            await self.master_watch.stop()

    async def _master_lost(self) -> None:
        """The master's connection closed: it is gone (a frozen master keeps it)."""
        if self.follower is not None:
            await self._follow(self.follower.lease_returned(time.monotonic()))

    async def _watch_master(self, stop: asyncio.Event) -> None:
        topology, master = self.topology, self.id.master
        interval = topology.heartbeat_interval_s
        self.follower = Follower(
            self.id,
            master.slaves(topology.cluster(self.cluster)),
            interval_s=interval,
            misses=topology.heartbeat_misses,
            ceiling_s=topology.suspect_ceiling_s,
            trust=self.trust,
            failed_at=self.failed_at,
        )
        woke = time.monotonic()
        step = self.follower.next_look_in(woke)  # the machine says when to look again
        while not stop.is_set():
            await asyncio.sleep(step)
            now = time.monotonic()
            late, woke = now - woke - step, now
            await self._follow(self.follower.look(now, late))
            step = self.follower.next_look_in(time.monotonic())

    async def _follow(self, effects: list[FollowerEffect]) -> None:
        """Perform what the follower machine returned (follower.py)."""
        assert self.follower is not None
        self.failed_at = self.follower.failed_at  # handed to the master it may become
        await self.enact(effects)

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {
            **super().performers,
            Suspected: self._suspected,
            Elected: self._elected,
            Promote: self._promoted,
            Leader: self._leader,
            NameLease: self._name_lease,
            StopServing: self._retired,
        }

    def _suspected(self, effect: Suspected) -> None:
        master = self.id.master
        if effect.by == "lease":
            log.warning(
                "%s: lease of %s returned (its connection closed): electing", self.id, master
            )
            self.count("master_lease_returned")
        else:
            log.warning(
                "%s: no beat from %s for %.2f s: electing", self.id, master, effect.silent_s
            )
            self.count("master_suspected")
        RECOVERY_S.labels(self.cluster, master.kind.value, "detection").observe(effect.silent_s)

    def _elected(self, effect: Elected) -> None:
        RECOVERY_S.labels(self.cluster, self.id.master.kind.value, "election").observe(
            effect.took_s
        )

    def _promoted(self, effect: Promote) -> None:
        self.next_reign = effect.reign
        self._promote(effect.why)

    def _leader(self, effect: Leader) -> None:
        log.warning("%s: %s serves %s now", self.id, effect.slave, self.id.master)

    async def _name_lease(self, effect: NameLease) -> None:
        await self.master_watch.named(effect.lease)

    async def _take_over(self, message: Takeover) -> None:
        """The operator's take-over: as an election's winner, tell the other slaves
        first, so none of them elects against this one once the old master is silent."""
        await super()._take_over(message)
        if self.switch_to is None:
            return
        if self.follower is None:
            self._winning_reign()
            return
        effects = self.follower.take_over()
        self.next_reign = self.follower.next_reign
        await self._follow(effects)

    def _winning_reign(self) -> Reign:
        if self.follower is not None:
            self.next_reign = self.follower.winning_reign()
        elif self.next_reign is None:
            self.next_reign = self.trust.successor(self.id.slave)
        return self.next_reign

    def _promote(self, why: str) -> None:
        if self.switch_to is not None:
            return
        self._winning_reign()
        self.switch_to = self.id.master
        self.count("takeovers")
        log.warning("%s taking over %s (%s)", self.id, self.switch_to, why)
        self.stop_serving()

    def quiet_beats(self) -> bool:
        """Quiet when its master's beats are (``Follower.master_quiet``) and its own
        inbox is (``peer.Role``)."""
        follower = self.follower
        return follower is not None and follower.master_quiet and super().quiet_beats()

    async def _on_beat(self, message: Beat) -> None:
        if self.follower is None:
            return
        effects = self.follower.beat(
            message.broker,
            Reign(message.epoch, message.by),
            message.reply_to,
            message.lease,
            stale=self.master_watch.stale(message.lease),
            now=time.monotonic(),
            next_s=message.next_s,
        )
        await self._follow(effects)

    async def _on_vote(self, message: Vote) -> None:
        if self.follower is None:
            return
        effects = self.follower.vote(
            message.broker, message.kind, Reign(message.epoch, message.by), time.monotonic()
        )
        await self._follow(effects)

    def apply(self, key: str, document: dict[str, Any]) -> None:  # pragma: no cover
        raise NotImplementedError

    @functools.cached_property
    def inbox_handlers(self) -> dict[type, Handler]:
        return self.replica_handlers()

    def replica_handlers(self) -> dict[type, Handler]:
        """A slave's inbox handlers for its master's replication."""
        return {Replicate: self._store_entry, Read: self._read}

    async def _store_entry(self, message: Replicate) -> None:
        await asyncio.to_thread(
            self.store.save,
            self.replica_owner,
            message.state_kind,
            message.key,
            message.table,
            message.version,
        )
        self.held_version = max(self.held_version, message.version)
        self.apply(message.key, message.table)
        self.count("replicas")
        await self.send(
            self.cluster,
            message.reply_to or self.master_control,  # to the master that wrote it
            Ack(key=message.key, version=message.version, broker=self.replica_owner),
        )

    async def _read(self, message: Read) -> None:
        with heap.paused():  # a second copy of the table, no cycles: heap.py
            await self._answer_read(message)
        self.count("reads_answered")

    async def _answer_read(self, message: Read) -> None:
        await answer_read(self, self.store, self.replica_owner, message)
