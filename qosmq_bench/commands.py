"""``qosmq bench …`` and ``qosmq demo``: benchmark cells from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.cli_help import renamed
from middleware.cliargs import integer, integers, names, number, numbers, out_file, path
from middleware.errors import InvalidArgument
from middleware.settings import Settings

from .balance_commands import register_balance
from .bench_common import live_arguments, progress, provenance
from .confirms import MODES, CellSpec, receipt_share, run_cell_sync
from .phoenix_commands import register_phoenix
from .stats import whole

__all__ = ["format_table", "register", "run_confirms_grid"]


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark cells against the running cluster")
    cmds = bench.add_subparsers(title="benchmarks", required=True)
    confirms = cmds.add_parser("confirms", help="confirm modes x queue counts (Xu & Jiao)")
    _grid_arguments(confirms, modes="raw,none,broker,persistent,e2e", queues="1,2,3", duration=10.0)
    live_arguments(confirms)
    confirms.set_defaults(run=_run_confirms)
    demo = sub.add_parser("demo", help="bring up the local cluster and run a short benchmark")
    _grid_arguments(demo, modes="raw,broker,persistent,e2e", queues="1,2", duration=5.0, out=False)
    demo.add_argument(
        "--state-dir",
        type=path,
        default=Path(".qosmq"),
        help="where the local cluster keeps its nodes' data, logs and PIDs",
    )
    demo.add_argument(
        "--out", type=path, default=Path("results"), help="the folder the results go to"
    )
    demo.set_defaults(run=_run_demo)
    register_balance(cmds)
    register_phoenix(cmds)
    transport = cmds.add_parser("transport", help="the clients' cost per message vs raw")
    from .transport import CLIENTS

    transport.add_argument(
        "--clients",
        type=names(CLIENTS),
        default="raw,layer,layer-per-frame",
        help="the clients compared (comma list; raw: plain aio-pika, the baseline)",
    )
    transport.add_argument(
        "--messages", type=integer(1, 100_000_000), default=4000, help="per cell"
    )
    transport.add_argument(
        "--size", type=integer(1, 16 * 2**20), default=100, help="message size in bytes"
    )
    transport.add_argument(
        "--repeats", type=integer(1, 100), default=3, help="passes (order rotated)"
    )
    transport.add_argument("--out", type=out_file, help="also write the rows to this JSON file")
    renamed(transport, "--json", "--out")
    live_arguments(transport)
    transport.set_defaults(run=_run_transport)
    queues = cmds.add_parser("queues", help="persistent-queue API rates, spool and drain")
    queues.add_argument(
        "--duration",
        type=number(0, 86_400, above=True),
        default=10.0,
        help="seconds per cell",
    )
    queues.add_argument(
        "--size", type=integer(1, 16 * 2**20), default=1500, help="message size in bytes"
    )
    queues.add_argument(
        "--window", type=integer(1, 65_536), default=256, help="enqueues unconfirmed at once"
    )
    queues.add_argument("--out", type=out_file, help="also write the rows to this JSON file")
    renamed(queues, "--json", "--out")
    live_arguments(queues)
    queues.set_defaults(run=_run_queues)
    loss = cmds.add_parser(
        "node-loss",
        help="confirm modes through a lost RabbitMQ node (needs the local cluster)",
    )
    from .node_loss import FAULTS, SCENARIOS

    loss.add_argument(
        "--scenarios",
        type=names(SCENARIOS),
        default=",".join(SCENARIOS),
        help="publisher-node: clients and queue leaders on the killed node; leader-node: "
        "the leaders' node killed, clients elsewhere; two-nodes: the publisher node, then "
        "the node the clients failed over to (default: all)",
    )
    loss.add_argument(
        "--rates",
        type=numbers(0, 1e5, above=True),
        default="30",
        help="publishes/s per workload, comma list (each scenario runs at each rate)",
    )
    loss.add_argument(
        "--down",
        type=number(0, 3600, above=True),
        default=30.0,
        help="seconds each node stays down",
    )
    loss.add_argument(
        "--fault",
        choices=FAULTS,
        default="kill",
        help="kill: SIGKILL (a crash); stop: a graceful stop (a rolling restart); freeze: "
        "SIGSTOP for the outage, then SIGCONT (a paused VM)",
    )
    loss.add_argument("--state-dir", type=path, default=Path(".qosmq"), help="the local cluster")
    loss.add_argument("--out", type=out_file, help="also write the rows to this JSON file")
    renamed(loss, "--json", "--out")
    renamed(loss, "--rate", "--rates")
    loss.set_defaults(run=_run_node_loss)
    spark = sub.add_parser("spark", help="the PySpark benchmark pipeline on local[*]")
    jobs = spark.add_subparsers(title="jobs", required=True)
    job = jobs.add_parser("confirms", help="confirm modes x queue counts, with a report")
    from .spark_confirms import arguments

    arguments(job)
    job.set_defaults(run=_run_spark_confirms, master="local[*]")
    job = jobs.add_parser(
        "phoenix", help="Phoenix response time vs rate or subscriptions, with a report"
    )
    from .spark_phoenix import arguments as phoenix_arguments

    phoenix_arguments(job)
    job.set_defaults(run=_run_spark_phoenix, master="local[*]")
    job = jobs.add_parser(
        "faults", help="Phoenix role recovery, link failures or cluster leave, with a report"
    )
    from .spark_faults import arguments as faults_arguments

    faults_arguments(job)
    job.set_defaults(run=_run_spark_faults, master="local[*]")
    job = jobs.add_parser(
        "balance", help="weighted dispatch, paper 001's experiment, with a report"
    )
    from .spark_balance import arguments as balance_arguments

    balance_arguments(job)
    job.set_defaults(run=_run_spark_balance, master="local[*]")


def _grid_arguments(
    p: argparse.ArgumentParser, *, modes: str, queues: str, duration: float, out: bool = True
) -> None:
    p.add_argument(
        "--modes", type=names(MODES), default=modes, help=f"comma list of {', '.join(MODES)}"
    )
    p.add_argument(
        "--queues", type=integers(1, 64), default=queues, help="comma list of queue counts"
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
        "--duration", type=number(0, 86_400, above=True), default=duration, help="seconds per cell"
    )
    p.add_argument(
        "--window", type=integer(1, 65_536), default=64, help="in-flight publishes per producer"
    )
    if out:  # the demo's --out is the Spark job's folder
        p.add_argument("--out", type=out_file, help="write the records to this JSON file")
        renamed(p, "--json", "--out")


def _cells(args: argparse.Namespace) -> list[CellSpec]:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        queue_counts = [int(q) for q in args.queues.split(",") if q.strip()]
        return [
            CellSpec(
                mode=m,
                queues=q,
                producers_per_queue=args.producers_per_queue,
                consumers_per_queue=args.consumers_per_queue,
                size=args.size,
                duration_s=args.duration,
                window=args.window,
            )
            for q in queue_counts
            for m in modes
        ]
    except ValueError as exc:
        raise InvalidArgument(f"bad grid: {exc}") from None


def run_confirms_grid(
    settings: Settings, cells: list[CellSpec], *, interval_s: float = 1.0, quiet: bool = False
) -> list[dict[str, Any]]:
    """Run cells one after another (they must not compete for the CPU); add ratios.  A
    progress line every ``interval_s`` on stderr inside each cell unless ``quiet``."""

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = []
    for i, cell in enumerate(cells, 1):
        print(
            f"[{i}/{len(cells)}] mode={cell.mode} queues={cell.queues} "
            f"for {cell.duration_s:g} s ...",
            file=sys.stderr,
            flush=True,
        )
        try:
            row = run_cell_sync(
                settings, cell, progress=None if quiet else progress, interval_s=interval_s
            )
        except Exception as exc:  # a failed cell is recorded and the grid goes on
            row = {
                "mode": cell.mode,
                "queues": cell.queues,
                "error": f"{type(exc).__name__}: {exc}",
                "confirmed_per_s": float("nan"),
            }
        row.update(provenance(settings))
        rows.append(row)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's throughput over the same queue count's ``persistent`` and ``raw`` rows."""
    for base in ("persistent", "raw"):
        ref = {r["queues"]: r.get("confirmed_per_s") for r in rows if r["mode"] == base}
        for r in rows:
            denominator = ref.get(r["queues"])
            value = r.get("confirmed_per_s")
            r[f"ratio_vs_{base}"] = (
                round(value / denominator, 3) if denominator and value == value else None
            )


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'mode':15} {'queues':>6} {'confirmed/s':>11} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'p99 ms':>8} {'lost':>5} {'dups':>5} {'x persistent':>12} {'x raw':>6} "
        f"{'client cpu %':>12} {'cpu µs/msg':>10} {'receipt msgs %':>14}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['mode']:15} {r['queues']:>6} FAILED: {r['error']}")
            continue
        lines.append(
            f"{r['mode']:15} {r['queues']:>6} {r['confirmed_per_s']:>11.0f} "
            f"{r['confirm_p50_ms']:>8.1f} {r['confirm_p95_ms']:>8.1f} {r['confirm_p99_ms']:>8.1f} "
            f"{r['lost']:>5} {r['duplicates']:>5} {_ratio(r['ratio_vs_persistent']):>12} "
            f"{_ratio(r['ratio_vs_raw']):>6} {whole(r.get('client_cpu_pct')):>12} "
            f"{whole(r.get('client_cpu_us_per_msg')):>10} {receipt_share(r):>14}"
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _run_confirms(args: argparse.Namespace) -> int:
    cells = _cells(args)
    rows = run_confirms_grid(args.settings, cells, interval_s=args.interval, quiet=args.quiet)
    print(format_table(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
        print(f"records: {args.out}")
    return 1 if any("error" in r or r.get("lost") for r in rows) else 0


def _run_demo(args: argparse.Namespace) -> int:
    """Cluster up, then a short Spark job (or, without PySpark, the same cells directly)."""
    from middleware.localcluster import LocalCluster

    cells = _cells(args)  # refuse a bad grid before starting anything
    cluster = LocalCluster.open(args.state_dir)
    started = time.monotonic()
    status = cluster.up()
    print(
        f"cluster: {', '.join(status['members'])} (ready in {time.monotonic() - started:.1f} s)",
        file=sys.stderr,
    )
    settings = args.settings.model_copy(update={"amqp_urls": tuple(status["amqp_urls"])})
    try:
        import pyspark  # noqa: F401
    except ImportError:
        print("PySpark not installed: running the cells without Spark", file=sys.stderr)
        args.out.mkdir(parents=True, exist_ok=True)
        return _run_confirms_with(settings, cells, args.out / "cells.json")
    from .spark_confirms import arguments, execute

    job = arguments().parse_args(
        [
            "--modes",
            args.modes,
            "--queues",
            args.queues,
            "--duration",
            str(args.duration),
            "--repeats",
            "1",
            "--producers-per-queue",
            str(args.producers_per_queue),
            "--consumers-per-queue",
            str(args.consumers_per_queue),
            "--size",
            str(args.size),
            "--out",
            str(args.out),
            "--master",
            "local[*]",
            "--tasks-per-cell",  # the short run: one task per cell, one clock per cell
            "1",
        ]
    )
    os.environ["QOSMQ_AMQP_URLS"] = ",".join(status["amqp_urls"])
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    return execute(job)


def _run_queues(args: argparse.Namespace) -> int:
    from .queues import run_queue_bench

    rows = runtime.run(
        run_queue_bench(
            args.settings,
            duration_s=args.duration,
            size=args.size,
            window=args.window,
            progress=progress(args),
            interval_s=args.interval,
        ),
        event_loop=args.settings.event_loop,
    )
    print(f"{'cell':8} {'messages':>9} {'seconds':>8} {'msg/s':>9} {'x raw':>6} {'x enqueue':>9}")
    for r in rows:
        r.update(provenance(args.settings))
        print(
            f"{r['cell']:8} {r['messages']:>9} {r['seconds']:>8.2f} {r['per_s']:>9.0f} "
            f"{r['ratio_vs_raw']:>6.2f} {r['ratio_vs_enqueue']:>9.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def _run_node_loss(args: argparse.Namespace) -> int:
    from middleware.localcluster import LocalCluster

    from .node_loss import run_node_loss

    cluster = LocalCluster.open(args.state_dir)
    settings = args.settings.model_copy(update={"amqp_urls": tuple(cluster.status()["amqp_urls"])})
    rows: list[dict[str, Any]] = []
    for rate in (float(r) for r in args.rates.split(",")):
        for scenario in args.scenarios.split(","):
            found = runtime.run(
                run_node_loss(
                    cluster,
                    settings,
                    scenario=scenario,
                    rate=rate,
                    down_s=args.down,
                    fault=args.fault,
                    progress=lambda line: print(line, file=sys.stderr, flush=True),
                ),
                event_loop=args.settings.event_loop,
            )
            rows += [{**r, "rate": rate} for r in found]
    print(format_node_loss(rows))
    if args.out:
        for r in rows:
            r.update(provenance(args.settings))
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def format_node_loss(rows: list[dict[str, Any]]) -> str:
    """The node-loss rows as a Markdown table."""
    head = (
        "| scenario | workload | phase | published | confirmed | first confirm s | "
        "longest gap s | p50 s | p99 s | max s | errors | lost | dups |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        cells = [r["scenario"], r["workload"], r["phase"], r["published"], r["confirmed"]]
        cells += [r.get("first_confirm_s", "-"), r.get("longest_gap_s", "-")]
        cells += [r["p50_s"], r["p99_s"], r["max_s"], errors]
        cells += [r.get("lost", ""), r.get("duplicates", "")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def _run_transport(args: argparse.Namespace) -> int:
    from .transport import CLIENTS, LOOPS, SYNC_CLIENTS, run_transport, split_client

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    unknown = sorted(
        c
        for c in clients
        if split_client(c)[0] not in CLIENTS
        or split_client(c)[1] not in (None, *LOOPS)
        or (split_client(c)[0] in SYNC_CLIENTS and split_client(c)[1] is not None)
    )
    if unknown or args.messages < 1 or args.repeats < 1:
        raise InvalidArgument(
            f"--clients from {', '.join(CLIENTS)}, the asyncio ones "
            f"optionally @{'|@'.join(LOOPS)} (got {unknown}); --messages and --repeats >= 1"
        )
    header = f"{'client':16} {'repeat':>6} {'msg/s':>8} {'CPU us/msg':>10} {'frames/write':>12}"
    print(header)

    def report(r: dict[str, Any]) -> None:
        fpw = "-" if r["frames_per_write"] is None else f"{r['frames_per_write']:.2f}"
        print(
            f"{r['client']:16} {r['repeat']:>6} {r['per_s']:>8.0f} "
            f"{r['cpu_us_per_message']:>10.0f} {fpw:>12}"
        )

    rows = run_transport(
        args.settings,
        clients=clients,
        messages=args.messages,
        size=args.size,
        repeats=args.repeats,
        report=report,
        progress=progress(args),
        interval_s=args.interval,
    )
    summary = []
    for client in clients:
        mine = [r for r in rows if r["client"] == client]
        summary.append(
            {
                "client": client,
                "per_s": round(sum(r["per_s"] for r in mine) / len(mine), 1),
                "cpu_us_per_message": round(
                    sum(r["cpu_us_per_message"] for r in mine) / len(mine), 1
                ),
            }
        )
    # the baselines: the sync face against raw pika; the asyncio clients against plain
    # "raw", else the first raw cell named with its loop
    raw_pika = next((s for s in summary if s["client"] == "raw-pika"), None)
    raw = next((s for s in summary if s["client"] == "raw"), None) or next(
        (s for s in summary if split_client(s["client"])[0] == "raw"), None
    )
    print(f"\nmean of {args.repeats} passes; x raw: against the same face's raw client, same run")
    for s in summary:
        base = raw_pika if s["client"] in SYNC_CLIENTS else raw
        ratio = (
            ""
            if base is None
            else (
                f"  x {base['client']}: {s['per_s'] / base['per_s']:.2f} msg/s, "
                f"{s['cpu_us_per_message'] / base['cpu_us_per_message']:.2f} CPU"
            )
        )
        print(
            f"{s['client']:16} {s['per_s']:>8.0f} msg/s {s['cpu_us_per_message']:>6.0f} us{ratio}"
        )
    if args.out:
        records = {"cells": rows, "summary": summary, **provenance(args.settings)}
        args.out.write_text(json.dumps(records, indent=2))
    return 0


def _run_spark_confirms(args: argparse.Namespace) -> int:
    from .spark_confirms import execute

    return execute(args)


def _run_spark_balance(args: argparse.Namespace) -> int:
    from .spark_balance import execute

    return execute(args)


def _run_spark_faults(args: argparse.Namespace) -> int:
    from .spark_faults import execute

    return execute(args)


def _run_spark_phoenix(args: argparse.Namespace) -> int:
    from .spark_phoenix import execute

    return execute(args)


def _run_confirms_with(settings: Settings, cells: list[CellSpec], out: Path | None) -> int:
    rows = run_confirms_grid(settings, cells)
    print()
    print(format_table(rows))
    print(
        "\nx persistent: throughput over the paper's baseline (confirms + quorum queue + "
        "persistent messages);\nx raw: over plain aio-pika with publisher confirms, same load, "
        "same run."
    )
    if out:
        out.write_text(json.dumps(rows, indent=2))
    return 1 if any("error" in r or r.get("lost") for r in rows) else 0
