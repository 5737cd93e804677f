"""Replica quorums (paper 000: replicas on slaves managed by quorum consensus): pure logic.

A write is durable once W of the N replicas acknowledged it; a read asks R replicas
and keeps the newest version.  W + R > N makes every read set meet every write set,
so a read always sees the latest acknowledged write.

:class:`ReplicaLog` is a master's side of one replicated table as a state machine: it
takes writes, acks, snapshot pages and admissions and returns what to do (``Persist``
an entry, ``Send`` a message to a replica's inbox, ahead of any event backlog there,
or behind it for a write that must not overtake the events already dispatched to the
replica (``write(..., behind=True)``), resolve a version as ``Written`` or ``GaveUp`` on
it).  The role's driver
(``replica_set.ReplicaSet``) does the I/O and keeps the futures.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import DeadLetter
from ..phoenix.effects import Box, Send
from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY
from .messages import Ack, Heartbeat, Read, Replicate, Snapshot

__all__ = [
    "TOMBSTONE",
    "GaveUp",
    "Persist",
    "Quorum",
    "ReadResult",
    "ReplicaLog",
    "Send",
    "Versioned",
    "Written",
    "live",
    "merge_replicas",
]

#: A deleted entry is written as this document (with a new version), so a replica
#: that missed the delete cannot bring the entry back at the next quorum read.
TOMBSTONE: dict[str, Any] = {"_deleted": True}
Entries = Mapping[str, tuple[int, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Versioned:
    version: int
    value: Any


@dataclass(frozen=True, slots=True)
class Quorum:
    replicas: int
    write: int
    read: int

    def __post_init__(self) -> None:
        if not 1 <= self.write <= self.replicas or not 1 <= self.read <= self.replicas:
            raise ValueError(
                f"need 1 <= W, R <= N; got N={self.replicas} W={self.write} R={self.read}"
            )
        if self.write + self.read <= self.replicas:
            raise ValueError(
                f"W + R must exceed N so reads meet writes; got N={self.replicas} "
                f"W={self.write} R={self.read}"
            )

    @classmethod
    def majority(cls, replicas: int) -> Quorum:
        w = replicas // 2 + 1
        return cls(replicas, w, replicas - w + 1)

    def written(self, acknowledged: Iterable[str]) -> bool:
        """True once W distinct replicas acknowledged the write."""
        return len(set(acknowledged)) >= self.write

    def resolve(self, responses: Mapping[str, Versioned | None]) -> Versioned | None:
        """The newest value among at least R replies (None = the replica has no copy)."""
        if len(responses) < self.read:
            raise ValueError(f"a read needs {self.read} replies, got {len(responses)}")
        present = [v for v in responses.values() if v is not None]
        return max(present, key=lambda v: v.version, default=None)


def merge_replicas(
    replies: Sequence[Entries], *, at_least: int
) -> dict[str, tuple[int, dict[str, Any]]]:
    """A read of whole tables: per key, the newest version among ``at_least`` (R) replies.

    Tombstones are kept (``live`` drops them), so the caller can repair its own copy.
    """
    if len(replies) < at_least:
        raise ValueError(f"a read needs {at_least} replies, got {len(replies)}")
    merged: dict[str, tuple[int, dict[str, Any]]] = {}
    for reply in replies:
        for key, (version, document) in reply.items():
            if key not in merged or version > merged[key][0]:
                merged[key] = (version, document)
    return merged


def live(entries: Entries) -> dict[str, tuple[int, dict[str, Any]]]:
    """The entries that are not tombstones."""
    return {k: (v, d) for k, (v, d) in entries.items() if d != TOMBSTONE}


@dataclass(frozen=True, slots=True)
class Persist:
    """Save this entry in the master's own copy (the store keeps the newest version)."""

    key: str
    version: int
    document: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Written:
    """W of N replicas hold ``version``: it is durable."""

    version: int


@dataclass(frozen=True, slots=True)
class GaveUp:
    """``version`` is no longer waited for (too many writes below W: slaves silent)."""

    version: int


Effect = Persist | Send | Written | GaveUp


@dataclass(slots=True)
class _Read:
    pages: dict[str, dict[str, tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    first: Entries = field(default_factory=dict)  # the master's own reply


@dataclass(frozen=True, slots=True)
class ReadResult:
    entries: dict[str, tuple[int, dict[str, Any]]]  # live: tombstones dropped
    repairs: list[Persist]  # entries the master's own copy was behind on
    replies: int  # how many replicas answered, the master's own copy included
    degraded: bool  # fewer than R answered: started from what did


MASTER = "master"  # how the master's own copy acknowledges a write


@dataclass(slots=True)
class _Owed:
    """A write some replicas have not acknowledged yet, kept beyond W for ``owing`` (by
    its ``tag``) or for the order of a key written ``behind`` the events."""

    tag: Hashable
    key: str | None  # set when it was sent behind the events
    replicas: set[RoleId]


class ReplicaLog:
    """A master's replicated table: versions, entries, writes waiting for W acks, reads
    collecting R replies.  No I/O: every method returns the effects to carry out.

    ``replicas`` are the slaves it replicates to (the topology's, less the one it was
    promoted from); ``n`` is N as the topology has it (slaves + 1), so that a promoted
    master's read still needs R of those N and meets every write W of them acknowledged.
    """

    MAX_PENDING = 100_000  # writes waiting for W acks before the oldest are given up

    def __init__(
        self,
        *,
        owner: str,
        kind: str,
        replicas: Iterable[RoleId],
        n: int,
        reply_to: str,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self.owner, self.kind, self.reply_to = owner, kind, reply_to
        self.replicas = list(replicas)
        self.quorum = Quorum.majority(n)
        self.max_pending = max_pending
        self.version = 0
        self.entries: dict[str, tuple[int, dict[str, Any]]] = {}  # tombstones included
        self.pending: dict[int, set[str]] = {}  # version -> replicas that acked it
        #: versions some replica has not acknowledged yet, beyond W, of tagged writes
        #: and writes sent behind the events; each tag's versions (``owing``) and each
        #: key's versions sent behind (a later write of the key goes behind them too)
        self.unacked: dict[int, _Owed] = {}
        self._tagged: dict[Hashable, set[int]] = {}
        self._behind: dict[Hashable, set[int]] = {}
        self.reads: dict[str, _Read] = {}

    @property
    def names(self) -> list[str]:
        """How the replicas sign acks, snapshots and heartbeats."""
        return [r.owner for r in self.replicas]

    def _replicate(self, key: str, version: int, document: dict[str, Any]) -> Replicate:
        return Replicate(
            key=key, state_kind=self.kind, version=version, table=document, reply_to=self.reply_to
        )

    def write(
        self,
        key: str,
        document: dict[str, Any] | None,
        tag: Hashable = None,
        *,
        behind: bool = False,
    ) -> tuple[int, list[Effect]]:
        """One entry (None: delete, as a tombstone): its version and the effects, in
        order: persist it here, resolve or give up versions, replicate it.  With a
        ``tag``, :meth:`owing` names the replicas that have not acknowledged it yet.
        ``behind``: replicated at the lowest priority, behind every event already in
        the replicas' inboxes (a hand-over's tombstone: the events dispatched before it
        were for the subscription); a later write of the key goes behind too while a
        replica owes one sent so, so that the two never swap."""
        self.version += 1
        version, document = self.version, TOMBSTONE if document is None else document
        self.entries[key] = (version, document)
        behind = behind or key in self._behind
        if (tag is not None or behind) and self.replicas:
            self.unacked[version] = _Owed(tag, key if behind else None, set(self.replicas))
            if tag is not None:
                self._tagged.setdefault(tag, set()).add(version)
            if behind:
                self._behind.setdefault(key, set()).add(version)
            while len(self.unacked) > self.max_pending:  # a replica silent for long
                self._settle(next(iter(self.unacked)))
        effects: list[Effect] = [Persist(key, version, document)]
        self.pending[version] = set()
        effects += self.acked(version, MASTER)
        while len(self.pending) > self.max_pending:  # slaves silent for long: stop waiting
            oldest = next(iter(self.pending))  # versions are added in increasing order
            del self.pending[oldest]
            effects.append(GaveUp(oldest))
        entry = self._replicate(key, version, document)
        priority = 0 if behind else MAX_PRIORITY
        effects += [
            Send(replica, entry, box=Box.INBOX, priority=priority) for replica in self.replicas
        ]
        return version, effects

    def owing(self, tag: Hashable) -> set[RoleId]:
        """The replicas that have not acknowledged a write tagged ``tag`` yet."""
        versions = self._tagged.get(tag)
        if not versions:
            return set()
        return set().union(*(self.unacked[v].replicas for v in versions))

    def _settle(self, version: int) -> None:
        owed = self.unacked.pop(version)
        for index, at in ((self._tagged, owed.tag), (self._behind, owed.key)):
            versions = index.get(at)
            if versions is not None:
                versions.discard(version)
                if not versions:
                    del index[at]

    def acked(self, version: int, replica: str) -> list[Written]:
        """``replica`` holds ``version``: ``Written`` once W distinct replicas do (once;
        an ack for a version already written or given up changes nothing)."""
        owed = self.unacked.get(version)
        if owed is not None:
            owed.replicas.difference_update([r for r in owed.replicas if r.owner == replica])
            if not owed.replicas:
                self._settle(version)
        acks = self.pending.get(version)
        if acks is None:
            return []
        acks.add(replica)
        if not self.quorum.written(acks):
            return []
        del self.pending[version]
        return [Written(version)]

    def sender(self, message: Heartbeat | Ack | Snapshot) -> RoleId:
        """The replica that sent ``message``; one the set does not hold (a forged or
        stale sender) is dead-lettered: its ack must not count toward W, its snapshot
        toward R, its heartbeat must not draw events to an inbox nobody serves."""
        for replica in self.replicas:
            if replica.owner == message.broker:
                return replica
        raise DeadLetter(
            f"{message.kind} from {message.broker!r}, not a replica of {self.owner} "
            f"(its replicas: {', '.join(self.names) or 'none'})"
        )

    def on_ack(self, message: Ack) -> list[Written]:
        self.sender(message)
        return self.acked(message.version, message.broker)

    def begin_read(self, request: str, own: Entries, held: Entries | None = None) -> list[Effect]:
        """A quorum read: the master's own copy is the first reply (with ``held``, the
        replica a promoted master held as a slave, merged in); ask every replica for R - 1
        more."""
        first = merge_replicas([held, own], at_least=1) if held is not None else dict(own)
        self.reads[request] = _Read(first=first)
        if self.quorum.read <= 1:
            return []
        ask = Read(request=request, state_kind=self.kind, reply_to=self.reply_to)
        return [Send(replica, ask, box=Box.INBOX) for replica in self.replicas]

    def page(self, message: Snapshot) -> bool:
        """A page of a replica's snapshot; True once the read has R replies (a page for
        a read that ended, or from a replica not in the set, changes nothing)."""
        self.sender(message)
        read = self.reads.get(message.request)
        if read is None:
            return False
        read.pages.setdefault(message.broker, {}).update(message.entries)
        if message.last:
            read.done.add(message.broker)
        return self.complete(message.request)

    def complete(self, request: str) -> bool:
        read = self.reads.get(request)
        return read is not None and 1 + len(read.done) >= self.quorum.read

    def finish_read(self, request: str, own: Entries) -> ReadResult:
        """Merge what answered (newest version per key), take it as the table, and say
        which entries the master's own copy (``own``) must be repaired with."""
        read = self.reads.pop(request)
        replies = [read.first, *(read.pages[b] for b in sorted(read.done))]
        degraded = len(replies) < self.quorum.read
        merged = merge_replicas(replies, at_least=min(len(replies), self.quorum.read))
        for key, (version, document) in self.entries.items():  # written while it read
            if version > merged.get(key, (0, None))[0]:
                merged[key] = (version, document)
        self.version = max([self.version, *(v for v, _ in merged.values())])
        repairs = [
            Persist(key, version, document)
            for key, (version, document) in merged.items()
            if own.get(key, (-1, None))[0] < version
        ]
        self.entries = dict(merged)
        return ReadResult(live(merged), repairs, len(replies), degraded)

    def admit(self, slave: RoleId) -> list[Effect]:
        """Replicate to ``slave`` from now on, after the whole table in version order
        (the version it says it holds is from another reign, not comparable with these).
        Its acks count toward W from the first entry it gets."""
        entries = sorted(self.entries.items(), key=lambda item: item[1][0])
        self.replicas.append(slave)
        return [Send(slave, self._replicate(k, v, d), box=Box.INBOX) for k, (v, d) in entries]

    def adopt(self, documents: Mapping[str, dict[str, Any]]) -> None:
        """Entries taken over from elsewhere (a departed cluster): this master's own from
        now on, each with a new version; persisted by a snapshot, not replicated."""
        for key, document in documents.items():
            self.version += 1
            self.entries[key] = (self.version, document)
