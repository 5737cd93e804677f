"""``timeliness``: the latencyMap, queue prediction, and the predicted-T and blind
dispatch of ``Dispatch``."""

from __future__ import annotations

import math

import pytest

from middleware.routing import (
    LatencyMap,
    QueuePredictor,
    QuietReads,
    choose_broker,
    mean_processing_time,
    predicted_queue,
    round_robin,
)


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


def test_blind_dispatch_turns_over_the_master_and_its_reporting_live_slaves() -> None:
    from middleware.routing.timeliness import Dispatch

    dispatch = Dispatch()
    dispatch.reported(0, 0.0, 1.0, now=0.0)
    dispatch.reported(1, 0.0, 1.0, now=0.0)
    assert [dispatch.choose_blind({0, 1, 2}) for _ in range(4)] == [None, 0, 1, None]
    assert [dispatch.choose_blind({1}) for _ in range(2)] == [1, None]  # slave 0 silent
    assert dispatch.choose_blind({0, 1}, mode="master") is None


def test_blind_dispatch_is_checked_at_start_up_and_on_a_live_switch(tmp_path) -> None:
    from pydantic import ValidationError

    from middleware.errors import ConfigurationError
    from middleware.phoenix.protocol import PhoenixTopology

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


def test_a_quiet_inbox_is_read_once_in_ten_windows_and_at_once_when_something_comes() -> None:
    reads = QuietReads(keepalive=10)
    assert reads.due(active=False)  # never read: read
    reads.read(0)
    # nothing waiting, nothing delivered: nine windows without a read, the tenth reads
    assert [reads.due(active=False) for _ in range(10)] == [False] * 9 + [True]
    reads.read(0)
    assert not reads.due(active=False)
    assert reads.due(active=True)  # a delivery: read now
    reads.read(3)
    assert reads.due(active=False)  # something was waiting: read until it is gone
    reads.read(None)  # a failed read
    assert reads.due(active=False)


def test_a_predictor_is_quiet_only_with_nothing_arriving_finishing_or_in_progress() -> None:
    p = QueuePredictor(window_s=0.5)
    assert p.quiet
    p.arrived(now=1.0)
    assert not p.quiet
    p.close_window(1.5, 0)
    assert not p.quiet  # still in progress
    p.completed(now=1.6)
    p.close_window(2.0, 0)
    assert p.quiet
