"""Phoenix wire messages and the deployment's topology (pure); role names are in ids.py."""

from __future__ import annotations

import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import ConfigurationError, DeadLetter
from .matching import Event

__all__ = ["ClusterSpec", "Kind", "PhoenixMessage", "PhoenixTopology"]

MAX_PRIORITY = 9


class Kind(StrEnum):
    ADVERTISE = "advertise"
    SUBSCRIBE = "subscribe"
    UNSUBSCRIBE = "unsubscribe"  # client -> the type's owner, along the ring like subscribe
    UNSUBSCRIBED = "unsubscribed"  # owner's match master -> routers that counted its level
    PUBLISH = "publish"
    HEARTBEAT = "heartbeat"
    JOIN = "join"  # a cluster joins the ring (to every routing master)
    HANDOVER = "handover"  # routing master -> its match masters: move an arc's subscriptions
    REPLICATE = "replicate"  # routing master -> routing slaves: a routing-table entry
    ACK = "ack"  # slave -> its master's control queue: replica entry stored
    READ = "read"  # master -> slave: send me your replica (quorum read)
    SNAPSHOT = "snapshot"  # slave -> master's control queue: a page of its replica
    CONFIGURE = "configure"  # operator -> masters' control queues: switch outer/inner live
    TAKEOVER = "takeover"  # -> a slave's control queue: serve your master's role (broker)


class PhoenixMessage(BaseModel):
    """One message between Phoenix roles (JSON body of an AMQP message)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    kind: Kind
    event_type: str
    event: Event | None = None
    filter: list[list[Any]] = Field(default_factory=list)
    latency_level: int = Field(3, ge=1, le=5)
    queue: str | None = None  # the subscriber's own queue
    confirm: Literal["broker", "e2e"] = "broker"  # subscribe: how deliveries are confirmed
    subscription_id: str | None = None
    # subscribe: the subscriber's cluster, whose RabbitMQ (and vhost) holds its queue
    home: str | None = None
    hops: list[str] = Field(default_factory=list)  # clusters visited, for hop counts
    replica: bool = False  # a master's copy for its slaves (subscribe) or a dispatch (publish)
    broker: str | None = None  # heartbeat sender / the broker that matched a delivery
    predicted_t: float | None = None  # heartbeat: the sender's predicted processing time
    cluster: str | None = None  # join / handover: the joining cluster
    arc: tuple[int, int] | None = None  # handover: ring interval (start, end] that moves
    table: dict[str, Any] | None = None  # replicate: the entry's document (or a tombstone)
    version: int | None = None  # replicate / ack: the entry's version
    key: str | None = None  # replicate: the entry's key
    state_kind: str | None = None  # replicate / read / snapshot: routing_table, subscription
    request: str | None = None  # read / snapshot: which read this answers
    reply_to: str | None = None  # read: the master's control queue; configure: the operator
    entries: dict[str, tuple[int, dict[str, Any]]] | None = None  # snapshot: key -> (v, doc)
    last: bool = False  # snapshot: the final page
    priority: int = Field(0, ge=0, le=MAX_PRIORITY)  # set by the routing master (latency level)


def parse_message(body: bytes, what: str = "Phoenix message") -> PhoenixMessage:
    """A message as a role or client receives it; malformed: dead-lettered with why."""
    try:
        return PhoenixMessage.model_validate_json(body)
    except ValueError as exc:
        raise DeadLetter(f"malformed {what}: {exc}") from None


class ClusterSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    amqp_urls: tuple[str, ...] = ()  # empty: the process's own settings
    vhost: str | None = Field(None, min_length=1)  # None: the process's own settings
    match_masters: int = Field(1, ge=1, le=16)
    match_slaves: int = Field(0, ge=0, le=16)  # per match master
    joined: bool = True  # false: listed, but joins later (qosmq phoenix join)
    routing_slaves: int = Field(0, ge=0, le=16)  # replicas of the routing master's tables


class PhoenixTopology(BaseModel):
    """The deployment: which clusters exist and where their RabbitMQ is."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    clusters: tuple[ClusterSpec, ...] = Field(min_length=1)
    state_store: str = ".qosmq/phoenix-state.sqlite3"
    prefix: str = "phoenix"
    #: deliveries a role holds unacknowledged: small, so a backlog waits in the broker's
    #: priority queue and urgent events overtake it (the outer mechanism)
    inbox_prefetch: int = Field(16, ge=1, le=1000)
    #: messages a role sends to the same inbox and priority in one event-loop turn leave
    #: together, up to this many in one AMQP message (1: one AMQP message each)
    batch_max: int = Field(32, ge=1, le=1000)
    outer: bool = True  # latency-level priorities between clusters
    inner: bool = True  # predicted-T dispatch to match slaves inside a cluster
    #: how a match master dispatches with ``inner`` off: ``round_robin`` over itself and
    #: its live slaves (the paper's base system, blind to load: "matched locally or sent
    #: to the master's slaves"), or ``master`` (it matches every event itself)
    blind_dispatch: Literal["round_robin", "master"] = "round_robin"
    persist_interval_s: float = Field(60.0, gt=0)  # masters' periodic table snapshots
    read_timeout_s: float = Field(60.0, gt=0)  # how long a master waits for R replica replies

    def cluster(self, cluster_id: str) -> ClusterSpec:
        for c in self.clusters:
            if c.id == cluster_id:
                return c
        raise ConfigurationError(
            f"cluster {cluster_id!r} is not in the topology "
            f"({', '.join(c.id for c in self.clusters)})"
        )

    @classmethod
    def load(cls, path: Path | str) -> PhoenixTopology:
        try:
            data = tomllib.loads(Path(path).read_text())
            return cls.model_validate(
                {
                    "clusters": data.get("cluster", []),
                    **{k: v for k, v in data.items() if k != "cluster"},
                }
            )
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"topology file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigurationError(
                f"topology file {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 TOML"
            ) from None
        except ValidationError as exc:
            raise ConfigurationError(
                f"topology file {path}: {exc.errors(include_url=False)}"
            ) from None
