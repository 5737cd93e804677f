"""A match broker's subscription registry (paper 000): pure logic, no I/O.

The records a match master (or one of its slaves) holds, the index per event type that
matches events against them, where each matched event goes (one copy per subscriber
queue on its home cluster's RabbitMQ, confirmed end to end if any of its subscriptions
asked so), which records an arc handed to a joining cluster carries, and subscriptions
restored from a departed cluster, indexed lazily (one type when its first event comes,
or when the driver's background pass reaches it).

The role's driver (``match_roles``) persists, replicates, sends and logs; the
registry only says what is held and where things go.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .matching import Filter, FilterError, SubscriptionIndex
from .records import RecordError, SubscriptionRecord

__all__ = ["Copies", "Registry"]


@dataclass(frozen=True, slots=True)
class Copies:
    """Where one matched event goes."""

    #: (home cluster, subscriber queue) -> "broker" or "e2e", in a stable order
    queues: dict[tuple[str, str], str]
    #: the queues whose home cluster left the ring: dead-lettered with why, not dropped
    departed: list[str]


class Registry:
    """Subscriptions by id, indexed per event type."""

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster  # the owner's: the home of records kept before homes were
        self.records: dict[str, SubscriptionRecord] = {}
        self._indexes: dict[str, SubscriptionIndex] = {}
        self._indexed: set[str] = set()
        #: restored, not indexed yet: event type -> {subscription id: record}
        self.unindexed: dict[str, dict[str, SubscriptionRecord]] = {}

    def __len__(self) -> int:
        return len(self.records)

    def __contains__(self, sid: object) -> bool:
        return sid in self.records

    def get(self, sid: str) -> SubscriptionRecord | None:
        return self.records.get(sid)

    def add(self, sid: str, record: SubscriptionRecord) -> None:
        """Hold and index ``record`` (replacing the one ``sid`` had); a filter the index
        cannot hold raises :class:`FilterError` before anything changes."""
        flt = Filter.parse(record.filter)
        self.remove(sid)
        self._indexes.setdefault(record.event_type, SubscriptionIndex()).add(sid, flt)
        self._indexed.add(sid)
        self.records[sid] = record

    def hold(self, sid: str, document: Mapping[str, Any]) -> str | None:
        """``add`` a stored or replicated document; the reason it cannot be held (a
        document an older version kept, a filter the index refuses), or None."""
        try:
            self.add(sid, SubscriptionRecord.from_document(document))
        except (FilterError, RecordError) as exc:
            return str(exc)
        return None

    def remove(self, sid: str) -> SubscriptionRecord | None:
        """Forget ``sid``; what it held, or None."""
        record = self.records.pop(sid, None)
        if record is None or sid not in self._indexed:
            return record
        self._indexed.discard(sid)
        index = self._indexes[record.event_type]
        index.remove(sid)
        if not len(index):
            del self._indexes[record.event_type]
        return record

    def match(self, event_type: str, attributes: Mapping[str, Any]) -> set[str]:
        """The subscriptions an event matches (its type indexed first if restored)."""
        if event_type in self.unindexed:
            self.index_type(event_type)
        index = self._indexes.get(event_type)
        return index.match(attributes) if index else set()

    def copies(self, matched: Collection[str], departed: Collection[str]) -> Copies:
        """One copy per (home, queue), e2e if any matched subscription of it asked so."""
        queues: dict[tuple[str, str], str] = {}
        for sid in matched:
            record = self.records[sid]
            where = (record.homed(self.cluster), record.queue)
            if queues.get(where) != "e2e":
                queues[where] = record.confirm
        gone = sorted(f"{queue} (cluster {home})" for home, queue in queues if home in departed)
        kept = {k: queues[k] for k in sorted(queues) if k[0] not in departed}
        return Copies(kept, gone)

    def in_arc(self, covers: Callable[[str], bool]) -> list[tuple[str, SubscriptionRecord]]:
        """The records whose event type ``covers`` says an arc holds."""
        return [(sid, r) for sid, r in self.records.items() if covers(r.event_type)]

    def restore(
        self, by_type: Mapping[str, Mapping[str, Mapping[str, Any]]]
    ) -> tuple[dict[str, dict[str, Any]], list[str]]:
        """Subscriptions of a departed cluster (event type -> {sid: document}): held from
        now on, each type indexed when ``match`` or ``index_type`` reaches it.  Returns
        the documents newly held (to persist as the owner's own) and why others were not
        (a document no version wrote; an id already held here keeps its record)."""
        found: dict[str, dict[str, Any]] = {}
        refused: list[str] = []
        for event_type, documents in by_type.items():
            for sid, document in documents.items():
                if sid in self.records:
                    continue
                try:
                    record = SubscriptionRecord.from_document(document)
                except RecordError as exc:
                    refused.append(f"{sid}: {exc}")
                    continue
                self.records[sid] = record
                self.unindexed.setdefault(event_type, {})[sid] = record
                found[sid] = dict(document)
        return found, refused

    def index_type(self, event_type: str) -> list[str]:
        """Index the restored records of one type still held as restored (not replaced
        or removed meanwhile); why any could not be."""
        return self.index_some(event_type, None)

    def index_some(self, event_type: str, limit: int | None) -> list[str]:
        """``index_type`` for at most ``limit`` of the type's restored records (None:
        all); the others stay restored, for the next call or ``match``.  A background
        indexer takes small steps, so the events it runs beside wait milliseconds, not
        a whole type's indexing (~70 ms for 6 700 subscriptions here)."""
        pending = self.unindexed.get(event_type)
        if pending is None:
            return []
        refused: list[str] = []
        count = len(pending) if limit is None else min(limit, len(pending))
        for _ in range(count):
            sid, record = pending.popitem()
            if self.records.get(sid) is record and sid not in self._indexed:
                try:
                    flt = Filter.parse(record.filter)
                except FilterError as exc:
                    del self.records[sid]
                    refused.append(f"{sid}: {exc}")
                    continue
                self._indexes.setdefault(event_type, SubscriptionIndex()).add(sid, flt)
                self._indexed.add(sid)
        if not pending:
            del self.unindexed[event_type]
        return refused

    def types(self) -> Iterator[str]:
        """The event types with indexed subscriptions."""
        return iter(self._indexes)
