from __future__ import annotations

import hashlib
import math
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from middleware.routing import (
    ChordRing,
    Event,
    Filter,
    FilterError,
    LatencyMap,
    Op,
    QueuePredictor,
    SubscriptionIndex,
    choose_broker,
    mean_processing_time,
    predicted_queue,
    round_robin,
)


def _sha(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16)


def _owner_brute_force(clusters: list[str], event_type: str) -> str:
    key = _sha(event_type)
    after = sorted((c for c in clusters if _sha(c) >= key), key=_sha)
    return after[0] if after else min(clusters, key=_sha)


CLUSTERS = [f"cluster-{i}" for i in range(12)]


@pytest.mark.parametrize("event_type", [f"type.{i}" for i in range(200)])
def test_owner_matches_an_independent_sha1_computation(event_type: str) -> None:
    assert ChordRing(CLUSTERS).owner(event_type) == _owner_brute_force(CLUSTERS, event_type)


def test_finger_routing_reaches_the_owner_in_log_hops() -> None:
    clusters = [f"c{i}" for i in range(64)]
    ring = ChordRing(clusters)
    rng = random.Random(3)
    for _ in range(300):
        start, event_type = rng.choice(clusters), f"e{rng.random()}"
        path = ring.route(start, event_type)
        assert path[0] == start and path[-1] == ring.owner(event_type)
        assert len(path) - 1 <= math.ceil(math.log2(len(clusters))) + 1


def test_a_join_hands_over_exactly_its_arc() -> None:
    ring = ChordRing(CLUSTERS)
    types = [f"t{i}" for i in range(2000)]
    before = {t: ring.owner(t) for t in types}
    handover = ring.join("newcomer")
    after = {t: ring.owner(t) for t in types}
    moved = {t for t in types if before[t] != after[t]}
    assert moved == {t for t in types if handover.covers(t)}
    assert all(after[t] == "newcomer" and before[t] == handover.previous_owner for t in moved)
    assert ring.leave("newcomer") == handover.previous_owner
    assert {t: ring.owner(t) for t in types} == before


def test_successor_list_and_predecessor() -> None:
    ring = ChordRing(CLUSTERS)
    order = ring.clusters
    i = order.index("cluster-3")
    assert ring.successors("cluster-3", 3) == [order[(i + k) % 12] for k in (1, 2, 3)]
    assert ring.predecessor(order[0]) == order[-1]


def test_latency_map_priorities() -> None:
    lm = LatencyMap(levels=5)
    lm.add("alarm", 1)
    lm.add("alarm", 1)
    lm.add("report", 5)
    lm.add("mixed", 1)
    lm.add("mixed", 4)
    assert (lm.priority("alarm"), lm.priority("report"), lm.priority("unknown")) == (9, 0, 0)
    assert lm.mean_level("mixed") == 2.5 and lm.priority("mixed") == 6  # 9*(5-2.5)/4 = 5.6
    with pytest.raises(ValueError):
        lm.add("x", 6)


def test_latency_map_takes_an_unsubscribed_level_out() -> None:
    lm = LatencyMap(levels=5)
    lm.add("mixed", 1)
    lm.add("mixed", 4)
    lm.add("mixed", 4)
    lm.remove("mixed", 1)
    assert lm.entries["mixed"] == (8, 2) and lm.priority("mixed") == 2  # mean 4: 9*1/4
    lm.remove("mixed", 4)
    lm.remove("mixed", 4)
    assert "mixed" not in lm.entries and lm.priority("mixed") == 0
    lm.remove("mixed", 3)  # a router that never counted it (joined later): left alone
    lm.remove("never", 2)
    assert lm.entries == {}
    lm.add("t", 2)
    lm.add("t", 2)
    lm.remove("t", 5)  # a level it never had: the mean stays a level (>= 1), not below
    assert lm.entries["t"] == (1, 1)


def test_queue_prediction_hand_computed() -> None:
    assert predicted_queue(10, 50, 30, 0.5) == 20.0
    assert predicted_queue(10, 10, 40, 0.5) == 0.0
    assert mean_processing_time(19, 10) == 1.0  # (19+1)/(2*10)
    assert mean_processing_time(0, 0) == 0.0  # idle, never measured: give it work
    assert mean_processing_time(3, 0) == math.inf  # a backlog nobody serves
    p = QueuePredictor(window_s=1.0)
    p.last_close = 100.0
    p.arrived(50)
    p.completed(30)
    assert p.close_window(101.0) == pytest.approx((20 + 1) / 60)  # q = 20, mu = 30
    assert p.predict(101.5) == pytest.approx((30 + 1) / 60)  # q grows 20/s for 0.5 s
    assert choose_broker({"master": 0.7, "slave-1": 0.2, "slave-2": 0.2}) == "slave-1"


def test_blind_dispatch_takes_turns_over_whoever_is_live() -> None:
    brokers: list[int | None] = [None, 0, 1]  # the master itself, then its slaves
    turn, chosen = 0, []
    for _ in range(7):
        broker, turn = round_robin(brokers, turn)
        chosen.append(broker)
    assert chosen == [None, 0, 1, None, 0, 1, None]
    assert round_robin([None, 1], turn) == (1, 0)  # slave 0 went silent: turns go on
    with pytest.raises(ValueError):
        round_robin([], 0)


def test_blind_dispatch_is_checked_at_start_up_and_on_a_live_switch(tmp_path) -> None:
    from pydantic import ValidationError

    from middleware.errors import ConfigurationError
    from middleware.routing.protocol import PhoenixTopology

    path = tmp_path / "phoenix.toml"
    path.write_text('[[cluster]]\nid = "A"\n')
    topology = PhoenixTopology.load(path)
    assert topology.blind_dispatch == "round_robin"
    switched = {**topology.model_dump(), "blind_dispatch": "master"}  # as a master applies it
    assert PhoenixTopology.model_validate(switched, strict=True).blind_dispatch == "master"
    with pytest.raises(ValidationError, match="blind_dispatch"):
        PhoenixTopology.model_validate({**switched, "blind_dispatch": "random"}, strict=True)
    path.write_text('blind_dispatch = "random"\n[[cluster]]\nid = "A"\n')
    with pytest.raises(ConfigurationError, match="blind_dispatch"):
        PhoenixTopology.load(path)


def test_a_masters_view_of_a_slave_counts_what_it_sent_since_the_report() -> None:
    from middleware.routing import RemoteBroker

    slave = RemoteBroker()
    slave.report(queue=2, service_rate=100, now=10.0)
    assert slave.predict(10.0) == pytest.approx(3 / 200)  # (2 + 1) / (2 * 100)
    slave.sent += 8  # dispatched since the report
    assert slave.predict(10.05) == pytest.approx((2 + 8 - 5 + 1) / 200)  # 5 served in 50 ms
    assert slave.predict(11.0) == pytest.approx(1 / 200)  # drained: q = 0
    slave.report(queue=0, service_rate=100, now=11.0)
    assert slave.sent == 0


def test_service_rate_from_busy_time_is_the_capacity_not_the_arrival_rate() -> None:
    p = QueuePredictor(window_s=1.0)
    p.last_close = 100.0
    for k in range(10):  # 10 events in the second, each taking 5 ms: busy 50 ms
        p.arrived(now=100.0 + k / 10)
        p.completed(now=100.0 + k / 10 + 0.005)
    t = p.close_window(101.0)
    assert p.arrival_rate == pytest.approx(10)
    assert p.service_rate == pytest.approx(200)  # 10 events / 0.05 s busy
    assert t == pytest.approx(1 / 400)  # q = 0: (0 + 1) / (2 * 200)
    p.arrived(now=101.2)  # an event still in progress at the window's end
    p.close_window(101.5)
    assert p.service_rate == pytest.approx(1 / 0.3)  # busy 0.3 s, nothing done
    p.completed(now=101.6)
    p.close_window(102.0)
    assert p.service_rate == pytest.approx(1 / 0.1)  # busy 101.5 -> 101.6 in this window
    # a measured backlog replaces the prediction: 30 waiting at mu = 10 -> T = 31 / 20
    assert p.close_window(102.5, observed_queue=30) == pytest.approx(31 / 20)


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


def test_quorum_reads_always_see_the_last_acknowledged_write() -> None:
    from itertools import combinations

    from middleware.routing import Quorum, Versioned

    q = Quorum.majority(3)
    assert (q.write, q.read) == (2, 2)
    with pytest.raises(ValueError, match="W \\+ R"):
        Quorum(3, 1, 2)
    replicas = ["m", "s1", "s2"]
    for acked in combinations(replicas, 2):  # every write set of size W
        assert q.written(acked) and not q.written(acked[:1])
        state = {r: (Versioned(2, "new") if r in acked else Versioned(1, "old")) for r in replicas}
        for asked in combinations(replicas, 2):  # every read set of size R
            assert q.resolve({r: state[r] for r in asked}) == Versioned(2, "new")
    assert q.resolve({"m": None, "s1": None}) is None


def test_replica_merge_keeps_the_newest_version_and_honours_deletes() -> None:
    from middleware.routing.replicas import TOMBSTONE, live, merge_replicas

    master = {"a": (3, {"v": "a3"}), "b": (1, {"v": "b1"})}
    slave0 = {"a": (2, {"v": "a2"}), "b": (4, TOMBSTONE), "c": (5, {"v": "c5"})}
    merged = merge_replicas([master, slave0], at_least=2)
    assert merged == {"a": (3, {"v": "a3"}), "b": (4, TOMBSTONE), "c": (5, {"v": "c5"})}
    assert live(merged) == {"a": (3, {"v": "a3"}), "c": (5, {"v": "c5"})}
    with pytest.raises(ValueError, match="needs 2 replies"):
        merge_replicas([master], at_least=2)


def _role(cls: type, cluster: dict[str, object], state_store: str = ":memory:") -> Any:
    """One Phoenix role of cluster B built in-process (its I/O is not started)."""
    from middleware.routing.protocol import PhoenixTopology
    from middleware.settings import Settings

    topology = PhoenixTopology.model_validate({"clusters": [cluster], "state_store": state_store})
    return cls(settings=Settings.load(), topology=topology, cluster=cluster["id"])


def test_master_keeps_events_until_a_backlog_makes_a_slave_sooner() -> None:
    from middleware.routing.timeliness import Dispatch

    dispatch = Dispatch(hop_s=0.002)
    master = QueuePredictor(last_close=100.0, service_rate=100.0)
    for j, q in ((0, 5.0), (1, 0.0)):  # the slaves' load reports, as they arrive
        dispatch.reported(j, q, 100.0, now=100.0)
    live = {0, 1}
    assert dispatch.choose(master, live, 100.0) is None  # nothing waiting: it keeps it
    master.queue = 40.0  # T = 41/200 s at the master; slave 1: 1/200 + 2 ms
    assert dispatch.choose(master, live, 100.0) == 1
    for _ in range(200):  # what it was sent since its report counts
        dispatch.dispatched(1, 0.002)
    assert dispatch.choose(master, live, 100.0) == 0
    master.queue = 5000.0  # still a backlog ...
    assert dispatch.choose(master, set(), 110.0) is None  # ... but silent slaves get nothing
    assert dispatch.choose(master, {2}, 100.0) is None  # nor one that never reported


def test_blind_dispatch_turns_over_the_master_and_its_reporting_live_slaves() -> None:
    from middleware.routing.timeliness import Dispatch

    dispatch = Dispatch()
    dispatch.reported(0, 0.0, 1.0, now=0.0)
    dispatch.reported(1, 0.0, 1.0, now=0.0)
    assert [dispatch.choose_blind({0, 1, 2}) for _ in range(4)] == [None, 0, 1, None]
    assert [dispatch.choose_blind({1}) for _ in range(2)] == [1, None]  # slave 0 silent
    assert dispatch.choose_blind({0, 1}, mode="master") is None


def test_masters_snapshot_their_table_periodically(tmp_path) -> None:
    import asyncio

    from middleware.routing.replicas import TOMBSTONE
    from middleware.routing.roles import RouterMaster

    async def scenario() -> None:
        router = _role(RouterMaster, {"id": "B"}, str(tmp_path / "s.sqlite3"))
        replicas = router.replicas
        await replicas.write("a", {"level_sum": 1, "count": 1})
        await replicas.write("b", {"level_sum": 2, "count": 1})
        await replicas.write("b", None)  # deleted: a tombstone
        router.store.snapshot("B/router", "routing_table", {})  # the store lost its copy
        assert await replicas.persist_once() is True
        assert await replicas.persist_once() is False  # nothing changed since
        saved = router.store.load("B/router", "routing_table")
        assert saved == {"a": (1, {"level_sum": 1, "count": 1}), "b": (3, TOMBSTONE)}
        stop = asyncio.Event()
        loop = asyncio.create_task(replicas.persist_loop(0.05, stop))
        await replicas.write("c", {"level_sum": 5, "count": 1})
        await asyncio.sleep(0.2)
        stop.set()
        await loop
        assert router.store.load("B/router", "routing_table")["c"][0] == 4
        assert router.counters["snapshots"] == 2
        router.store.close()

    asyncio.run(scenario())


def test_a_replica_write_does_not_stall_the_loop_while_the_store_is_busy(tmp_path) -> None:
    import asyncio
    import threading
    import time

    from middleware.routing.roles import RouterMaster

    async def scenario() -> None:
        router = _role(RouterMaster, {"id": "B"}, str(tmp_path / "s.sqlite3"))
        held = threading.Event()

        def snapshot_elsewhere() -> None:  # another thread holds the store for 0.5 s
            with router.store._lock:
                held.set()
                time.sleep(0.5)

        busy = threading.Thread(target=snapshot_elsewhere)
        busy.start()
        held.wait()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        await router.replicas.write("a", {"level_sum": 1, "count": 1})
        during = ticks - before
        tick.cancel()
        busy.join()
        assert during >= 5, during  # the loop went on while the write waited for the store
        assert router.store.load("B/router", "routing_table")["a"][0] == 1
        router.store.close()

    asyncio.run(scenario())


def test_bench_summary_averages_repeats_and_keeps_their_spread() -> None:
    from middleware.bench.phoenix_timeliness import summarize

    def row(mechanism: str, rate: float, mean: float, p99: float | None) -> dict[str, object]:
        return {
            "subscriptions": 1000,
            "mechanism": mechanism,
            "rate": rate,
            "mean_ms": mean,
            "p50_ms": mean,
            "p99_ms": p99,
            "urgent_mean_ms": None,
            "bulk_mean_ms": mean,
        }

    rows = [row("none", 100, 10.0, 30.0), row("none", 100, 20.0, 50.0)]
    rows += [row("none", 100, 60.0, None), row("inner", 100, 5.0, 9.0)]
    rows[0]["cpu"] = {"machine": 50.0, "router": 20.0}
    rows[1]["cpu"] = {"machine": 70.0, "router": None}
    summary = {(r["mechanism"], r["rate"]): r for r in summarize(rows)}
    none = summary[("none", 100)]
    assert none["repeats"] == 3
    assert none["mean_ms"] == 30.0 and none["mean_ms_range"] == [10.0, 60.0]
    assert none["p99_ms"] == 40.0 and none["p99_ms_range"] == [30.0, 50.0]  # None skipped
    assert none["urgent_mean_ms"] is None and "urgent_mean_ms_range" not in none
    assert summary[("inner", 100)]["mean_ms_range"] == [5.0, 5.0]
    assert none["cpu"] == {"machine": 60.0, "router": 20.0}  # rows without a reading skipped
    assert summary[("inner", 100)]["cpu"] == {}


def test_clusters_on_one_rabbitmq_share_a_connection_key() -> None:
    from middleware.routing.protocol import PhoenixTopology
    from middleware.routing.roles import cluster_settings
    from middleware.settings import Settings

    own = ["amqp://127.0.0.1:6001/"]
    topology = PhoenixTopology.model_validate(
        {
            "clusters": [
                {"id": "A"},
                {"id": "B", "amqp_urls": own},
                {"id": "C", "amqp_urls": own},
                {"id": "D", "vhost": "/d"},
                {"id": "E", "amqp_urls": own, "vhost": "/d"},
            ]
        }
    )
    settings = Settings.load()
    assert cluster_settings(settings, topology, "A") == ("default", settings)
    key_b, settings_b = cluster_settings(settings, topology, "B")
    assert key_b == cluster_settings(settings, topology, "C")[0] == f"{own[0]}|/"
    assert list(settings_b.amqp_urls) == own and settings_b.vhost == "/"
    # a vhost of the process's own RabbitMQ, and one of another RabbitMQ: each its own key
    key_d, settings_d = cluster_settings(settings, topology, "D")
    assert settings_d.amqp_urls == settings.amqp_urls and settings_d.vhost == "/d"
    key_e, settings_e = cluster_settings(settings, topology, "E")
    assert list(settings_e.amqp_urls) == own and settings_e.vhost == "/d"
    assert len({"default", key_b, key_d, key_e}) == 4


def test_a_phoenix_client_refuses_a_connection_to_another_clusters_rabbitmq() -> None:
    from middleware.errors import ConfigurationError
    from middleware.routing.client import PhoenixClient
    from middleware.routing.protocol import PhoenixTopology
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    topology = PhoenixTopology.model_validate(
        {"clusters": [{"id": "A"}, {"id": "B", "vhost": "/b"}]}
    )
    client = AsyncClient(settings=Settings.load())  # never connected: refused before any I/O
    PhoenixClient(client, topology=topology, cluster="A")
    with pytest.raises(ConfigurationError, match=r"cluster 'B' is on .* vhost '/b'"):
        PhoenixClient(client, topology=topology, cluster="B")
    with pytest.raises(ConfigurationError, match="not in the topology"):
        PhoenixClient(client, topology=topology, cluster="Z")


def test_a_bench_deployment_lists_every_role_queue_and_survives_a_failed_cleanup(
    tmp_path, monkeypatch, capsys
) -> None:
    """The queues a deployment deletes are exactly its roles' inboxes and control queues;
    a cleanup that fails (broker gone at the end) is reported, not raised over the cells."""
    from middleware.bench.phoenix_timeliness import Deployment
    from middleware.routing.ids import role_queues

    deployment = Deployment(tmp_path, prefix="px", amqp_urls=["amqp://127.0.0.1:1/"])
    names = role_queues(deployment.topology)
    assert len(names) == len(set(names)) == 3 * 6 * 2  # 6 roles: inbox + control each
    assert "px.A.router.control" in names and "px.C.match.0.slave.1" in names

    async def unreachable() -> int:
        raise OSError("connection refused")

    monkeypatch.setattr(deployment, "up", lambda: None)
    monkeypatch.setattr(deployment, "down", lambda: None)
    monkeypatch.setattr(deployment, "delete_queues", unreachable)
    with deployment.running():
        pass
    assert "queues of px not deleted: connection refused" in capsys.readouterr().err


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
