"""The Phoenix bench's summaries and its deployment's cleanup."""

from __future__ import annotations


def test_bench_summary_averages_repeats_and_keeps_their_spread() -> None:
    from qosmq_bench.phoenix_timeliness import summarize

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


def test_a_bench_deployment_lists_every_role_queue_and_survives_a_failed_cleanup(
    tmp_path, monkeypatch, capsys
) -> None:
    """The queues a deployment deletes are exactly its roles' inbox, control and parked queues;
    a cleanup that fails (broker gone at the end) is reported, not raised over the cells."""
    from middleware.phoenix.ids import role_queues
    from qosmq_bench.phoenix_deploy import Deployment

    deployment = Deployment(tmp_path, prefix="px", amqp_urls=["amqp://127.0.0.1:1/"])
    names = role_queues(deployment.topology)
    assert len(names) == len(set(names)) == 3 * 6 * 3  # 6 roles: inbox, control, parked
    assert "px.A.router.control" in names and "px.C.match.0.slave.1" in names
    assert "px.B.match.0.parked" in names

    async def unreachable() -> int:
        raise OSError("connection refused")

    monkeypatch.setattr(deployment, "up", lambda: None)
    monkeypatch.setattr(deployment, "down", lambda: None)
    monkeypatch.setattr(deployment, "delete_queues", unreachable)
    with deployment.running():
        pass
    assert "queues of px not deleted: connection refused" in capsys.readouterr().err


def test_the_throughput_steps_name_each_queue_s_hop_and_group_cpu_by_kind(tmp_path) -> None:
    """Every role queue of the deployment maps to the hop of its role kind (its control
    queue to ``control``), the subscribers' queues to ``subscriber``, other queues of the
    prefix to ``other``, queues of anybody else to nothing; CPU sums by kind."""
    from middleware.routing import RoleId
    from qosmq_bench.phoenix_deploy import Deployment, subscriber_queue
    from qosmq_bench.phoenix_throughput import _cpu_by_group, hop_of

    deployment = Deployment(tmp_path, prefix="thr", amqp_urls=["amqp://127.0.0.1:1/"])
    hop = hop_of(deployment)
    assert hop(RoleId.router("A").inbox("thr")) == "router"
    assert hop(RoleId.router_slave("B", 1).inbox("thr")) == "router_slave"
    assert hop(RoleId.match("C", 0).inbox("thr")) == "match"
    assert hop(RoleId.match_slave("C", 0, 1).inbox("thr")) == "match_slave"
    assert hop(RoleId.match_slave("C", 0, 1).control("thr")) == "control"
    assert hop(subscriber_queue("thr", "A")) == "subscriber"
    assert hop("thr.process.0123") == "other"
    assert hop("thrx.A.router") is None and hop("somebody.else") is None
    groups = _cpu_by_group(
        {
            "A/router": 10.0,
            "B/router": 5.5,
            "A/router-slave-0": 1.0,
            "broker-7": 30.0,
            "broker-8": 20.0,
            "client": 40.0,
            "C/router": None,
        }
    )
    assert groups == {"router": 15.5, "router_slave": 1.0, "brokers": 50.0, "client": 40.0}


def test_a_rate_from_the_management_counters_is_not_inflated_by_their_refresh() -> None:
    """The counters refresh every 5 s at a phase of their own; the bench reads them
    STATS_EVERY_S after the phase before and after the measured one, so each read lags
    by up to an interval.  Averaged over the phase, ``per_second`` gives the true rate;
    divided by the measured wall time alone, a 5 s phase read about twice it."""
    from qosmq_bench.phoenix_throughput import STATS_EVERY_S, per_second

    rate, interval, wall = 108.0, STATS_EVERY_S - 0.5, 5.0
    read_1, read_2 = 0.0, wall + STATS_EVERY_S  # the phase runs from 0 to wall

    def shown(at: float, phase: float) -> float:  # the count as of the last refresh
        last = phase + interval * ((at - phase) // interval)
        return rate * last

    phases = [interval * k / 1000 for k in range(1000)]
    counted = [shown(read_2, p) - shown(read_1, p) for p in phases]
    assert abs(sum(per_second(c, wall) for c in counted) / len(counted) - rate) < 0.5
    assert sum(c / wall for c in counted) / len(counted) > 1.9 * rate  # the old division
