"""The Spark pipeline end to end on local[2] against the real cluster."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("pyspark")

from qosmq_bench.spark_confirms import arguments, execute

pytestmark = [pytest.mark.spark, pytest.mark.rabbit, pytest.mark.slow]


def test_two_cell_grid_outputs_exist_and_agree(brokers, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        [
            "--modes",
            "persistent,e2e",
            "--queues",
            "1",
            "--duration",
            "2",
            "--repeats",
            "1",
            "--producers-per-queue",
            "1",
            "--consumers-per-queue",
            "1",
            "--out",
            str(tmp_path),
            "--master",
            "local[2]",
            "--tasks-per-cell",
            "1",  # one process per cell: its CPU per message is the cell's
            "--quiet",
        ]
    )
    assert execute(args) == 0
    (out,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    for name in (
        "records.parquet",
        "summary.csv",
        "summary.json",
        "cells.json",
        "report.md",
        "throughput.png",
        "ratio.png",
        "latency.png",
    ):
        assert (out / name).exists(), name
    summary = {s["mode"]: s for s in json.loads((out / "summary.json").read_text())}
    cells = {c["mode"]: c for c in json.loads((out / "cells.json").read_text())}
    assert set(summary) == {"persistent", "e2e"}

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[1]").getOrCreate()
    try:
        counts = {
            r["mode"]: r["count"]
            for r in spark.read.parquet(str(out / "records.parquet"))
            .groupBy("mode")
            .count()
            .collect()
        }
    finally:
        spark.stop()
    for mode, s in summary.items():
        assert counts[mode] == s["published"] == cells[mode]["published"] > 0
        assert s["confirmed"] == cells[mode]["confirmed"] and s["lost"] == 0
        # where the CPU went: the executor measured its own process around the cell
        assert 0 < s["client_cpu_pct"] == cells[mode]["client_cpu_pct"]
        assert s["client_cpu_us_per_msg"] == cells[mode]["client_cpu_us_per_msg"] > 0
    ratio = summary["e2e"]["confirmed_per_s_mean"] / summary["persistent"]["confirmed_per_s_mean"]
    assert summary["e2e"]["ratio_vs_persistent"] == pytest.approx(ratio)
    assert summary["persistent"]["ratio_vs_persistent"] == pytest.approx(1.0)
    report = (out / "report.md").read_text()
    assert "3.08x" in report and f"{ratio:.2f}x" in report and "CPU µs/msg" in report
    assert os.environ["QOSMQ_AMQP_URLS"].split(",")[0] in report


def test_a_cell_spread_over_two_tasks_of_a_barrier_stage(brokers, tmp_path, monkeypatch) -> None:
    """--tasks-per-cell 1,2: each cell once in one task, once over two tasks started
    together; the two-task cells count every message across both processes (records in
    Parquet = published, nothing lost, no duplicate) and the report names each cell's
    limit and the tasks' clock spread."""
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        [
            "--modes",
            "persistent,e2e",
            "--queues",
            "1",
            "--tasks-per-cell",
            "1,2",
            "--duration",
            "2",
            "--repeats",
            "1",
            "--producers-per-queue",
            "2",
            "--consumers-per-queue",
            "2",
            "--out",
            str(tmp_path),
            "--master",
            "local[2]",
            "--quiet",
        ]
    )
    assert execute(args) == 0
    (out,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = {(s["mode"], s["tasks"]): s for s in json.loads((out / "summary.json").read_text())}
    cells = json.loads((out / "cells.json").read_text())
    assert set(summary) == {(m, t) for m in ("persistent", "e2e") for t in (1, 2)}
    assert not [c for c in cells if "error" in c]
    two = [c for c in cells if c["tasks"] == 2]
    assert len(two) == 2 and all(
        c["parts"] == 2 and len(c["client_cpu_pct_parts"]) == 2 for c in two
    )

    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[1]").getOrCreate()
    try:
        counts = {
            (r["mode"], r["tasks"]): r["count"]
            for r in spark.read.parquet(str(out / "records.parquet"))
            .groupBy("mode", "tasks")
            .count()
            .collect()
        }
    finally:
        spark.stop()
    for key, s in summary.items():
        assert counts[key] == s["published"] > 0 and s["confirmed"] > 0, key
        assert s["lost"] == 0 and s["duplicates"] == 0, key
        assert s["limit"] in ("client", "cores", "brokers", "none"), s
    report = (out / "report.md").read_text()
    assert "| tasks |" in report and "tasks' wall clocks were at most" in report


def test_more_tasks_per_cell_than_slots_is_refused(brokers, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    args = arguments().parse_args(
        ["--queues", "1", "--tasks-per-cell", "2", "--out", str(tmp_path), "--master", "local[1]"]
    )
    assert execute(args) == 2
    assert "task slots" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing started, no result folder


def test_a_second_run_never_overwrites_the_first(tmp_path) -> None:
    from qosmq_bench.spark_confirms import _new_result_dir

    first, second = _new_result_dir(tmp_path), _new_result_dir(tmp_path)
    assert first != second and first.exists() and second.exists()


@pytest.mark.parametrize(
    "bad",
    [
        ["--modes", "nope"],
        ["--queues", "0"],
        ["--duration", "-1"],
        ["--queues", "a,b"],
        ["--repeats", "0"],
        ["--tasks-per-cell", "0"],
        ["--tasks-per-cell", "x"],
    ],
)
def test_invalid_grids_are_refused_before_anything_starts(bad, tmp_path, capsys) -> None:
    try:  # refused by the argument types, or by the grid's own checks
        code = execute(arguments().parse_args([*bad, "--out", str(tmp_path)]))
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert "error" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_keeps_the_finished_cells(brokers, tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    env = {**os.environ, "QOSMQ_AMQP_URLS": ",".join(brokers.urls), "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "middleware.cli",
            "spark",
            "confirms",
            "--modes",
            "broker",
            "--queues",
            "1,1,1,1",
            "--duration",
            "2",
            "--repeats",
            "1",
            "--producers-per-queue",
            "1",
            "--consumers-per-queue",
            "1",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
        env=env,
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        for line in proc.stderr:  # type: ignore[union-attr]
            if line.startswith("[1/4]") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    (result,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    cells = json.loads((result / "cells.json").read_text())
    assert 1 <= len(cells) < 4 and all("error" not in c for c in cells)
    assert "interrupted" in (result / "report.md").read_text()
