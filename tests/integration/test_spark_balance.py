"""Weighted dispatch (paper 001's experiment) as a Spark job on local[2]: each cell run
by an executor against the real brokers, one record per message appended to Parquet,
Spark's percentiles over them, the report's claims.  The counts come from each cell's
own consumers."""

from __future__ import annotations

import csv
import json

import pytest

pytest.importorskip("pyspark")

from qosmq_bench.spark_balance import arguments, execute

pytestmark = [pytest.mark.spark, pytest.mark.rabbit, pytest.mark.slow]


def test_balance_cells_are_aggregated_by_spark(brokers, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        [
            *("--algorithms", "round_robin,paper,predictive", "--rates", "150"),
            *("--duration", "4", "--repeats", "1"),
            *("--out", str(tmp_path / "out"), "--master", "local[2]"),
        ]
    )
    assert execute(args) == 0
    (out,) = (tmp_path / "out").iterdir()
    with (out / "cells.csv").open() as fh:
        cells = {r["algorithm"]: r for r in csv.DictReader(fh)}
    summary = {s["algorithm"]: s for s in json.loads((out / "summary.json").read_text())}
    assert set(cells) == set(summary) == {"round_robin", "paper", "predictive"}
    for algorithm, s in summary.items():
        cell = cells[algorithm]
        # Spark's counts of the per-message records are the cell's own counts
        assert s["published"] == int(cell["published"]) > 0
        assert s["handled"] == int(cell["handled"])
        assert s["latency_p50_ms"] <= s["latency_p95_ms"] <= s["latency_p99_ms"]
        assert s["repeats"] == 1
        assert s["first_left"] + s["last_left"] <= s["published"] - s["handled"]
    cut = summary["paper"]["predictive_p99_cut"]
    assert cut is not None and cut < 1
    report = (out / "report.md").read_text()
    assert "predictive's p99" in report and "latency over the cell: " in report
    assert (out / "records.parquet").is_dir()
