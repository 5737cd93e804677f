"""What Phoenix roles persist, as typed records (the documents the state store holds).

Two tables are replicated by quorum (``replicas.py``) and read back at start:

* a match master's ``subscription`` table: subscription id -> :class:`SubscriptionRecord`;
* a routing master's ``routing_table``: event type -> :class:`LatencyEntry` (latencyMap).

Every entry is stored with a version (``Versioned``); a deleted one as ``TOMBSTONE``.
Roles, the bench's store seeding and the tests build and read documents through these
records only, so a field added here reaches every place that writes or reads one.

``from_document`` accepts what older versions wrote (no ``confirm``, ``home`` or
``path``), and raises :class:`RecordError` (a ``ValueError``) for a document no version
wrote: the role logs and leaves that one entry out rather than stopping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidArgument

__all__ = ["LatencyEntry", "RecordError", "SubscriptionRecord"]


class RecordError(InvalidArgument):
    """A persisted document that is not a record of its table."""


@dataclass(frozen=True, slots=True)
class SubscriptionRecord:
    """One subscription as its match master (and each of its slaves) holds it."""

    event_type: str
    filter: list[Any]
    queue: str
    latency_level: int = 1
    confirm: str = "broker"  # "broker" or "e2e"
    home: str | None = None  # the subscriber's cluster (None: the owner's, before homes)
    #: the routing masters that counted its latency level (an unsubscribe reaches them)
    path: list[str] = field(default_factory=list)

    def to_document(self) -> dict[str, Any]:
        return {
            "event_type": self.event_type,
            "filter": self.filter,
            "queue": self.queue,
            "latency_level": self.latency_level,
            "confirm": self.confirm,
            "home": self.home,
            "path": list(self.path),
        }

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> SubscriptionRecord:
        try:
            event_type, queue = document["event_type"], document["queue"]
            flt = document["filter"]
        except (KeyError, TypeError) as exc:
            raise RecordError(f"subscription document without {exc}") from None
        level = document.get("latency_level", 1)
        confirm = document.get("confirm") or "broker"
        home, path = document.get("home"), document.get("path") or []
        if not isinstance(event_type, str) or not isinstance(queue, str):
            raise RecordError("subscription document: event_type and queue must be strings")
        if not isinstance(flt, list):
            raise RecordError("subscription document: filter must be a list of predicates")
        if isinstance(level, bool) or not isinstance(level, int):
            raise RecordError(f"subscription document: latency_level {level!r} is not an int")
        if confirm not in ("broker", "e2e"):
            raise RecordError(f"subscription document: confirm {confirm!r}")
        if home is not None and not isinstance(home, str):
            raise RecordError(f"subscription document: home {home!r}")
        if not isinstance(path, list) or not all(isinstance(c, str) for c in path):
            raise RecordError(f"subscription document: path {path!r}")
        return cls(event_type, flt, queue, level, confirm, home, list(path))

    def homed(self, owner: str) -> str:
        """The subscriber's cluster (the owner's for records kept before homes were)."""
        return self.home or owner


@dataclass(frozen=True, slots=True)
class LatencyEntry:
    """One latencyMap entry: the sum and count of the latency levels of one event type's
    subscriptions whose path crossed this routing master."""

    level_sum: int
    count: int

    def to_document(self) -> dict[str, Any]:
        return {"level_sum": self.level_sum, "count": self.count}

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> LatencyEntry:
        try:
            return cls(int(document["level_sum"]), int(document["count"]))
        except (KeyError, TypeError, ValueError) as exc:
            # (not ``dict(document)``: a document that is no mapping would raise here)
            raise RecordError(f"routing-table document {document!r}: {exc}") from None

    @classmethod
    def of(cls, entry: tuple[int, int] | None) -> LatencyEntry | None:
        """From a ``LatencyMap`` entry (None: the type has no subscription left)."""
        return None if entry is None else cls(*entry)
