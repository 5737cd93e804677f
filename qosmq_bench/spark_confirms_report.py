"""The Spark confirms job's outputs (``spark_confirms.py``): its charts and its
Markdown report beside the paper's figures (paper 003 §4)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from middleware.settings import Settings

from .confirms import MODES, receipt_share
from .cpu import CLIENT_BOUND_PCT, MACHINE_BOUND_PCT, RUNNABLE_PCT
from .spark_common import provenance, pyplot
from .stats import whole

if TYPE_CHECKING:
    from .spark_confirms import Grid


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


__all__ = ["PAPER", "charts", "paper_summary", "report"]

PAPER = {  # paper 003 §4: e2e over the persistent baseline
    "optimisation 1": {1: 3.08, 2: 2.01, 15: 1.409, 30: 1.403, "mean >3 queues": 1.429},
    "optimisation 2": {1: 3.48, 2: 2.16, 15: 1.526, 30: 1.534, "mean >3 queues": 1.565},
}


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


def charts(out: Path, summary: list[dict[str, Any]]) -> list[str]:
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


def report(
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


def _num(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def _x(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.2f}x"
