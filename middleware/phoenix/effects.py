"""Effects every Phoenix machine may return, one definition each, for ``routing/`` and
``recovery/`` alike (a machine's own effects live beside it: ``subscribing``,
``copies``, ``takeover``, ...; the election's ``Send(to, what)`` is translated to typed
votes in one place, ``routing/follower.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["After", "Count", "Refuse"]


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
class After:
    """Give the machine its timer input for ``key`` ``after_s`` from now (the driver's
    ``call_later``); each machine has one timer input and says what its keys are
    (``MatchedReceipts.due``: an entry cluster; ``ArcTakeover.expired`` and
    ``HandBack.expired``: a request; ``ReadAhead.forget``: (cluster, reading);
    ``Supervision.timer``: a slave's number)."""

    after_s: float
    key: Any  # hashable: what the machine told itself to come back to
