"""PySpark job: the Phoenix failure experiments (role recovery, link failures, cluster
leave) against real brokers, real role processes and real faults, with a report.

    spark-submit spark/faults_job.py --experiment link --runs 5 --rates 200,1000
    qosmq spark faults --experiment leave --runs 5 --subscriptions 200000
    qosmq spark faults --experiment recovery --runs 10 --kinds router,match

How it runs: one Spark task per run (a kill, a link fault, a removal), one after
another (they must not compete for the CPU, and each needs its deployment to itself).
The task's executor does what ``qosmq bench phoenix --experiment …`` does for one run:
it starts the deployment beside it (role processes, and for links and leaves a TCP
proxy per directed link in the executor's process), injects the fault under a steady
stream of events, counts every event with its own consumer, stops the roles, and
returns the run's row.  Spark aggregates the rows (median and p99 with
``percentile_approx`` per kind of fault and rate, sums of events, losses and
duplicates) and checks the issue's targets: 0 lost, and the function time's median
under the target (recovery 0.5 s, a link 1 s, a leave 5 s).

On a cluster: the executors need the package (``pip install 'qosmq[spark]'``), the
brokers' addresses (``--config`` or ``QOSMQ_AMQP_URLS``), and the role processes run on
the executor that runs the task (one executor is enough: the runs are sequential).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from middleware.cli_help import not_for, renamed
from middleware.cliargs import Parser, integer, number, path
from middleware.settings import Settings

from . import spark_common
from .options import add_departed_masters, fault_arguments
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

__all__ = ["TARGETS_S", "aggregate", "arguments", "execute", "main"]

#: the issues' targets for the median function time (first event served after the fault)
TARGETS_S = {"recovery": 0.5, "link": 1.0, "leave": 5.0}
#: per experiment: the row field that names the kind of fault, and the times aggregated
SHAPE = {
    "recovery": ("kind", ("detection_s", "recovery_s", "function_s")),
    "link": ("fault", ("detect_s", "reroute_s", "function_s", "back_s")),
    "leave": ("departed", ("detect_s", "restore_s", "function_s")),
}
LOST = {"recovery": ("lost",), "link": ("lost",), "leave": ("lost_after", "lost_in_departed")}


def arguments(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or Parser(prog="faults_job", description=__doc__.split("\n")[0])
    p.set_defaults(master=None)
    p.add_argument(
        "--experiment",
        choices=tuple(TARGETS_S),
        default="link",
        help="which failure experiment the job runs",
    )
    p.add_argument(
        "--repeats",
        type=integer(1, 10_000),
        default=5,
        help="repetitions: faults per kind and rate (recovery: kills; link: cuts; leave: removals)",
    )
    renamed(p, "--runs", "--repeats")
    p.add_argument("--rates", type=str, default="200", help="events/s, comma list")
    fault_arguments(p, kinds=("router", "match"), faults_help="link: the faults injected")
    p.add_argument(
        "--subscriptions",
        type=integer(1, 10_000_000),
        default=200_000,
        help="leave: subscriptions in the departed cluster's arc",
    )
    add_departed_masters(p)
    p.add_argument(
        "--stream",
        type=number(3, 3600),
        default=6.0,
        help="seconds of events around each fault (the fault inside them)",
    )
    p.add_argument(
        "--out", type=path, default=Path("results"), help="parent folder of the run's folder"
    )
    p.add_argument("--work-dir", type=path, help="executors' deployment state and logs")
    p.add_argument("--master", default=None, help="Spark master (spark-submit sets it)")
    p.add_argument("--config", type=path, help="qosmq TOML settings")
    add_uri(p)
    return p


#: the options only some experiments use (any other refuses them)
OPTIONS = {
    "kinds": ("recovery",),
    "faults": ("link",),
    "subscriptions": ("leave",),
    "departed_masters": ("leave",),
}


def _validate(args: argparse.Namespace) -> None:
    reason = not_for(args, vars(arguments().parse_args([])), OPTIONS, args.experiment)
    if reason is not None:
        raise ValueError(reason)
    try:
        rates = [float(x) for x in args.rates.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be numbers, got {args.rates!r}") from None
    if not rates or any(not 1 <= r <= 100_000 for r in rates):
        raise ValueError(f"--rates must be 1..100000 events/s, got {args.rates!r}")


def _tasks(args: argparse.Namespace) -> list[dict[str, Any]]:
    rates = [float(x) for x in args.rates.split(",")]
    if args.experiment == "recovery":
        kinds = args.kinds.split(",")
    elif args.experiment == "link":
        kinds = args.faults.split(",")
    else:
        kinds = ["remove"]
    return [
        {"experiment": args.experiment, "kind": kind, "rate": rate, "run": i}
        for rate in rates
        for kind in kinds
        for i in range(args.repeats)
    ]


# ------------------------------------------------------------------ executor side
def _run_on_executor(
    settings_data: dict[str, Any], task: dict[str, Any], options: dict[str, Any]
) -> dict[str, Any]:
    """Runs inside a Spark task: one run of one experiment; its row (or the error)."""
    settings = Settings.load(**settings_data)
    work = Path(options["work_dir"]) if options.get("work_dir") else None
    try:
        with tempfile.TemporaryDirectory(prefix="qosmq-faults-") as temporary:
            directory = work or Path(temporary)
            experiment, rate = task["experiment"], task["rate"]
            if experiment == "recovery":
                from .phoenix_recovery import run_recovery

                rows, _ = run_recovery(
                    settings,
                    directory=directory,
                    kinds=[task["kind"]],
                    rates=[rate],
                    kills=1,
                    seconds=options["stream"],
                    seed=1 + task["run"],
                )
            elif experiment == "link":
                from .phoenix_links import run_links

                rows, _ = run_links(
                    settings,
                    directory=directory,
                    faults=[task["kind"]],
                    rates=[rate],
                    cuts=1,
                    seconds=max(options["stream"], 5.5),
                    seed=1 + task["run"],
                )
            else:
                from .phoenix_links import run_leave

                rows = run_leave(
                    settings,
                    directory=directory,
                    runs=1,
                    rate=rate,
                    subscriptions=options["subscriptions"],
                    seconds=max(options["stream"], 10.0),
                    departed_masters=options.get("departed_masters", 1),
                )
    except Exception as exc:
        return {"rows": [], **failure(exc)}
    return {"rows": [{**row, "run": task["run"]} for row in rows]}


# -------------------------------------------------------------------- driver side
def run(args: argparse.Namespace) -> Path:
    settings = Settings.load(args.config)
    spark = session("qosmq-faults", args.master)
    out = new_result_dir(args.out, f"faults-{args.experiment}")
    tasks = _tasks(args)
    print(
        f"qosmq faults job: {args.experiment}, {len(tasks)} runs; results in {out}",
        file=sys.stderr,
        flush=True,
    )
    options = {
        "stream": args.stream,
        "subscriptions": args.subscriptions,
        "departed_masters": args.departed_masters,
        "work_dir": str(args.work_dir) if args.work_dir else None,
    }

    progress = progress_printer(len(tasks), lambda t: f"{t['kind']} at {t['rate']:g}/s")

    try:
        driven = drive(
            spark,
            out,
            _run_on_executor,
            spark_common.settings_payload(settings),
            tasks,
            extra=(options,),
            progress=progress,
        )
        summary = aggregate(spark, args.experiment, driven.rows)
    finally:
        spark.stop()
    _write(out, args.experiment, driven.rows, driven.errors, summary, settings)
    return out


def aggregate(spark: Any, experiment: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kind of fault and rate: median and p99 of each time (``percentile_approx``),
    sums of events, losses and duplicates, and the targets checked."""
    if not rows:
        return []
    from pyspark.sql import functions as F

    kind, times = SHAPE[experiment]
    lost = LOST[experiment]
    columns = [kind, "rate", *times, "events", *lost, "duplicates"]
    data = [{c: (None if r.get(c) is None else r[c]) for c in columns} for r in rows]
    frame = spark.createDataFrame(
        [tuple(d[c] for c in columns) for d in data],
        schema=", ".join(
            f"{c} {'string' if c == kind else 'double' if c in ('rate', *times) else 'long'}"
            for c in columns
        ),
    )
    measures = [F.count(F.lit(1)).alias("runs")]
    for t in times:
        measures.append(F.percentile_approx(t, 0.5, 10_000).alias(f"{t}_p50"))
        measures.append(F.percentile_approx(t, 0.99, 10_000).alias(f"{t}_p99"))
    measures += [F.sum(c).alias(c) for c in ("events", *lost, "duplicates")]
    summary = []
    for row in frame.groupBy(kind, "rate").agg(*measures).orderBy("rate", kind).collect():
        s = row.asDict()
        s["lost_total"] = sum(int(s[c] or 0) for c in lost)
        target = TARGETS_S[experiment]
        p50 = s.get("function_s_p50")
        s["target_s"] = target
        s["target_met"] = p50 is not None and p50 <= target and s["lost_total"] == 0
        summary.append(s)
    return summary


def _write(
    out: Path,
    experiment: str,
    rows: list[dict[str, Any]],
    errors: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
) -> None:
    kind, times = SHAPE[experiment]
    write_csv(out / "runs.csv", rows, (kind, "rate", "run", *times))
    write_csv(out / "summary.csv", summary, (kind, "rate", "runs"))
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    lines = [f"# Phoenix {experiment} experiment (Spark)", "", *provenance(settings), ""]
    for s in summary:
        p50, p99 = s.get("function_s_p50"), s.get("function_s_p99")
        verdict = "met" if s["target_met"] else "NOT met"
        lines.append(
            f"- {s[kind]} at {s['rate']:g}/s, {s['runs']} runs: first event served after "
            f"the fault {p50} s median (p99 {p99}); {s['events']} events, "
            f"{s['lost_total']} lost, {s['duplicates']} duplicates; target "
            f"{s['target_s']} s median and 0 lost: {verdict}"
        )
    for e in errors:
        lines.append(f"- run {e['run']} of {e['kind']} at {e['rate']:g}/s failed: {e['error']}")
    lines += ["", "Per run: `runs.csv`; per kind and rate: `summary.csv`."]
    (out / "report.md").write_text("\n".join(lines) + "\n")


def execute(args: argparse.Namespace) -> int:
    """Validate, run, print the report; for ``main`` and ``qosmq spark faults``."""
    return spark_common.execute(args, job="faults_job", validate=_validate, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    return execute(arguments().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
