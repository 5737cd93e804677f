"""A master's side of its cluster role (driver): it beats to its slaves, admits and
supervises them (``supervision.py``: silence, second processes, replacements), answers
late votes, and fences or steps down against a rival reign (``recovery/fencing.py``).
The routing and match masters are masters (``router_roles.py``, ``match_roles.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import DeadLetter, MiddlewareError
from ..phoenix.ids import RoleId
from ..phoenix.protocol import Kind
from ..recovery import FailureDetector
from ..recovery.fencing import (
    Reign,
    SendFence,
    Stale,
)
from ..transport import Delivery
from .beats import LeaseWatch
from .messages import Beat, Message, Read, Replicate, Retire, Vote
from .peer import WARM_AFTER_PROMOTION_S
from .performing import Inputs, Performer
from .reigns import Reigns
from .replica_set import ReplicaSet, answer_read
from .serving import each
from .supervision import Check, Note, Provision, Supervision
from .supervision import Effect as SupervisionEffect
from .supervision import Retire as RetireProcess
from .wiring import Handler

__all__ = ["Master"]

log = logging.getLogger(__name__)


class Master(Reigns):
    """What every master does beside its own role: its slaves and its reign."""

    replicas: ReplicaSet  # the table its slaves hold (each master's own)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        topology = self.topology
        # its slaves, by number, as their beats and load reports say: the one liveness
        # rule for dispatch (match masters) and for replacements
        self.live = FailureDetector[int](
            topology.slave_beat_interval_s, topology.heartbeat_misses, topology.suspect_ceiling_s
        )
        #: which process serves each slave, second processes, replacements (pure)
        self.supervision = Supervision(
            topology.replace_after_s, topology.replace_retry_s, self.provisioner is not None
        )
        #: each slave's lease as this master watches it (beats.py)
        self.slave_watches: dict[int, LeaseWatch] = {}
        self.doubting(topology.heartbeat_interval_s * topology.heartbeat_misses, self.live)

    @functools.cached_property
    def control_handlers(self) -> dict[type, Handler]:
        return {**super().control_handlers, Beat: self._on_other_beat, Vote: self._on_late_vote}

    async def recovery(self, stop: asyncio.Event) -> None:
        """Beside serving: a master beats to its slaves every heartbeat interval (its
        slaves elect a successor when the beats stop)."""
        every = self.id.slaves(self.topology.cluster(self.cluster))
        if not every:
            return
        # the one a promoted master left beats to it once served again (admitted then)
        slaves = [r for r in every if r != self.promoted_from]
        if self.promoted_from is None:
            # from the first beat on its slaves watch it: a master that starts beating
            # only once it serves is never suspected for the pauses of loading its tables
            # (a full collection of a large heap holds every thread for ~0.5 s; a bench
            # start saw one).  A promoted master beats at once: its slaves watch already.
            await self.serving.wait()
        self.live.watch([r.slave for r in every], time.monotonic())  # silent from now on
        self._ticking()
        if self.provisioner is not None:
            # a promoted master warms once the switch is behind it: the zygote's imports
            # (0.7 s of CPU) made the switch itself 0.3 s slower on 2 cores
            delay = WARM_AFTER_PROMOTION_S if self.promoted_from is not None else 0.0
            asyncio.get_running_loop().call_later(delay, self._warm)
        beat = Beat(
            broker=self.id.owner,
            epoch=self.reign.epoch,
            by=self.reign.by,
            reply_to=self.connections.process_queue,
        )
        if self.promoted_from is not None:
            # its slaves trusted it at its COORDINATOR and wait for its beats from then:
            # the first goes over the connection it has, before the beat thread connects
            for slave in slaves:
                await self.signal(slave, beat)

        try:
            await self.beating(
                [self.control_of(r) for r in slaves],
                lambda: beat,
                self._replacing(stop),
                self.topology.heartbeat_interval_s,
            )
        finally:
            for watch in self.slave_watches.values():
                await watch.stop()

    async def _replacing(self, stop: asyncio.Event) -> None:
        """Ask for a replacement of a slave silent too long, when the machine says a
        check can find one (``Supervision.next_check_in``)."""
        while not stop.is_set():
            wait = self.supervision.next_check_in(
                self._silences(time.monotonic()),
                self.live.timeout_s,
                self.topology.heartbeat_interval_s,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
            await self.replace_silent(time.monotonic())

    def _warm(self) -> None:
        if self.provisioner is None:
            return
        try:
            self.provisioner.warm()
        except Exception as exc:  # a provisioner's failure is not the master's
            log.warning("%s: provisioner not warmed: %s", self.id, exc)

    async def _on_other_beat(self, message: Beat) -> None:
        """A master's beat that reached this master (at the control queue it had as a
        slave): another process serving the same role.  The older reign steps down: that
        one is fenced, or this one steps down itself."""
        if message.reply_to == self.connections.process_queue:
            return  # its own (sent before it switched role)
        if message.broker != self.id.owner:
            await self._on_slave_beat(message)
            return
        theirs = Reign(message.epoch, message.by)
        await self._rival(self.reigning.rival_beat(theirs, message.reply_to), message.broker)

    async def _on_slave_beat(self, message: Beat) -> None:
        """A slave's beat: it is alive (the live set that dispatch and replication use);
        a slave the replica set does not hold (the one a promoted master left, served
        again by a fenced master or a replacement) is caught up and admitted."""
        replicas = self.replica_set
        try:
            slave = RoleId.from_owner(message.broker)
        except ValueError:
            slave = None
        if (
            replicas is None
            or slave is None
            or slave not in self.id.slaves(self.topology.cluster(self.cluster))
        ):
            raise DeadLetter(f"beat from {message.broker!r}, not a slave of {self.id}")
        watch = self._slave_watch(slave)
        if watch.stale(message.lease):
            return  # sent before its connection closed: no sign of life
        serving, effects = self.supervision.beat(slave.slave, message.reply_to, time.monotonic())
        await self._supervise(effects)
        if not serving:
            return  # a second process: no sign of life of the one serving the role
        theirs = Reign(message.epoch, message.by)
        if theirs > self.reign:  # its slaves follow a successor: as their FENCE would
            await self._rival(self.reigning.fence(theirs), message.broker)
            return
        self._trusts(message)
        if slave not in replicas.replicas:
            if slave == self.promoted_from:
                await self._stop_draining()
            await replicas.admit(slave, message.version)
            if self.beater is not None:
                self.beater.add(self.control_of(slave))
        self.slave_heard(slave.slave)
        self.live.announced(slave.slave, message.next_s)
        if message.lease is not None:
            await watch.named(message.lease)

    def former_inbox_handler(self) -> Callable[[Delivery], Awaitable[None]]:
        async def on_former_inbox(delivery: Delivery) -> None:
            await each(self, delivery, self._former_inbox, self.gate)

        return on_former_inbox

    async def _former_inbox(self, message: Message) -> None:
        """What reaches the inbox a promoted master had as a slave and drains: its
        events are handled; a READ (a master of another reign reading its replicas) is
        answered from the replica it held, as the slave would; a replicated entry is
        not this reign's and is dropped."""
        replicas = self.replica_set
        if isinstance(message, Read) and replicas is not None and self.promoted_from:
            await answer_read(self, replicas.store, self.promoted_from.owner, message)
            self.count("former_reads_answered")
            return
        if isinstance(message, Replicate):
            if message.reply_to == self.connections.process_queue and self.promoted_from:
                # this master's own, to the process that serves the slave it was now
                # (taken here before the drain stopped): passed on, not dropped
                self.count("former_replicas_passed_on")
                inbox = self.inbox_of(self.promoted_from)
                await self.send(self.cluster, inbox, message)
                return
            self.count("former_replicas_dropped")
            return
        await self.handle(message)

    async def _stop_draining(self) -> None:
        """The slave this master was is served again (by a master that stepped down, or
        a replacement): its control queue and its inbox are that slave's from now on, so
        this master stops consuming them before it replicates there (a replica taken
        by its drain was dropped, and a subscribe waited for W of N in vain)."""
        client = await self.client_for(self.cluster)
        tags, self.former_tags = self.former_tags, []
        for tag in tags:
            with contextlib.suppress(Exception):
                await client.cancel(tag)

    async def _supervise(self, effects: list[SupervisionEffect]) -> None:
        """Perform what the supervision machine returned (supervision.py)."""
        await self.enact(effects, self.supervised)

    @functools.cached_property
    def supervised(self) -> Inputs:
        """The supervision machine's timer input (keyed by a slave's number)."""

        def timer(key: Any) -> list[SupervisionEffect]:
            slave, now = int(key), time.monotonic()
            return self.supervision.timer(slave, slave in self.live.alive(now), now)

        return Inputs(timer=timer)

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        return {
            **super().performers,
            Note: self._note,
            RetireProcess: self._retire_process,
            Check: self._check,
            Provision: lambda effect: self._background(self._replacement(effect)),
            SendFence: self._send_fence,
            Stale: lambda _: self.count("stale_fences"),
        }

    def _note(self, effect: Note) -> None:
        log.warning("%s: %s", self.id, effect.text.format(slave=self._slave(effect.slave)))

    async def _retire_process(self, effect: RetireProcess) -> None:
        self.count("retires_sent")
        retire = Retire(
            broker=self.id.owner,
            slave=self._slave(effect.slave).owner,
            epoch=self.reign.epoch,
            by=self.reign.by,
        )
        await self.tell(effect.process, retire)

    async def _check(self, effect: Check) -> list[SupervisionEffect]:
        there = await self._process_there(effect.known)
        return self.supervision.checked(effect.slave, effect.known, effect.process, there)

    async def _process_there(self, queue: str) -> bool:
        """Whether a slave's process queue is there (it goes with the process's
        connection); a look that fails says it is (the slave is then told to stop, as
        before the look)."""
        try:
            client = await self.client_for(self.cluster)
            return await client.queue_there(queue)
        except MiddlewareError as exc:
            log.info("%s: could not look at %s (%s): taken as there", self.id, queue, exc)
            return True

    async def _replacement(self, effect: Provision) -> None:
        """Ask the provisioner for a process serving the slave; tell the machine."""
        slave = self._slave(effect.slave)
        started = None
        assert self.provisioner is not None  # the machine asks only where one is
        try:
            started = await asyncio.to_thread(self.provisioner.start, slave)
        except Exception as exc:  # a provisioner's failure is not the master's
            log.warning("%s: no replacement for %s: %s", self.id, slave, exc)
        else:
            if started is None:
                log.info("%s: %s %s; nothing to start", self.id, slave, effect.why)
            else:
                self.count("replacements")
                log.warning(
                    "%s: %s %s: replacement started (%s)", self.id, slave, effect.why, started
                )
        await self._supervise(self.supervision.provisioned(effect.slave, started is not None))

    def _slave_watch(self, slave: RoleId) -> LeaseWatch:
        watch = self.slave_watches.get(slave.slave)
        if watch is None:

            async def lost() -> None:
                await self._slave_lease_returned(slave)

            watch = self.slave_watches[slave.slave] = LeaseWatch(
                self.topology.prefix,
                lambda: self.client_for(self.cluster),
                lost,
                name=str(slave),
            )
        return watch

    async def _slave_lease_returned(self, slave: RoleId) -> None:
        """A slave's process died: no more dispatch to it, and a replacement now."""
        self.live.lost(slave.slave)
        self.count("slave_lease_returned")
        log.warning("%s: lease of %s returned (its connection closed)", self.id, slave)
        await self._supervise(self.supervision.lease_returned(slave.slave))

    @property
    def replica_set(self) -> ReplicaSet:
        """The replicas of the table its slaves hold."""
        return self.replicas

    def slave_heard(self, slave: int) -> None:
        """A slave's beat or load report arrived."""
        now = time.monotonic()
        self.live.watch([slave], now)
        self.live.heard(slave, now)
        self.supervision.heard(slave)

    async def replace_silent(self, now: float) -> None:
        """When the supervision says (``next_check_in``): a replacement for every slave
        silent past the rule."""
        silences = self._silences(now)
        await self._supervise(self.supervision.silences(silences, self.live.timeout_s, now))

    def _silences(self, now: float) -> dict[int, float | None]:
        """Each slave's silence (None: not watched)."""
        return {
            slave.slave: self.live.silent_for(slave.slave, now)
            for slave in self.id.slaves(self.topology.cluster(self.cluster))
        }

    async def _on_late_vote(self, message: Vote) -> None:
        """A slave still electing after this master took over: tell it who won."""
        if message.kind is not Kind.ELECTION or self.promoted_from is None:
            self.count("late_votes")
            return
        with contextlib.suppress(ValueError):
            sender = RoleId.from_owner(message.broker)
            if sender in self.id.slaves(self.topology.cluster(self.cluster)):
                coordinator = Vote(
                    kind=Kind.COORDINATOR,
                    broker=self.promoted_from.owner,
                    epoch=self.reign.epoch,
                    by=self.reign.by,
                )
                await self.signal(sender, coordinator)
