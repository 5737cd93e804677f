"""Properties of Phoenix over an in-memory network of the real machines.

Each machine is the one the drivers run (``SubscriptionBook``, ``ReplicaLog``,
``Bully``, ``Departures``, ``ArcTakeover``, ``HandBack``); the network here only
carries their effects as messages, in an order, with losses and repeats, that
hypothesis draws, and applies a crash as a process's death does: what it held in memory
and what was in flight to it is gone, what it persisted stays.  The claims:

- a subscription confirmed to its client survives its match master's death, the
  election among the slaves and the winner's R-of-N read; an unsubscribe confirmed
  stays removed;
- a departed cluster's arc is taken over by exactly one routing master (however many
  found the cluster gone and told the others, in whatever order), which releases the
  arc's events exactly once; when the cluster rejoins, exactly that router hands the arc
  back, and tells the joiner exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.phoenix.ring import ChordRing
from middleware.recovery.election import Bully
from middleware.routing.departures import Departures, LeaveHere, TakeOverArc, TellRouter
from middleware.routing.joining import AskMasters, HandBack, Tell
from middleware.routing.messages import Ack, Snapshot, Subscribe, Unsubscribe
from middleware.routing.registry import Registry
from middleware.routing.replicas import Persist, ReplicaLog, ToReplica, Written
from middleware.routing.subscribing import Confirm, SubscriptionBook
from middleware.routing.subscribing import Persist as PersistSubscription
from middleware.routing.takeover import Adopt, ArcTakeover, AskRestore, Released

from .bully_network import drive

Entries = dict[str, tuple[int, dict[str, Any]]]

# ---------------------------------------------------------------- subscriptions


@dataclass
class _MatchCluster:
    """One match master and its slaves: the master's machines, every process's store
    (persisted: it outlives the process), the messages in flight."""

    slaves: list[RoleId]
    master: RoleId = field(default_factory=lambda: RoleId.match("B", 0))
    stores: dict[str, Entries] = field(default_factory=dict)
    in_flight: list[tuple[str, Any]] = field(default_factory=list)  # (to, message)
    waiting: dict[int, tuple[str, bool]] = field(default_factory=dict)  # version -> sid
    #: sid -> the version of its last write, and the newest confirmed (version, subscribed)
    last_write: dict[str, int] = field(default_factory=dict)
    confirmed: dict[str, tuple[int, bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.book = SubscriptionBook(Registry("B"))
        self.log = ReplicaLog(
            owner=self.master.owner,
            kind="subscription",
            replicas=self.slaves,
            n=len(self.slaves) + 1,
            reply_to="master",
        )
        for role in (self.master, *self.slaves):
            self.stores[role.owner] = {}

    def request(self, sid: str, subscribe: bool) -> None:
        if subscribe:
            message: Subscribe | Unsubscribe = Subscribe(
                event_type="t", subscription_id=sid, queue=f"q-{sid}", latency_level=1
            )
            effects = self.book.subscribe(message)
        else:
            effects = self.book.unsubscribe(Unsubscribe(event_type="t", subscription_id=sid))
        version = None
        for effect in effects:
            if isinstance(effect, PersistSubscription):
                version, more = self.log.write(effect.key, effect.document)
                self.last_write[sid] = version
                self._perform(more)
            elif isinstance(effect, Confirm) and effect.after_write:
                assert version is not None  # the client hears once W of N hold it
                if version in self.log.pending:
                    self.waiting[version] = (sid, subscribe)
                else:  # held already (a master without slaves: its own copy is W)
                    self.confirmed[sid] = (version, subscribe)

    def _perform(self, effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, Persist):  # awaited before anything is sent
                _save(self.stores[self.master.owner], effect.key, effect.version, effect.document)
            elif isinstance(effect, ToReplica):
                self.in_flight.append((effect.replica.owner, effect.message))
            elif isinstance(effect, Written):
                held = self.waiting.pop(effect.version, None)
                if held is not None:
                    sid, subscribed = held
                    if self.confirmed.get(sid, (0, False))[0] < effect.version:
                        self.confirmed[sid] = (effect.version, subscribed)

    def deliver(self, index: int, lose: bool) -> None:
        to, message = self.in_flight.pop(index % len(self.in_flight))
        if lose:
            return
        if to == "master":  # an ack
            self._perform(self.log.on_ack(message))
            return
        _save(self.stores[to], message.key, message.version, message.table)
        self.in_flight.append(("master", Ack(broker=to, version=message.version, key=message.key)))


def _save(store: Entries, key: str, version: int, document: dict[str, Any]) -> None:
    if store.get(key, (0, None))[0] < version:  # stores keep the newest version
        store[key] = (version, document)


def _elect(slaves: list[RoleId], dead: set[RoleId], order: list[int]) -> list[RoleId]:
    """The bully election among the live slaves, each suspecting in ``order``: who took
    over."""
    machines = {s: Bully(me=s, peers=slaves, answer_s=0.2, coordinator_s=0.5) for s in slaves}
    live = [s for s in slaves if s not in dead]
    return drive(machines, [live[i % len(live)] for i in order], dead)


@settings(max_examples=400, deadline=None)
@given(
    slaves=st.integers(1, 3),
    steps=st.lists(
        st.one_of(
            st.tuples(st.just("subscribe"), st.integers(0, 5)),
            st.tuples(st.just("unsubscribe"), st.integers(0, 5)),
            st.tuples(st.just("deliver"), st.integers(0, 50), st.booleans()),
        ),
        max_size=40,
    ),
    crash=st.sets(st.integers(0, 2), max_size=2),
    order=st.lists(st.integers(0, 2), min_size=1, max_size=3),
    answers=st.lists(st.integers(0, 2), max_size=3),
    flush=st.integers(0, 100),
    own_lost=st.booleans(),
)
def test_a_confirmed_subscription_survives_the_masters_death_the_election_and_the_read(
    slaves: int,
    steps: list[tuple[Any, ...]],
    crash: set[int],
    order: list[int],
    answers: list[int],
    flush: int,
    own_lost: bool,
) -> None:
    roles = [RoleId.match_slave("B", 0, j) for j in range(slaves)]
    dead = {roles[i] for i in crash if i < slaves}
    if len(dead) == slaves:  # no slave left to take over
        dead.discard(roles[0])
    cluster = _MatchCluster(roles)
    for step in steps:
        if step[0] == "deliver":
            if cluster.in_flight:
                cluster.deliver(step[1], lose=step[2])
        else:
            cluster.request(f"s{step[1]}", subscribe=step[0] == "subscribe")
    for n in range(flush):  # then some of what is in flight arrives before the kill
        if cluster.in_flight:
            cluster.deliver(n, lose=False)
    # the master dies (SIGKILL): what it held in memory and had in flight is gone; the
    # slaves in ``dead`` die with it; the others elect who takes over
    (winner,) = _elect(roles, dead, order)
    others = [r for r in roles if r != winner]
    reader = ReplicaLog(
        owner=cluster.master.owner,
        kind="subscription",
        replicas=others,
        n=slaves + 1,
        reply_to="winner",
    )
    # the master's own copy is in the state store; ``own_lost``: gone too (its node's disk)
    own = {} if own_lost else cluster.stores[cluster.master.owner]
    held = cluster.stores[winner.owner]
    asked = [e.replica for e in reader.begin_read("r", own, held) if isinstance(e, ToReplica)]
    live_asked = [r for r in asked if r not in dead]
    for i in answers or range(len(live_asked)):  # the live ones answer in some order
        if not live_asked:
            break
        replica = live_asked[i % len(live_asked)]
        snapshot = Snapshot(
            request="r",
            state_kind="subscription",
            entries=dict(cluster.stores[replica.owner]),
            last=True,
            broker=replica.owner,
        )
        reader.page(snapshot)
    result = reader.finish_read("r", own)
    checked = 0
    for sid, (version, subscribed) in cluster.confirmed.items():
        if own_lost and result.degraded:  # fewer than R answered: no promise then
            break
        if version == cluster.last_write[sid]:  # (a later write in flight may win)
            assert (sid in result.entries) is subscribed, (sid, subscribed, result.entries)
            checked += 1
    event(f"confirmed and checked: {min(checked, 3)}")


# ---------------------------------------------------------------- departures


@dataclass
class _Router:
    cluster: str
    departures: Departures
    takeover: ArcTakeover = field(default_factory=lambda: ArcTakeover(bound_s=60.0))
    hand_back: HandBack = field(default_factory=lambda: HandBack(answer_s=60.0, tell_s=5.0))
    took: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    told: list[str] = field(default_factory=list)


def _routers(clusters: list[str]) -> dict[str, _Router]:
    topology = PhoenixTopology.model_validate({"clusters": [{"id": c} for c in clusters]})
    ids = iter(range(10**6))
    return {
        c: _Router(c, Departures(c, ChordRing(clusters), topology, lambda: f"n{next(ids)}"))
        for c in clusters
    }


def _take_over(router: _Router, effect: TakeOverArc, answers: list[int], masters: int) -> None:
    """The arc take-over's machine at the successor: the plan names ``masters`` match
    masters, which answer in the drawn order (repeats and strays included); the
    departed router's table is read once."""
    router.took.append(effect.cluster)
    taking = router.takeover
    effects = taking.left(effect.cluster, f"req-{effect.cluster}", 0.0)
    names = [f"{router.cluster}-m{i}" for i in range(masters)]
    effects += taking.planned(effect.cluster, object(), names, 0.0)
    request = next((e.request for e in effects if isinstance(e, AskRestore)), None)
    for i in answers:
        if request is not None:
            effects += taking.answered(request, f"{router.cluster}-m{i % (masters + 1)}", 1, 0.0)
    effects += taking.table_read(effect.cluster, {}, None, 0.0)
    if request is not None:
        effects += taking.expired(request, 1.0)  # the bound passes (late: changes nothing)
    for e in effects:
        if isinstance(e, Released):
            router.released.append(e.cluster)
        assert not isinstance(e, Adopt) or e.cluster == effect.cluster


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(3, 6),
    leaving=st.integers(0, 5),
    finders=st.sets(st.integers(0, 5), min_size=1),
    deliveries=st.lists(st.tuples(st.integers(0, 100), st.booleans()), max_size=60),
    answers=st.lists(st.integers(0, 3), max_size=8),
    masters=st.integers(0, 3),
)
def test_a_departed_arc_is_taken_over_once_and_handed_back_once_on_rejoin(
    size: int,
    leaving: int,
    finders: set[int],
    deliveries: list[tuple[int, bool]],
    answers: list[int],
    masters: int,
) -> None:
    clusters = [chr(ord("A") + i) for i in range(size)]
    routers = _routers(clusters)
    x = clusters[leaving % size]
    others = [c for c in clusters if c != x]
    successor = ChordRing(clusters).successors(x, 1)[0]
    # the routers that found ``x`` gone announce it: a Leave to every other router (in
    # flight: delivered in the drawn order, some twice), and leave it themselves
    in_flight: list[tuple[str, str, str]] = []  # (to, departed, by)
    for finder in (others[i % len(others)] for i in finders):
        for effect in routers[finder].departures.announce(x):
            if isinstance(effect, TellRouter):
                in_flight.append((effect.cluster, effect.message.cluster, effect.message.by))
            elif isinstance(effect, LeaveHere):
                in_flight.insert(0, (finder, effect.cluster, effect.by))
    for index, again in deliveries:
        if not in_flight:
            break
        message = in_flight[index % len(in_flight)]
        if not again:
            in_flight.remove(message)
        _leave(routers[message[0]], message[1], message[2], answers, masters)
    for to, departed, by in in_flight:  # the rest arrive in the end
        _leave(routers[to], departed, by, answers, masters)

    took = [c for c, r in routers.items() if x in r.took]
    assert took == [successor]  # exactly one, the ring's successor
    assert routers[successor].released == [x]  # its events released exactly once
    for c in others:
        assert x not in routers[c].departures.ring.clusters
    # ``x`` rejoins: each router adds it; the one whose arc shrank hands it back
    handing = []
    for c in others:
        handover = routers[c].departures.ring.join(x)
        if handover is not None and handover.previous_owner == c:
            handing.append(c)
            _hand_back(routers[c], x, (handover.start, handover.end), answers, masters)
    assert handing == [successor]
    assert routers[successor].told == [x]  # the joiner told exactly once


def _leave(router: _Router, departed: str, by: str, answers: list[int], masters: int) -> None:
    for effect in router.departures.leave(departed, by, ring_applied=True):
        if isinstance(effect, TakeOverArc):
            _take_over(router, effect, answers, masters)


def _hand_back(
    router: _Router, joiner: str, arc: tuple[int, int], answers: list[int], masters: int
) -> None:
    names = [f"{router.cluster}-m{i}" for i in range(max(masters, 1))]
    effects = router.hand_back.start(f"back-{joiner}", joiner, arc, names)
    (ask,) = [e for e in effects if isinstance(e, AskMasters)]
    for i in [*answers, *range(len(names))]:  # repeats and strays, then everyone
        effects += router.hand_back.answered(ask.request, f"{router.cluster}-m{i}", 2, 0.0)
    for effect in effects:
        if isinstance(effect, Tell):
            router.told.append(effect.cluster)
            effects += router.hand_back.told(effect.request)
    assert router.hand_back.answered(ask.request, names[0], 2, 1.0) == []  # late: nothing
