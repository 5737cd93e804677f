"""One performer for every Phoenix machine's effects (driver): a role hands what a
machine returned to :meth:`Performing.enact`, which performs each effect in order by
its type (one table per role, each kind adding its own entries as it adds handlers)
and performs next what the machine returns on the result (a check's answer, a
store's read, a plan, how a send ended), before the rest.  ``After`` sets a timer
whose firing is the machine's timer input; a ``Send`` with ``then`` comes back as the
machine's ``sent`` input (``Inputs``).  A new behaviour is a machine and its effects,
and at most a performer entry for an effect type that is new: never a loop of its own.
The whole picture: ``docs/phoenix-roles.md``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import DeadLetter, HopFailed
from ..phoenix.effects import After, Count, GiveBack, Refuse, Send, Sent, Signal

__all__ = ["NO_INPUTS", "Inputs", "Performer", "Performing"]

#: performs one effect; what it returns (maybe awaited) is performed next: the
#: machine's effects on the result, or a ``Sent`` for the machine's ``sent`` input
Performer = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class Inputs:
    """Where what a machine's effects give back goes: ``timer`` (an ``After``'s key ->
    the machine's effects when it fires) and ``sent`` (a ``Send`` with ``then`` and how
    it ended -> the machine's effects)."""

    timer: Callable[[Any], Iterable[Any]] | None = None
    sent: Callable[[Send, Sent], Iterable[Any]] | None = None


NO_INPUTS = Inputs()


class Performing:
    """The effect performer a role is (``peer.Peer`` gives it its voice)."""

    def count(self, outcome: str, n: int = 1) -> None:
        raise NotImplementedError

    async def perform(self, effect: Send | Signal) -> Sent | None:
        raise NotImplementedError

    def _background(self, work: Awaitable[Any]) -> None:
        raise NotImplementedError

    @functools.cached_property
    def performers(self) -> dict[type, Performer]:
        """How this role performs each effect type its machines return (each kind
        adds the ones of its machines, as its handler tables)."""
        return {
            Count: self._count,
            Refuse: self._refuse,
            GiveBack: self._give_back,
            Send: self.perform,
            Signal: self.perform,
        }

    def _count(self, effect: Count) -> None:
        self.count(effect.name, effect.n)

    @staticmethod
    def _refuse(effect: Refuse) -> None:
        raise DeadLetter(effect.reason)

    @staticmethod
    def _give_back(effect: GiveBack) -> None:
        raise HopFailed(effect.reason)

    async def enact(
        self,
        effects: Iterable[Any],
        inputs: Inputs = NO_INPUTS,
        here: Mapping[type, Performer] | None = None,
    ) -> None:
        """Perform ``effects`` in order, each by its type (``here`` first: the
        performers bound to the input being handled, then the role's table); what a
        performer returns is performed next, before the rest.  A ``Refuse`` raises
        there (``DeadLetter``), after the effects before it were done, and so does a
        ``GiveBack`` (``HopFailed``: tried again, then given back to the inbox)."""
        pending = collections.deque(effects)
        table = self.performers
        while pending:
            effect = pending.popleft()
            kind = type(effect)
            if kind is After:
                self.set_timer(effect, inputs)
                continue
            performer = here.get(kind) if here is not None else None
            if performer is None:
                performer = table.get(kind)
            if performer is None:
                raise TypeError(f"{type(self).__name__} performs no {kind.__name__}")
            more = performer(effect)
            if asyncio.iscoroutine(more):
                more = await more
            if isinstance(more, Sent):
                if inputs.sent is None:  # nobody hears it here: the send's failure is
                    if more.error is not None:  # the input's, as for a send without then
                        raise (DeadLetter if more.lasting else HopFailed)(more.error)
                    continue
                more = inputs.sent(effect, more)
            if more:
                pending.extendleft(reversed(list(more)))

    def set_timer(self, effect: After, inputs: Inputs) -> None:
        """The machine's timer input for ``effect.key``, ``effect.after_s`` from now (a
        new input: nothing of the one that set it is bound); what it returns is
        performed beside serving."""
        timer = inputs.timer
        if timer is None:
            raise TypeError(f"{type(self).__name__}: a timer with no timer input")

        def fire() -> None:
            self._background(self.enact(timer(effect.key), inputs))

        asyncio.get_running_loop().call_later(effect.after_s, fire)
