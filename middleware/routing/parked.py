"""When a parked message is tried again (pure: ``serving`` performs it).

A role parks what it could not pass on (a copy for a subscriber queue that is full or
whose node is down, an event for a role inbox that is down) in its parked queue, and
its consumer of that queue tries each again.  Until 2026-12-07 each was held in hand
and tried after 0.25, 0.5, 1, 2, 2, 2, 2 s, then given back to the *head* of the parked
queue: a destination that stayed down held the consumer's prefetch for good (what was
parked for other destinations waited behind it), and on RabbitMQ 4.0 a quorum parked
queue drops a message given back 20 times.

Now the pace is per destination (``key_of``): while one is failing, one message of
it at a time is tried (the probe), at most once per ``pause_s``; the others wait in
hand for ``pause_s`` since their delivery and go back to the *tail* of the parked
queue untried (``REPARK``), so the queue turns over and nothing is given back.  Once
a probe passes, what follows for that destination is tried at once, so a backlog
drains at the pace of the consumer, not one per pause.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .messages import Copy, Message

__all__ = ["Next", "ParkedPace", "key_of"]


class Next(enum.Enum):
    TRY = "try"  # pass it on now
    WAIT = "wait"  # hold it in hand for ``wait_s``, then ask again
    REPARK = "repark"  # to the parked queue's tail, untried, once held ``pause_s``


def key_of(message: Message) -> str:
    """The destination a parked message waits for: a copy's subscriber queue at its
    home; for other kinds, the kind (the next role's inbox, one per kind)."""
    if isinstance(message, Copy):
        return f"copy {message.home} {message.queue}"
    return message.kind.value


@dataclass
class _Failing:
    at: float  # when the last try for it failed
    probing: bool = False  # a try for it is under way


class ParkedPace:
    """The per-destination memory of one role's parked-queue consumer."""

    def __init__(self, pause_s: float = 1.0) -> None:
        self.pause_s = pause_s
        self._failing: dict[str, _Failing] = {}

    def next(self, key: str, now: float, *, waited: bool) -> tuple[Next, float]:
        """What to do with a parked message for ``key`` now (``waited``: it was held
        once already, it is not held again)."""
        failing = self._failing.get(key)
        if failing is None:
            return Next.TRY, 0.0
        due = failing.at + self.pause_s
        if now < due:
            return (Next.REPARK, 0.0) if waited else (Next.WAIT, due - now)
        if failing.probing:
            return Next.REPARK, 0.0
        failing.probing = True
        return Next.TRY, 0.0

    def tried(self, key: str, now: float, *, passed: bool | None) -> None:
        """A try for ``key`` passed (what follows is tried at once), failed, or ended
        saying nothing of the destination (``None``: the message's own fault)."""
        if passed:
            self._failing.pop(key, None)
        elif passed is False:
            self._failing[key] = _Failing(now)
        elif (failing := self._failing.get(key)) is not None:
            failing.probing = False

    @property
    def failing(self) -> int:
        """Destinations whose last try failed."""
        return len(self._failing)
