"""One identity per Phoenix role (pure): what it is called everywhere, and its rank.

A role used to be named four ways in strings built and parsed in several places (its
process key ``B/matcher-0-slave-1``, its store owner and signature ``B/match-0/slave-1``,
its inbox ``phoenix.B.match.0.slave.1``, its master's control queue).  :class:`RoleId`
builds each of them and parses each back, so that the roles, the deployment, the bench
and the tests agree by construction; the formats are the ones persisted stores already
hold.  Ids are frozen and ordered; ``rank`` is what an election compares.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .protocol import ClusterSpec, PhoenixTopology

__all__ = ["RoleId", "RoleKind", "role_queues"]

_CLUSTER = r"[A-Za-z0-9_-]{1,64}"  # as ClusterSpec.id


class RoleKind(StrEnum):
    ROUTER = "router"  # routing master
    ROUTER_SLAVE = "router_slave"
    MATCH = "match"  # match master
    MATCH_SLAVE = "match_slave"

    @property
    def is_slave(self) -> bool:
        return self in (RoleKind.ROUTER_SLAVE, RoleKind.MATCH_SLAVE)

    @property
    def master_kind(self) -> RoleKind:
        """The kind this kind replicates (itself for masters): what a promotion makes."""
        return {RoleKind.ROUTER_SLAVE: RoleKind.ROUTER, RoleKind.MATCH_SLAVE: RoleKind.MATCH}.get(
            self, self
        )


_OWNER = re.compile(
    rf"^(?P<cluster>{_CLUSTER})/(?:(?P<router>router)|router-slave-(?P<rslave>\d+)"
    rf"|match-(?P<index>\d+)(?:/slave-(?P<mslave>\d+))?)$"
)
_KEY = re.compile(
    rf"^(?P<cluster>{_CLUSTER})/(?:(?P<router>router)|router-slave-(?P<rslave>\d+)"
    rf"|matcher-(?P<index>\d+)(?:-slave-(?P<mslave>\d+))?)$"
)


#: per kind: its store owner, its process key, its inbox after the prefix (``c``: cluster,
#: ``i``: match index, ``s``: slave number) — the formats persisted stores already hold
_NAMES = {
    RoleKind.ROUTER: ("{c}/router", "{c}/router", "{c}.router"),
    RoleKind.ROUTER_SLAVE: ("{c}/router-slave-{s}", "{c}/router-slave-{s}", "{c}.router.slave.{s}"),
    RoleKind.MATCH: ("{c}/match-{i}", "{c}/matcher-{i}", "{c}.match.{i}"),
    RoleKind.MATCH_SLAVE: (
        "{c}/match-{i}/slave-{s}",
        "{c}/matcher-{i}-slave-{s}",
        "{c}.match.{i}.slave.{s}",
    ),
}


@dataclass(frozen=True, order=True)
class RoleId:
    """A role: its cluster, its kind, its match master's number (match kinds) and its
    slave number (slave kinds); 0 where a field does not apply."""

    cluster: str
    kind: RoleKind
    index: int = 0
    slave: int = 0

    def __post_init__(self) -> None:
        if self.index < 0 or self.slave < 0:
            raise ValueError(f"role numbers are never negative: {self.index}, {self.slave}")
        if self.kind in (RoleKind.ROUTER, RoleKind.ROUTER_SLAVE) and self.index:
            raise ValueError("a routing role has no match index")
        if not self.kind.is_slave and self.slave:
            raise ValueError("a master has no slave number")

    # ----------------------------------------------------------- constructors
    @classmethod
    def router(cls, cluster: str) -> RoleId:
        return cls(cluster, RoleKind.ROUTER)

    @classmethod
    def router_slave(cls, cluster: str, slave: int) -> RoleId:
        return cls(cluster, RoleKind.ROUTER_SLAVE, 0, slave)

    @classmethod
    def match(cls, cluster: str, index: int) -> RoleId:
        return cls(cluster, RoleKind.MATCH, index)

    @classmethod
    def match_slave(cls, cluster: str, index: int, slave: int) -> RoleId:
        return cls(cluster, RoleKind.MATCH_SLAVE, index, slave)

    # ---------------------------------------------------------------- relations
    @property
    def is_slave(self) -> bool:
        return self.kind.is_slave

    @property
    def master(self) -> RoleId:
        """The master whose tables this role holds (itself for a master)."""
        return RoleId(self.cluster, self.kind.master_kind, self.index)

    def slaves(self, spec: ClusterSpec) -> list[RoleId]:
        """A master's slaves as the cluster's spec has them (none for a slave)."""
        if self.kind is RoleKind.ROUTER:
            return [RoleId.router_slave(self.cluster, j) for j in range(spec.routing_slaves)]
        if self.kind is RoleKind.MATCH:
            return [
                RoleId.match_slave(self.cluster, self.index, j) for j in range(spec.match_slaves)
            ]
        return []

    @property
    def rank(self) -> tuple[int, int]:
        """What a bully election compares among one master's replicas: the master above
        its slaves, then the lower slave number (``slave-0`` outranks ``slave-1``)."""
        return (1, 0) if not self.is_slave else (0, -self.slave)

    # ------------------------------------------------------------------- names
    @property
    def owner(self) -> str:
        """Its store owner, and how it signs acks, snapshots, heartbeats and deliveries."""
        return self._name(0)

    @property
    def key(self) -> str:
        """Its process key in a deployment (``phoenix.json``, log file names)."""
        return self._name(1)

    def _name(self, which: int) -> str:
        return _NAMES[self.kind][which].format(c=self.cluster, i=self.index, s=self.slave)

    @property
    def log_file(self) -> str:
        """The name of its log file in a deployment's state folder."""
        return f"phoenix-{self.key.replace('/', '-')}.log"

    def inbox(self, prefix: str) -> str:
        """Its inbox queue (data and replication, with priorities)."""
        return f"{prefix}.{self._name(2)}"

    def parked(self, prefix: str) -> str:
        """Where its inbox's messages wait that it could not pass on (the next queue's
        node down), so they hold up nothing behind them (``routing.serving``)."""
        return f"{self.inbox(prefix)}.parked"

    def control(self, prefix: str) -> str:
        """Its control queue (a master's: acks, snapshots, heartbeats, configure; every
        role's: take-over): never behind the data backlog of its inbox."""
        return f"{self.inbox(prefix)}.control"

    def __str__(self) -> str:
        return self.owner

    # ----------------------------------------------------------------- parsing
    @classmethod
    def from_owner(cls, text: str) -> RoleId:
        """``B/match-0/slave-1`` -> the id; ``ValueError`` naming the text otherwise."""
        return cls._parse(_OWNER, text, "store owner")

    @classmethod
    def from_key(cls, text: str) -> RoleId:
        """``B/matcher-0-slave-1`` -> the id; ``ValueError`` naming the text otherwise."""
        return cls._parse(_KEY, text, "process key")

    @classmethod
    def from_inbox(cls, prefix: str, text: str) -> RoleId:
        """``phoenix.B.match.0.slave.1`` (or its ``.control``) -> the id."""
        pattern = re.compile(
            rf"^{re.escape(prefix)}\.(?P<cluster>{_CLUSTER})\.(?:(?P<router>router)"
            rf"|router\.slave\.(?P<rslave>\d+)|match\.(?P<index>\d+)(?:\.slave\.(?P<mslave>\d+))?)"
            rf"(?:\.control)?$"
        )
        return cls._parse(pattern, text, "inbox")

    @classmethod
    def _parse(cls, pattern: re.Pattern[str], text: str, what: str) -> RoleId:
        found = pattern.match(text) if isinstance(text, str) else None
        if found is None:
            raise ValueError(f"{text!r} is not a Phoenix role's {what}")
        cluster = found["cluster"]
        if found["router"]:
            return cls.router(cluster)
        if found["rslave"] is not None:
            return cls.router_slave(cluster, int(found["rslave"]))
        if found["mslave"] is not None:
            return cls.match_slave(cluster, int(found["index"]), int(found["mslave"]))
        return cls.match(cluster, int(found["index"]))

    # ------------------------------------------------------------- enumeration
    @classmethod
    def of_cluster(cls, spec: ClusterSpec) -> Iterator[RoleId]:
        """Every role of a cluster, routing master first (the order ``phoenix up`` starts them)."""
        router = cls.router(spec.id)
        yield router
        yield from router.slaves(spec)
        masters = [cls.match(spec.id, i) for i in range(spec.match_masters)]
        yield from masters
        for master in masters:
            yield from master.slaves(spec)

    def in_topology(self, topology: PhoenixTopology) -> bool:
        """True when the topology has this role, or may add it: a match master (and its
        slaves) beyond the cluster's own, up to the most any cluster runs, which a
        successor adds when it takes over a larger cluster's arc (``is_added``).  A
        forged or stale id is not."""
        try:
            spec = topology.cluster(self.cluster)
        except Exception:
            return False
        if self in set(RoleId.of_cluster(spec)):
            return True
        if self.index >= topology.most_match_masters:
            return False
        return self.kind is RoleKind.MATCH or (
            self.kind is RoleKind.MATCH_SLAVE and self.slave < spec.match_slaves
        )

    def is_added(self, topology: PhoenixTopology) -> bool:
        """A match role beyond its cluster's own masters (added by a take-over's plan)."""
        return (
            self.kind in (RoleKind.MATCH, RoleKind.MATCH_SLAVE)
            and self.index >= topology.cluster(self.cluster).match_masters
        )


def role_queues(topology: PhoenixTopology) -> list[str]:
    """Every inbox, control and parked queue the topology's roles use (to remove a
    deployment)."""
    names, prefix = [], topology.prefix
    for spec in topology.clusters:
        roles = list(RoleId.of_cluster(spec))
        for i in range(spec.match_masters, topology.most_match_masters):  # may be added
            master = RoleId.match(spec.id, i)
            roles += [master, *master.slaves(spec)]
        for role in roles:
            names += [role.inbox(prefix), role.control(prefix), role.parked(prefix)]
    return names
