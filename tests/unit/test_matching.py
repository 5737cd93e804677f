"""``matching``: filters, events and the subscription index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.routing import (
    Event,
    Filter,
    FilterError,
    Op,
    SubscriptionIndex,
)


def test_malformed_filters_and_events_are_refused() -> None:
    for bad in (
        [("price", "~", 1)],
        [("price", "<", True)],
        [("", "=", 1)],
        [("region", "in", [])],
        [("name", "prefix", 3)],
        [("a", "exists", 1)],
        ["x"],
    ):
        with pytest.raises(FilterError):
            Filter.parse(bad)
    with pytest.raises(FilterError):
        Event.parse({"event_type": "bad type!", "attributes": {}})
    with pytest.raises(FilterError):
        Event.parse({"event_type": "quote", "attributes": {"p": [1, 2]}})


@pytest.mark.parametrize(
    "spec",
    [
        5,
        "price",
        b"x",
        {"price": 1},
        [("x", "!=", 2**70)],
        [("x", "in", [1, -(2**64)])],
        [("x", "<", float("inf"))],
        [("x", "=", float("nan"))],
    ],
)
def test_a_filter_the_index_cannot_hold_is_a_filter_error(spec) -> None:
    with pytest.raises(FilterError):
        Filter.parse(spec)


def test_events_carry_numbers_a_filter_can_compare() -> None:
    assert Filter.parse([("x", "<", 2**63 - 1)]).matches({"x": -(2**63)})
    for bad in (2**63, float("nan"), float("-inf")):
        with pytest.raises(FilterError):
            Event.parse({"event_type": "t", "attributes": {"x": bad}})


scalars = st.one_of(
    st.integers(-3, 3),
    st.sampled_from([-1.5, 0.0, 1.0, 2.5]),
    st.sampled_from(["a", "ab", "b", "abc"]),
    st.booleans(),
)


ops = st.sampled_from(["=", "!=", "<", "<=", ">", ">=", "in", "prefix", "exists"])


@st.composite
def predicates(draw):
    attr = draw(st.sampled_from(["x", "y", "z"]))
    op = draw(ops)
    if op == "exists":
        return (attr, op)
    if op == "in":
        return (attr, op, draw(st.lists(scalars, min_size=1, max_size=3)))
    if op == "prefix":
        return (attr, op, draw(st.sampled_from(["", "a", "ab", "b"])))
    if op in ("<", "<=", ">", ">="):
        return (attr, op, draw(st.one_of(st.integers(-3, 3), st.sampled_from([0.5, "a", "b"]))))
    return (attr, op, draw(scalars))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(predicates(), max_size=3), min_size=1, max_size=25),
    st.lists(st.dictionaries(st.sampled_from(["x", "y", "z"]), scalars), min_size=1, max_size=10),
)
def test_index_matches_exactly_like_brute_force(specs, events) -> None:
    index = SubscriptionIndex()
    filters = {f"s{i}": Filter.parse(spec) for i, spec in enumerate(specs)}
    for sid, flt in filters.items():
        index.add(sid, flt)
    index.remove("s0")
    index.add("s0", filters["s0"])
    for attributes in events:
        expected = {sid for sid, flt in filters.items() if flt.matches(attributes)}
        assert index.match(attributes) == expected


@settings(max_examples=200, deadline=None)
@given(st.lists(predicates(), max_size=4))
def test_a_filter_survives_its_json_form(spec) -> None:
    """What a client sends (``Filter.spec`` through JSON) parses back to the same filter."""
    import json

    flt = Filter.parse(spec)
    assert Filter.parse(json.loads(json.dumps(flt.spec()))) == flt


def test_compiled_predicates_agree_with_the_reference_on_every_value() -> None:
    from middleware.routing.matching import Predicate, _compile  # the hot path, tested alone

    values = [-1, 0, 1, 2, 0.0, 1.0, 1.5, True, False, "", "a", "ab", "b"]
    checked = 0
    for op in Op:
        if op is Op.EXISTS:
            operands: list[object] = [None]
        elif op is Op.IN:
            operands = [(1,), (True, "a"), (0.0, "b", False)]
        elif op is Op.PREFIX:
            operands = ["", "a", "ab"]
        elif op in (Op.LT, Op.LE, Op.GT, Op.GE):
            operands = [v for v in values if not isinstance(v, bool)]
        else:
            operands = values
        for operand in operands:
            p = Predicate("x", op, operand)  # type: ignore[arg-type]
            test = _compile(p)
            for x in values:
                assert test(x) == p.matches({"x": x}), (op, operand, x)
                checked += 1
    assert checked > 500


def test_matching_work_does_not_grow_with_subscriptions() -> None:
    def work_per_match(n: int) -> float:
        index = SubscriptionIndex()
        for i in range(n):  # each subscription: its own symbol and a price bound
            index.add(f"s{i}", Filter.parse([("symbol", "=", f"S{i}"), ("price", "<", i % 100)]))
        for i in range(0, n, n // 100):
            matched = index.match({"symbol": f"S{i}", "price": 50})
            assert matched == ({f"s{i}"} if i % 100 > 50 else set())
        return index.work / 100

    assert work_per_match(1_000) == work_per_match(100_000) == 1.0
