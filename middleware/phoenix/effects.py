"""Effects every Phoenix machine may return, one definition each, for ``routing/`` and
``recovery/`` alike (a machine's own effects live beside it: ``subscribing``,
``copies``, ``takeover``, ...; the election's ``Send(to, what)`` is translated to typed
votes in one place, ``routing/follower.py``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Count", "Refuse"]


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
