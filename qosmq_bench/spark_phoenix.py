"""PySpark job: the Phoenix timeliness experiments (paper 000 §4, figures 9 and 10)
against real brokers and real role processes, with a report.

    spark-submit spark/phoenix_job.py --experiment rate --subscriptions 200000 \\
        --rates 100,200,400 --repeats 3 --out results
    qosmq spark phoenix --experiment subscriptions --subscriptions 10000,200000 --rates 200

How it runs: one Spark task per subscription count, one count after another (they
must not compete for the CPU).  The task's executor does what ``qosmq bench phoenix``
does for that count: it preloads the subscriptions, starts the paper's deployment
beside it (3 clusters, 18 role processes, ``qosmq phoenix up``), measures a ``raw`` row
per rate, then every rate x mechanism x repeat with the mechanisms switched live and
rotated, stops the roles and deletes their queues.  Both clients run in the executor's
process, so every response time comes from one clock.  With ``--tasks-per-cell N`` > 1
a count runs as N tasks of a barrier stage: task 0 as said, receiving every event; the
others publish their shares of every cell's events (``serve_share``), so that one
client process does not limit the offered rate; response times then cross processes
(wall clocks).  The task returns one record per
published event, ``(seq, latency level, response time or none)``, and each cell's CPU
readings; Spark aggregates the records (mean, p50 and p99 with ``percentile_approx``,
per cell and repeat, then over repeats, and p99 over all repeats' events together) and
checks the paper's claim at every point: ``inner`` and ``both`` below ``none``, in mean
and in p99.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.cli_help import renamed
from middleware.cliargs import Parser, integer, integers, path
from middleware.errors import ConfigurationError
from middleware.settings import Settings

from . import spark_common, spark_phoenix_report
from .options import MECHANISMS, timeliness_arguments
from .parts import Part
from .phoenix_timeliness import (
    run_experiment,
    serve_share,
    steal_limits,
)
from .spark_common import (
    add_uri,
    drive,
    failure,
    hms,
    new_result_dir,
    session,
    settings_payload,
    slots,
    write_csv,
)
from .spark_phoenix_report import claims, phoenix_limit

__all__ = [
    "PhoenixGrid",
    "aggregate",
    "arguments",
    "claims",
    "execute",
    "main",
    "parse_grid",
    "phoenix_limit",
]

KEYS = ("subscriptions", "mechanism", "rate", "repeat")
START_S, CELL_EXTRA_S = 40.0, 5.0  # measured: deployment start; per-cell switch and drain


@dataclass(frozen=True)
class PhoenixGrid:
    experiment: str
    subscriptions: tuple[int, ...]
    rates: tuple[float, ...]
    mechanisms: tuple[str, ...]
    duration_s: float
    repeats: int
    warmup_s: float
    max_steal_pct: float | None = 5.0
    steal_retries: int = 2
    inbox_mirrors: int = 0  # RabbitMQ nodes per role queue (0: no mirroring)
    tasks: int = 1  # Spark tasks publishing each cell's events (part 0 also receives)

    @property
    def cells(self) -> int:
        """Measured cells, ``raw`` rows included."""
        per_count = len(self.rates) * (1 + self.repeats * len(self.mechanisms))
        return len(self.subscriptions) * per_count

    def estimate_s(self) -> float:
        cell = self.duration_s + CELL_EXTRA_S
        per_count = START_S + len(self.rates) * (
            cell + self.repeats * len(self.mechanisms) * (cell + self.warmup_s)
        )
        return len(self.subscriptions) * per_count


def parse_grid(args: argparse.Namespace) -> PhoenixGrid:
    """Validate the whole grid before anything starts; raise ValueError naming the problem."""
    by_rate = args.experiment == "rate"
    if args.experiment not in ("rate", "subscriptions"):
        raise ValueError(f"--experiment must be rate or subscriptions, got {args.experiment!r}")
    try:
        counts = tuple(
            int(x)
            for x in (
                args.subscriptions or ("200000" if by_rate else "10000,50000,100000,200000")
            ).split(",")
        )
    except ValueError:
        raise ValueError(f"--subscriptions must be integers, got {args.subscriptions!r}") from None
    try:
        rates = tuple(
            float(x) for x in (args.rates or ("100,200,400" if by_rate else "200")).split(",")
        )
    except ValueError:
        raise ValueError(f"--rates must be numbers, got {args.rates!r}") from None
    mechanisms = tuple(m.strip() for m in args.mechanisms.split(",") if m.strip())
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown or not mechanisms:
        raise ValueError(
            f"unknown mechanism(s) {unknown or mechanisms}; choose from {', '.join(MECHANISMS)}"
        )
    if min(counts) < 1:
        raise ValueError(f"--subscriptions must be >= 1, got {args.subscriptions!r}")
    if min(rates) <= 0:
        raise ValueError(f"--rates must be > 0 events/s, got {args.rates!r}")
    if args.duration <= 0 or args.repeats < 1 or args.warmup < 0:
        raise ValueError("--duration and --repeats must be positive, --warmup not negative")
    max_steal, retries = steal_limits(args)
    tasks = getattr(args, "tasks_per_cell", 1)
    if tasks < 1:
        raise ValueError(f"--tasks-per-cell must be >= 1, got {tasks}")
    return PhoenixGrid(
        args.experiment,
        counts,
        rates,
        mechanisms,
        args.duration,
        args.repeats,
        args.warmup,
        max_steal,
        retries,
        getattr(args, "inbox_mirrors", 0),
        tasks,
    )


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="phoenix_job", description=__doc__.split("\n")[0])
    p.set_defaults(master=None)
    p.add_argument(
        "--experiment",
        choices=("rate", "subscriptions"),
        default="rate",
        help="rate: (a) response time vs event rate; subscriptions: (b) vs subscriptions",
    )
    p.add_argument(
        "--subscriptions",
        type=integers(1, 10_000_000),
        help="comma list (rate: 200000; else 10000,…,200000)",
    )
    timeliness_arguments(p, repeats=3)
    p.add_argument(
        "--out",
        type=path,
        default=Path("results"),
        help="parent folder; each run writes a new sub-folder",
    )
    p.add_argument(
        "--work-dir", type=path, help="executors' deployment state and logs (default: a temp dir)"
    )
    p.add_argument(
        "--tasks-per-cell",
        type=integer(1, 256),
        default=1,
        help="Spark tasks publishing each cell's events (one of them also runs the "
        "deployment and receives every event); at most the application's task slots",
    )
    p.add_argument("--master", default=None, help="Spark master (spark-submit sets it)")
    p.add_argument("--config", type=path, help="qosmq TOML settings")
    add_uri(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines while the job runs")
    renamed(p, "--no-progress", "--quiet")
    return p


# ------------------------------------------------------------------ executor side
def _run_count_on_executor(
    settings_data: dict[str, Any], task: dict[str, Any], context: Any = None
) -> dict[str, Any]:
    """Runs inside a Spark task: one subscription count's cells against the brokers.  The
    cells finished before an error come back with it.  With a barrier ``context`` (more
    than one task per cell): task 0 does that, the others publish their shares of each
    cell's events (``serve_share``) until task 0 is done."""
    settings = Settings.load(**settings_data)
    fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in task.items()}
    work_dir = fields.pop("work_dir", None)
    fields.pop("parts", None)
    work = Path(work_dir) if work_dir else None
    grid = PhoenixGrid(**fields)
    (count,) = grid.subscriptions
    part = None
    if context is not None:
        part = Part(context.partitionId(), grid.tasks, f"phoenix-{count}", context)
        if part.index != 0:
            try:
                served = runtime.run(serve_share(settings, part), event_loop=settings.event_loop)
            except Exception as exc:
                return {"rows": [], "part": part.index, **failure(exc)}
            return {"rows": [], "part": part.index, "served": served}
    rows: list[dict[str, Any]] = []
    try:
        with tempfile.TemporaryDirectory(prefix="qosmq-phoenix-") as temporary:
            run_experiment(
                settings,
                directory=work or Path(temporary),
                subscription_counts=[count],
                rates=grid.rates,
                mechanisms=grid.mechanisms,
                duration_s=grid.duration_s,
                repeats=grid.repeats,
                warmup_s=grid.warmup_s,
                report=rows.append,
                records=True,
                max_steal_pct=grid.max_steal_pct,
                steal_retries=grid.steal_retries,
                inbox_mirrors=grid.inbox_mirrors,
                part=part,
            )
    except Exception as exc:
        return {"rows": _keyed(rows), **failure(exc)}
    return {"rows": _keyed(rows)}


def _merge(task: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Task 0's rows (it counted every event), with the first error of any task."""
    merged = dict(results[0])
    failed = [r for r in results if "error" in r]
    if failed and "error" not in merged:
        merged["error"] = f"task {failed[0].get('part')}: {failed[0]['error']}"
    return merged


def _keyed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        row.setdefault("repeat", 0)
    return rows


# -------------------------------------------------------------------- driver side
def run(args: argparse.Namespace) -> Path:
    """Run the grid; return the result folder.  Ctrl-C keeps the finished counts."""
    grid = parse_grid(args)
    settings = Settings.load(args.config)
    spark = session("qosmq-phoenix", args.master)
    have = slots(spark)
    if grid.tasks > have:
        spark.stop()
        raise ConfigurationError(
            f"--tasks-per-cell {grid.tasks} needs as many task slots; this Spark "
            f"application has {have} (local[N], or more executors)"
        )
    out = new_result_dir(args.out, "phoenix")
    print(
        f"qosmq phoenix job: {grid.cells} cells ({len(grid.subscriptions)} subscription "
        f"count(s) x {len(grid.rates)} rate(s) x (raw + {len(grid.mechanisms)} mechanisms x "
        f"{grid.repeats} repeats)), about {hms(grid.estimate_s())}; results in {out}",
        file=sys.stderr,
        flush=True,
    )
    tasks = [
        {
            **asdict(grid),
            "subscriptions": [count],
            "work_dir": str(args.work_dir) if args.work_dir else None,  # + subs-N
            "parts": grid.tasks,
        }
        for count in grid.subscriptions
    ]

    def progress(i: int, task: dict[str, Any], result: dict[str, Any]) -> None:
        if not args.quiet:
            state = result.get("error") or f"{len(result['rows'])} cells"
            print(
                f"[{i}/{len(tasks)}] {task['subscriptions'][0]} subscriptions: {state}",
                file=sys.stderr,
                flush=True,
            )

    try:
        driven = drive(
            spark,
            out,
            _run_count_on_executor,
            settings_payload(settings),
            tasks,
            append_records=_append_records,
            label=lambda task: {"subscriptions": task["subscriptions"][0]},
            progress=progress,
            merge=_merge,
        )
        cells = driven.rows
        summary = aggregate(spark, out, cells) if driven.records_written else []
        write_outputs(out, grid, cells, driven.errors, summary, settings, driven.interrupted)
    finally:
        spark.stop()
    return out


def _append_records(
    spark: Any, out: Path, row: dict[str, Any], records: Sequence[Sequence[Any]]
) -> None:
    from pyspark.sql.types import (
        DoubleType,
        IntegerType,
        StringType,
        StructField,
        StructType,
    )

    schema = StructType(
        [
            StructField("subscriptions", IntegerType(), False),
            StructField("mechanism", StringType(), False),
            StructField("rate", DoubleType(), False),
            StructField("repeat", IntegerType(), False),
            StructField("seq", IntegerType(), False),
            StructField("level", IntegerType(), False),
            StructField("response_ms", DoubleType(), True),  # None: never delivered
        ]
    )
    key = (row["subscriptions"], row["mechanism"], float(row["rate"]), row["repeat"])
    data = [(*key, seq, level, None if t is None else 1000 * t) for seq, level, t in records]
    spark.createDataFrame(data, schema).write.mode("append").parquet(str(out / "records.parquet"))


def aggregate(spark: Any, out: Path, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (subscriptions, mechanism, rate): from the Parquet records, each repeat's mean,
    p50 and p99 and their mean over repeats (with the lowest and highest repeat), p99 over
    every repeat's events together, urgent (levels 1-2) and bulk (4-5) means; the CPU
    readings averaged from the cells; and the mean's ratio to the same point's ``none``."""
    from pyspark.sql import functions as F

    records = spark.read.parquet(str(out / "records.parquet"))
    ms = F.col("response_ms")
    per_repeat = (
        records.groupBy(*KEYS)
        .agg(
            F.count("*").alias("events"),
            F.count(ms).alias("delivered"),
            F.mean(ms).alias("mean_ms"),
            F.percentile_approx(ms, [0.5, 0.99], 10000).alias("pcts"),
            F.mean(F.when(F.col("level") <= 2, ms)).alias("urgent_mean_ms"),
            F.mean(F.when(F.col("level") >= 4, ms)).alias("bulk_mean_ms"),
        )
        .collect()
    )
    pooled = {
        (r["subscriptions"], r["mechanism"], r["rate"]): r["p99"]
        for r in records.groupBy(*KEYS[:3])
        .agg(F.percentile_approx(ms, 0.99, 10000).alias("p99"))
        .collect()
    }
    groups: dict[tuple[int, str, float], list[dict[str, Any]]] = {}
    for r in per_repeat:
        d = r.asDict()
        d["p50_ms"], d["p99_ms"] = d.pop("pcts") or (None, None)
        groups.setdefault((d["subscriptions"], d["mechanism"], d["rate"]), []).append(d)
    cpu_of: dict[tuple[int, str, float], list[dict[str, Any]]] = {}
    for c in cells:
        if c.get("discarded"):
            continue
        key = (c["subscriptions"], c["mechanism"], float(c["rate"]))
        cpu_of.setdefault(key, []).append(c.get("cpu") or {})
    summary = []
    for key, group in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        s: dict[str, Any] = dict(zip(KEYS[:3], key, strict=True))
        s["repeats"] = len(group)
        s["events"] = sum(g["events"] for g in group)
        s["delivered"] = sum(g["delivered"] for g in group)
        for name in ("mean_ms", "p50_ms", "p99_ms", "urgent_mean_ms", "bulk_mean_ms"):
            values = [g[name] for g in group if g[name] is not None]
            s[name] = _round(sum(values) / len(values)) if values else None
            if name in ("mean_ms", "p99_ms"):
                s[f"{name}_range"] = [_round(min(values)), _round(max(values))] if values else None
        s["pooled_p99_ms"] = _round(pooled.get(key))
        readings: dict[str, list[float]] = {}
        for cpu in cpu_of.get(key, []):
            for kind, pct in cpu.items():
                if pct is not None:
                    readings.setdefault(kind, []).append(pct)
        s["cpu"] = {kind: _round(sum(v) / len(v)) for kind, v in readings.items()}
        summary.append(s)
    base = {(s["subscriptions"], s["rate"]): s for s in summary if s["mechanism"] == "none"}
    for s in summary:
        none = base.get((s["subscriptions"], s["rate"]))
        ratio = none and s["mean_ms"] and none["mean_ms"] and s["mean_ms"] / none["mean_ms"]
        s["x_none"] = round(ratio, 2) if ratio else None
    return summary


def write_outputs(
    out: Path,
    grid: PhoenixGrid,
    cells: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
    interrupted: bool,
) -> None:
    (out / "cells.json").write_text(json.dumps(cells, indent=2, default=str))
    (out / "summary.json").write_text(
        json.dumps({"summary": summary, "claims": claims(summary)}, indent=2, default=str)
    )
    flat = [{**{k: v for k, v in s.items() if k != "cpu"}, **_cpu_columns(s)} for s in summary]
    write_csv(out / "summary.csv", flat, KEYS[:3])
    charts = spark_phoenix_report.charts(out, grid, summary)
    (out / "report.md").write_text(
        spark_phoenix_report.report(grid, errors, summary, settings, interrupted, charts, cells)
    )


def _cpu_columns(s: dict[str, Any]) -> dict[str, Any]:
    return {f"cpu_{kind}": pct for kind, pct in (s.get("cpu") or {}).items()}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def execute(args: argparse.Namespace) -> int:
    """Validate, run, print the report; for ``main`` and ``qosmq spark phoenix``."""
    return spark_common.execute(args, job="phoenix_job", validate=parse_grid, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return execute(arguments().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
