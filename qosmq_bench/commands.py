"""``qosmq bench …`` and ``qosmq demo``: benchmark cells from the command line."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import time
from pathlib import Path
from typing import Any

from middleware import __version__, runtime
from middleware.cli_help import not_for, renamed
from middleware.cliargs import integer, integers, names, number, numbers, out_file, path
from middleware.errors import InvalidArgument
from middleware.settings import Settings

from .confirms import MODES, CellSpec, receipt_share, run_cell_sync
from .options import add_departed_masters
from .stats import whole

__all__ = ["format_table", "register", "run_confirms_grid"]


def register(sub: Any) -> None:
    bench = sub.add_parser("bench", help="benchmark cells against the running cluster")
    cmds = bench.add_subparsers(title="benchmarks", required=True)
    confirms = cmds.add_parser("confirms", help="confirm modes x queue counts (Xu & Jiao)")
    _grid_arguments(confirms, modes="raw,none,broker,persistent,e2e", queues="1,2,3", duration=10.0)
    _live_arguments(confirms)
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
    balance = cmds.add_parser("balance", help="weighted dispatch vs round robin (paper 001)")
    from middleware.balancer import ALGORITHMS

    balance.add_argument(
        "--algorithms",
        type=names(ALGORITHMS),
        default="round_robin,paper,inverse,predictive",
        help="the dispatch algorithms compared (comma list)",
    )
    balance.add_argument(
        "--replicas", type=integer(1, 64), default=2, help="queue replicas of the topic"
    )
    balance.add_argument(
        "--rates",
        type=numbers(0, 1e6, above=True),
        default="250,400",
        help="comma list of msg/s (light,heavy)",
    )
    balance.add_argument(
        "--duration",
        type=number(0, 86_400, above=True),
        default=30.0,
        help="seconds per cell",
    )
    balance.add_argument(
        "--service-ms",
        type=number(0, 60_000),
        default=2.0,
        help="milliseconds each consumer spends per message",
    )
    balance.add_argument(
        "--slow-extra-ms",
        type=number(0, 60_000),
        default=6.0,
        help="extra per-message time of replica 0's consumer",
    )
    balance.add_argument(
        "--phases",
        action="store_true",
        help="fault phases instead of steady cells: every algorithm in a lane of its own at "
        "once, 3 replicas, phases steady, slow (a consumer at a quarter of its rate), kill "
        "(a consumer process SIGKILLed, restarted 12 s later), delete (a replica's queue)",
    )
    balance.add_argument(
        "--rate-sources",
        action="store_true",
        help="the replicas' arrival and service rates as the management API and "
        "rabbitmq_prometheus read them, beside the publisher's own rate (the first of "
        "--rates, for --duration s)",
    )
    balance.add_argument(
        "--phase-seconds", type=number(1, 3600), default=30.0, help="--phases: each phase, s"
    )
    balance.add_argument(
        "--service-rate",
        type=number(0, 1e5, above=True),
        default=50.0,
        help="--phases: messages/s each consumer process serves per replica",
    )
    balance.add_argument(
        "--work-dir",
        type=path,
        default=Path(".qosmq/balance-faults"),
        help="--phases: where the sidecars' files go",
    )
    balance.add_argument("--out", type=out_file, help="also write the rows to this JSON file")
    renamed(balance, "--json", "--out")
    renamed(balance, "--rate", "--rates")
    balance.set_defaults(run=_run_balance)
    phoenix = cmds.add_parser("phoenix", help="Phoenix experiments (paper 000)")
    phoenix.add_argument(
        "--experiment",
        choices=(
            *("matching", "rate", "subscriptions", "recovery", "link", "leave", "busy"),
            *("chaos", "throughput"),
        ),
        default="matching",
        help="matching: (c) one match broker; rate: (a) response time vs event rate; "
        "subscriptions: (b) response time vs subscriptions; recovery: (figure 8) SIGKILL "
        "of each role kind under load; link: a link between two routing masters cut or "
        "blackholed under load (detour, way back); leave: a whole cluster removed under "
        "load (its arc restored at its successor from the persisted state); busy: the "
        "deployment started and run beside CPU hogs, elections nobody caused counted; "
        "chaos: every fault kind in a seeded order under both client faces and both "
        "confirm modes, each subscriber's own counts checked against its filters; "
        "throughput: the idle cost, then the rate raised in steps until the deployment "
        "falls behind, with the CPU per event of every process and the messages per "
        "event on each hop",
    )
    phoenix.add_argument(
        "--idle",
        type=number(1, 3600),
        default=20.0,
        help="throughput: seconds measured with no events (the idle cost)",
    )
    phoenix.add_argument(
        "--keep-going",
        action="store_true",
        help="throughput: run every step, also after one fell behind",
    )
    phoenix.add_argument(
        "--batch-linger-ms",
        type=float,
        default=None,
        help="throughput: the topology's batch_linger_ms for every role and the client "
        "(default: the topology's default)",
    )
    phoenix.add_argument(
        "--subscriber-confirm",
        choices=("broker", "e2e"),
        default="broker",
        help="recovery: the subscription's confirm mode (e2e: the Phoenix client's e2e "
        "consumer, whose duplicate filter the duplicates count then checks)",
    )
    phoenix.add_argument(
        "--copy-batch-max",
        type=integer(1, 1000),
        default=None,
        help="throughput, recovery, rate, subscriptions, chaos: the topology's copy_batch_max, "
        "copies for one subscriber queue in one AMQP message (default: the topology's, 1)",
    )
    phoenix.add_argument(
        "--seed", type=integer(0, 2**31), default=1, help="chaos: the order of the faults"
    )
    phoenix.add_argument(
        "--chaos-faults",
        type=names(
            (
                *("router", "router_slave", "match", "match_slave", "freeze", "node", "silent"),
                *("cut", "blackhole", "cut_both", "leave"),
            )
        ),
        default="router,router_slave,match,match_slave,freeze,node,silent",
        help="chaos: the fault kinds (node: needs --state-dir of a local cluster; cut, "
        "blackhole, cut_both: the link B->C, or both ways, through a proxy; leave: the "
        "last cluster other than B and C removed, then joined again; with any of these "
        "every inter-cluster link goes through a proxy and the subscribers are homed at "
        "A and C, or with 4 or more clusters at every cluster)",
    )
    phoenix.add_argument(
        "--chaos-clusters",
        type=integer(3, 8),
        default=3,
        help="chaos: how many clusters (A, B, C, D, ...)",
    )
    phoenix.add_argument(
        "--window", type=number(4, 3600), default=8.0, help="chaos: seconds per fault window"
    )
    phoenix.add_argument(
        "--state-dir", type=path, help="chaos: the local cluster whose nodes it may kill"
    )
    phoenix.add_argument(
        "--hogs",
        type=integer(0, 64),
        default=2,
        help="busy: processes spinning on the cores beside the deployment",
    )
    phoenix.add_argument(
        "--suspect-ceiling",
        type=number(0, 600),
        help="busy: the topology's suspect_ceiling_s (0: the fixed detection rule; "
        "default: the topology's, 2.0)",
    )
    phoenix.add_argument(
        "--busy-seconds",
        type=number(1, 86_400),
        default=300.0,
        help="busy: seconds of steady events under the hogs",
    )
    add_departed_masters(phoenix)
    phoenix.add_argument(
        "--leave-after",
        type=number(0.1, 3600),
        help="leave: the topology's leave_after_s (default: the topology's, 3.0)",
    )
    phoenix.add_argument(
        "--faults",
        type=names(("cut", "blackhole")),
        default="cut,blackhole",
        help="link: cut (connections reset, new ones refused), blackhole (open, silent)",
    )
    phoenix.add_argument(
        "--down",
        type=number(0.5, 600),
        default=2.5,
        help="link: seconds the link stays broken before it heals",
    )
    phoenix.add_argument(
        "--link-timeout",
        type=number(0.01, 60),
        help="link: the topology's link_timeout_s (default: the topology's, 1.0)",
    )
    phoenix.add_argument(
        "--kinds",
        type=names(("router", "router_slave", "match", "match_slave")),
        default="router,router_slave,match,match_slave",
        help="recovery: the role kinds killed",
    )
    phoenix.add_argument(
        "--heartbeat-interval",
        type=number(0.001, 60),
        help="recovery: the topology's heartbeat_interval_s (default: the topology's, 0.1)",
    )
    phoenix.add_argument(
        "--heartbeat-misses",
        type=integer(1, 100),
        help="recovery: the topology's heartbeat_misses (default: the topology's, 5)",
    )
    phoenix.add_argument(
        "--stream",
        type=number(3, 3600),
        default=5.0,
        help="recovery, link, leave: seconds of events around each fault (a kill at a "
        "random moment from 1 s to 2 s before the end)",
    )
    phoenix.add_argument(
        "--subscriptions",
        type=integers(1, 10_000_000),
        help="comma list (default: 10000,50000,100000,200000; rate: 200000)",
    )
    phoenix.add_argument(
        "--events", type=integer(1, 100_000_000), default=20_000, help="matching: events"
    )
    phoenix.add_argument(
        "--symbols",
        type=integer(1, 100_000_000),
        default=50_000,
        help="matching: distinct symbols the subscriptions pick from (fewer: more matches "
        "per event)",
    )
    from .phoenix_timeliness import timeliness_arguments

    timeliness_arguments(
        phoenix,
        repeats=None,
        repeats_help="repetitions: rate, subscriptions: mechanism passes, rotated (default "
        f"{PHOENIX_REPEATS['rate']}); recovery: kills per kind and rate "
        f"({PHOENIX_REPEATS['recovery']}); link: faults per kind and rate "
        f"({PHOENIX_REPEATS['link']}); leave: removals, a fresh deployment each "
        f"({PHOENIX_REPEATS['leave']})",
    )
    renamed(phoenix, "--kills", "--repeats")
    renamed(phoenix, "--cuts", "--repeats")
    phoenix.add_argument(
        "--work-dir", type=path, default=Path(".qosmq/bench-phoenix"), help="state and logs"
    )
    phoenix.add_argument("--out", type=out_file, help="also write the rows to this JSON file")
    renamed(phoenix, "--json", "--out")
    phoenix.set_defaults(run=_run_phoenix)
    phoenix.set_defaults(
        phoenix_defaults={a.dest: a.default for a in phoenix._actions if a.option_strings}
    )
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
    _live_arguments(transport)
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
    _live_arguments(queues)
    queues.set_defaults(run=_run_queues)
    loss = cmds.add_parser(
        "node-loss",
        help="confirm modes through a SIGKILLed RabbitMQ node (needs the local cluster)",
    )
    from .node_loss import SCENARIOS

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


def _live_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=number(0, 3600, above=True),
        default=1.0,
        help="seconds between the live progress lines inside a cell (stderr)",
    )
    p.add_argument("--quiet", action="store_true", help="no live progress lines")


def _progress(args: argparse.Namespace) -> Any:
    """Where a benchmark's live lines go: stderr, or nowhere with ``--quiet``."""
    if args.quiet:
        return None
    return lambda line: print(line, file=sys.stderr, flush=True)


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
        row.update(_provenance(settings))
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


def _provenance(settings: Settings) -> dict[str, Any]:
    return {
        "version": __version__,
        "event_loop": runtime.loop_name(settings.event_loop),
        "python": platform.python_version(),
        "host": socket.gethostname(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


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


def _run_balance(args: argparse.Namespace) -> int:
    from .balance import BalanceCell, run_balance_cell

    if args.phases:
        return _run_balance_phases(args)
    if args.rate_sources:
        return _run_rate_sources(args)
    try:
        cells = [
            BalanceCell(
                algorithm=a.strip(),
                rate=float(r),
                duration_s=args.duration,
                replicas=args.replicas,
                service_ms=args.service_ms,
                slow_extra_ms=args.slow_extra_ms,
            )
            for r in args.rates.split(",")
            for a in args.algorithms.split(",")
        ]
    except ValueError as exc:
        raise InvalidArgument(f"bad grid: {exc}") from None
    rows = []
    for i, cell in enumerate(cells, 1):
        print(
            f"[{i}/{len(cells)}] {cell.algorithm} at {cell.rate:g} msg/s for "
            f"{cell.duration_s:g} s ...",
            file=sys.stderr,
            flush=True,
        )
        row = runtime.run(
            run_balance_cell(args.settings, cell), event_loop=args.settings.event_loop
        )
        row.update(_provenance(args.settings))
        rows.append(row)
    head = (
        f"{'algorithm':12} {'rate':>6} {'handled/s':>9} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'p99 ms':>8} {'p99 1st/3':>9} {'p99 3rd/3':>9} {'max len':>7} {'backlog':>7} routed"
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        print(
            f"{r['algorithm']:12} {r['rate']:>6g} {r['handled_per_s']:>9.0f} "
            f"{r['latency_p50_ms']:>8.1f} {r['latency_p95_ms']:>8.1f} {r['latency_p99_ms']:>8.1f} "
            f"{r['p99_first_third_ms']:>9.1f} {r['p99_last_third_ms']:>9.1f} "
            f"{r['max_queue_length']:>7} {r['backlog']:>7} {r['routed']}"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def _run_rate_sources(args: argparse.Namespace) -> int:
    from .balance_rates import format_rate_sources, run_rate_sources

    rate = float(args.rates.split(",")[0])
    rows = runtime.run(
        run_rate_sources(args.settings, rate=rate, duration_s=args.duration),
        event_loop=args.settings.event_loop,
    )
    print(format_rate_sources(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def _run_balance_phases(args: argparse.Namespace) -> int:
    from .balance_faults import PHASES, run_balance_faults

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    rate = float(args.rates.split(",")[0])
    rows = runtime.run(
        run_balance_faults(
            args.settings,
            algorithms,
            rate=rate,
            service_rate=args.service_rate,
            phase_s=args.phase_seconds,
            work_dir=args.work_dir,
            progress=lambda line: print(line, file=sys.stderr, flush=True),
        ),
        event_loop=args.settings.event_loop,
    )
    print(format_balance_phases(rows, PHASES))
    if args.out:
        for r in rows:
            r.update(_provenance(args.settings))
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def format_balance_phases(rows: list[dict[str, Any]], phases: tuple[str, ...]) -> str:
    """One Markdown table per phase: each algorithm's latency, its p99 as a ratio to
    round robin's and the paper's in the same run, how fast the faulted replica's share
    fell, what callers saw."""
    out = []
    for phase in phases:
        mine = [r for r in rows if r["phase"] == phase]
        p99 = {r["algorithm"]: r["p99_s"] for r in mine}
        out.append(
            f"\n{phase}\n\n| algorithm | published | p50 s | p99 s | p99 / round robin | "
            "p99 / paper | share < 1/2 after s | share < 1/10 after s | errors | lost |\n"
            + "|---|---|---|---|---|---|---|---|---|---|"
        )
        for r in mine:

            def ratio(base: str, r: dict[str, Any] = r, p99: dict[str, Any] = p99) -> str:
                b = p99.get(base)
                return f"{r['p99_s'] / b:.2f}" if b and r["p99_s"] is not None else "-"

            errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
            out.append(
                f"| {r['algorithm']} | {r['published']} | {r['p50_s']} | {r['p99_s']} | "
                f"{ratio('round_robin')} | {ratio('paper')} | {r.get('to_half_s', '-')} | "
                f"{r.get('to_tenth_s', '-')} | {errors} | {r['lost']} |"
            )
    return "\n".join(out)


#: ``bench phoenix --repeats`` when not given, by experiment
PHOENIX_REPEATS = {"rate": 1, "subscriptions": 1, "recovery": 10, "link": 5, "leave": 5}
#: the ``bench phoenix`` options that only some experiments use (any other refuses them)
PHOENIX_OPTIONS: dict[str, tuple[str, ...]] = {
    "seed": ("chaos",),
    "chaos_faults": ("chaos",),
    "chaos_clusters": ("chaos",),
    "window": ("chaos",),
    "state_dir": ("chaos",),
    "hogs": ("busy",),
    "suspect_ceiling": ("busy",),
    "busy_seconds": ("busy",),
    "idle": ("throughput",),
    "keep_going": ("throughput",),
    "batch_linger_ms": ("throughput",),
    "copy_batch_max": ("throughput", "recovery", "rate", "subscriptions", "chaos"),
    "subscriber_confirm": ("recovery",),
    "departed_masters": ("leave",),
    "leave_after": ("leave",),
    "faults": ("link",),
    "down": ("link",),
    "link_timeout": ("link",),
    "kinds": ("recovery",),
    "heartbeat_interval": ("recovery",),
    "heartbeat_misses": ("recovery",),
    "stream": ("recovery", "link", "leave"),
    "events": ("matching",),
    "symbols": ("matching",),
    "subscriptions": ("matching", "rate", "subscriptions", "leave", "throughput"),
    "repeats": ("rate", "subscriptions", "recovery", "link", "leave"),
    "mechanisms": ("rate", "subscriptions", "throughput"),
    "duration": ("rate", "subscriptions", "throughput"),
    "warmup": ("rate", "subscriptions", "throughput"),
    "inbox_mirrors": ("rate", "subscriptions"),
    "role_queues": ("rate", "subscriptions"),
    "max_steal": ("rate", "subscriptions"),
    "steal_retries": ("rate", "subscriptions"),
    "rates": ("rate", "subscriptions", "recovery", "link", "leave", "busy", "chaos", "throughput"),
}


def _run_phoenix(args: argparse.Namespace) -> int:
    reason = not_for(args, args.phoenix_defaults, PHOENIX_OPTIONS, args.experiment)
    if reason is not None:
        raise InvalidArgument(reason)
    if args.repeats is None:
        args.repeats = PHOENIX_REPEATS.get(args.experiment, 1)
    if args.experiment != "matching":  # a broker must answer before anything is preloaded
        _brokers_answer(args.settings)
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
            **_provenance(args.settings),
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
    print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns) + "  detour", flush=True)

    def report(row: dict[str, Any]) -> None:
        line = " ".join(f"{row.get(c)!s:>{max(8, len(c))}}" for c in columns)
        print(f"{line}  {row['detour']}", flush=True)

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
                {"rows": rows, "summary": summary, "run": run, **_provenance(args.settings)},
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
        fields=None if args.copy_batch_max is None else {"copy_batch_max": args.copy_batch_max},
    )
    print(summarize(rows))
    broken = problems(rows)
    for line in broken:
        print(f"broken: {line}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"seed": args.seed, "rows": rows}, indent=2))
    return 1 if broken else 0


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
        copy_batch_max=args.copy_batch_max,
        report=lambda row: print(json.dumps(row), flush=True),
    )
    result.update(_provenance(args.settings))
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
    row.update(_provenance(args.settings))
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
    print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns), flush=True)

    def report(row: dict[str, Any]) -> None:
        print(" ".join(f"{row.get(c)!s:>{max(8, len(c))}}" for c in columns), flush=True)

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
            json.dumps({"rows": rows, "summary": summary, **_provenance(args.settings)}, indent=2)
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
    print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns) + "  killed", flush=True)

    def report(row: dict[str, Any]) -> None:
        line = " ".join(f"{row.get(c)!s:>{max(8, len(c))}}" for c in columns)
        print(f"{line}  {row['killed']} -> {row['served_by']}", flush=True)

    rows, run = run_recovery(
        args.settings,
        directory=args.work_dir,
        kinds=args.kinds.split(","),
        rates=rates,
        kills=args.repeats,
        seconds=args.stream,
        report=report,
        fields={
            key: value
            for key, value in (
                ("heartbeat_interval_s", args.heartbeat_interval),
                ("heartbeat_misses", args.heartbeat_misses),
                ("copy_batch_max", args.copy_batch_max),
            )
            if value is not None
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
                {"rows": rows, "summary": summary, "run": run, **_provenance(args.settings)},
                indent=2,
            )
        )
    lost = sum(r["lost"] for r in rows)
    return 1 if lost else 0


def _run_phoenix_timeliness(args: argparse.Namespace) -> int:
    from .phoenix_timeliness import MECHANISMS, run_experiment, steal_limits, summarize

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
    print(" ".join(f"{c:>{max(8, len(c))}}" for c in columns) + "  cpu %", flush=True)

    try:
        max_steal, steal_retries = steal_limits(args)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None

    def report(row: dict[str, Any]) -> None:
        line = " ".join(f"{row.get(c)!s:>{max(8, len(c))}}" for c in columns)
        marks = "".join(
            f"  ({what}: {row[what]})" for what in ("discarded", "disturbed") if row.get(what)
        )
        print(f"{line}  {_cpu_text(row.get('cpu'))}{marks}", flush=True)

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
        fields=None if args.copy_batch_max is None else {"copy_batch_max": args.copy_batch_max},
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
        row.update(_provenance(args.settings))
    if args.out:
        args.out.write_text(json.dumps({"cells": rows, "summary": summary}, indent=2))
    return 0


def _cpu_text(cpu: dict[str, float | None] | None) -> str:
    return " ".join(f"{k}={v}" for k, v in (cpu or {}).items() if v is not None)


def _run_queues(args: argparse.Namespace) -> int:
    from .queues import run_queue_bench

    rows = runtime.run(
        run_queue_bench(
            args.settings,
            duration_s=args.duration,
            size=args.size,
            window=args.window,
            progress=_progress(args),
            interval_s=args.interval,
        ),
        event_loop=args.settings.event_loop,
    )
    print(f"{'cell':8} {'messages':>9} {'seconds':>8} {'msg/s':>9} {'x raw':>6} {'x enqueue':>9}")
    for r in rows:
        r.update(_provenance(args.settings))
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
                    progress=lambda line: print(line, file=sys.stderr, flush=True),
                ),
                event_loop=args.settings.event_loop,
            )
            rows += [{**r, "rate": rate} for r in found]
    print(format_node_loss(rows))
    if args.out:
        for r in rows:
            r.update(_provenance(args.settings))
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


def _brokers_answer(settings: Settings) -> None:
    """Connect once (one try per node): a benchmark that cannot reach a broker says so
    in one line before it preloads or starts anything."""
    from middleware.errors import MiddlewareError
    from middleware.transport import AsyncClient

    async def check() -> None:
        async with AsyncClient(settings=settings):
            pass

    try:
        runtime.run(check(), event_loop=settings.event_loop)
    except MiddlewareError as exc:
        raise InvalidArgument(
            f"no RabbitMQ answers at {','.join(settings.amqp_urls)} ({exc}); start one "
            "(qosmq cluster up) or name yours (--uri or QOSMQ_AMQP_URLS)"
        ) from None


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
        progress=_progress(args),
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
        records = {"cells": rows, "summary": summary, **_provenance(args.settings)}
        args.out.write_text(json.dumps(records, indent=2))
    return 0


def _run_spark_confirms(args: argparse.Namespace) -> int:
    from .spark_confirms import execute

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
