"""Effects every Phoenix machine may return, one definition each, for ``routing/`` and
``recovery/`` alike: ``Count``, ``Refuse``, ``After`` (a timer), ``Signal`` and ``Send``
(a message to another role, built by the machine; the driver only addresses and
publishes it: ``Peer.perform``).  A machine's own effects live beside it where the
driver's part is more than that (``subscribing.Persist``, ``takeover``'s reads, ...);
the election's ``Send(to, what)`` is translated to typed votes in one place,
``routing/follower.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from .ids import RoleId
from .protocol import MAX_PRIORITY

__all__ = [
    "DUE_MARGIN_S",
    "After",
    "Box",
    "Count",
    "GiveBack",
    "Refuse",
    "Send",
    "Sent",
    "Signal",
]

#: a look or check a machine schedules for the moment a bound passes comes this much
#: after it, so the bound has passed when it runs (the follower's looks at its master,
#: the supervision's checks of its slaves' silences)
DUE_MARGIN_S = 0.001


@dataclass(frozen=True, slots=True)
class Count:
    """Add ``n`` to the role's counter ``name`` (its metrics and its stop summary)."""

    name: str
    n: int = 1


@dataclass(frozen=True, slots=True)
class Refuse:
    """Dead-letter the message being handled with ``reason``, once the effects before
    it were done."""

    reason: str


@dataclass(frozen=True, slots=True)
class GiveBack:
    """The message being handled could not be passed on (the next role's inbox on a node
    that is down, a failover): it is handled again a little later, and in the end goes
    back to the role's inbox (``HopFailed``; ``serving.each``), never dead-lettered."""

    reason: str


@dataclass(frozen=True, slots=True)
class After:
    """Give the machine its timer input for ``key`` ``after_s`` from now (the driver's
    ``call_later``); each machine has one timer input and says what its keys are
    (``MatchedReceipts.due``: an entry cluster; ``ArcTakeover.expired`` and
    ``HandBack.expired``: a request; ``ReadAhead.forget``: (cluster, reading);
    ``Supervision.timer``: a slave's number)."""

    after_s: float
    key: Any  # hashable: what the machine told itself to come back to


class Box(StrEnum):
    """Which of a role's two queues a message goes to."""

    CONTROL = "control"  # control messages: beats, votes, ring changes, answers
    INBOX = "inbox"  # the role's work: events, subscriptions, hand-overs


@dataclass(frozen=True, slots=True)
class Signal:
    """``message`` (a wire message of ``routing/messages.py``) to ``to``'s control queue
    (a role) or to the queue named ``to`` (a process's), at the top priority, expiring
    when it would be stale (votes and fences of a dead peer do not pile up).  Best
    effort: a queue not there or a broker out of reach is logged, never raised."""

    to: RoleId | str
    message: Any


@dataclass(frozen=True, slots=True)
class Send:
    """``message`` (a wire message) to ``to``'s ``box`` at ``priority``, batched with the
    other sends of the loop turn to the same queue and confirmed, on the RabbitMQ of the
    cluster ``via`` (``to``'s own when None: an added master of a departed cluster's arc
    is reached at its host).  ``bound_s``: one try that gives up after it; a miss (the
    link, the broker, the time) is logged and counted as ``missed`` when given, never
    raised.  None: the send's failure is the input's (it stays unacked), unless
    ``then`` is given: then how the send ended comes back to the machine as
    :class:`Sent` (``then``: what it said to come back to), never raised."""

    to: RoleId
    message: Any
    box: Box = Box.CONTROL
    priority: int = MAX_PRIORITY
    via: str | None = None
    bound_s: float | None = None
    missed: str | None = None
    then: Any = None  # hashable: the machine hears how the send ended (``Sent``)


@dataclass(frozen=True, slots=True)
class Sent:
    """An input: how a :class:`Send` with ``then`` ended (``error``: None once it was
    confirmed, else why it was not sent; ``lasting``: the error is the message's own,
    sending it again cannot help: a message the broker refuses)."""

    then: Any
    error: str | None = None
    lasting: bool = False
