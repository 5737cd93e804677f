"""The Phoenix Spark job end to end on local[2]: a real 3-cluster deployment (18 role
processes) over the test brokers, records in Parquet, Spark's aggregation and the report."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyspark")

from qosmq_bench.spark_phoenix import arguments, claims, execute, phoenix_limit

pytestmark = [pytest.mark.spark, pytest.mark.rabbit, pytest.mark.slow]


@pytest.mark.parametrize("tasks", [1, 2])
def test_a_small_grid_runs_on_real_roles_and_spark_agrees(
    brokers, tmp_path, monkeypatch, tasks
) -> None:
    """tasks 2: a barrier stage per count; task 0 runs the deployment and receives, both
    publish: every event of both is recorded and counted once, the same as with one."""
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        [
            *("--experiment", "rate", "--subscriptions", "300", "--rates", "30,60"),
            *("--mechanisms", "none,inner", "--duration", "2", "--repeats", "1"),
            *("--warmup", "0", "--out", str(tmp_path / "out"), "--master", "local[2]"),
            *("--work-dir", str(tmp_path / "work"), "--quiet"),
            *("--tasks-per-cell", str(tasks)),
        ]
    )
    assert execute(args) == 0
    (out,) = (tmp_path / "out").iterdir()
    for name in ("records.parquet", "summary.csv", "summary.json", "cells.json", "report.md"):
        assert (out / name).exists(), name
    assert (out / "response-subscriptions-300.png").exists()
    measured = json.loads((out / "cells.json").read_text())
    # a cell disturbed by CPU steal is kept as discarded and measured again
    cells = {(c["mechanism"], c["rate"]): c for c in measured if not c.get("discarded")}
    assert len(cells) == len([c for c in measured if not c.get("discarded")])
    assert set(cells) == {(m, r) for m in ("raw", "none", "inner") for r in (30.0, 60.0)}
    result = json.loads((out / "summary.json").read_text())
    summary = {(s["mechanism"], s["rate"]): s for s in result["summary"]}
    assert set(summary) == set(cells)

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[1]").getOrCreate()
    try:
        records = spark.read.parquet(str(out / "records.parquet"))
        counts = {
            (r["mechanism"], r["rate"]): r["count"]
            for r in records.groupBy("mechanism", "rate").count().collect()
        }
        levels = {r["level"] for r in records.select("level").distinct().collect()}
        delivered: dict[tuple[str, float], set[int]] = {}
        arrived = records.where("response_ms IS NOT NULL").select("mechanism", "rate", "seq")
        for r in arrived.collect():
            delivered.setdefault((r["mechanism"], r["rate"]), set()).add(r["seq"])
    finally:
        spark.stop()
    assert levels <= {1, 2, 3, 4, 5} and len(levels) > 1
    for key, cell in cells.items():
        s = summary[key]
        assert "error" not in cell
        # one record per published event, and Spark counts the deliveries the executor saw
        assert counts[key] == cell["events"] == s["events"] > 0
        assert s["delivered"] == cell["delivered_events"] == len(delivered[key])
        # Spark's mean over the Parquet records is the mean the executor measured
        assert s["mean_ms"] == pytest.approx(cell["mean_ms"], abs=0.11)
        assert 0 < s["p50_ms"] <= s["p99_ms"]
        if key[0] != "raw":  # the roles ran: the CPU readings name them, and the limit
            assert {"machine", "router", "match_master", "client"} <= set(s["cpu"])
            assert phoenix_limit(s["cpu"]) != "unknown"
    for rate in (30.0, 60.0):
        # raw: every event straight into a subscriber queue; through Phoenix: the same
        # events (one seed) and exactly the ones some subscription matches, whichever
        # mechanism ran: nothing lost, nothing extra
        assert len(delivered[("raw", rate)]) == cells[("raw", rate)]["events"]
        assert delivered[("none", rate)] == delivered[("inner", rate)]
        assert 0 < len(delivered[("none", rate)]) < cells[("none", rate)]["events"]
    verdicts = result["claims"]
    assert verdicts == claims(result["summary"])
    assert {(v["mechanism"], v["rate"]) for v in verdicts} == {("inner", 30.0), ("inner", 60.0)}
    report = (out / "report.md").read_text()
    assert "The paper's claim" in report and "Met at every point" in report
    assert "| limit |" in report
    assert f"published from {tasks} Spark task(s)" in report
    if tasks == 2:  # both tasks published into every cell: sequence numbers of both parities
        for key, seqs in delivered.items():
            assert {s % 2 for s in seqs} == {0, 1}, key
        assert all(c.get("parts") == 2 for c in cells.values())
    assert brokers.urls[0] in report


@pytest.mark.parametrize(
    "bad",
    [
        ["--experiment", "nope"],
        ["--mechanisms", "none,fastest"],
        ["--rates", "0"],
        ["--rates", "a"],
        ["--subscriptions", "0"],
        ["--duration", "0"],
        ["--repeats", "0"],
        ["--warmup", "-1"],
        ["--steal-retries", "-1"],
        ["--max-steal", "101"],
    ],
)
def test_invalid_grids_are_refused_before_anything_starts(bad, tmp_path, capsys) -> None:
    try:  # refused by the argument types, or by the grid's own checks
        code = execute(arguments().parse_args([*bad, "--out", str(tmp_path)]))
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert "qosmq: error:" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
