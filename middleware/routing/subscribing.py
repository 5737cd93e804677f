"""A match master's book of subscriptions, without I/O.

The owner's match master takes a client's subscribe and unsubscribe here; the book
decides, the driver (``match_master.MatchMaster``) performs the effects in the order given:

- subscribe: held in the registry (a filter the registry refuses is answered with the
  reason and dead-lettered, :class:`Refuse`), written to the replicas
  (:class:`Persist`: the inbox delivery is acked only once W of N hold it), then the
  client answered once the write is held (:class:`Confirm`);
- unsubscribe: unknown here (or of another type) answered ``removed: False`` at once;
  else forgotten, a tombstone written, counted, and, unless it was a removal handed over
  by the arc's previous owner (whose routers were told then), the routing masters that
  counted its latency level told (an UNSUBSCRIBED ``Send`` to each routing master's
  inbox, one bounded try: one out of reach costs its count, never the unsubscribe; a
  cluster that left counts nothing) before the client hears ``removed: True``.  A
  removal of a subscription restored from a departed cluster is remembered (at most
  ``remember``, the oldest forgotten first): that cluster's own persisted copy would
  match again at its rejoin, so the hand-over carries the removals too
  (``joining.handover_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..phoenix.effects import Box, Count, Refuse, Send
from ..phoenix.ids import RoleId
from .matching import FilterError
from .messages import Subscribe, Unsubscribe, Unsubscribed
from .records import SubscriptionRecord
from .registry import Registry

__all__ = [
    "MAX_REMOVED_ADOPTED",
    "Confirm",
    "Count",
    "Effect",
    "Persist",
    "Refuse",
    "Send",
    "SubscriptionBook",
    "subscription_record",
]

#: removals of departed arcs' subscriptions a match master remembers for the hand-over
MAX_REMOVED_ADOPTED = 100_000


@dataclass(frozen=True, slots=True)
class Persist:
    """Write ``document`` (None: a tombstone) as ``key`` to the replicas; go on once W
    of N hold it (or the write gave up: the client hears that from :class:`Confirm`)."""

    key: str
    document: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Confirm:
    """Confirm the client (if it asked) with ``outcome``; ``after_write``: once the
    :class:`Persist` before it is held (its failure answered instead)."""

    outcome: dict[str, Any]
    after_write: bool


Effect = Persist | Confirm | Send | Count | Refuse


def subscription_record(message: Subscribe) -> SubscriptionRecord:
    return SubscriptionRecord(
        event_type=message.event_type,
        filter=message.filter,
        queue=message.queue,
        latency_level=message.latency_level,
        confirm=message.confirm,
        home=message.home,
        path=message.hops,  # the routing masters that counted its latency level
    )


class SubscriptionBook:
    """The subscriptions a match master keeps, and what their changes take."""

    def __init__(
        self,
        registry: Registry,
        departed: set[str] | None = None,
        *,
        remember: int = MAX_REMOVED_ADOPTED,
        link_timeout_s: float = 1.0,
    ) -> None:
        self.registry = registry
        #: how long the routers' UNSUBSCRIBED may take (the topology's link timeout)
        self.link_timeout_s = link_timeout_s
        #: clusters that left the ring (shared with the delivery: their subscribers'
        #: copies are dead-lettered)
        self.departed: set[str] = set() if departed is None else departed
        #: event types restored from a departed cluster: matched here, never dispatched
        self.local_types: set[str] = set()
        #: removals of restored subscriptions (id -> event type), for the hand-over
        self.removed_adopted: dict[str, str] = {}
        self.remember = remember

    def subscribe(self, message: Subscribe) -> list[Effect]:
        record = subscription_record(message)
        try:
            self.registry.add(message.subscription_id, record)
        except FilterError as exc:  # sent by something other than the layer's client
            return [
                Confirm({"error": str(exc), "refused": "filter"}, after_write=False),
                Refuse(f"subscription {message.subscription_id}: {exc}"),
            ]
        return [
            Persist(message.subscription_id, record.to_document()),
            Confirm({}, after_write=True),
        ]

    def unsubscribe(self, message: Unsubscribe) -> list[Effect]:
        sid = message.subscription_id
        record = self.registry.get(sid)
        if record is None or record.event_type != message.event_type:  # unknown here
            return [Confirm({"removed": False}, after_write=False)]
        self.registry.remove(sid)
        effects: list[Effect] = [Persist(sid, None), Count("unsubscribed")]
        if message.handed_over:  # removed at the previous owner, the routers told then
            return effects
        if record.event_type in self.local_types:
            self.removed_adopted[sid] = record.event_type
            while len(self.removed_adopted) > self.remember:
                del self.removed_adopted[next(iter(self.removed_adopted))]
        taken_out = Unsubscribed(event_type=record.event_type, latency_level=record.latency_level)
        effects += [
            Send(
                RoleId.router(cluster),
                taken_out,
                box=Box.INBOX,
                bound_s=self.link_timeout_s,
                missed="unsubscribed_not_told",
            )
            for cluster in dict.fromkeys(record.path)
            if cluster not in self.departed
        ]
        effects.append(Confirm({"removed": True}, after_write=True))
        return effects

    def left(self, cluster: str) -> None:
        self.departed.add(cluster)

    def joined(self, cluster: str) -> None:
        self.departed.discard(cluster)

    def removal_handed(self, sid: str) -> None:
        self.removed_adopted.pop(sid, None)
