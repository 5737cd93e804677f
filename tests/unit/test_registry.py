"""``registry.Registry`` and ``records``: what a match broker holds and where matches go."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.phoenix.ring import ChordRing
from middleware.phoenix.ring import Handover as Arc
from middleware.routing.matching import FilterError
from middleware.routing.records import LatencyEntry, RecordError, SubscriptionRecord
from middleware.routing.registry import Registry


def _record(event_type: str = "quotes", queue: str = "q", **kw: object) -> SubscriptionRecord:
    return SubscriptionRecord(event_type, [["price", "<", 10]], queue, **kw)  # type: ignore[arg-type]


def test_records_round_trip_and_read_what_older_versions_wrote() -> None:
    record = _record(latency_level=2, confirm="e2e", home="A", path=["A", "B"])
    assert SubscriptionRecord.from_document(record.to_document()) == record
    old = {"event_type": "quotes", "filter": [], "queue": "q", "latency_level": 3}
    assert SubscriptionRecord.from_document(old) == SubscriptionRecord("quotes", [], "q", 3)
    assert SubscriptionRecord.from_document(old).homed("B") == "B"
    for bad in (
        {"filter": [], "queue": "q"},
        {**old, "latency_level": "1"},
        {**old, "confirm": "maybe"},
        {**old, "path": "AB"},
        {**old, "filter": "price < 10"},
    ):
        with pytest.raises(RecordError):
            SubscriptionRecord.from_document(bad)
    assert LatencyEntry.from_document(LatencyEntry(3, 2).to_document()) == LatencyEntry(3, 2)
    with pytest.raises(RecordError):
        LatencyEntry.from_document({"count": 1})


def test_one_copy_per_queue_e2e_if_any_asked_and_departed_homes_named() -> None:
    registry = Registry("B")
    registry.add("s1", _record(queue="q1", home="A"))
    registry.add("s2", _record(queue="q1", home="A", confirm="e2e"))
    registry.add("s3", _record(queue="q2"))  # no home: the owner's (B)
    registry.add("s4", _record(queue="q3", home="C"))
    matched = registry.match("quotes", {"price": 1})
    assert matched == {"s1", "s2", "s3", "s4"}
    copies = registry.copies(matched, departed={"C"})
    assert copies.queues == {("A", "q1"): "e2e", ("B", "q2"): "broker"}
    assert copies.departed == ["q3 (cluster C)"]
    assert registry.match("quotes", {"price": 11}) == set()


def test_a_filter_the_index_refuses_changes_nothing() -> None:
    registry = Registry("B")
    registry.add("s1", _record())
    with pytest.raises(FilterError):
        registry.add("s1", SubscriptionRecord("quotes", [["price", "~", 1]], "q"))
    assert registry.match("quotes", {"price": 1}) == {"s1"}
    assert "without 'queue'" in (registry.hold("s2", {"event_type": "x", "filter": []}) or "")
    assert "s2" not in registry


def test_an_arc_carries_exactly_the_records_of_its_types() -> None:
    ring = ChordRing(["A", "B", "C"])
    joiner = next(f"D{i}" for i in range(500) if ring.owner(f"D{i}") == "B")
    handover = ring.join(joiner)
    assert handover is not None
    registry = Registry("B")
    types = [f"t{i}" for i in range(200)]
    for i, t in enumerate(types):
        registry.add(f"s{i}", _record(event_type=t))
    arc = Arc(joiner, "B", handover.start, handover.end)  # as the Handover message has it
    moving = {r.event_type for _, r in registry.in_arc(arc.covers)}
    assert moving == {t for t in types if ring.owner(t) == joiner}


def test_restored_records_are_indexed_when_their_first_event_comes() -> None:
    registry = Registry("B")
    registry.add("kept", _record(queue="mine"))
    found, refused = registry.restore(
        {
            "quotes": {
                "kept": _record(queue="theirs").to_document(),  # held here: ours stays
                "r1": _record(queue="r1", home="C").to_document(),
                "bad": {"event_type": "quotes"},
            },
            "trades": {"r2": _record(event_type="trades", queue="r2").to_document()},
        }
    )
    assert sorted(found) == ["r1", "r2"] and [r.split(":")[0] for r in refused] == ["bad"]
    assert sorted(registry.unindexed) == ["quotes", "trades"]
    assert registry.match("quotes", {"price": 1}) == {"kept", "r1"}  # indexed on demand
    assert registry.get("kept").queue == "mine"  # type: ignore[union-attr]
    registry.remove("r2")  # unsubscribed before its type was indexed
    assert registry.index_type("trades") == [] and registry.match("trades", {"price": 1}) == set()
    assert sorted(registry.unindexed) == []


def test_a_background_indexer_s_small_steps_leave_the_rest_to_match() -> None:
    registry = Registry("B")
    docs = {f"r{i}": _record(queue=f"q{i}").to_document() for i in range(5)}
    registry.restore({"quotes": docs})
    assert registry.index_some("quotes", 2) == []
    assert len(registry.unindexed["quotes"]) == 3  # the rest wait
    assert registry.match("quotes", {"price": 1}) == set(docs)  # match indexes them
    assert registry.unindexed == {}
    assert registry.index_some("quotes", 2) == []  # nothing left: nothing done


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "remove", "restore", "index", "index_some"]),
            st.integers(0, 5),
            st.sampled_from(["a", "b"]),
        ),
        max_size=40,
    )
)
def test_whatever_the_order_matches_are_exactly_the_held_records(ops: list) -> None:
    """Adds, removes, restores and lazy indexing (whole types or a few records at a
    time) in any order: an event matches exactly the records held for its type, each
    once."""
    registry = Registry("B")
    held: dict[str, str] = {}  # sid -> event type, the reference
    for op, n, event_type in ops:
        sid = f"s{n}"
        if op == "add":
            registry.add(sid, _record(event_type=event_type))
            held[sid] = event_type
        elif op == "remove":
            registry.remove(sid)
            held.pop(sid, None)
        elif op == "restore":
            found, _ = registry.restore({event_type: {sid: _record(event_type).to_document()}})
            if found:
                held[sid] = event_type
        elif op == "index_some":  # a background indexer's small step: n of them
            registry.index_some(event_type, n)
        else:
            registry.index_type(event_type)
    for event_type in ("a", "b"):
        expected = {sid for sid, t in held.items() if t == event_type}
        assert registry.match(event_type, {"price": 0}) == expected
    assert len(registry) == len(held)
