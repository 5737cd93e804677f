"""Phoenix messages from one role to another (pure): replication, beats, elections and
fences, load reports, joins, hand-overs, links, leaves and restores, receipts.  Parsed
and encoded through ``messages.py`` (one union of every kind).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from ..phoenix.protocol import Kind
from ..recovery import flood as flooding
from .message_base import Cluster as _Cluster
from .message_base import Finite as _Finite
from .message_base import WireMessage as _Message


class Heartbeat(_Message):
    """Match slave -> its master's control queue: what predicting its T needs."""

    kind: Literal[Kind.HEARTBEAT] = Kind.HEARTBEAT
    broker: str  # the sender's owner id
    predicted_t: _Finite
    queue: _Finite  # events waiting
    service_rate: _Finite  # events per busy second


class Join(_Message):
    kind: Literal[Kind.JOIN] = Kind.JOIN
    cluster: str  # the cluster that joins the ring


class Handover(_Message):
    """Routing master -> its match masters: move the arc's subscriptions to ``cluster``."""

    kind: Literal[Kind.HANDOVER] = Kind.HANDOVER
    cluster: str
    arc: tuple[int, int]  # ring interval (start, end]
    #: when set, answer :class:`Recovered` (``request``, how many moved) to ``reply_to``
    #: once handed over: the router then retires the masters a take-over had added
    request: str | None = Field(None, min_length=1, max_length=200)
    reply_to: str | None = Field(None, min_length=1)


class Replicate(_Message):
    """Master -> slave: one versioned entry of a table (or a tombstone)."""

    kind: Literal[Kind.REPLICATE] = Kind.REPLICATE
    state_kind: str  # routing_table, subscription
    key: str = Field(min_length=1)
    version: int = Field(ge=1)
    table: dict[str, Any]  # the entry's document
    #: the writing master's process queue, where the ack goes (None: its control queue);
    #: two processes may consume the control queue while one is frozen and replaced
    reply_to: str | None = None


class Ack(_Message):
    """Slave -> its master's control queue: the replica entry is stored."""

    kind: Literal[Kind.ACK] = Kind.ACK
    broker: str
    version: int = Field(ge=1)
    key: str | None = None


class Read(_Message):
    """Master -> slave: send me your replica of ``state_kind`` (a quorum read)."""

    kind: Literal[Kind.READ] = Kind.READ
    request: str
    state_kind: str
    reply_to: str  # the reading master's process queue


class Snapshot(_Message):
    """Slave -> master's control queue: a page of its replica, answering ``request``."""

    kind: Literal[Kind.SNAPSHOT] = Kind.SNAPSHOT
    request: str
    state_kind: str
    broker: str
    entries: dict[str, tuple[int, dict[str, Any]]] = Field(default_factory=dict)
    last: bool = False


class Configure(_Message):
    """Operator -> masters' control queues: switch mechanisms live."""

    kind: Literal[Kind.CONFIGURE] = Kind.CONFIGURE
    switches: dict[str, Any]
    request: str | None = None
    reply_to: str | None = None  # the operator's queue, answered with :class:`Answer`


class Takeover(_Message):
    """-> a slave's control queue: serve your master's role (``master``, its owner id)."""

    kind: Literal[Kind.TAKEOVER] = Kind.TAKEOVER
    master: str
    request: str | None = None
    reply_to: str | None = None


class Beat(_Message):
    """Every heartbeat interval, both ways: master -> each of its slaves' control queues
    (its reign, and its process queue for a FENCE), slave -> its master's control queue
    (the reign it trusts and the newest replica version it holds, for its catch-up)."""

    kind: Literal[Kind.BEAT] = Kind.BEAT
    broker: str  # the sender's owner id
    epoch: int = Field(0, ge=0)  # the master's reign (recovery/fencing.py)
    by: int = Field(0, le=0)
    reply_to: str | None = None  # a master's process queue
    version: int | None = Field(None, ge=0)  # a slave's newest replica entry
    lease: str | None = None  # the sender's lease queue (routing/beats.py)
    #: the sender beats slowly while it has nothing to do: its next beat comes within
    #: this many seconds (``quiet_beat_interval_s``); None: at its usual interval
    next_s: float | None = Field(None, gt=0, le=60)


class Vote(_Message):
    """Between one master's slaves: the bully election (election, answer, coordinator);
    a COORDINATOR carries the winner's reign."""

    kind: Literal[Kind.ELECTION, Kind.ELECTION_ANSWER, Kind.COORDINATOR]
    broker: str  # the sender's owner id
    epoch: int = Field(0, ge=0)
    by: int = Field(0, le=0)


class Fence(_Message):
    """A slave -> the process queue of a master whose reign is older than the one it
    trusts: step down (to the slave role given by ``by``, or the one it left)."""

    kind: Literal[Kind.FENCE] = Kind.FENCE
    broker: str  # the slave that saw the stale beat
    epoch: int = Field(ge=0)  # the reign it trusts
    by: int = Field(le=0)


class Retire(_Message):
    """A master -> the process queue of a second process beating as one of its slaves
    (a scheduler started a replacement while the first was frozen, not dead): another
    process serves that slave role now; stop."""

    kind: Literal[Kind.RETIRE] = Kind.RETIRE
    broker: str  # the master's owner id
    slave: str  # the slave role's owner id
    epoch: int = Field(0, ge=0)  # the master's reign
    by: int = Field(0, le=0)


class Answer(_Message):
    """A role -> an operator: ``request`` (configure, take-over) is done by ``broker``."""

    kind: Literal[Kind.ANSWER] = Kind.ANSWER
    request: str | None = None
    broker: str


class Confirmation(_Message):
    """Owner's match master -> a client: its (un)subscribe's outcome once W of N hold it."""

    kind: Literal[Kind.CONFIRMATION] = Kind.CONFIRMATION
    subscription_id: str
    event_type: str
    broker: str
    outcome: dict[str, Any] = Field(default_factory=dict)  # removed / error / refused

    @field_validator("outcome")
    @classmethod
    def _known(cls, value: dict[str, Any]) -> dict[str, Any]:
        unknown = set(value) - {"removed", "error", "refused"}
        if unknown:
            raise ValueError(f"unknown outcome fields {sorted(unknown)}")
        return value


class Probe(_Message):
    """The bounded flood (recovery/flood.py): routing master -> routing masters' control
    queues, looking for a way to ``target``."""

    kind: Literal[Kind.PROBE] = Kind.PROBE
    flood: str = Field(min_length=1, max_length=200)
    origin: _Cluster
    target: _Cluster
    path: list[_Cluster] = Field(min_length=1, max_length=64)  # origin first, sender last
    ttl: int = Field(ge=0, le=64)

    @model_validator(mode="after")
    def _from_its_origin(self) -> Probe:
        if self.path[0] != self.origin:
            raise ValueError("a probe's path starts at its origin")
        return self

    @classmethod
    def of(cls, probe: flooding.Probe) -> Probe:
        return cls(
            flood=probe.flood,
            origin=probe.origin,
            target=probe.target,
            path=list(probe.path),
            ttl=probe.ttl,
        )

    def to_flood(self) -> flooding.Probe:
        return flooding.Probe(self.flood, self.origin, self.target, tuple(self.path), self.ttl)


class Found(_Message):
    """The flood's target answered: back along the probe's path to its origin."""

    kind: Literal[Kind.FOUND] = Kind.FOUND
    flood: str = Field(min_length=1, max_length=200)
    origin: _Cluster
    target: _Cluster
    path: list[_Cluster] = Field(min_length=1, max_length=64)
    by: Literal["master", "slave"]
    at: int = Field(ge=0, le=63)  # the index in ``path`` this FOUND is addressed to

    @model_validator(mode="after")
    def _on_its_path(self) -> Found:
        if self.at >= len(self.path) or self.path[0] != self.origin:
            raise ValueError("at must index the path, which starts at the origin")
        return self

    @classmethod
    def of(cls, found: flooding.Found) -> Found:
        return cls(
            flood=found.flood,
            origin=found.origin,
            target=found.target,
            path=list(found.path),
            by="slave" if found.by == "slave" else "master",
            at=found.at,
        )

    def to_flood(self) -> flooding.Found:
        path = tuple(self.path)
        return flooding.Found(self.flood, self.origin, self.target, path, self.by, self.at)


class Leave(_Message):
    """A routing master -> every routing master's control queue (and each to its match
    roles): ``cluster`` left the ring (no flood reached it for ``leave_after_s``)."""

    kind: Literal[Kind.LEAVE] = Kind.LEAVE
    cluster: _Cluster
    by: _Cluster  # the routing master that found it gone


class Recover(_Message):
    """The departed cluster's successor's routing master -> its match masters' control
    queues: restore the departed match masters' subscriptions of ``arc`` that route to
    you, from the persisted state, then answer :class:`Recovered`."""

    kind: Literal[Kind.RECOVER] = Kind.RECOVER
    cluster: _Cluster  # the departed cluster
    arc: tuple[int, int]  # ring interval (start, end] it owned
    masters: int = Field(ge=1, le=16)  # its match masters (whose stores to read)
    request: str = Field(min_length=1, max_length=200)
    reply_to: str = Field(min_length=1)  # the router's process queue
    #: the capacity plan's (recovery/capacity.py): the departed match masters' store
    #: owners this master reads (empty: all ``masters``), and over how many of the
    #: successor's masters the arc's types are routed (SHA-1 % it; 0: the topology's)
    owners: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=16
    )
    routed_over: int = Field(0, ge=0, le=16)
    #: the departed cluster is only suspected (a flood found no way): read its state
    #: now and keep it ready, answer nothing (the leave's RECOVER then finds it read)
    prepare: bool = False


class Recovered(_Message):
    """A match master -> the recovering router: ``request`` done, ``restored`` held now
    (or, answering a :class:`Handover` that asked, how many subscriptions moved)."""

    kind: Literal[Kind.RECOVERED] = Kind.RECOVERED
    request: str = Field(min_length=1, max_length=200)
    broker: str
    restored: int = Field(ge=0)


class HandedOver(_Message):
    """The previous owner's routing master -> the joining cluster's routing master's
    control queue: every subscription of the arc it took was sent (``count``, to that
    control queue, before this): the joiner stops holding the arc's events once it has
    routed them all.  No ``count``: still under way (its match masters have not all
    answered): the joiner's bound runs again from now."""

    kind: Literal[Kind.HANDED_OVER] = Kind.HANDED_OVER
    cluster: _Cluster  # the joiner
    by: _Cluster  # the previous owner
    count: int | None = Field(None, ge=0)


class Matched(_Message):
    """The owner cluster's match master or slave -> the entry router's control queue:
    the events of these ids were matched and their copies confirmed; the entry router
    stops keeping them (it routes what it keeps again if their owner leaves the ring)."""

    kind: Literal[Kind.MATCHED] = Kind.MATCHED
    by: _Cluster  # the owner cluster
    ids: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(max_length=4096)
