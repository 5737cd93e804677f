from __future__ import annotations

import math
import random
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.balancer.factors import (
    PredictiveChooser,
    ReplicaReport,
    WeightedPicker,
    inverse_factors,
    paper_factors,
)
from middleware.errors import InvalidArgument


def test_the_papers_worked_example() -> None:
    # (b1:5),(b2:1),(b3:3) -> sorted (b2:1),(b3:3),(b1:5) -> values 5,3,1 handed back
    assert paper_factors([5, 1, 3]) == [1, 5, 3]


def test_gcd_is_divided_out() -> None:
    assert paper_factors([10, 2, 6]) == [1, 5, 3]


@pytest.mark.parametrize(
    ("averages", "expected"),
    [
        ([0, 0, 0], [1, 1, 1]),  # all zero: equal
        ([0.2, 0.4], [1, 1]),  # all round to zero: equal
        ([0, 4], [1, 0]),  # one zero: the longest gets T=0 (literal paper)
        ([2, 2, 4], [2, 2, 1]),  # ties share the largest value handed to their group
        ([2.5, 1.4], [1, 3]),  # rounded half-up to 3 and 1 first
        ([7], [1]),
    ],
)
def test_defined_edge_cases(averages, expected) -> None:
    assert paper_factors(averages) == expected


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        paper_factors([])
    with pytest.raises(ValueError):
        paper_factors([1, -1])
    with pytest.raises(ValueError):
        inverse_factors([math.nan])


lengths = st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=8)


@given(lengths)
def test_paper_factors_properties(b) -> None:
    factors = paper_factors(b)
    assert len(factors) == len(b) and all(f >= 0 for f in factors) and sum(factors) > 0
    for i in range(len(b)):
        for j in range(len(b)):
            if b[i] < b[j]:
                assert factors[i] >= factors[j]  # a shorter queue never gets less
            if b[i] == b[j]:
                assert factors[i] == factors[j]  # equal queues, equal factors
    # the multiset of T values is preserved up to tie sharing
    if any(b):
        c = math.gcd(*b)
        assert max(factors) == max(x // c for x in b)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=8))
def test_inverse_is_monotone(b) -> None:
    w = inverse_factors(b)
    for i in range(len(b)):
        for j in range(len(b)):
            if b[i] < b[j]:
                assert w[i] >= w[j]


def test_picker_follows_the_weights() -> None:
    picker = WeightedPicker([1, 5, 3], random.Random(7))
    counts = Counter(picker.pick() for _ in range(90_000))
    assert set(counts) == {0, 1, 2}
    for i, w in enumerate([1, 5, 3]):
        assert counts[i] / 90_000 == pytest.approx(w / 9, abs=0.01)
    assert Counter(WeightedPicker([0, 2], random.Random(1)).pick() for _ in range(100)) == {1: 100}
    floats = WeightedPicker([0.5, 0.25, 0.25], random.Random(3))
    assert Counter(floats.pick() for _ in range(40_000))[0] / 40_000 == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError):
        WeightedPicker([0, 0])


def test_predicted_length_hand_computed() -> None:
    chooser = PredictiveChooser(2, random.Random(0))
    chooser.report(0, ReplicaReport(length=10, arrival_rate=50, service_rate=30, at=100.0))
    chooser.report(1, ReplicaReport(length=10, arrival_rate=10, service_rate=40, at=100.0))
    assert chooser.predicted(0, 100.5) == pytest.approx(20.0)  # 10 + (50-30)*0.5
    assert chooser.predicted(1, 100.5) == 0.0  # 10 - 15 -> clamped at 0
    assert chooser.choose(100.5) == 1 and chooser.predicted(1, 100.5) == 0.0  # 10 - 15 + 1


def test_own_sends_are_not_counted_twice() -> None:
    chooser = PredictiveChooser(1)
    chooser.report(0, ReplicaReport(length=0, arrival_rate=0, service_rate=0, at=0.0))
    for _ in range(20):
        chooser.choose(0.5)  # this publisher sent 20 in 1 s
    # the sidecar then reports a = 20/s (all of it ours) and mu = 20/s
    chooser.report(0, ReplicaReport(length=5, arrival_rate=20, service_rate=20, at=1.0))
    assert chooser.own_rate[0] == pytest.approx(20.0)
    # 1 s later with 3 more of ours: 5 + (0 others - 20 served)*1 + 3 -> clamped at 0
    for _ in range(3):
        chooser.choose(1.5)
    assert chooser.predicted(0, 2.0) == 0.0
    assert chooser.predicted(0, 1.1) == pytest.approx(5 - 2 + 3)


def test_predictive_spreads_when_equal() -> None:
    chooser = PredictiveChooser(3, random.Random(1))
    counts = Counter(chooser.choose(0.0) for _ in range(3000))
    assert max(counts.values()) - min(counts.values()) <= 2


@pytest.mark.parametrize(
    "bad", [[math.inf, 1, 1], [math.nan, 1, 1], [-1, 1], ["abc", 1], [None, 1], []]
)
def test_factors_and_weights_refuse_what_is_not_a_finite_non_negative_number(bad) -> None:
    for build in (paper_factors, inverse_factors, WeightedPicker):
        with pytest.raises(InvalidArgument):
            build(bad)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"period_s": float("nan")}, "period_s"),
        ({"period_s": -1}, "period_s"),
        ({"period_s": 0}, "period_s"),
        ({"topic": ""}, "topic"),
        ({"replicas": "x"}, "replicas"),
        (
            {
                "replicas": [
                    {"queue": "t.r0", "length": "abc", "arrival_rate": 0, "service_rate": 0}
                ]
            },
            "length",
        ),
        (
            {"replicas": [{"queue": "t.r0", "length": None, "arrival_rate": 0, "service_rate": 0}]},
            "length",
        ),
        (
            {
                "replicas": [
                    {
                        "queue": "t.r0",
                        "length": 1,
                        "arrival_rate": 0,
                        "service_rate": 0,
                        "exists": "yes",
                    }
                ]
            },
            "exists",
        ),
    ],
)
def test_a_malformed_load_report_is_refused_naming_the_field(change, names) -> None:
    import json

    from middleware.balancer import LoadReport

    good = {
        "topic": "t",
        "period_s": 1.0,
        "sent_at": 1.0,
        "replicas": [{"queue": "t.r0", "length": 1, "arrival_rate": 0, "service_rate": 0}],
    }
    assert LoadReport.decode(json.dumps(good).encode()).replicas[0].exists
    with pytest.raises(InvalidArgument, match=names):
        LoadReport.decode(json.dumps({**good, **change}).encode())


def test_a_missing_replica_is_never_chosen_and_none_left_is_unroutable() -> None:
    import asyncio

    from middleware.balancer import BalancedPublisher
    from middleware.errors import Unroutable
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    for algorithm in ("round_robin", "paper", "inverse", "predictive"):
        publisher = BalancedPublisher(
            AsyncClient(settings=Settings.load()), topic="t", replicas=3, algorithm=algorithm
        )
        publisher.missing = {1}
        picks = {publisher.choose() for _ in range(300)}
        assert picks == {0, 2}, algorithm
        assert {publisher.choose(exclude={0}) for _ in range(50)} == {2}
        with pytest.raises(Unroutable):
            publisher.choose(exclude={0, 2})
    asyncio.run(asyncio.sleep(0))


@pytest.mark.parametrize(
    ("topic", "replicas", "says"),
    [
        ("", 3, "the topic is empty"),
        ("a\nb", 3, "control characters"),
        ("t" * 201, 3, "201 bytes long"),
        (None, 3, "must be a string"),
        ("t", 0, "at least one replica"),
        ("t", True, "at least one replica"),
    ],
)
def test_the_library_refuses_a_topic_the_broker_cannot_carry(topic, replicas, says) -> None:
    import asyncio

    from middleware.balancer import BalancedPublisher, declare_replicated_topic
    from middleware.errors import InvalidArgument
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    settings = Settings.load()
    with pytest.raises(InvalidArgument, match=says):
        BalancedPublisher(AsyncClient(settings=settings), topic=topic, replicas=replicas)
    with pytest.raises(InvalidArgument, match=says):  # before any connection is tried
        asyncio.run(declare_replicated_topic(settings, topic, replicas))


def test_a_stalled_replica_is_chosen_only_when_no_other_is_left() -> None:
    import asyncio

    from middleware.balancer import BalancedPublisher
    from middleware.errors import InvalidArgument, Unroutable
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    client = AsyncClient(settings=Settings.load())
    for algorithm in ("round_robin", "paper", "inverse", "predictive"):
        publisher = BalancedPublisher(client, topic="t", replicas=3, algorithm=algorithm)
        publisher.stalled = {1}
        assert {publisher.choose() for _ in range(300)} == {0, 2}, algorithm
        assert {publisher.choose(exclude={0, 2}) for _ in range(20)} == {1}  # the last one left
        publisher.missing = {1}
        with pytest.raises(Unroutable):
            publisher.choose(exclude={0, 2})
    with pytest.raises(InvalidArgument, match="stall_s"):
        BalancedPublisher(client, topic="t", replicas=3, stall_s=0)
    asyncio.run(asyncio.sleep(0))


def test_a_replica_that_refused_a_publish_is_left_out_for_recheck_s() -> None:
    import time

    from middleware.balancer.choice import Choice

    for algorithm in ("round_robin", "paper", "inverse", "predictive"):
        choice = Choice(topic="t", replicas=3, algorithm=algorithm, recheck_s=0.2)
        choice.refused(1)
        assert choice.nacked == 1
        assert {choice.choose() for _ in range(300)} == {0, 2}, algorithm
        assert {choice.choose(exclude={0, 2}) for _ in range(20)} == {1}  # the last one left
        time.sleep(0.25)
        assert 1 in {choice.choose() for _ in range(300)}, algorithm  # chosen again


def test_a_stalled_replica_comes_back_when_its_own_stalled_publishes_end() -> None:
    import asyncio

    from middleware.balancer import BalancedPublisher
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    async def scenario() -> None:
        publisher = BalancedPublisher(AsyncClient(settings=Settings.load()), topic="t", replicas=3)
        gates = {i: asyncio.Event() for i in (1, 2)}

        async def held(i: int) -> str:
            await gates[i].wait()
            return f"r{i}"

        tasks = {i: asyncio.ensure_future(held(i)) for i in (1, 2)}
        for i, task in tasks.items():
            publisher._stall_send(i, task)
        assert publisher.stalled == {1, 2}
        gates[2].set()
        await tasks[2]
        await asyncio.sleep(0)  # (done callbacks)
        assert publisher.stalled == {1}  # replica 1's publish still waits
        await publisher.close()  # ends what is still stalled
        assert publisher.stalled == set()

    asyncio.run(scenario())


def test_the_sync_face_tries_a_stalled_replica_again_after_recheck_s() -> None:
    """The sync face has no running publish to bring a stalled replica back: it is left
    out for ``recheck_s`` (looked at when a publish comes), then chosen again; a
    confirm from it ends its stall at once."""
    import time

    from middleware.balancer import SyncBalancedPublisher
    from middleware.settings import Settings
    from middleware.transport import SyncClient

    client = SyncClient(settings=Settings.load())  # never connected: nothing is sent
    publisher = SyncBalancedPublisher(
        client, topic="t", replicas=3, algorithm="round_robin", recheck_s=0.05
    )
    publisher._stall_here(2)
    assert publisher.stalled == {2}
    publisher.look()
    assert publisher.stalled == {2}  # within recheck_s: still out
    assert {publisher.choose() for _ in range(30)} == {0, 1}
    time.sleep(0.06)
    publisher.look()
    assert publisher.stalled == set()
    assert 2 in {publisher.choose() for _ in range(30)}
    publisher._stall_here(1)
    publisher._stall_here(1)  # stalled again before its probation ended: one stall
    publisher._confirmed(1)
    assert publisher.stalled == set()


def test_both_balanced_faces_run_on_the_test_doubles() -> None:
    """A service's unit tests can run either balanced publisher on the in-memory
    doubles: each message in exactly one replica, a deleted replica left out and
    chosen again once it exists."""
    import asyncio

    from middleware.balancer import BalancedPublisher, SyncBalancedPublisher, replica_names
    from middleware.testing import InMemoryBroker, InMemoryClient, InMemorySyncClient
    from middleware.transport import QueueSpec

    broker = InMemoryBroker()
    queues = replica_names("t", 3)
    sync_client = InMemorySyncClient(broker=broker).connect()
    for name in queues:
        sync_client.declare_queue(QueueSpec(name))
    sync = SyncBalancedPublisher(
        sync_client, topic="t", replicas=3, algorithm="round_robin", recheck_s=0.0
    ).start()
    assert sorted(sync.publish(b"m") for _ in range(6)) == sorted(queues * 2)
    sync_client.delete_queue(queues[1])
    assert {sync.publish(b"m") for _ in range(6)} == {queues[0], queues[2]}
    assert sync.missing == {1}
    sync_client.declare_queue(QueueSpec(queues[1]))
    assert queues[1] in {sync.publish(b"m") for _ in range(6)}

    async def asynchronous() -> list[str]:
        client = await InMemoryClient(broker=broker).connect()
        publisher = await BalancedPublisher(
            client, topic="t", replicas=3, algorithm="predictive"
        ).start()
        sent = [await publisher.publish(b"m") for _ in range(30)]
        await publisher.close()
        await client.close()
        return sent

    assert set(asyncio.run(asynchronous())) == set(queues)
    # every confirmed message in one replica: 18 sync and 30 async, less the 2 that went
    # with the deleted queue
    assert sum(broker.queue_length(q) for q in queues) == 18 + 30 - 2
