"""A routing master's logic (paper 000): ring forwarding and latencyMap, without I/O.

For each routed message (a publish, a subscription, an unsubscription, an
advertisement) :meth:`RouterLogic.accept` decides what the routing master does before
it passes the message on: give it the id it keeps however often it is sent again, drop
one the owner already routed (sent again over a detour after its first confirm was lost
with a link), fix a subscription's home cluster, count or take out a latency level and
say which latencyMap entry to write (``WriteEntry``), and stamp the hop and the
priority.  :meth:`RouterLogic.step` then says where it goes: ``Forward`` to the next
cluster on the ring (fingers), or a ``Send`` to the inbox of the match master the
routing table names at the owner.  :meth:`RouterLogic.relay` follows a detour's path.
:meth:`RouterLogic.forget` takes back an id whose send to the match master failed, so
the message is routed when it comes again.

The driver (``router_roles.RouterMaster``) persists and replicates entries, sends, waits for
an arc being restored, and asks ``step`` again when a next hop left the ring meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import DeadLetter
from ..phoenix.effects import Box, Send
from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..phoenix.ring import ChordRing, Handover, master_index
from ..unique import random_hex
from .messages import Copy, Publish, RoutedMessage, Subscribe, Unsubscribe, Unsubscribed
from .records import LatencyEntry, RecordError
from .timeliness import LatencyMap

__all__ = ["TO_MATCH", "Forward", "KeptEvents", "RouterLogic", "WriteEntry"]

#: what a ``Send`` to the match master at the owner says to come back to (with the id)
TO_MATCH = "to-match"


@dataclass(frozen=True, slots=True)
class WriteEntry:
    """Persist and replicate the latencyMap entry of ``event_type`` (None: delete it)."""

    event_type: str
    entry: LatencyEntry | None


@dataclass(frozen=True, slots=True)
class Forward:
    """Send ``message`` to ``cluster``'s routing master with ``priority``."""

    cluster: str
    message: RoutedMessage | Copy
    priority: int


class RouterLogic:
    """One routing master's ring position, latencyMap and recently routed ids."""

    KEEP_IDS = 100_000  # ids an owner remembers to drop a message routed twice

    def __init__(
        self,
        cluster: str,
        topology: PhoenixTopology,
        ring: ChordRing,
        *,
        new_id: Callable[[], str] = lambda: random_hex(8),
        keep_ids: int = KEEP_IDS,
    ) -> None:
        self.cluster, self.topology, self.ring = cluster, topology, ring
        self.latency = LatencyMap()
        self.new_id, self.keep_ids = new_id, keep_ids
        self._routed: OrderedDict[str, None] = OrderedDict()
        #: arcs this router took over from departed clusters: departed -> (arc, P), the
        #: arc's types routed to match master SHA-1 % P (the capacity plan's)
        self.adopted: dict[str, tuple[Handover, int]] = {}

    def masters_for(self, event_type: str) -> int:
        """Over how many of this cluster's match masters ``event_type`` is routed: the
        topology's, or a take-over's P for the types of an adopted arc."""
        for arc, masters in self.adopted.values():
            if arc.covers(event_type):
                return masters
        return self.topology.cluster(self.cluster).match_masters

    def load(self, table: Mapping[str, tuple[int, Mapping[str, Any]]]) -> list[str]:
        """The routing table read back (event type -> (version, document)); why any
        entry was left out (a document no version wrote)."""
        refused = []
        for event_type, (_, document) in table.items():
            try:
                entry = LatencyEntry.from_document(document)
            except RecordError as exc:
                refused.append(f"{event_type}: {exc}")
                continue
            self.latency.entries[event_type] = (entry.level_sum, entry.count)
        return refused

    def take_entries(self, entries: Mapping[str, LatencyEntry]) -> None:
        """A departed owner's entries of its arc, counted here from now (they replace
        what this router counted: the owner had seen every subscription of its types)."""
        for event_type, entry in entries.items():
            self.latency.entries[event_type] = (entry.level_sum, entry.count)

    def priority(self, message: RoutedMessage | Copy) -> int:
        """The latency level's priority: the highest any router on the path knows."""
        if not self.topology.outer:
            return 0
        return max(message.priority, self.latency.priority(message.event_type))

    def accept(
        self, message: RoutedMessage, entered_at: float | None = None
    ) -> tuple[list[WriteEntry], RoutedMessage | None]:
        """What to write, and the message to pass on (None: it ends here: a duplicate
        the owner routed already, or an unsubscription's latency level taken out).
        ``entered_at``: an event's entry into the ring (stamped here, with the rest:
        one copy of the message per hop)."""
        et = message.event_type
        update: dict[str, Any] = {}
        if message.id is None:  # one id from here on, however often it is sent again
            update["id"] = self.new_id()
        elif self.ring.owner(et) == self.cluster and self._routed_before(message.id):
            return [], None
        if entered_at is not None:
            update["entered_at"] = entered_at
        if isinstance(message, Subscribe | Unsubscribe):
            message = self._homed(message)
        writes: list[WriteEntry] = []
        if isinstance(message, Subscribe):
            self.latency.add(et, message.latency_level)
        elif isinstance(message, Unsubscribed):
            self.latency.remove(et, message.latency_level)
        if isinstance(message, Subscribe | Unsubscribed):
            writes.append(WriteEntry(et, LatencyEntry.of(self.latency.entries.get(et))))
            if isinstance(message, Unsubscribed):
                return writes, None
        update["hops"] = [*message.hops, self.cluster]
        update["priority"] = self.priority(message)
        return writes, message.model_copy(update=update)

    def step(self, message: RoutedMessage) -> Forward | Send:
        """The next hop on the ring now, or the send to the match master at the owner."""
        et = message.event_type
        if self.ring.owner(et) != self.cluster:
            return Forward(self.ring.route(self.cluster, et)[1], message, message.priority)
        # the routing table: SHA-1 of the event type over the cluster's match masters
        # (over a take-over's P for an adopted arc's types)
        match = RoleId.match(self.cluster, master_index(et, self.masters_for(et)))
        # how the send ends comes back (``Forwarding.to_match``): a message not sent is
        # no longer one this router routed (the owner's id check must not drop it again)
        return Send(match, message, Box.INBOX, message.priority, then=(TO_MATCH, message.id))

    def relay(self, message: RoutedMessage | Copy) -> Forward | RoutedMessage | Copy:
        """A message on a detour: ``Forward`` to the next hop of its path, or the message
        to route from here (the path named this cluster)."""
        hop, rest = message.via[0], message.via[1:]
        if hop not in {c.id for c in self.topology.clusters}:
            raise DeadLetter(f"{message.kind.value}: detour hop {hop!r} is not in the topology")
        onward = message.model_copy(update={"via": rest})
        if hop == self.cluster:
            return onward
        return Forward(hop, onward, message.priority)

    def forget(self, message_id: str) -> None:
        """``message_id`` was not routed after all (its send to the match master failed):
        when it comes again (the inbox gives it back, the entry router sends it again)
        it is routed, not dropped as a duplicate."""
        self._routed.pop(message_id, None)

    def _routed_before(self, message_id: str) -> bool:
        if message_id in self._routed:
            return True
        self._routed[message_id] = None
        if len(self._routed) > self.keep_ids:
            self._routed.popitem(last=False)
        return False

    def _homed(self, subscription: Subscribe | Unsubscribe) -> Subscribe | Unsubscribe:
        """The subscriber's cluster, where deliveries and confirmations go: the entry
        router's when unsaid."""
        home = subscription.home
        if home is None:
            home = subscription.hops[0] if subscription.hops else self.cluster
        if home not in {c.id for c in self.topology.clusters}:
            raise DeadLetter(
                f"{subscription.kind.value}: home cluster {home!r} is not in the topology"
            )
        return subscription.model_copy(update={"home": home})


class KeptEvents:
    """The events that entered the ring at this router and left for another cluster,
    kept until their owner says they were matched (``Matched``); if the owner leaves the
    ring first, what waited in its inboxes went with its RabbitMQ, and :meth:`left`
    gives them back to be routed again. Kept at most ``keep_s`` (oldest first), so a
    lost ``Matched`` costs memory only that long."""

    def __init__(self, cluster: str, keep_s: float) -> None:
        self.cluster, self.keep_s = cluster, keep_s
        #: id -> (when kept, owner, the clusters it passes on the way, the event)
        self._kept: OrderedDict[str, tuple[float, str, frozenset[str], Publish]] = OrderedDict()
        self.expired = 0

    def __len__(self) -> int:
        return len(self._kept)

    def keep(
        self, message: RoutedMessage, owner: str, now: float, through: Iterable[str] = ()
    ) -> bool:
        """Keep ``message`` (stamped here, sent toward ``owner`` over the clusters
        ``through``: a detour's hops, the ring's) if it is an event that entered the ring
        here; whether it was kept."""
        if not isinstance(message, Publish) or message.id is None:
            return False
        if message.hops != [self.cluster] or owner == self.cluster:
            return False  # passing through, or matched here: not this router's to keep
        passes = frozenset(through) - {self.cluster, owner}
        self._kept[message.id] = (now, owner, passes, message)
        self._kept.move_to_end(message.id)
        while self._kept:
            oldest, (since, _, _, _) = next(iter(self._kept.items()))
            if since > now - self.keep_s:
                break
            del self._kept[oldest]
            self.expired += 1
        return True

    def matched(self, ids: list[str]) -> int:
        """The owner matched these: not kept any longer; how many were kept."""
        return sum(self._kept.pop(i, None) is not None for i in ids)

    def left(self, cluster: str) -> list[Publish]:
        """``cluster`` left the ring: the events kept for it, or that passed it on their
        way (a detour's hop, a ring hop: they may have been in its inbox), to route again
        (ids kept, hops cleared: the new owner matches each once, an e2e subscriber drops
        a copy delivered before)."""
        again = [
            m
            for _, owner, passes, m in self._kept.values()
            if cluster in passes or owner == cluster
        ]
        for message in again:
            assert message.id is not None
            del self._kept[message.id]
        return [m.model_copy(update={"hops": [], "via": [], "again": True}) for m in again]
