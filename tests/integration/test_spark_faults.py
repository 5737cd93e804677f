"""The Phoenix failure experiments as a Spark job on local[2]: a link cut under load
(a deployment with a TCP proxy per directed link, started by the executor) and a
cluster removed; the runs come back as rows, Spark aggregates them, the report checks
the targets.  Counts come from each run's own consumer."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("pyspark")

from qosmq_bench.spark_faults import arguments, execute

pytestmark = [pytest.mark.spark, pytest.mark.rabbit, pytest.mark.slow]


@pytest.mark.parametrize(
    ("experiment", "options"),
    [
        ("link", ("--faults", "cut", "--repeats", "2")),
        # the departed cluster has two match masters, its successor one: the successor
        # adds one (the capacity plan) within the run
        ("leave", ("--subscriptions", "500", "--departed-masters", "2", "--repeats", "1")),
    ],
)
def test_fault_runs_are_aggregated_by_spark(
    brokers, tmp_path, monkeypatch, experiment, options
) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        [
            *("--experiment", experiment, *options, "--rates", "100"),
            *("--out", str(tmp_path / "out"), "--master", "local[2]"),
            *("--work-dir", str(tmp_path / "work")),
        ]
    )
    assert execute(args) == 0
    (out,) = (tmp_path / "out").iterdir()
    with (out / "runs.csv").open() as fh:
        runs = list(csv.DictReader(fh))
    (summary,) = json.loads((out / "summary.json").read_text())
    assert summary["runs"] == len(runs) == int(options[-1])
    assert summary["lost_total"] == 0
    assert summary["events"] == sum(int(r["events"]) for r in runs)
    times = sorted(float(r["function_s"]) for r in runs)
    assert times[0] <= summary["function_s_p50"] <= times[-1]  # Spark's median of the rows
    report = (out / "report.md").read_text()
    assert "0 lost" in report and "target" in report
    if experiment == "leave":
        assert [int(r["added_roles"]) for r in runs] == [1]  # one master, no slaves here
