"""``qosmq bench balance``: weighted dispatch against round robin (paper 001), the rate
sources, and the dispatch under replica faults, from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from middleware import runtime
from middleware.cli_help import renamed
from middleware.cliargs import integer, names, number, numbers, out_file, path
from middleware.errors import InvalidArgument

from .bench_common import provenance

__all__ = ["format_balance_phases", "register_balance"]


def register_balance(cmds: Any) -> None:
    """``bench balance`` and its options (``cmds``: the bench's subcommands)."""
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
        row.update(provenance(args.settings))
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
            r.update(provenance(args.settings))
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
