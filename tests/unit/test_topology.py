from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from middleware.transport.replay import Replay, Verdict, absent
from middleware.transport.topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
    TopologyRecord,
    topic_matches,
)


def _record() -> TopologyRecord:
    r = TopologyRecord()
    r.add(ExchangeSpec("d", ExchangeType.DIRECT))
    r.add(ExchangeSpec("f", ExchangeType.FANOUT))
    r.add(ExchangeSpec("t", ExchangeType.TOPIC))
    r.add(ExchangeSpec("h", ExchangeType.HEADERS))
    for q in ("q1", "q2", "q3"):
        r.add(QueueSpec(q))
    r.add(BindingSpec("q1", "d", "a"))
    r.add(BindingSpec("q2", "d", "a"))
    r.add(BindingSpec("q3", "d", "b"))
    r.add(BindingSpec("q1", "f"))
    r.add(BindingSpec("q2", "f"))
    r.add(BindingSpec("q1", "t", "orders.*.eu"))
    r.add(BindingSpec("q2", "t", "orders.#"))
    r.add(BindingSpec("q1", "h", arguments={"x-match": "all", "k": 1, "z": "y"}))
    r.add(BindingSpec("q2", "h", arguments={"x-match": "any", "k": 1, "z": "y"}))
    return r


@pytest.mark.parametrize(
    ("exchange", "key", "headers", "expected"),
    [
        ("d", "a", None, {"q1", "q2"}),
        ("d", "b", None, {"q3"}),
        ("d", "c", None, set()),
        ("f", "anything", None, {"q1", "q2"}),
        ("t", "orders.new.eu", None, {"q1", "q2"}),
        ("t", "orders", None, {"q2"}),
        ("t", "orders.new.us", None, {"q2"}),
        ("h", "", {"k": 1, "z": "y"}, {"q1", "q2"}),
        ("h", "", {"k": 1}, {"q2"}),
        ("h", "", {"k": 2}, set()),
        ("", "q3", None, {"q3"}),
        ("unknown", "a", None, set()),
    ],
)
def test_route_like_the_broker(exchange, key, headers, expected) -> None:
    assert _record().route(exchange, key, headers) == expected


def _reference(pattern: str, key: str) -> bool:
    """Brute force: expand '#' into every possible count of words."""
    pw, kw = pattern.split("."), key.split(".")

    def go(i: int, j: int) -> bool:
        if i == len(pw):
            return j == len(kw)
        if pw[i] == "#":
            return any(go(i + 1, k) for k in range(j, len(kw) + 1))
        return j < len(kw) and pw[i] in ("*", kw[j]) and go(i + 1, j + 1)

    return go(0, 0)


words = st.sampled_from(["a", "b", "c"])


@given(
    st.lists(st.one_of(words, st.just("*"), st.just("#")), min_size=1, max_size=5),
    st.lists(words, min_size=1, max_size=6),
)
def test_topic_matches_reference(pattern, key) -> None:
    p, k = ".".join(pattern), ".".join(key)
    assert topic_matches(p, k) == _reference(p, k)


@pytest.mark.parametrize(
    ("pattern", "key", "ok"),
    [
        ("#", "a.b", True),
        ("a.#", "a", True),
        ("#.a", "a", True),
        ("*.a", "a", False),
        ("a.*.c", "a.b.c", True),
        ("a.*.c", "a.c", False),
        ("a.#.c", "a.c", True),
    ],
)
def test_topic_examples(pattern, key, ok) -> None:
    assert topic_matches(pattern, key) is ok


def test_replay_order_and_forgetting() -> None:
    r = _record()
    r.add(ConsumerSpec("q1", "c1", 10))
    kinds = [type(s).__name__ for s in r.replay_plan()]
    assert kinds == sorted(
        kinds, key=["ExchangeSpec", "QueueSpec", "BindingSpec", "ConsumerSpec"].index
    )
    r.forget_queue("q1")
    assert "q1" not in r.route("d", "a") and "c1" not in r.consumers


def test_queue_arguments() -> None:
    spec = QueueSpec(
        "q",
        max_priority=5,
        dead_letter_exchange="dlx",
        max_length=10,
        message_ttl_ms=1000,
        leader_locator="client-local",
    )
    assert spec.declare_arguments() == {
        "x-queue-type": "quorum",
        "x-max-priority": 5,
        "x-dead-letter-exchange": "dlx",
        "x-max-length": 10,
        "x-message-ttl": 1000,
        "x-queue-leader-locator": "client-local",
    }
    with pytest.raises(ValueError, match="must be durable"):
        QueueSpec("tmp", exclusive=True)
    assert QueueSpec("tmp", kind=QueueKind.CLASSIC, exclusive=True).exclusive


def test_cached_routes_follow_topology_changes() -> None:
    r = _record()
    assert r.route("d", "a") == {"q1", "q2"}  # now cached
    r.add(QueueSpec("q4"))
    r.add(BindingSpec("q4", "d", "a"))
    assert r.route("d", "a") == {"q1", "q2", "q4"}
    r.forget_queue("q1")
    assert r.route("d", "a") == {"q2", "q4"}
    r.forget_exchange("d")
    assert r.route("d", "a") == set()


def test_a_bad_topology_file_is_named_in_one_line_as_the_file_has_it(tmp_path) -> None:
    """Each error as ``where: what (got value)``, with the file's names (``[[cluster]]
    #1``), and no second error of the list that only follows from its item's."""
    import pytest

    from middleware.errors import ConfigurationError
    from middleware.routing import PhoenixTopology

    bad = tmp_path / "phoenix.toml"
    bad.write_text('prefix = "x"\ninbox_prefetch = 0\n[[cluster]]\nid = "A"\nrouting_slaves = -1\n')
    with pytest.raises(ConfigurationError) as caught:
        PhoenixTopology.load(bad)
    text = str(caught.value)
    assert (
        "[[cluster]] #1 routing_slaves: Input should be greater than or equal to 0 (got -1)" in text
    )
    assert "inbox_prefetch: Input should be greater than or equal to 1 (got 0)" in text
    assert "too_short" not in text and "at least 1 item" not in text and "\n" not in text


def test_a_written_topology_reads_back_equal_with_defaults_left_out(tmp_path) -> None:
    from middleware.routing import PhoenixTopology

    topology = PhoenixTopology.model_validate(
        {
            "prefix": 'a "quoted" prefix',
            "outer": False,
            "heartbeat_interval_s": 0.05,
            "blind_dispatch": "master",
            "role_queues": "quorum",
            "clusters": [
                {"id": "A", "match_slaves": 2, "amqp_urls": ["amqp://127.0.0.1:5682/"]},
                {"id": "B", "joined": False, "vhost": "b"},
            ],
            "links": [{"from": "A", "to": "B", "amqp_urls": ["amqp://127.0.0.1:6000/"]}],
        }
    )
    path = topology.write(tmp_path / "deeper" / "phoenix.toml")
    assert PhoenixTopology.load(path) == topology
    text = path.read_text()
    assert "inbox_prefetch" not in text and "match_masters" not in text  # defaults
    assert 'from = "A"' in text and "joined = false" in text


def test_a_replay_leaves_out_an_unreachable_queue_with_its_bindings_and_consumers() -> None:
    """A durable classic queue whose home node is down refuses its declare with 404: the
    failover goes on without it; its binding is skipped, its consumer waits."""
    replay = Replay(declared=frozenset({"home", "mine"}))
    home, other = QueueSpec("home", kind=QueueKind.CLASSIC), QueueSpec("other")
    assert replay.before(home) is Verdict.APPLY
    assert replay.not_found(home) is Verdict.SKIP
    assert replay.before(other) is Verdict.APPLY
    assert replay.before(BindingSpec("home", "x")) is Verdict.SKIP
    assert replay.before(BindingSpec("other", "x")) is Verdict.APPLY
    assert replay.before(ConsumerSpec("home", "c1", 10)) is Verdict.LATER
    assert replay.before(ConsumerSpec("other", "c2", 10)) is Verdict.APPLY
    # a consumer's 404: its own queue vanished (declared again), someone else's waits
    assert replay.not_found(ConsumerSpec("mine", "c3", 10)) is Verdict.REDECLARE
    assert replay.not_found(ConsumerSpec("theirs", "c4", 10)) is Verdict.LATER
    # a binding's 404 is its exchange missing: the failover fails, as before
    assert replay.not_found(BindingSpec("other", "gone")) is Verdict.RAISE
    assert replay.not_found(ExchangeSpec("x")) is Verdict.RAISE
    assert replay.unreachable == {"home"}


def test_a_404_says_whether_the_queue_is_there_but_out_of_reach() -> None:
    """RabbitMQ 3.10's texts (rabbit_amqqueue: not_found/1, priv_absent/4)."""
    assert not absent("NOT_FOUND - no queue 'q' in vhost '/'")
    assert absent(
        "NOT_FOUND - home node 'rabbit@b' of durable queue 'q' in vhost '/' is down or inaccessible"
    )
    assert absent("NOT_FOUND - queue 'q' in vhost '/' process is stopped by supervisor")
    assert absent("NOT_FOUND - queue 'q' in vhost '/' has crashed and failed to restart")
