"""``router.RouterLogic``: ring forwarding and latencyMap without a broker."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.errors import DeadLetter
from middleware.phoenix.effects import Send
from middleware.phoenix.protocol import PhoenixTopology
from middleware.phoenix.ring import ChordRing, ring_id
from middleware.routing.matching import Event
from middleware.routing.messages import Publish, Subscribe, Unsubscribe, Unsubscribed
from middleware.routing.records import LatencyEntry
from middleware.routing.router import Forward, KeptEvents, RouterLogic, WriteEntry

CLUSTERS = ["A", "B", "C", "D", "E"]


def _routers(clusters: list[str] = CLUSTERS, masters: int = 2) -> dict[str, RouterLogic]:
    topology = PhoenixTopology.model_validate(
        {"clusters": [{"id": c, "match_masters": masters} for c in clusters]}
    )
    ids = (f"id{n}" for n in itertools.count())
    return {
        c: RouterLogic(c, topology, ChordRing(clusters), new_id=lambda: next(ids)) for c in clusters
    }


def _walk(routers: dict[str, RouterLogic], start: str, message: object) -> tuple[list, list]:
    """Route ``message`` from ``start`` as the routing masters would: (hops, effects)."""
    at, hops, effects = start, [], []
    while True:
        writes, stamped = routers[at].accept(message)  # type: ignore[arg-type]
        effects += writes
        hops.append(at)
        if stamped is None:
            return hops, effects
        step = routers[at].step(stamped)
        effects.append(step)
        if isinstance(step, Send):
            return hops, effects
        at, message = step.cluster, step.message


@settings(max_examples=200, deadline=None)
@given(
    start=st.sampled_from(CLUSTERS),
    event_type=st.from_regex(r"[a-z][a-z0-9_.]{0,11}", fullmatch=True),
)
def test_a_publish_reaches_the_owners_match_master_along_the_rings_route(
    start: str, event_type: str
) -> None:
    routers = _routers()
    ring = ChordRing(CLUSTERS)
    publish = Publish(event_type=event_type, event=Event(event_type=event_type, attributes={}))
    hops, effects = _walk(routers, start, publish)
    assert hops == ring.route(start, event_type)
    last = effects[-1]
    assert isinstance(last, Send) and last.to.index == ring_id(event_type) % 2
    assert last.message.hops == hops and last.message.id == "id0"  # one id on the way


def test_a_subscription_counts_its_level_on_every_router_of_its_path_and_writes_it() -> None:
    routers = _routers()
    ring = ChordRing(CLUSTERS)
    start = "A"
    event_type = next(t for t in (f"t{i}" for i in range(500)) if len(ring.route(start, t)) >= 3)
    sub = Subscribe(event_type=event_type, subscription_id="s1", queue="q", latency_level=1)
    hops, effects = _walk(routers, start, sub)
    writes = [e for e in effects if isinstance(e, WriteEntry)]
    assert writes == [WriteEntry(event_type, LatencyEntry(1, 1))] * len(hops)
    last = effects[-1]
    assert isinstance(last, Send)
    assert last.message.home == "A"  # the entry router's cluster, when unsaid
    assert last.message.priority == routers[start].latency.priority(event_type) > 0
    gone = Unsubscribed(event_type=event_type, latency_level=1)
    for cluster in hops:  # the match master tells each router of the path
        writes, passed = routers[cluster].accept(gone)
        assert writes == [WriteEntry(event_type, None)] and passed is None


def test_the_owner_drops_a_message_it_routed_already() -> None:
    routers = _routers()
    event_type = "quotes"
    owner = ChordRing(CLUSTERS).owner(event_type)
    publish = Publish(
        event_type=event_type, event=Event(event_type=event_type, attributes={}), id="m1"
    )
    assert routers[owner].accept(publish)[1] is not None
    assert routers[owner].accept(publish) == ([], None)  # sent again over a detour
    other = next(c for c in CLUSTERS if c != owner)
    assert routers[other].accept(publish)[1] is not None  # only the owner keeps ids
    assert routers[other].accept(publish)[1] is not None


def test_the_owner_forgets_the_oldest_ids_past_its_window() -> None:
    topology = PhoenixTopology.model_validate({"clusters": [{"id": "A"}]})
    router = RouterLogic("A", topology, ChordRing(["A"]), keep_ids=2)
    publishes = [
        Publish(event_type="t", event=Event(event_type="t", attributes={}), id=f"m{i}")
        for i in range(3)
    ]
    for p in publishes:
        router.accept(p)
    assert router.accept(publishes[0])[1] is not None  # forgotten: routed again
    assert router.accept(publishes[2]) == ([], None)


def test_a_subscription_homed_outside_the_topology_is_dead_lettered() -> None:
    routers = _routers()
    sub = Subscribe(event_type="t", subscription_id="s", queue="q", home="Z")
    with pytest.raises(DeadLetter, match="home cluster 'Z' is not in the topology"):
        routers["A"].accept(sub)
    unsub = Unsubscribe(event_type="t", subscription_id="s", home="A")
    assert routers["A"].accept(unsub)[1] is not None


def test_a_detour_is_relayed_along_its_path_and_routed_at_its_end() -> None:
    routers = _routers()
    publish = Publish(event_type="t", event=Event(event_type="t", attributes={}), via=["C", "D"])
    step = routers["B"].relay(publish)
    assert isinstance(step, Forward) and step.cluster == "C" and step.message.via == ["D"]
    back = routers["C"].relay(publish.model_copy(update={"via": ["C"]}))
    assert not isinstance(back, Forward) and back.via == []  # on from here by the ring
    with pytest.raises(DeadLetter, match="detour hop 'Q' is not in the topology"):
        routers["B"].relay(publish.model_copy(update={"via": ["Q"]}))


def test_a_hop_that_left_is_routed_around_by_the_next_step() -> None:
    routers = _routers()
    event_type = next(
        t for t in (f"t{i}" for i in range(500)) if len(ChordRing(CLUSTERS).route("A", t)) >= 3
    )
    stamped = routers["A"].accept(
        Publish(event_type=event_type, event=Event(event_type=event_type, attributes={}))
    )[1]
    assert stamped is not None
    first = routers["A"].step(stamped)
    assert isinstance(first, Forward)
    routers["A"].ring.leave(first.cluster)  # the driver learnt it left: ask again
    second = routers["A"].step(stamped)
    assert getattr(second, "cluster", None) != first.cluster


def test_priorities_off_when_the_outer_mechanism_is() -> None:
    topology = PhoenixTopology.model_validate({"clusters": [{"id": "A"}], "outer": False})
    router = RouterLogic("A", topology, ChordRing(["A"]))
    router.accept(Subscribe(event_type="t", subscription_id="s", queue="q", latency_level=1))
    publish = Publish(event_type="t", event=Event(event_type="t", attributes={}))
    stamped = router.accept(publish)[1]
    assert stamped is not None and stamped.priority == 0


def test_a_routing_table_read_back_leaves_out_what_no_version_wrote() -> None:
    router = _routers()["A"]
    refused = router.load(
        {"a": (1, {"level_sum": 3, "count": 2}), "b": (2, {"level_sum": "x"}), "c": (3, {})}
    )
    assert router.latency.entries == {"a": (3, 2)}
    assert [r.split(":")[0] for r in refused] == ["b", "c"]


def _event(event_id: str, hops: list[str], event_type: str = "quotes") -> Publish:
    return Publish(
        event_type=event_type,
        event=Event(event_type=event_type, attributes={"p": 1}),
        id=event_id,
        hops=hops,
    )


def test_an_entry_router_keeps_what_it_sent_away_until_the_owner_matched_it() -> None:
    kept = KeptEvents("A", keep_s=60)
    assert kept.keep(_event("e1", ["A"]), "B", now=0)
    assert kept.keep(_event("e2", ["A"]), "C", now=1)
    assert not kept.keep(_event("e3", ["C", "A"]), "B", now=1)  # passing through A
    assert not kept.keep(_event("e4", ["A"]), "A", now=1)  # matched at A itself
    assert not kept.keep(Subscribe(event_type="q", subscription_id="s", queue="q"), "B", 1)
    assert len(kept) == 2
    assert kept.matched(["e1", "unknown"]) == 1
    assert kept.left("B") == []  # e1 was matched: nothing to route again
    (again,) = kept.left("C")
    assert again.id == "e2" and again.hops == [] and again.via == []
    assert len(kept) == 0


def test_kept_events_expire_oldest_first() -> None:
    kept = KeptEvents("A", keep_s=10)
    for i in range(5):
        kept.keep(_event(f"e{i}", ["A"]), "B", now=float(i))
    kept.keep(_event("late", ["A"]), "B", now=12.5)  # e0..e2 are older than 10 s now
    assert kept.expired == 3 and len(kept) == 3
    assert [m.id for m in kept.left("B")] == ["e3", "e4", "late"]


@given(
    st.lists(st.tuples(st.sampled_from("BCD"), st.booleans()), min_size=1, max_size=40),
    st.sampled_from("BCD"),
)
def test_what_a_departed_owner_had_not_matched_comes_back_exactly_once(sends, gone) -> None:
    """Every event sent toward the departed owner and not matched is routed again once;
    nothing matched, and nothing of another owner, is."""
    kept = KeptEvents("A", keep_s=3600)
    for i, (owner, _) in enumerate(sends):
        kept.keep(_event(f"e{i}", ["A"]), owner, now=float(i))
    kept.matched([f"e{i}" for i, (_, done) in enumerate(sends) if done])
    again = [m.id for m in kept.left(gone)]
    expected = [f"e{i}" for i, (owner, done) in enumerate(sends) if owner == gone and not done]
    assert again == expected
    assert kept.left(gone) == []


def test_what_passed_a_departed_cluster_on_its_way_is_routed_again_too() -> None:
    """A detour's hop (or a ring hop) that leaves may have held the event in its inbox."""
    kept = KeptEvents("A", keep_s=60)
    kept.keep(_event("e1", ["A"]), "X", now=0, through=["Y", "X"])  # detour A -> Y -> X
    kept.keep(_event("e2", ["A"]), "X", now=0, through=["X"])  # direct
    assert [m.id for m in kept.left("Y")] == ["e1"]
    assert [m.id for m in kept.left("X")] == ["e2"]
