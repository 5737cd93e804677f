"""The Phoenix deployment's topology and the kinds of its messages (pure); the messages
themselves are in messages.py, role names in ids.py."""

from __future__ import annotations

import json
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import ConfigurationError

__all__ = ["MAX_PRIORITY", "ClusterSpec", "Kind", "LinkSpec", "PhoenixTopology"]

MAX_PRIORITY = 9
#: how long ``phoenix join`` waits for the joiner's roles to serve before it announces the
#: join (the joiner's router holds its arc's events this long at most without it)
JOIN_SERVING_TIMEOUT_S = 60.0


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
    TAKEOVER = "takeover"  # -> a slave's control queue: serve your master's role
    ANSWER = "answer"  # role -> operator: a configure or take-over is done
    BEAT = "beat"  # master -> each slave's control queue, every heartbeat interval
    ELECTION = "election"  # slave -> higher slaves: the master is silent (bully)
    ELECTION_ANSWER = "election_answer"  # higher slave -> lower: I am alive, I elect
    COORDINATOR = "coordinator"  # the winner -> the other slaves: I serve the master now
    FENCE = "fence"  # slave -> a stale master's process queue: a newer reign serves, step down
    RETIRE = "retire"  # master -> a second process beating as one slave: another serves it
    CONFIRMATION = "confirmation"  # owner's match master -> client: (un)subscribe outcome
    PROBE = "probe"  # routing master -> routing masters' control queues: the bounded flood
    FOUND = "found"  # the flood's target -> back along the probe's path to its origin
    LEAVE = "leave"  # a routing master -> every routing master, its match roles: X left
    RECOVER = "recover"  # the departed's successor's router -> its match masters: restore
    RECOVERED = "recovered"  # a match master -> that router: restored (how many)
    MATCHED = "matched"  # the owner's match roles -> the entry router: these events are done
    COPY = "copy"  # a match broker -> routers -> a subscriber's home router: one copy
    HANDED_OVER = "handed_over"  # previous owner's router -> the joiner's: arc all sent


class ClusterSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    amqp_urls: tuple[str, ...] = ()  # empty: the process's own settings
    vhost: str | None = Field(None, min_length=1)  # None: the process's own settings
    match_masters: int = Field(1, ge=1, le=16)
    match_slaves: int = Field(0, ge=0, le=16)  # per match master
    joined: bool = True  # false: listed, but joins later (qosmq phoenix join)
    routing_slaves: int = Field(0, ge=0, le=16)  # replicas of the routing master's tables


class LinkSpec(BaseModel):
    """How the roles of cluster ``from`` reach cluster ``to``'s RabbitMQ, when not by
    ``to``'s own ``amqp_urls`` (a TCP proxy, another network path): one per directed link,
    so that a fault on one link leaves the others standing."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)
    source: str = Field(alias="from", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    target: str = Field(alias="to", pattern=r"^[A-Za-z0-9_-]{1,64}$")
    amqp_urls: tuple[str, ...] = Field(min_length=1)


class PhoenixTopology(BaseModel):
    """The deployment: which clusters exist and where their RabbitMQ is."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    clusters: tuple[ClusterSpec, ...] = Field(min_length=1)
    state_store: str = ".qosmq/phoenix-state.sqlite3"
    prefix: str = "phoenix"
    #: deliveries a role holds unacknowledged: small, so a backlog waits in the broker's
    #: priority queue and urgent events overtake it (the outer mechanism)
    inbox_prefetch: int = Field(16, ge=1, le=1000)
    #: inbox messages a role handles at once (its priority gate; the deliveries in hand
    #: may carry more, in batches): each holds its place until what it sent for it was
    #: confirmed, so this over the confirm's round trip bounds a role's rate; the most
    #: urgent waiting message goes in next
    inbox_concurrency: int = Field(64, ge=1, le=10_000)
    #: messages a role sends to the same inbox and priority in one event-loop turn leave
    #: together, up to this many in one AMQP message (1: one AMQP message each)
    batch_max: int = Field(32, ge=1, le=1000)
    #: how long a batch may wait for more messages before it leaves, in milliseconds, at
    #: the lowest priority; less the more urgent its most urgent message (nothing at the
    #: top priority: the most urgent latency level and control messages); 0: a batch
    #: leaves at the end of the loop turn it was opened in
    batch_linger_ms: float = Field(5.0, ge=0, le=1000)
    #: copies for one subscriber queue that may leave together in one AMQP message (a
    #: JSON array, with the same linger): 1, the default, one message per copy, which
    #: any AMQP consumer reads; above 1 only where every consumer of the subscriber
    #: queues is the Phoenix client, which hands them to the application one event at a
    #: time (an e2e batch is one e2e message with one receipt, each copy checked against
    #: the subscriber's duplicate filter as if alone: docs/phoenix.md)
    copy_batch_max: int = Field(1, ge=1, le=1000)
    #: events, forwards and copies published persistent (delivery mode 2), so a broker
    #: confirm means they survive their RabbitMQ node's restart; False: transient, faster
    #: (no disk write before each hop's confirm), and what a restarted node held is lost
    persistent: bool = True
    outer: bool = True  # latency-level priorities between clusters
    inner: bool = True  # predicted-T dispatch to match slaves inside a cluster
    #: how a match master dispatches with ``inner`` off: ``round_robin`` over itself and
    #: its live slaves (the paper's base system, blind to load: "matched locally or sent
    #: to the master's slaves"), or ``master`` (it matches every event itself)
    blind_dispatch: Literal["round_robin", "master"] = "round_robin"
    persist_interval_s: float = Field(60.0, gt=0)  # masters' periodic table snapshots
    read_timeout_s: float = Field(60.0, gt=0)  # how long a master waits for R replica replies
    #: a cluster that joins (or rejoins) the ring holds its arc's events at its routing
    #: master until the previous owner's hand-over of the arc's subscriptions is all
    #: there, at most this long after the join's announcement or the previous owner's
    #: last word that it is under way (0: not at all): an event matched before would
    #: miss the subscriptions made meanwhile at the previous owner
    handover_wait_s: float = Field(5.0, ge=0, le=600)
    #: masters beat to their slaves this often; a slave suspects its master after
    #: ``heartbeat_misses`` silent intervals and the slaves elect who takes over (a dead
    #: master is heard at once by its lease: the beats find a frozen one, after 1 s by
    #: default; at 0.1 s the master beats were two thirds of an idle deployment's control
    #: messages and a quarter of its roles' CPU)
    heartbeat_interval_s: float = Field(0.2, gt=0, le=60)
    heartbeat_misses: int = Field(5, ge=1, le=100)
    #: slaves beat to their master this often: the master's view of them (dispatch to a
    #: match slave, replacing a silent one, admission) suspects a slave after
    #: ``heartbeat_misses`` of these; slower than the masters' beats, which elections
    #: hang on: half the deployment's idle control traffic was slave beats, and a slave's
    #: death is heard at once by its lease either way
    slave_beat_interval_s: float = Field(0.25, gt=0, le=60)
    #: a master whose inbox took nothing for 5 s (``peer.QUIET_AFTER_S``) beats this often,
    #: and so do its slaves, each beat saying so (``Beat.next_s``): the peers excuse the
    #: longer silence, so a master frozen while quiet is found after this plus the usual
    #: detection timeout (2.8 s at 2 s), one frozen while busy as before; the idle
    #: deployment's beats cost a seventh.  0: always the usual intervals
    #: (docs/phoenix-recovery.md, "Quiet beats")
    quiet_beat_interval_s: float = Field(2.0, ge=0, le=60)
    #: beats that arrive irregularly (a busy machine) raise the silence a peer may keep
    #: before it is suspected, from ``heartbeat_misses`` intervals up to this many seconds
    #: (recovery/detector.py; a SIGKILLed role is heard at once by its lease either way;
    #: 0: the fixed rule)
    suspect_ceiling_s: float = Field(2.0, ge=0, le=600)
    #: each role process holds a lease on its beat connection (routing/beats.py): when the
    #: process dies its watchers (a master's slaves) hear it at once from the broker,
    #: instead of after ``heartbeat_misses`` silent intervals; off: the beats alone
    leases: bool = True
    #: a master that hears nothing from one of its slaves for this long (never less than
    #: the detection timeout) asks its provisioner for a replacement, again after
    #: ``replace_retry_s`` if none came
    replace_after_s: float = Field(2.0, ge=0)
    replace_retry_s: float = Field(30.0, gt=0)
    #: how many RabbitMQ nodes hold each role inbox and control queue (a classic mirrored
    #: queue, by a policy ``phoenix up`` sets): 2 survives the loss of one node; 0 or 1:
    #: no policy (the queue lives on one node).  Off by default: on this machine it made
    #: responses 60-160x slower (docs/results.md).  RabbitMQ 3.10's quorum queues have no
    #: priorities, which the latency levels need (docs/phoenix-recovery.md)
    inbox_mirrors: int = Field(0, ge=0, le=16)
    #: the queue type of every role inbox and control queue: ``classic`` (with priorities,
    #: ``x-max-priority`` 9; replicated only by ``inbox_mirrors``, which RabbitMQ 4.0
    #: removed) or ``quorum`` (replicated by RabbitMQ itself on every version, with no
    #: broker priorities on 3.x and two levels from 4.0: the latency levels then order only
    #: what a role holds, by its priority gate); ``auto`` (default): classic, except
    #: where ``inbox_mirrors`` asks for replicas on a broker without classic mirroring
    #: (4.0 and later): quorum there, so the asked-for HA holds.  docs/compatibility.md
    role_queues: Literal["auto", "classic", "quorum"] = "auto"
    #: directed links with addresses of their own (``[[link]]`` tables)
    links: tuple[LinkSpec, ...] = ()
    #: ring failures (docs/phoenix-ring-failures.md): a forward to another cluster not
    #: confirmed within ``link_timeout_s`` counts as a failed link and starts a flood; no
    #: FOUND within ``flood_timeout_s``: the target is taken as gone for now (its events
    #: wait, and the flood is run again); a failed direct link is tried again every
    #: ``link_retry_s`` and traffic goes back to it once it answers
    link_timeout_s: float = Field(1.0, gt=0, le=60)
    flood_timeout_s: float = Field(1.0, gt=0, le=60)
    link_retry_s: float = Field(0.5, gt=0, le=60)
    #: every routing master checks its ring neighbours (successor and predecessor) this
    #: often over their direct links, as the paper's neighbours heartbeat each other, so
    #: a cluster that goes while nobody sends to it is found gone all the same (0: off,
    #: only failed forwards detect)
    neighbour_check_s: float = Field(1.0, ge=0, le=60)
    #: a cluster no flood has reached for this long (its RabbitMQ unreachable from every
    #: routing master that tried) has left the ring: its successor takes over its arc
    #: from the persisted state.  Longer than a role's recovery (#23), which keeps the
    #: cluster's RabbitMQ reachable anyway
    leave_after_s: float = Field(3.0, gt=0, le=3600)
    #: an event that entered the ring at a router and left for another cluster is kept
    #: there until its owner says it was matched (routed again if the owner leaves);
    #: at most this long (a lost ``Matched`` costs memory only this long)
    keep_unmatched_s: float = Field(60.0, gt=0, le=3600)
    #: deliveries (docs/phoenix.md, "What a subscriber can count on"): an e2e copy's
    #: receipt is waited for ``e2e_hold_s`` at most; past it the copy counts once the
    #: subscriber's broker holds it, and that subscriber's next copies wait only for its
    #: broker (one probe copy every ``e2e_probe_s`` waits again), and at most
    #: ``e2e_window`` copies of one subscriber wait for receipts at a time, so a
    #: subscriber that stops consuming holds up no other.  A copy whose home cannot be
    #: reached directly within ``link_timeout_s`` is handed to the match broker's own
    #: routing master, which carries it to the home's routing master over the ring's
    #: links and detours
    e2e_hold_s: float = Field(2.0, ge=0, le=3600)
    e2e_probe_s: float = Field(1.0, gt=0, le=3600)
    e2e_window: int = Field(4, ge=1, le=1000)

    @model_validator(mode="after")
    def _links_between_clusters(self) -> PhoenixTopology:
        ids = {c.id for c in self.clusters}
        for link in self.links:
            for end in (link.source, link.target):
                if end not in ids:
                    raise ValueError(f"link {link.source}->{link.target}: no cluster {end!r}")
        return self

    def role_queue_kind(self, classic_mirroring: bool | None) -> Literal["classic", "quorum"]:
        """The role queues' type on a broker that has (``True``), lacks (``False``) or has
        not reported (``None``) classic mirroring: ``auto`` takes quorum only where
        ``inbox_mirrors`` asks for replicas that classic mirroring cannot give."""
        if self.role_queues != "auto":
            return self.role_queues
        if self.inbox_mirrors >= 2 and classic_mirroring is False:
            return "quorum"
        return "classic"

    def link(self, source: str | None, target: str) -> LinkSpec | None:
        """The link ``source`` -> ``target`` when it has addresses of its own."""
        if source is None or source == target:
            return None
        return next((k for k in self.links if (k.source, k.target) == (source, target)), None)

    @property
    def most_match_masters(self) -> int:
        """The most match masters a cluster may run: a successor that takes over a
        departed cluster's arc adds masters up to the number that cluster had
        (``recovery/capacity.py``), so no cluster ever runs more than this."""
        return max(c.match_masters for c in self.clusters)

    def cluster(self, cluster_id: str) -> ClusterSpec:
        for c in self.clusters:
            if c.id == cluster_id:
                return c
        raise ConfigurationError(
            f"cluster {cluster_id!r} is not in the topology "
            f"({', '.join(c.id for c in self.clusters)})"
        )

    def to_toml(self) -> str:
        """The topology as the file ``load`` reads: top-level fields, then one
        ``[[cluster]]`` and one ``[[link]]`` table each; defaults left out."""
        top = self.model_dump(mode="json", exclude_defaults=True, exclude={"clusters", "links"})
        lines = [f"{key} = {_toml(value)}" for key, value in top.items()]
        for cluster in self.clusters:
            own = cluster.model_dump(mode="json", exclude_defaults=True)
            lines += ["", "[[cluster]]", *(f"{k} = {_toml(v)}" for k, v in own.items())]
        for link in self.links:
            own = link.model_dump(mode="json", by_alias=True)
            lines += ["", "[[link]]", *(f"{k} = {_toml(v)}" for k, v in own.items())]
        return "\n".join(lines) + "\n"

    def write(self, path: Path | str) -> Path:
        """Write the topology file (``load`` reads it back equal); its path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_toml())
        return path

    @classmethod
    def load(cls, path: Path | str) -> PhoenixTopology:
        try:
            data = tomllib.loads(Path(path).read_text())
            return cls.model_validate(
                {
                    "clusters": data.get("cluster", []),
                    "links": data.get("link", []),
                    **{k: v for k, v in data.items() if k not in ("cluster", "link")},
                }
            )
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigurationError(f"topology file {path}: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigurationError(
                f"topology file {path}: not UTF-8 text (byte {exc.start}); save it as UTF-8 TOML"
            ) from None
        except ValidationError as exc:
            raise ConfigurationError(f"topology file {path}: {explain(exc)}") from None


def _toml(value: object) -> str:
    """One TOML value of a topology field: a boolean, a number, a string (JSON's escapes
    are TOML's), or an array of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def explain(exc: ValidationError) -> str:
    """A topology's validation errors as one line, each ``where: what (got value)``,
    named as the file has them (``[[cluster]] #2 routing_slaves``); an error of a list
    that only follows from one of its items' errors is left out."""
    errors = exc.errors(include_url=False)
    locs = [tuple(e["loc"]) for e in errors]
    parts = []
    for error in errors:
        loc = tuple(error["loc"])
        if any(len(other) > len(loc) and other[: len(loc)] == loc for other in locs):
            continue  # the list's complaint about an item that failed on its own
        if len(loc) > 1 and loc[0] in ("clusters", "links") and isinstance(loc[1], int):
            where = f"[[{str(loc[0])[:-1]}]] #{loc[1] + 1}"
            where += "".join(f" {part}" for part in loc[2:])
        else:
            where = ".".join(str(part) for part in loc) or "the file"
        value = error.get("input")
        got = "" if isinstance(value, dict | list | tuple) else f" (got {value!r})"
        parts.append(f"{where}: {error['msg']}{got}")
    return "; ".join(parts)
