"""A role's beats (driver): the process's beat thread (``beats.Beater``) aimed at the
role's queues while it serves, at the usual pace or, while the role has nothing to do,
at the topology's ``quiet_beat_interval_s`` (each such beat says when the next comes,
``Beat.next_s``), and woken when a quiet role's inbox gives it work, so that the usual
pace is back from that delivery on (docs/phoenix-recovery.md, "Quiet beats").
``peer.Peer`` is a :class:`Beating`; ``mastering.Master`` beats to its slaves,
``holding.ReplicaHolder`` to its master.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .beats import Beater, beat_thread

if TYPE_CHECKING:
    from ..phoenix.ids import RoleId
    from ..phoenix.protocol import PhoenixTopology
    from ..settings import Settings
    from .messages import Beat
    from .wiring import Connections

__all__ = ["Beating"]


class Beating:
    """What a role beats, and when (mixed into ``peer.Peer``, which has the rest)."""

    id: RoleId
    settings: Settings
    topology: PhoenixTopology
    cluster: str
    connections: Connections
    process_beater: Beater | None
    beater: Beater | None
    inbox_at: float  # (``peer.Role``: when its inbox last gave it a message)
    #: its last beat said it was quiet (``Beat.next_s``): set by the beat thread
    beat_quiet = False

    def count(self, outcome: str, n: int = 1) -> None:
        raise NotImplementedError

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
        own and stops it after.  A role with nothing to do (``quiet_beats``) beats at
        the topology's ``quiet_beat_interval_s`` instead, and each beat says so."""

        def body() -> tuple[bytes, float]:
            quiet_s = self.topology.quiet_beat_interval_s
            next_s = quiet_s if quiet_s > interval_s and self.quiet_beats() else None
            self.beat_quiet = next_s is not None  # (read by ``inbox_took``)
            message = beat().model_copy(update={"lease": beater.lease, "next_s": next_s})
            # without its unset fields: a beat at the usual pace is one a role from
            # before ``next_s`` reads too (its messages refuse unknown fields)
            return message.model_dump_json(exclude_none=True).encode(), next_s or interval_s

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

    def quiet_beats(self) -> bool:
        """Whether this role has nothing to do now, so its beats may come slower (read
        by the beat thread at each beat)."""
        return False

    def inbox_took(self) -> None:
        """Its inbox gave it a delivery.  A role whose last beat said it was quiet has
        its beat thread woken: the usual pace is back from this delivery on, not from
        its next quiet beat (up to ``quiet_beat_interval_s`` later), so a master that
        freezes right after a quiet spell is found as soon as under load."""
        self.inbox_at = time.monotonic()
        if self.beat_quiet:
            self.beat_quiet = False
            beater = self.beater
            if beater is not None:
                beater.wake()
