"""PySpark job: weighted dispatch, paper 001's experiment, against real brokers, with a
report.

    spark-submit spark/balance_job.py --algorithms round_robin,paper,inverse,predictive \\
        --rates 250,400 --duration 30 --repeats 3
    qosmq spark balance --rates 250 --repeats 5

How it runs: one Spark task per cell (an algorithm at a rate, one repeat), one after
another (cells must not compete for the CPU or the brokers; the algorithms alternate
within each repeat, so the ones compared ran minutes apart at most).  The task's
executor does what ``qosmq bench balance`` does for one cell: two replica queues of a
topic, the balancer sidecar's load reports, one consumer per replica (replica 0's
slower by ``--slow-extra-ms``: the paper's broker that also serves a second topic),
Poisson arrivals at the rate, and its own count of every message handled.  It returns
the cell's row and one record per message (its send time in the cell and its publish
-> handled latency, none if it was not handled by the end), appended to
``records.parquet``.  Spark aggregates per algorithm and rate over every repeat's
messages: p50/p95/p99 latency and the p99 of the first and last third of the cell
(``percentile_approx``), messages not handled, the longest replica queue, handled/s.
The report checks the issue's two claims: under the light load round robin's p99 grows
from the first third to the last while the balanced algorithms' stays flat, and
``predictive``'s p99 is at least 30 % below ``paper``'s.

On a cluster: the executors need the package (``pip install 'qosmq[spark]'``) and the
brokers' addresses (``--config``, ``--uri`` or ``QOSMQ_AMQP_URLS``); one executor is
enough (the cells run one at a time).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.balancer import ALGORITHMS
from middleware.cliargs import Parser, integer, names, number, path
from middleware.settings import Settings

from . import spark_common
from .spark_common import (
    add_uri,
    drive,
    failure,
    new_result_dir,
    progress_printer,
    provenance,
    session,
    write_csv,
)

__all__ = ["CLAIM_P99_CUT", "aggregate", "arguments", "execute", "main"]

#: the issue's claim: predictive's p99 at least this much below paper's
CLAIM_P99_CUT = 0.30
#: round robin "grows": its last third's p99 at least this many times its first third's
GROWTH = 1.5


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="balance_job", description=__doc__.split("\n")[0])
    p.set_defaults(master=None)
    p.add_argument(
        "--algorithms",
        type=names(ALGORITHMS),
        default=",".join(ALGORITHMS),
        help=f"comma list of {', '.join(ALGORITHMS)}",
    )
    p.add_argument("--rates", type=str, default="250,400", help="messages/s, comma list")
    p.add_argument(
        "--duration", type=number(2, 3600), default=30.0, help="seconds of arrivals per cell"
    )
    p.add_argument("--repeats", type=integer(1, 1000), default=3, help="cells per algorithm")
    p.add_argument("--replicas", type=integer(2, 16), default=2, help="replica queues")
    p.add_argument(
        "--service-ms", type=number(0, 10_000), default=2.0, help="each consumer's ms per message"
    )
    p.add_argument(
        "--slow-extra-ms",
        type=number(0, 10_000),
        default=6.0,
        help="what replica 0's consumer spends more per message",
    )
    p.add_argument(
        "--out", type=path, default=Path("results"), help="parent folder of the run's folder"
    )
    p.add_argument("--master", default=None, help="Spark master (spark-submit sets it)")
    p.add_argument("--config", type=path, help="qosmq TOML settings")
    add_uri(p)
    return p


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be numbers, got {text!r}") from None
    if not rates or any(not 1 <= r <= 100_000 for r in rates):
        raise ValueError(f"--rates must be 1..100000 messages/s, got {text!r}")
    return rates


def _validate(args: argparse.Namespace) -> None:
    _rates(args.rates)


def _tasks(args: argparse.Namespace) -> list[dict[str, Any]]:
    algorithms = args.algorithms.split(",")
    tasks = []
    for repeat in range(args.repeats):
        shift = repeat % len(algorithms)  # alternate which algorithm goes first
        for rate in _rates(args.rates):
            for algorithm in [*algorithms[shift:], *algorithms[:shift]]:
                tasks.append({"algorithm": algorithm, "rate": rate, "repeat": repeat})
    return tasks


# ------------------------------------------------------------------ executor side
def _run_on_executor(
    settings_data: dict[str, Any], task: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    """Runs inside a Spark task: one cell; its row with its records (or the error)."""
    from .balance import BalanceCell, run_balance_cell

    settings = Settings.load(**settings_data)
    cell = BalanceCell(
        algorithm=task["algorithm"],
        rate=task["rate"],
        duration_s=options["duration"],
        replicas=options["replicas"],
        service_ms=options["service_ms"],
        slow_extra_ms=options["slow_extra_ms"],
        seed=1 + task["repeat"],
    )
    try:
        row = runtime.run(
            run_balance_cell(settings, cell, records=True), event_loop=settings.event_loop
        )
    except Exception as exc:
        return {"rows": [], **failure(exc)}
    row.pop("queue_lengths", None)
    row["repeat"] = task["repeat"]
    return {"rows": [row]}


def _append_records(
    spark: Any, out: Path, row: dict[str, Any], records: Sequence[tuple[str, float, float | None]]
) -> None:
    from pyspark.sql.types import DoubleType, IntegerType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("algorithm", StringType(), False),
            StructField("rate", DoubleType(), False),
            StructField("repeat", IntegerType(), False),
            StructField("message_id", StringType(), False),
            StructField("sent_s", DoubleType(), False),
            StructField("latency_ms", DoubleType(), True),
        ]
    )
    key = (row["algorithm"], float(row["rate"]), int(row["repeat"]))
    data = [(*key, m, float(s), None if ms is None else float(ms)) for m, s, ms in records]
    spark.createDataFrame(data, schema).write.mode("append").parquet(str(out / "records.parquet"))


# -------------------------------------------------------------------- driver side
def run(args: argparse.Namespace) -> Path:
    settings = Settings.load(args.config)
    spark = session("qosmq-balance", args.master)
    out = new_result_dir(args.out, "balance")
    tasks = _tasks(args)
    print(f"qosmq balance job: {len(tasks)} cells; results in {out}", file=sys.stderr, flush=True)
    options = {
        "duration": args.duration,
        "replicas": args.replicas,
        "service_ms": args.service_ms,
        "slow_extra_ms": args.slow_extra_ms,
    }

    progress = progress_printer(
        len(tasks), lambda t: f"{t['algorithm']} at {t['rate']:g}/s, repeat {t['repeat']}"
    )

    try:
        driven = drive(
            spark,
            out,
            _run_on_executor,
            spark_common.settings_payload(settings),
            tasks,
            extra=(options,),
            append_records=_append_records,
            progress=progress,
        )
        summary = (
            aggregate(spark, out, driven.rows, args.duration) if driven.records_written else []
        )
    finally:
        spark.stop()
    _write(out, driven.rows, driven.errors, summary, settings)
    return out


def aggregate(
    spark: Any, out: Path, rows: list[dict[str, Any]], duration_s: float
) -> list[dict[str, Any]]:
    """Per algorithm and rate, over every repeat: latency percentiles of the handled
    messages and of the first and last third of the cell (``percentile_approx`` over
    ``records.parquet``), messages published and not handled, the cells' longest
    replica queue and mean handled/s; then each rate's claims (``_claims``)."""
    from pyspark.sql import functions as F

    records = spark.read.parquet(str(out / "records.parquet"))
    latency, sent = F.col("latency_ms"), F.col("sent_s")
    third = duration_s / 3
    pcts = [0.5, 0.95, 0.99]
    by_messages = records.groupBy("algorithm", "rate").agg(
        F.count(F.lit(1)).alias("published"),
        F.count(latency).alias("handled"),
        F.percentile_approx(latency, pcts, 10_000).alias("latency_ms"),
        F.percentile_approx(F.when(sent < third, latency), 0.99, 10_000).alias("first_p99"),
        F.percentile_approx(F.when(sent >= 2 * third, latency), 0.99, 10_000).alias("last_p99"),
        F.countDistinct("repeat").alias("repeats"),
        F.sum(F.when((sent < third) & latency.isNull(), 1).otherwise(0)).alias("first_left"),
        F.sum(F.when((sent >= 2 * third) & latency.isNull(), 1).otherwise(0)).alias("last_left"),
    )
    cells = spark.createDataFrame(
        [
            (r["algorithm"], float(r["rate"]), r["handled_per_s"], r["max_queue_length"])
            for r in rows
        ],
        "algorithm string, rate double, handled_per_s double, max_queue_length long",
    )
    by_cells = cells.groupBy("algorithm", "rate").agg(
        F.avg("handled_per_s").alias("handled_per_s"),
        F.max("max_queue_length").alias("max_queue_length"),
    )
    summary = []
    joined = by_messages.join(by_cells, ["algorithm", "rate"]).orderBy("rate", "algorithm")
    for row in joined.collect():
        s = row.asDict()
        p50, p95, p99 = s.pop("latency_ms") or (None, None, None)
        s.update(latency_p50_ms=p50, latency_p95_ms=p95, latency_p99_ms=p99)
        s["not_handled"] = s["published"] - s["handled"]
        s["handled_per_s"] = round(s["handled_per_s"], 1)
        summary.append(s)
    _claims(summary)
    return summary


def _claims(summary: list[dict[str, Any]]) -> None:
    """Per algorithm and rate: whether its latency grows over the cell (``grows``: the
    last third's p99 at least ``GROWTH`` times the first's, or more of the last third's
    messages than of the first's not handled by the end: the p99 of the handled ones
    alone then hides the growing backlog), and per rate predictive's p99 cut against
    paper's (the claim: at least ``CLAIM_P99_CUT``)."""
    for s in summary:
        first, last = s.get("first_p99"), s.get("last_p99")
        s["growth"] = round(last / first, 2) if first and last else None
        s["grows"] = (s["growth"] is not None and s["growth"] >= GROWTH) or (
            s["last_left"] > s["first_left"]
        )
        same = {t["algorithm"]: t for t in summary if t["rate"] == s["rate"]}
        paper, predictive = same.get("paper"), same.get("predictive")
        s["predictive_p99_cut"] = None
        if paper and predictive and paper["latency_p99_ms"] and predictive["latency_p99_ms"]:
            cut = 1 - predictive["latency_p99_ms"] / paper["latency_p99_ms"]
            s["predictive_p99_cut"] = round(cut, 3)


def _write(
    out: Path,
    rows: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
) -> None:
    first = ("algorithm", "rate", "repeat", "published", "handled", "backlog")
    rows = [{**r, "routed": " ".join(map(str, r.get("routed", [])))} for r in rows]
    write_csv(out / "cells.csv", rows, first)
    write_csv(out / "summary.csv", summary, ("algorithm", "rate", "repeats"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = ["# Weighted dispatch, paper 001's experiment (Spark)", "", *provenance(settings), ""]
    lines += [
        "| rate | algorithm | repeats | handled / published | p50 / p95 / p99 ms "
        "| p99 first, last third ms | longest queue | handled/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['rate']:g} | {s['algorithm']} | {s['repeats']} | {s['handled']} / "
            f"{s['published']} | {_ms(s['latency_p50_ms'])} / {_ms(s['latency_p95_ms'])} / "
            f"{_ms(s['latency_p99_ms'])} | {_ms(s['first_p99'])}, {_ms(s['last_p99'])} | "
            f"{s['max_queue_length']} | {s['handled_per_s']} |"
        )
    lines.append("")
    for rate in sorted({s["rate"] for s in summary}):
        same = {s["algorithm"]: s for s in summary if s["rate"] == rate}
        growth = "; ".join(
            f"{a} {'grows' if t['grows'] else 'flat'} (p99 x{t['growth']}, not handled "
            f"{t['first_left']} of the first third, {t['last_left']} of the last)"
            for a, t in same.items()
        )
        lines.append(f"- {rate:g}/s, latency over the cell: {growth}")
        cut = next((s["predictive_p99_cut"] for s in same.values()), None)
        if cut is not None:
            verdict = "met" if cut >= CLAIM_P99_CUT else "NOT met"
            side = "below" if cut >= 0 else "above"
            lines.append(
                f"- {rate:g}/s: predictive's p99 {abs(100 * cut):.0f} % {side} paper's "
                f"(claim: at least {100 * CLAIM_P99_CUT:.0f} % below): {verdict}"
            )
    for e in errors:
        lines.append(
            f"- {e['algorithm']} at {e['rate']:g}/s, repeat {e['repeat']} failed: {e['error']}"
        )
    lines += [
        "",
        "Per cell: `cells.csv`; per message: `records.parquet`; per algorithm and rate: "
        "`summary.csv`.",
    ]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def execute(args: argparse.Namespace) -> int:
    """Validate, run, print the report; for ``main`` and ``qosmq spark balance``."""
    return spark_common.execute(args, job="balance_job", validate=_validate, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return execute(arguments().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
