"""PySpark job: confirm modes x queue counts against real brokers (paper 003 §4), with a report.

Run anywhere Spark runs (``spark/confirms_job.py`` is the spark-submit entry point)::

    spark-submit spark/confirms_job.py --modes persistent,e2e --queues 1,2,3 --out results
    qosmq spark confirms --modes persistent,e2e --queues 1,2,3     # local[*]

This module lives in the installed package so that Spark's Python workers import
it by name; the PySpark extra is needed (``pip install 'qosmq[spark]'``).

Brokers come from the settings (``QOSMQ_AMQP_URLS`` …) read once on the driver and
shipped to the executors with the task, so a Spark cluster reaches a remote RabbitMQ
cluster by settings alone.

How a cell runs: cells run one after another (they must not compete for the CPU).  With
``--tasks-per-cell 1`` a cell is one Spark task: one executor Python process drives all
its producers and consumers on one event loop, every timestamp from one clock.  With
``N`` > 1 the cell's producers and consumers are spread over N tasks of a barrier stage
(Spark starts all or none; they meet before the producers start, while draining and
before the queues go), so that one Python process is not what is measured; its
throughput is the sum, its records the union, its latencies from the wall clocks of
the processes involved (the other tasks' offsets from task 0's clock are measured and
reported: on a cluster the executors' clocks must agree, e.g. chrony, to well under the
latencies read).  N is at most the application's task slots; ``auto`` (the default)
takes them all, at most one task per client of the smallest cell.  Each cell names
what limited it (``limit``): the busiest client process, the machine's cores, the
brokers, or none of them.
Records are per message, not sampled: (message id, sent, confirmed, first handled).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from middleware.cli_help import renamed
from middleware.cliargs import Parser, integer, integers, names, number, path
from middleware.errors import ConfigurationError
from middleware.settings import Settings

from . import spark_common, spark_confirms_report
from .confirms import MODES, CellSpec, merge_parts, run_cell_sync
from .cpu import limit as cpu_limit
from .parts import Part
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

DEFAULT_QUEUES = "1,2,3,5,10,15,20,30"
#: Measured by the executor around each cell (``run_cell``); averaged over repeats.
CPU_KEYS = (
    "client_cpu_pct",
    "client_wait_pct",
    "machine_pct",
    "client_cpu_us_per_msg",
    "broker_cpu_pct",
    "run_queue",
    "clock_offset_ms",
    "clock_error_ms",
    "cores",  # the executor machine's: the brokers' CPU is judged against them
)
SETUP_S = 4.0  # measured per-cell set-up and drain overhead, for the estimate


@dataclass(frozen=True)
class Grid:
    modes: tuple[str, ...]
    queues: tuple[int, ...]
    producers_per_queue: int
    consumers_per_queue: int
    size: int
    duration_s: float
    repeats: int
    tasks: tuple[int, ...] = (1,)
    #: ``--tasks-per-cell auto``: ``tasks`` is set from the task slots once Spark runs
    auto_tasks: bool = False

    def cells(self) -> Iterator[tuple[int, int, CellSpec]]:
        for repeat in range(self.repeats):
            for q in self.queues:
                for tasks in self.tasks:
                    for mode in self.modes:
                        yield (
                            repeat,
                            tasks,
                            CellSpec(
                                mode=mode,
                                queues=q,
                                producers_per_queue=self.producers_per_queue,
                                consumers_per_queue=self.consumers_per_queue,
                                size=self.size,
                                duration_s=self.duration_s,
                            ),
                        )

    @property
    def count(self) -> int:
        return self.repeats * len(self.queues) * len(self.modes) * len(self.tasks)

    def estimate_s(self) -> float:
        return self.count * (self.duration_s + SETUP_S)

    def with_slots(self, slots: int) -> Grid:
        """``auto`` resolved: every task slot the application has, at most one task per
        client of the smallest cell (a task with no producer or consumer would idle), so
        that no one client process limits a cell while there are executors to share it."""
        if not self.auto_tasks:
            return self
        clients = (self.producers_per_queue + self.consumers_per_queue) * min(self.queues)
        return replace(self, tasks=(max(1, min(slots, clients)),), auto_tasks=False)


def parse_grid(args: argparse.Namespace) -> Grid:
    """Validate the whole grid before anything starts; raise ValueError naming the problem."""
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise ValueError(f"unknown mode(s) {unknown or modes}; choose from {', '.join(MODES)}")
    try:
        queues = tuple(int(q) for q in args.queues.split(",") if q.strip())
    except ValueError:
        raise ValueError(f"--queues must be integers, got {args.queues!r}") from None
    if not queues or min(queues) < 1:
        raise ValueError(f"--queues must be >= 1, got {args.queues!r}")
    if args.duration <= 0 or args.repeats < 1 or args.size < 1:
        raise ValueError("--duration, --repeats and --size must be positive")
    if args.producers_per_queue < 1 or args.consumers_per_queue < 1:
        raise ValueError("--producers-per-queue and --consumers-per-queue must be >= 1")
    got = str(getattr(args, "tasks_per_cell", "1")).strip()
    auto = got == "auto"
    if auto:
        got = "1"  # checked as one task here; the slots decide once Spark runs
    try:
        tasks = tuple(int(t) for t in got.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--tasks-per-cell must be integers, got {got!r}") from None
    if not tasks or min(tasks) < 1:
        raise ValueError(f"--tasks-per-cell must be >= 1, got {got!r}")
    most = args.producers_per_queue + args.consumers_per_queue
    if max(tasks) > most * min(queues):
        raise ValueError(
            f"--tasks-per-cell {max(tasks)} leaves a task with no producer or consumer at "
            f"{min(queues)} queue(s) ({most * min(queues)} clients)"
        )
    grid = Grid(
        modes,
        queues,
        args.producers_per_queue,
        args.consumers_per_queue,
        args.size,
        args.duration,
        args.repeats,
        tasks,
        auto,
    )
    list(grid.cells())  # CellSpec checks each cell
    return grid


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="confirms_job", description=__doc__.split("\n")[0])
    p.set_defaults(master=None)
    p.add_argument(
        "--modes",
        type=names(MODES),
        default="none,broker,persistent,e2e",
        help="the confirm modes compared (comma list; raw: plain aio-pika)",
    )
    p.add_argument(
        "--queues",
        type=integers(1, 64),
        default=DEFAULT_QUEUES,
        help="queue counts, one cell each (comma list)",
    )
    p.add_argument(
        "--producers-per-queue", type=integer(1, 64), default=2, help="publishers per queue"
    )
    p.add_argument(
        "--consumers-per-queue", type=integer(1, 64), default=3, help="consumers per queue"
    )
    p.add_argument(
        "--size", type=integer(1, 16 * 2**20), default=1500, help="message size in bytes"
    )
    p.add_argument(
        "--duration", type=number(0, 86_400, above=True), default=10.0, help="seconds per cell"
    )
    p.add_argument("--repeats", type=integer(1, 100), default=3, help="runs of each cell, averaged")
    p.add_argument(
        "--tasks-per-cell",
        default="auto",
        help="Spark tasks a cell's producers and consumers are spread over, or a list "
        "(1,2: each cell both ways); at most the application's task slots; auto (the "
        "default): every slot, at most one task per client of the smallest cell",
    )
    p.add_argument(
        "--out",
        type=path,
        default=Path("results"),
        help="parent folder; each run writes a new sub-folder",
    )
    p.add_argument("--master", default=None, help="Spark master (spark-submit sets it)")
    p.add_argument("--config", type=path, help="qosmq TOML settings")
    add_uri(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines while the job runs")
    renamed(p, "--no-progress", "--quiet")
    return p


# ------------------------------------------------------------------ executor side
def _run_on_executor(
    settings_data: dict[str, Any], task: dict[str, Any], context: Any = None
) -> dict[str, Any]:
    """Runs inside a Spark task: one cell against the brokers, or one part of it (with
    the barrier ``context``); errors come back as data (a failed cell is a row with its
    error: ``cells.json`` keeps it)."""
    settings = Settings.load(**settings_data)
    cell = CellSpec(**task["cell"])
    part = None
    if context is not None:
        part = Part(context.partitionId(), task["parts"], task["run_id"], context)
    try:
        result = run_cell_sync(settings, cell, records=True, part=part)
    except Exception as exc:
        result = {"mode": cell.mode, "queues": cell.queues, **failure(exc)}
    result.pop("trace", None)
    result.update(
        repeat=task["repeat"],
        tasks=task["parts"],
        duration_s=result.get("duration_s", cell.duration_s),
    )
    return {"rows": [result]}


def _merge(task: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell's row from its parts' rows (the first error, if a part failed)."""
    rows = [r["rows"][0] for r in results]
    cell = CellSpec(**task["cell"])
    failed = [r for r in rows if "error" in r]
    if failed:
        row = {"mode": cell.mode, "queues": cell.queues, "error": failed[0]["error"]}
    else:
        row = merge_parts(cell, rows, records=True)
    row.update(repeat=task["repeat"], tasks=task["parts"])
    row.setdefault("duration_s", cell.duration_s)
    return {"rows": [row]}


# -------------------------------------------------------------------- driver side
def run(args: argparse.Namespace) -> Path:
    """Run the grid; return the result folder.  Ctrl-C keeps finished cells."""
    grid = parse_grid(args)
    settings = Settings.load(args.config)
    spark = session("qosmq-confirms", args.master)
    have = slots(spark)
    grid = grid.with_slots(have)
    if max(grid.tasks) > have:
        spark.stop()
        raise ConfigurationError(
            f"--tasks-per-cell {max(grid.tasks)} needs as many task slots; this Spark "
            f"application has {have} (local[N], or more executors)"
        )
    out = _new_result_dir(args.out)
    print(
        f"qosmq confirms job: {grid.count} cells ({len(grid.modes)} modes x {len(grid.queues)}"
        f" queue counts x {len(grid.tasks)} task counts x {grid.repeats} repeats), about "
        f"{hms(grid.estimate_s())}; results in {out}",
        file=sys.stderr,
        flush=True,
    )
    tasks = [
        {
            "cell": asdict(cell),
            "repeat": repeat,
            "parts": parts,
            "run_id": uuid.uuid4().hex[:8],
        }
        for repeat, parts, cell in grid.cells()
    ]
    try:
        with _progress(grid, args.quiet) as advance:
            driven = drive(
                spark,
                out,
                _run_on_executor,
                settings_payload(settings),
                tasks,
                append_records=_append_records,
                merge=_merge,
                progress=lambda _i, task, result: advance(
                    CellSpec(**task["cell"]), result["rows"][0]
                ),
            )
        cells = driven.rows
        summary = aggregate(spark, out, cells) if driven.records_written else []
        write_outputs(out, grid, cells, summary, settings, driven.interrupted)
    finally:
        spark.stop()
    return out


def _append_records(
    spark: Any,
    out: Path,
    cell: dict[str, Any],
    records: Sequence[tuple[str, float, float | None, float | None]],
) -> None:
    from pyspark.sql.types import DoubleType, IntegerType, StringType, StructField, StructType

    schema = StructType(
        [
            StructField("mode", StringType(), False),
            StructField("queues", IntegerType(), False),
            StructField("tasks", IntegerType(), False),
            StructField("repeat", IntegerType(), False),
            StructField("message_id", StringType(), False),
            StructField("sent", DoubleType(), False),
            StructField("confirmed", DoubleType(), True),
            StructField("handled", DoubleType(), True),
        ]
    )
    key = (cell["mode"], cell["queues"], cell.get("tasks", 1), cell["repeat"])
    rows = [(*key, m, s, c, h) for m, s, c, h in records]
    spark.createDataFrame(rows, schema).write.mode("append").parquet(str(out / "records.parquet"))


def aggregate(spark: Any, out: Path, cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell and repeat from the Parquet records; then mean/stddev over repeats; ratios."""
    from pyspark.sql import functions as F

    records = spark.read.parquet(str(out / "records.parquet"))
    durations = {_key(c): c["duration_s"] for c in cells if "error" not in c}
    confirm_ms = (F.col("confirmed") - F.col("sent")) * 1000
    e2e_ms = (F.col("handled") - F.col("sent")) * 1000
    pcts = [0.5, 0.95, 0.99, 0.999]
    per_repeat = (
        records.groupBy("mode", "queues", "tasks", "repeat")
        .agg(
            F.count("*").alias("published"),
            F.count("confirmed").alias("confirmed"),
            F.count("handled").alias("handled"),
            F.sum(
                F.when(F.col("confirmed").isNotNull() & F.col("handled").isNull(), 1).otherwise(0)
            ).alias("lost"),
            F.percentile_approx(confirm_ms, pcts, 10000).alias("confirm_ms"),
            F.percentile_approx(e2e_ms, pcts, 10000).alias("e2e_ms"),
        )
        .collect()
    )
    rows = []
    for r in per_repeat:
        d = r.asDict()
        duration = durations.get(_key(d))
        if not duration:
            continue
        d["confirmed_per_s"] = d["confirmed"] / duration
        for name in ("confirm_ms", "e2e_ms"):
            values = d.pop(name) or [math.nan] * 4
            for p, v in zip(("p50", "p95", "p99", "p999"), values, strict=True):
                d[f"{name.split('_')[0]}_{p}_ms"] = v
        cell = next((c for c in cells if _key(c) == _key(d)), {})
        d["duplicates"] = cell.get("duplicates", 0)
        d["receipts"] = cell.get("receipts", 0)
        d["receipt_messages"] = cell.get("receipt_messages", 0)
        for key in CPU_KEYS:  # measured by the executor around the cell (None off Linux)
            d[key] = cell.get(key)
        rows.append(d)
    return summarise_repeats(rows)


def _key(row: dict[str, Any]) -> tuple[str, int, int, int]:
    return (row["mode"], row["queues"], row.get("tasks", 1), row["repeat"])


def summarise_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean and sample stddev over repeats per (mode, queues, tasks per cell), the ratio
    to persistent at the same queues and tasks, and what limited the cell."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["mode"], r["queues"], r.get("tasks", 1)), []).append(r)
    summary = []
    order = sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))
    for (mode, queues, tasks), reps in order:
        tput = [r["confirmed_per_s"] for r in reps]
        s: dict[str, Any] = {
            "mode": mode,
            "queues": queues,
            "tasks": tasks,
            "repeats": len(reps),
            "confirmed_per_s_mean": _mean(tput),
            "confirmed_per_s_std": _std(tput),
        }
        for key in ("published", "confirmed", "handled", "lost", "duplicates"):
            s[key] = sum(r[key] for r in reps)
        for key in ("receipts", "receipt_messages"):
            s[key] = sum(r.get(key, 0) for r in reps)
        for key in [k for k in reps[0] if k.startswith(("confirm_", "e2e_")) and k.endswith("_ms")]:
            s[key] = _mean([r[key] for r in reps])
        for key in CPU_KEYS:
            known = [r[key] for r in reps if r.get(key) is not None]
            s[key] = _mean(known) if known else None
        s["limit"] = limit(s)
        summary.append(s)
    base = {
        (s["queues"], s["tasks"]): s["confirmed_per_s_mean"]
        for s in summary
        if s["mode"] == "persistent"
    }
    for s in summary:
        b = base.get((s["queues"], s["tasks"]))
        s["ratio_vs_persistent"] = s["confirmed_per_s_mean"] / b if b else None
    return summary


def limit(cell: dict[str, Any]) -> str:
    """What limited a cell (:func:`qosmq_bench.cpu.limit`): ``client``, ``cores``,
    ``brokers`` (the RabbitMQ nodes on this machine near the cores they may use: their
    summed % over the core count), ``none`` or ``unknown``."""
    broker, cores = cell.get("broker_cpu_pct"), cell.get("cores") or 1
    per_core = None if broker is None else broker / cores
    return cpu_limit(
        cell.get("client_cpu_pct"),
        cell.get("machine_pct"),
        {"brokers": per_core},
        cell.get("client_wait_pct"),
    )


def write_outputs(
    out: Path,
    grid: Grid,
    cells: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
    interrupted: bool,
) -> None:
    (out / "cells.json").write_text(json.dumps(cells, indent=2, default=str))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    write_csv(out / "summary.csv", summary, ("mode", "queues"))
    charts = spark_confirms_report.charts(out, summary)
    (out / "report.md").write_text(
        spark_confirms_report.report(grid, cells, summary, settings, interrupted, charts)
    )


def _new_result_dir(parent: Path) -> Path:
    return new_result_dir(parent, "confirms")


class _progress:
    """Per-cell and overall progress (rich), or plain lines without a terminal."""

    def __init__(self, grid: Grid, disabled: bool) -> None:
        self.grid, self.disabled = grid, disabled or not sys.stderr.isatty()
        self.done = 0

    def __enter__(self) -> Any:
        if self.disabled:
            return self._plain
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeRemainingColumn(),
        )
        self.bar.__enter__()
        self.task = self.bar.add_task("cells", total=self.grid.count)
        return self._rich

    def __exit__(self, *exc: object) -> None:
        if not self.disabled:
            self.bar.__exit__(None, None, None)

    def _plain(self, cell: CellSpec, result: dict[str, Any]) -> None:
        self.done += 1
        state = result.get("error") or f"{result.get('confirmed_per_s', 0):.0f} confirmed/s"
        print(
            f"[{self.done}/{self.grid.count}] {cell.mode} x {cell.queues} queue(s): {state}",
            file=sys.stderr,
            flush=True,
        )

    def _rich(self, cell: CellSpec, result: dict[str, Any]) -> None:
        state = result.get("error") or f"{result.get('confirmed_per_s', 0):.0f}/s"
        self.bar.update(self.task, advance=1, description=f"{cell.mode} x{cell.queues}: {state}")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def execute(args: argparse.Namespace) -> int:
    """Validate, run, print the report; for ``main`` and ``qosmq spark confirms``."""
    return spark_common.execute(args, job="confirms_job", validate=parse_grid, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return execute(arguments().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
