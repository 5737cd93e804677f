"""A master's reign against other processes serving its role (the driver's part of
``recovery/fencing.py``): a slave's FENCE, or its beat naming a newer reign, steps it
down to a slave role; and its doubt of its own reign after a pause of its own
(``fencing.Doubt``).

A master that was stopped (SIGSTOP) or starved for longer than its slaves' detection
may find a successor serving its role when it runs again, and would act on what it held
with what it knew until that successor's FENCE reached it: a routing master resumed
after a join it missed routed the deliveries it held with its old ring, and a match
master dispatched its own to slaves that no longer held their subscriptions.  So from
such a pause on it handles no inbox message until a slave's beat names its reign (a
beat naming a newer one steps it down), or until twice its slaves'
detection passed with none heard.  It keeps its own clock while it serves with slaves:
a tick every half of that detection.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from ..errors import DeadLetter, Requeue
from ..phoenix.ids import RoleId
from ..recovery import FailureDetector
from ..recovery.fencing import (
    Doubt,
    Refuse,
    Reign,
    Reigning,
    RivalOutcome,
    SendFence,
    StepDown,
)
from .messages import Beat, Fence, Message
from .peer import Role
from .performing import Performer

__all__ = ["Reigns"]

log = logging.getLogger(__name__)


class Reigns(Role):
    """A master's reign against others: fenced by a newer one (it steps down), doubted
    after a pause of its own (:class:`Doubt`)."""

    doubt: Doubt
    _trust: asyncio.Event

    def doubting(self, floor_s: float, slaves: FailureDetector[int]) -> None:
        """Its slaves elect a successor after ``floor_s`` of its silence; ``slaves``:
        how it hears them (the wait's bound: twice their detection)."""
        self.doubt = Doubt(floor_s=floor_s, bound_s=2 * slaves.timeout_s)
        self._trust = asyncio.Event()

    async def handle(self, message: Message) -> None:
        """An inbox message, once the master knows it still reigns (``Doubt``): after
        a pause past its slaves' detection a successor may serve the role already, and
        the successor's fence, not this master's old view, decides what it holds."""
        wait = self.doubt.wait_s(time.monotonic()) if self.doubt.last is not None else 0.0
        if wait:
            if self.doubt.doubts > self.counters["reign_doubted"]:
                self.count("reign_doubted")
                log.warning("%s: did not run for a while: acting once its slaves trust it", self.id)
            self._trust.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._trust.wait(), wait)
            if self.fenced:  # stepped down meanwhile: the master reigning now handles it
                raise Requeue(f"{self.id} stepped down")
        await super().handle(message)

    def _ticking(self) -> None:
        """The master's own clock for ``Doubt`` while it serves (with slaves): a stop
        longer than the floor leaves a gap at least that long whatever the step; half
        the floor keeps a busy loop's late ticks from passing for one."""
        if self.fenced or self.switch_to is not None:
            return
        self.doubt.tick(time.monotonic())
        asyncio.get_running_loop().call_later(self.doubt.floor_s / 2, self._ticking)

    def _trusts(self, message: Beat) -> None:
        """A slave's beat names the reign it trusts: this one ends a doubt."""
        if Reign(message.epoch, message.by) == self.reign:
            self.doubt.trusted()
            self._trust.set()

    @functools.cached_property
    def reigning(self) -> Reigning:
        """Its reign against rival ones: fence them, or step down once (pure)."""
        spec = self.topology.cluster(self.cluster)
        return Reigning(
            self.reign,
            None if self.promoted_from is None else self.promoted_from.slave,
            frozenset(r.slave for r in self.id.slaves(spec)),
        )

    def _slave(self, number: int) -> RoleId:
        return next(
            r for r in self.id.slaves(self.topology.cluster(self.cluster)) if r.slave == number
        )

    async def _on_fence(self, message: Fence) -> None:
        """A slave trusts a newer reign than this master's: step down to the slave role
        this process left when it took over, or (the master as started) the one the newer
        master left.  An older or equal reign, or one no slave can have, changes nothing
        (``fencing.fenced`` decides)."""
        reign = Reign(message.epoch, message.by)
        await self._rival(self.reigning.fence(reign), message.broker)

    async def _rival(self, outcome: RivalOutcome, sender: str) -> None:
        """Perform a fencing decision (recovery/fencing.py); ``sender`` is named in what
        a refusal and a step-down say; None: nothing to do."""
        if outcome is None:
            return

        def refuse(effect: Refuse) -> None:
            raise DeadLetter(f"{effect.reason} from {sender!r}: not for {self.id}")

        here: dict[type, Performer] = {
            Refuse: refuse,
            StepDown: functools.partial(self._step_down, sender),
        }
        await self.enact([outcome], here=here)

    async def _send_fence(self, outcome: SendFence) -> None:
        self.count("fences_sent")
        fence = Fence(broker=self.id.owner, epoch=outcome.reign.epoch, by=outcome.reign.by)
        await self.tell(outcome.to, fence)

    def _step_down(self, sender: str, outcome: StepDown) -> None:
        """Once: the machine serves no more after it."""
        back = self.promoted_from or self._slave(outcome.slave)
        what = "%s (%s) fenced by %s, which trusts %s: stepping down to %s"
        log.warning(what, self.id, self.reign, sender, outcome.reign, back)
        self.count("fenced")
        self.fenced = True
        self.switch_to, self.reign = back, self.reigning.reign  # the slave trusts it
        self.stop_serving()
