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

from . import spark_common
from .confirms import MODES, CellSpec, merge_parts, receipt_share, run_cell_sync
from .cpu import CLIENT_BOUND_PCT, MACHINE_BOUND_PCT, RUNNABLE_PCT
from .cpu import limit as cpu_limit
from .parts import Part
from .spark_common import (
    add_uri,
    drive,
    failure,
    hms,
    new_result_dir,
    provenance,
    pyplot,
    session,
    settings_payload,
    slots,
    write_csv,
)
from .stats import whole

DEFAULT_QUEUES = "1,2,3,5,10,15,20,30"
PAPER = {  # paper 003 §4: e2e over the persistent baseline
    "optimisation 1": {1: 3.08, 2: 2.01, 15: 1.409, 30: 1.403, "mean >3 queues": 1.429},
    "optimisation 2": {1: 3.48, 2: 2.16, 15: 1.526, 30: 1.534, "mean >3 queues": 1.565},
}
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


def paper_summary(
    summary: list[dict[str, Any]], mode: str = "e2e", tasks: int | None = None
) -> dict[str, Any]:
    """Our ratios at the paper's queue counts (at ``tasks`` per cell: the most in the
    run by default), and the mean over queue counts above 3."""
    if tasks is None:
        tasks = max((s.get("tasks", 1) for s in summary), default=1)
    ratios = {
        s["queues"]: s["ratio_vs_persistent"]
        for s in summary
        if s["mode"] == mode and s.get("tasks", 1) == tasks and s["ratio_vs_persistent"] is not None
    }
    above = [r for q, r in ratios.items() if q > 3]
    return {"by_queues": ratios, "mean >3 queues": _mean(above) if above else None}


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
    charts = _charts(out, summary)
    (out / "report.md").write_text(_report(grid, cells, summary, settings, interrupted, charts))


def _ratio_std(s: dict[str, Any], base: dict[str, Any] | None) -> float:
    """Stddev of a ratio of two means, from their relative stddevs (first order)."""
    if not base or not s["ratio_vs_persistent"]:
        return 0.0
    rel = [
        (x["confirmed_per_s_std"] or 0.0) / x["confirmed_per_s_mean"]
        for x in (s, base)
        if x["confirmed_per_s_mean"]
    ]
    return float(s["ratio_vs_persistent"] * math.sqrt(sum(r * r for r in rel)))


def _colour(mode: str) -> str:
    """One colour per mode in every chart."""
    return f"C{MODES.index(mode) % 10}" if mode in MODES else "C9"


def _cat(s: dict[str, Any]) -> tuple[int, int]:
    """A chart's category: queues, and tasks per cell when the run has several."""
    return (s["queues"], s.get("tasks", 1))


def _charts(out: Path, summary: list[dict[str, Any]]) -> list[str]:
    """Queue counts are categories (evenly spaced, one tick each), modes are bars side by
    side in each; error bars are one stddev over the repeats."""
    plt = pyplot()
    if plt is None or not summary:
        return []
    modes = [m for m in MODES if any(s["mode"] == m for s in summary)]
    cats = sorted({_cat(s) for s in summary})
    at = {k: i for i, k in enumerate(cats)}
    several = len({t for _, t in cats}) > 1
    width = 0.8 / max(len(modes), 1)

    def offset(i: int) -> float:
        return (i - (len(modes) - 1) / 2) * width

    def cells(mode: str) -> list[dict[str, Any]]:
        return sorted((s for s in summary if s["mode"] == mode), key=_cat)

    def categories(ax: Any) -> None:
        ax.set_xticks(
            range(len(cats)), [f"{q}\n{t} task(s)" if several else str(q) for q, t in cats]
        )
        ax.set_xlabel("queues")
        ax.grid(axis="y", alpha=0.3)

    fig, ax = plt.subplots(figsize=(8, 4))
    for i, mode in enumerate(modes):
        pts = cells(mode)
        ax.bar(
            [at[_cat(s)] + offset(i) for s in pts],
            [s["confirmed_per_s_mean"] for s in pts],
            width,
            yerr=[s["confirmed_per_s_std"] or 0.0 for s in pts],
            capsize=2,
            color=_colour(mode),
            label=mode,
        )
    categories(ax)
    ax.set(ylabel="confirmed messages / s", title="Throughput by confirm mode (mean ± stddev)")
    ax.legend(fontsize=8, ncol=len(modes))
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=110)

    fig, ax = plt.subplots(figsize=(8, 4))
    base = {_cat(s): s for s in summary if s["mode"] == "persistent"}
    shown = [m for m in modes if m != "persistent"]
    width = 0.8 / (len(shown) + 2)
    for i, mode in enumerate(shown):
        pts = [s for s in cells(mode) if s["ratio_vs_persistent"] is not None]
        ax.bar(
            [at[_cat(s)] + (i - len(shown) / 2) * width for s in pts],
            [s["ratio_vs_persistent"] for s in pts],
            width,
            yerr=[_ratio_std(s, base.get(_cat(s))) for s in pts],
            capsize=2,
            color=_colour(mode),
            label=f"{mode} (ours)",
        )
    for j, (name, marker) in enumerate((("optimisation 1", "D"), ("optimisation 2", "^"))):
        values = {q: v for q, v in PAPER[name].items() if isinstance(q, int)}
        paper = [(k, values[k[0]]) for k in cats if k[0] in values]
        ax.scatter(
            [at[k] + (len(shown) / 2 + j - 0.5) * width for k, _ in paper],
            [v for _, v in paper],
            marker=marker,
            color="black",
            zorder=3,
            label=f"paper e2e, {name}",
        )
    ax.axhline(1.0, color="grey", linewidth=1, linestyle=":")
    categories(ax)
    ax.set(
        ylabel="confirmed / s over persistent",
        title="Ratio to the persistent baseline of the same run (paper 003 beside)",
    )
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(out / "ratio.png", dpi=110)

    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        pts = cells(mode)
        xs = [at[_cat(s)] + offset(i) for s in pts]
        line = ax.plot(xs, [s["confirm_p50_ms"] for s in pts], "o", color=_colour(mode), label=mode)
        ax.plot(
            xs,
            [s["confirm_p99_ms"] for s in pts],
            "_",
            markersize=12,
            color=line[0].get_color(),
        )
        ax.vlines(
            xs,
            [s["confirm_p50_ms"] for s in pts],
            [s["confirm_p99_ms"] for s in pts],
            color=line[0].get_color(),
            alpha=0.5,
        )
    categories(ax)
    ax.set(
        ylabel="confirm latency (ms)",
        title="Confirm latency: p50 (dot) to p99 (bar)",
        yscale="log",
    )
    ax.legend(fontsize=7, ncol=len(modes))
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=110)
    plt.close("all")
    return ["throughput.png", "ratio.png", "latency.png"]


def _report(
    grid: Grid,
    cells: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
    interrupted: bool,
    charts: list[str],
) -> str:
    ours = paper_summary(summary)
    most = max(grid.tasks)
    lines = [
        "# qosmq confirm modes: results",
        "",
        *provenance(settings),
        f"- grid: modes {', '.join(grid.modes)}; queues {', '.join(map(str, grid.queues))}; "
        f"{grid.producers_per_queue} producers and {grid.consumers_per_queue} consumers per "
        f"queue; {grid.size}-byte messages; {grid.duration_s:g} s per cell; "
        f"{grid.repeats} repeat(s); tasks per cell {', '.join(map(str, grid.tasks))}",
    ]
    offsets = [s for s in summary if s.get("clock_offset_ms") is not None]
    if offsets:
        worst = max(offsets, key=lambda s: s["clock_offset_ms"])
        lines.append(
            f"- clocks: the other tasks' wall clocks were at most "
            f"{worst['clock_offset_ms']:.2f} ms from task 0's (± {worst['clock_error_ms']:.2f} "
            "ms: half the shortest of 12 round trips over the brokers); cross-task "
            "latencies carry that much"
        )
    if interrupted:
        lines.append("- **interrupted**: only the finished cells are reported")
    failed = [c for c in cells if "error" in c]
    if failed:
        lines.append(f"- failed cells: {len(failed)} (errors in cells.json)")
    lines += [
        "",
        f"## e2e over the persistent baseline, beside the paper ({most} task(s) per cell)",
        "",
        "| queues | ours | paper opt. 1 | paper opt. 2 |",
        "|---|---|---|---|",
    ]
    for key in sorted({*ours["by_queues"], 1, 2, 15, 30}):
        r = ours["by_queues"].get(key)
        lines.append(
            f"| {key} | {_x(r)} | {_x(PAPER['optimisation 1'].get(key))} | "
            f"{_x(PAPER['optimisation 2'].get(key))} |"
        )
    lines.append(
        f"| mean > 3 | {_x(ours['mean >3 queues'])} | "
        f"{_x(PAPER['optimisation 1']['mean >3 queues'])} | "
        f"{_x(PAPER['optimisation 2']['mean >3 queues'])} |"
    )
    lines += [
        "",
        "## Summary (mean ± stddev over repeats)",
        "",
        "Limit: `client` = the busiest client process used ≥ "
        f"{CLIENT_BOUND_PCT:.0f} % of a core, or was runnable (running or waiting for a "
        f"core) ≥ {RUNNABLE_PCT:.0f} % of the time while the machine had room; `cores` = "
        f"the machine ≥ "
        f"{MACHINE_BOUND_PCT:.0f} % busy (clients and brokers share its cores); `brokers` = "
        "the local RabbitMQ nodes near the cores; `none` = nothing saturated (windows and "
        "round trips). Client CPU is the busiest task's, in % of one core; brokers' is "
        "their sum; run queue = runnable threads, mean.",
        "",
        "| mode | queues | tasks | confirmed/s | confirm p50 / p99 ms | e2e p50 ms | lost |"
        " dups | x persistent | limit | client CPU % | brokers CPU % | machine % |"
        " run queue | CPU µs/msg | receipt msgs % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['mode']} | {s['queues']} | {s.get('tasks', 1)} | "
            f"{s['confirmed_per_s_mean']:.0f} ± {s['confirmed_per_s_std']:.0f} | "
            f"{s['confirm_p50_ms']:.1f} / {s['confirm_p99_ms']:.1f} | {s['e2e_p50_ms']:.1f} | "
            f"{s['lost']} | {s['duplicates']} | {_x(s['ratio_vs_persistent'])} | "
            f"{s.get('limit', 'unknown')} | {whole(s.get('client_cpu_pct'))} | "
            f"{whole(s.get('broker_cpu_pct'))} | {whole(s.get('machine_pct'))} | "
            f"{_num(s.get('run_queue'))} | {whole(s.get('client_cpu_us_per_msg'))} | "
            f"{receipt_share(s)} |"
        )
    lines += ["", *[f"![{c}]({c})" for c in charts], ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------ helpers
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


def _num(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"


def execute(args: argparse.Namespace) -> int:
    """Validate, run, print the report; for ``main`` and ``qosmq spark confirms``."""
    return spark_common.execute(args, job="confirms_job", validate=parse_grid, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return execute(arguments().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
