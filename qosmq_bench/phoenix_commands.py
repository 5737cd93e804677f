"""``qosmq bench phoenix``: the Phoenix experiments (paper 000) from the command line,
each experiment's options and its table."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from middleware.cli_help import not_for, renamed
from middleware.errors import InvalidArgument

from .bench_common import brokers_answer, provenance
from .phoenix_options import PHOENIX_OPTIONS, PHOENIX_REPEATS, add_phoenix_arguments

__all__ = ["register_phoenix"]


def register_phoenix(cmds: Any) -> None:
    """``bench phoenix`` and its options (``cmds``: the bench's subcommands)."""
    phoenix = cmds.add_parser("phoenix", help="Phoenix experiments (paper 000)")
    add_phoenix_arguments(phoenix)
    renamed(phoenix, "--json", "--out")
    phoenix.set_defaults(run=_run_phoenix)
    phoenix.set_defaults(
        phoenix_defaults={a.dest: a.default for a in phoenix._actions if a.option_strings}
    )


def _run_phoenix(args: argparse.Namespace) -> int:
    reason = not_for(args, args.phoenix_defaults, PHOENIX_OPTIONS, args.experiment)
    if reason is not None:
        raise InvalidArgument(reason)
    if args.repeats is None:
        args.repeats = PHOENIX_REPEATS.get(args.experiment, 1)
    if args.experiment != "matching":  # a broker must answer before anything is preloaded
        brokers_answer(args.settings)
    if args.experiment == "recovery":
        return _run_phoenix_recovery(args)
    if args.experiment == "link":
        return _run_phoenix_links(args)
    if args.experiment == "busy":
        return _run_phoenix_busy(args)
    if args.experiment == "chaos":
        return _run_phoenix_chaos(args)
    if args.experiment == "leave":
        return _run_phoenix_leave(args)
    if args.experiment == "throughput":
        return _run_phoenix_throughput(args)
    if args.experiment != "matching":
        return _run_phoenix_timeliness(args)
    from .phoenix import matching_throughput

    args.subscriptions = args.subscriptions or "10000,50000,100000,200000"
    rows = []
    print(
        f"{'subscriptions':>13} {'events/s':>9} {'matches/event':>13} {'work/event':>10} "
        f"{'build s':>8}"
    )
    for n in (int(x) for x in args.subscriptions.split(",")):
        row = {
            **matching_throughput(n, events=args.events, symbols=args.symbols),
            **provenance(args.settings),
        }
        rows.append(row)
        print(
            f"{n:>13} {row['events_per_s']:>9} {row['matches_per_event']:>13} "
            f"{row['work_per_event']:>10} {row['build_s']:>8}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def _run_phoenix_links(args: argparse.Namespace) -> int:
    from .phoenix_links import run_links, summarize_links

    rates = [float(x) for x in (args.rates or "200").split(",")]
    columns = (
        "fault",
        "rate",
        "detect_s",
        "reroute_s",
        "function_s",
        "back_s",
        "floods",
        "flood_messages",
        "events",
        "lost",
        "duplicates",
        "p50_direct_ms",
        "p50_detour_ms",
    )
    report = _live_table(columns, "detour", lambda row: str(row["detour"]))

    rows, run = run_links(
        args.settings,
        directory=args.work_dir,
        faults=args.faults.split(","),
        rates=rates,
        cuts=args.repeats,
        seconds=max(args.stream, args.down + 3.0),
        down_s=args.down,
        report=report,
        fields={} if args.link_timeout is None else {"link_timeout_s": args.link_timeout},
    )
    summary = summarize_links(rows)
    keys = tuple(summary[0]) if summary else ()
    print(
        f"\nper fault: median and p99 over the cuts of {run['link']} (detour via "
        f"{run['detour_via']}, link down {run['down_s']} s each); target: function_p50_s <= 1; "
        f"topology fields set: {run['topology'] or 'none (defaults)'}"
    )
    print(" ".join(f"{k:>{max(8, len(k))}}" for k in keys))
    for r in summary:
        print(" ".join(f"{r[k]!s:>{max(8, len(k))}}" for k in keys))
    print(f"logs: {run['directory']}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"rows": rows, "summary": summary, "run": run, **provenance(args.settings)},
                indent=2,
            )
        )
    return 1 if sum(r["lost"] for r in rows) else 0


def _run_phoenix_chaos(args: argparse.Namespace) -> int:
    from middleware.localcluster import LocalCluster

    from .phoenix_chaos import problems, run_chaos, summarize

    cluster = LocalCluster.open(args.state_dir) if args.state_dir else None
    rows = run_chaos(
        args.settings,
        directory=args.work_dir,
        seed=args.seed,
        faults=args.chaos_faults.split(","),
        rate=float((args.rates or "100").split(",")[0]),
        window_s=args.window,
        cluster=cluster,
        clusters="ABCDEFGH"[: args.chaos_clusters],
        fields=_topology_fields(args) or None,
    )
    print(summarize(rows))
    broken = problems(rows)
    for line in broken:
        print(f"broken: {line}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=2))
    return 1 if broken else 0


def _detection_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The topology's detection fields the command line set (beats, checks)."""
    return {
        key: value
        for key, value in (
            ("heartbeat_interval_s", args.heartbeat_interval),
            ("heartbeat_misses", args.heartbeat_misses),
            ("slave_beat_interval_s", args.slave_beat_interval),
            ("quiet_beat_interval_s", args.quiet_beat_interval),
            ("neighbour_check_s", args.neighbour_check),
        )
        if value is not None
    }


def _run_phoenix_throughput(args: argparse.Namespace) -> int:
    from .phoenix_throughput import run_throughput, summarize_throughput

    result = run_throughput(
        args.settings,
        directory=args.work_dir,
        subscriptions=int((args.subscriptions or "200000").split(",")[0]),
        rates=[float(r) for r in (args.rates or "200,400,800,1200,1600,2000").split(",")],
        mechanism=args.mechanisms.split(",")[-1],
        duration_s=args.duration,
        warmup_s=args.warmup,
        idle_s=args.idle,
        keep_going=args.keep_going,
        linger_ms=args.batch_linger_ms,
        report=lambda row: print(json.dumps(row), flush=True),
        topology_fields={**_detection_fields(args), **_topology_fields(args)},
    )
    result.update(provenance(args.settings))
    print(summarize_throughput(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


def _run_phoenix_busy(args: argparse.Namespace) -> int:
    from .phoenix_busy import run_busy

    row = run_busy(
        args.settings,
        directory=args.work_dir,
        hogs=args.hogs,
        rate=float((args.rates or "100").split(",")[0]),
        duration_s=args.busy_seconds,
        fields=None
        if args.suspect_ceiling is None
        else {"suspect_ceiling_s": args.suspect_ceiling},
    )
    row.update(provenance(args.settings))
    print(json.dumps(row, indent=2))
    if args.out:
        args.out.write_text(json.dumps(row, indent=2))
    return 0


def _run_phoenix_leave(args: argparse.Namespace) -> int:
    from .phoenix_links import run_leave, summarize_leave

    rate = float((args.rates or "200").split(",")[0])
    subscriptions = int((args.subscriptions or "200000").split(",")[0])
    columns = (
        "subscriptions",
        "rate",
        "departed",
        "successor",
        "added_roles",
        "provision_s",
        "detect_s",
        "restore_s",
        "restored",
        "restored_per_s",
        "function_s",
        "events",
        "lost_after",
        "lost_in_departed",
        "duplicates",
    )
    report = _live_table(columns)

    fields = {} if args.leave_after is None else {"leave_after_s": args.leave_after}
    rows = run_leave(
        args.settings,
        directory=args.work_dir,
        runs=args.repeats,
        rate=rate,
        subscriptions=subscriptions,
        seconds=max(args.stream, 10.0),
        report=report,
        fields=fields,
        departed_masters=args.departed_masters,
    )
    summary = summarize_leave(rows)
    print(
        "\nmedian and p99 over the removals; target: function_p50_s <= 5 with 200 000 "
        f"subscriptions; topology fields set: {fields or 'none (defaults)'}"
    )
    print(" ".join(f"{k:>{max(8, len(k))}}" for k in summary))
    print(" ".join(f"{v!s:>{max(8, len(k))}}" for k, v in summary.items()))
    if args.out:
        args.out.write_text(
            json.dumps({"rows": rows, "summary": summary, **provenance(args.settings)}, indent=2)
        )
    return 1 if summary["lost_after"] else 0


def _run_phoenix_recovery(args: argparse.Namespace) -> int:
    from .phoenix_recovery import run_recovery, summarize_recovery

    rates = [float(x) for x in (args.rates or "200").split(",")]
    columns = (
        "kind",
        "rate",
        "detection_s",
        "recovery_s",
        "function_s",
        "events",
        "lost",
        "duplicates",
        "delayed",
        "p50_before_ms",
        "max_latency_s",
    )
    report = _live_table(columns, "killed", lambda row: f"{row['killed']} -> {row['served_by']}")

    rows, run = run_recovery(
        args.settings,
        directory=args.work_dir,
        kinds=args.kinds.split(","),
        rates=rates,
        kills=args.repeats,
        seconds=args.stream,
        report=report,
        fields={
            **_detection_fields(args),
            **_topology_fields(args),
        },
        confirm=args.subscriber_confirm,
    )
    summary = summarize_recovery(rows)
    keys = (
        "kind",
        "rate",
        "kills",
        "detection_p50_s",
        "detection_p99_s",
        "recovery_p50_s",
        "recovery_p99_s",
        "function_p50_s",
        "function_p99_s",
        "lost",
        "duplicates",
        "delayed",
        "paper_s",
    )
    print(
        "\nper kind: median and p99 over the kills; paper: detection + recovery at 2000/s; "
        f"topology fields set: {run['topology'] or 'none (defaults)'}"
    )
    print(" ".join(f"{k:>{max(8, len(k))}}" for k in keys) + "  paper / recovery_p50")
    for r in summary:
        times = r["paper_s"] / r["recovery_p50_s"] if r["recovery_p50_s"] else float("nan")
        print(" ".join(f"{r[k]!s:>{max(8, len(k))}}" for k in keys) + f"  {times:.0f}x")
    print(
        f"\nelections logged: {run['elections_logged']} for {run['master_kills']} master "
        f"kills; false suspicions (elections against a master nobody killed in the 5 s "
        f"before): {run['false_suspicions']}; masters stepped down (fenced): "
        f"{run['stepped_down']}; processes retired (should be 0): {run.get('retired', 0)}; "
        f"logs: {run['directory']}"
    )
    for line in run["false_suspicion_lines"]:
        print(f"  false suspicion: {line}")
    if args.out:
        args.out.write_text(
            json.dumps(
                {"rows": rows, "summary": summary, "run": run, **provenance(args.settings)},
                indent=2,
            )
        )
    lost = sum(r["lost"] for r in rows)
    return 1 if lost else 0


def _run_phoenix_timeliness(args: argparse.Namespace) -> int:
    from .options import MECHANISMS
    from .phoenix_timeliness import run_experiment, steal_limits, summarize

    by_rate = args.experiment == "rate"
    counts = [
        int(x)
        for x in (
            args.subscriptions or ("200000" if by_rate else "10000,50000,100000,200000")
        ).split(",")
    ]
    rates = [float(x) for x in (args.rates or ("100,200,400" if by_rate else "200")).split(",")]
    mechanisms = args.mechanisms.split(",")
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        raise InvalidArgument(f"unknown mechanisms {unknown}; choose from {', '.join(MECHANISMS)}")
    columns = (
        "subscriptions",
        "mechanism",
        "rate",
        "offered_per_s",
        "events",
        "delivered_events",
        "mean_ms",
        "p50_ms",
        "p99_ms",
        "urgent_mean_ms",
        "bulk_mean_ms",
    )
    report = _live_table(columns, "cpu %", _cpu_and_marks)

    try:
        max_steal, steal_retries = steal_limits(args)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None

    rows = run_experiment(
        args.settings,
        directory=args.work_dir,
        subscription_counts=counts,
        rates=rates,
        mechanisms=mechanisms,
        duration_s=args.duration,
        repeats=args.repeats,
        warmup_s=args.warmup,
        report=report,
        max_steal_pct=max_steal,
        steal_retries=steal_retries,
        inbox_mirrors=args.inbox_mirrors,
        role_queue_type=args.role_queues,
        fields=_topology_fields(args) or None,
    )
    summary = summarize(rows)
    print(
        "\nmean over repeats (lowest-highest single repeat in brackets); "
        "ratio = mean response time / the same rate's 'none'; cpu %: machine and steal of "
        "all cores, client and the busiest role of each kind of one core"
    )
    keys = (
        "subscriptions",
        "mechanism",
        "rate",
        "repeats",
        "mean_ms",
        "p99_ms",
        "urgent_mean_ms",
        "bulk_mean_ms",
    )
    print(" ".join(f"{k:>{max(8, len(k))}}" for k in keys) + "  x none")
    base = {
        (r["subscriptions"], r["rate"]): r["mean_ms"] for r in summary if r["mechanism"] == "none"
    }
    for r in summary:
        none = base.get((r["subscriptions"], r["rate"]))
        r["x_none"] = round(r["mean_ms"] / none, 2) if none and r["mean_ms"] else None
        spread = " ".join(
            f"[{r[k][0]}-{r[k][1]}]" for k in ("mean_ms_range", "p99_ms_range") if r.get(k)
        )
        line = " ".join(f"{r.get(k)!s:>{max(8, len(k))}}" for k in keys)
        print(f"{line}  {r['x_none']}  {spread}  {_cpu_text(r.get('cpu'))}")
    for row in rows:
        row.update(provenance(args.settings))
    if args.out:
        args.out.write_text(json.dumps({"cells": rows, "summary": summary}, indent=2))
    return 0


def _cpu_text(cpu: dict[str, float | None] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (cpu or {}).items() if v is not None)


def _live_table(
    columns: Sequence[str], last: str = "", tail: Callable[[dict[str, Any]], str] | None = None
) -> Callable[[dict[str, Any]], None]:
    """Print the header of a live table (``columns``, then ``last`` unaligned) and return
    what prints each row as it comes (``tail``: the row's last, unaligned part)."""
    widths = [max(8, len(c)) for c in columns]
    header = " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True))
    print(f"{header}  {last}" if last else header, flush=True)

    def report(row: dict[str, Any]) -> None:
        line = " ".join(f"{row.get(c)!s:>{w}}" for c, w in zip(columns, widths, strict=True))
        print(f"{line}  {tail(row)}" if tail else line, flush=True)

    return report


def _cpu_and_marks(row: dict[str, Any]) -> str:
    """A timeliness row's CPU, and whether it was discarded or disturbed (steal)."""
    marks = "".join(
        f"  ({what}: {row[what]})" for what in ("discarded", "disturbed") if row.get(what)
    )
    return f"{_cpu_text(row.get('cpu'))}{marks}"


def _topology_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The topology fields ``--copy-batch-max``, ``--inbox-prefetch``,
    ``--inbox-concurrency`` and ``--transient`` set (none: defaults)."""
    fields: dict[str, Any] = {}
    for name in ("copy_batch_max", "inbox_prefetch", "inbox_concurrency"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    if args.transient:
        fields["persistent"] = False
    return fields
