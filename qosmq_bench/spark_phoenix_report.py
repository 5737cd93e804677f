"""The Spark Phoenix job's outputs (``spark_phoenix.py``): the paper's claim checked
per cell (``inner`` and ``both`` below ``none``), what limited each cell, its charts
and its Markdown report beside figures 9 and 10 of paper 000."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from middleware.settings import Settings

from .cpu import limit
from .spark_common import provenance, pyplot

if TYPE_CHECKING:
    from .spark_phoenix import PhoenixGrid

__all__ = ["CLAIMED", "charts", "claims", "phoenix_limit", "report"]

CLAIMED = ("inner", "both")  # the paper: these answer faster than "none" (figures 9, 10)


def claims(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """At every (subscriptions, rate) with a ``none`` cell: is each of ``inner`` and
    ``both`` lower than ``none`` in mean and in p99 (the mean of the repeats' p99)?"""
    cells = {(s["subscriptions"], s["rate"], s["mechanism"]): s for s in summary}
    out = []
    for (count, rate, mechanism), s in cells.items():
        none = cells.get((count, rate, "none"))
        if mechanism not in CLAIMED or none is None or None in (s["mean_ms"], s["p99_ms"]):
            continue
        out.append(
            {
                "subscriptions": count,
                "rate": rate,
                "mechanism": mechanism,
                "lower_mean": s["mean_ms"] < none["mean_ms"],
                "lower_p99": s["p99_ms"] < none["p99_ms"],
            }
        )
    return sorted(out, key=lambda c: (c["subscriptions"], c["rate"], c["mechanism"]))


def phoenix_limit(cpu: dict[str, Any]) -> str:
    """What limited a Phoenix cell: the client process (it publishes and receives every
    event), a role kind, the machine's cores, or nothing (:func:`qosmq_bench.cpu.limit`)."""
    roles = {k: v for k, v in cpu.items() if k not in ("machine", "steal", "client")}
    roles = {k: v for k, v in roles.items() if not k.endswith("_wait")}
    return limit(cpu.get("client"), cpu.get("machine"), roles, cpu.get("client_wait"))


def charts(out: Path, grid: PhoenixGrid, summary: list[dict[str, Any]]) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    x_key = "rate" if grid.experiment == "rate" else "subscriptions"
    made = []
    for fixed in sorted({s["subscriptions" if x_key == "rate" else "rate"] for s in summary}):
        fixed_key = "subscriptions" if x_key == "rate" else "rate"
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = sorted({s[x_key] for s in summary if s[fixed_key] == fixed})
        at = {x: i for i, x in enumerate(xs)}  # the grid's values as categories
        for mechanism in sorted({s["mechanism"] for s in summary}):
            pts = sorted(
                (s[x_key], s["mean_ms"], s["p99_ms"])
                for s in summary
                if s["mechanism"] == mechanism and s[fixed_key] == fixed and s["mean_ms"]
            )
            line = ax.plot(
                [at[p[0]] for p in pts], [p[1] for p in pts], marker="o", label=mechanism
            )
            ax.plot(
                [at[p[0]] for p in pts],
                [p[2] for p in pts],
                linestyle="--",
                color=line[0].get_color(),
                alpha=0.6,
            )
        ax.set_xticks(range(len(xs)), [f"{x:g}" for x in xs])
        ax.grid(axis="y", alpha=0.3)
        ax.set(
            xlabel="events / s" if x_key == "rate" else "subscriptions",
            ylabel="response time (ms): mean, p99 dashed",
            title=f"Phoenix response time, {fixed_key} = {fixed:g}",
            yscale="log",
        )
        ax.legend(fontsize=8)
        fig.tight_layout()
        name = f"response-{fixed_key}-{fixed:g}.png"
        fig.savefig(out / name, dpi=110)
        made.append(name)
    plt.close("all")
    return made


def report(
    grid: PhoenixGrid,
    errors: list[dict[str, Any]],
    summary: list[dict[str, Any]],
    settings: Settings,
    interrupted: bool,
    charts: list[str],
    cells: Sequence[dict[str, Any]] = (),
) -> str:
    lines = [
        "# qosmq Phoenix timeliness: results",
        "",
        *provenance(settings),
        f"- experiment {grid.experiment}: subscriptions {', '.join(map(str, grid.subscriptions))}"
        f"; rates {', '.join(f'{r:g}' for r in grid.rates)} events/s; mechanisms "
        f"{', '.join(grid.mechanisms)}; {grid.duration_s:g} s per cell after {grid.warmup_s:g} s"
        f" of warm-up; {grid.repeats} repeat(s); 3 clusters x (routing master + 2 slaves + "
        f"match master + 2 slaves), 2 clients; each cell's events published from "
        f"{grid.tasks} Spark task(s)",
        (
            f"- a cell is measured again when the hypervisor took more than "
            f"{grid.max_steal_pct:g} % of the CPU (steal), at most {grid.steal_retries} times"
            if grid.max_steal_pct is not None
            else "- cells disturbed by steal are not measured again (--max-steal < 0)"
        ),
    ]
    if interrupted:
        lines.append("- **interrupted**: only the finished cells are reported")
    lines += [f"- **failed** at {e['subscriptions']} subscriptions: {e['error']}" for e in errors]
    verdicts = claims(summary)
    if verdicts:
        met = all(v["lower_mean"] and v["lower_p99"] for v in verdicts)
        lines += [
            "",
            "## The paper's claim: inner and both answer faster than none",
            "",
            f"Met at every point: **{'yes' if met else 'no'}** (mean of the repeats' mean and "
            "of their p99).",
            "",
            "| subscriptions | rate | mechanism | lower mean | lower p99 |",
            "|---|---|---|---|---|",
            *(
                f"| {v['subscriptions']} | {v['rate']:g} | {v['mechanism']} | "
                f"{'yes' if v['lower_mean'] else 'no'} | {'yes' if v['lower_p99'] else 'no'} |"
                for v in verdicts
            ),
        ]
    lines += [
        "",
        "## Response time (publish to first delivery), ms",
        "",
        "Mean over repeats, the lowest and highest single repeat in brackets; pooled p99: "
        "over every repeat's events together; cpu: the machine's busy and steal % of all "
        "cores, the busiest router's and match master's and the client's % of one core; "
        "limit: the process near a whole core (the `client` publishing and receiving every "
        "event, or a role kind), `cores` when the machine was all busy, else `none`.",
        "",
        "| subscriptions | rate | mechanism | delivered | mean | p50 | p99 | pooled p99 |"
        " urgent / bulk mean | x none | cpu: machine / steal / router / match master /"
        " client | limit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        cpu = s.get("cpu") or {}
        lines.append(
            f"| {s['subscriptions']} | {s['rate']:g} | {s['mechanism']} | "
            f"{s['delivered']}/{s['events']} | {_ms(s['mean_ms'])} {_range(s['mean_ms_range'])} | "
            f"{_ms(s['p50_ms'])} | {_ms(s['p99_ms'])} {_range(s['p99_ms_range'])} | "
            f"{_ms(s['pooled_p99_ms'])} | {_ms(s['urgent_mean_ms'])} / {_ms(s['bulk_mean_ms'])}"
            f" | {'-' if s['x_none'] is None else s['x_none']} | "
            f"{_ms(cpu.get('machine'))} / {_ms(cpu.get('steal'))} / "
            f"{_ms(cpu.get('router'))} / {_ms(cpu.get('match_master'))} / "
            f"{_ms(cpu.get('client'))} | {phoenix_limit(cpu)} |"
        )
    lines += _stolen_section(cells)
    lines += ["", *[f"![{c}]({c})" for c in charts], ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------ helpers


def _stolen_section(cells: Sequence[dict[str, Any]]) -> list[str]:
    """The cells measured again because of steal, with what they measured, and the kept
    cells still over the limit: a reader sees what was left out and why."""
    marked = [c for c in cells if c.get("discarded") or c.get("disturbed")]
    if not marked:
        return []
    lines = [
        "",
        "## Cells disturbed by the hypervisor (steal)",
        "",
        "Discarded: measured again, left out of the figures above. Kept: the last "
        "re-measurement, still over the limit, counted above.",
        "",
        "| subscriptions | rate | mechanism | repeat | steal % | mean | p99 | |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in marked:
        lines.append(
            f"| {c['subscriptions']} | {float(c['rate']):g} | {c['mechanism']} | "
            f"{c.get('repeat', 0)} | {_ms((c.get('cpu') or {}).get('steal'))} | "
            f"{_ms(c.get('mean_ms'))} | {_ms(c.get('p99_ms'))} | "
            f"{'discarded' if c.get('discarded') else 'kept: ' + c['disturbed']} |"
        )
    return lines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def _range(pair: list[float] | None) -> str:
    return f"[{_ms(pair[0])}-{_ms(pair[1])}]" if pair else ""
