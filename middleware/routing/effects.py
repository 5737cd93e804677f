"""Effects every role machine may return, one definition each (the machines' own
effects live beside them: ``subscribing``, ``copies``, ``takeover``, ...)."""

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
