"""Cells disturbed by the hypervisor (CPU steal) are measured again, and what was left
out is reported (pure: the measurement is a stand-in that returns readings)."""

from __future__ import annotations

from typing import Any

import pytest

from qosmq_bench.phoenix_timeliness import remeasure_while_stolen, summarize


def readings(*steals: float | None) -> Any:
    """A cell whose successive measurements read these steal percentages."""
    it = iter(steals)
    count = [0]

    def measured() -> dict[str, Any]:
        count[0] += 1
        return {
            "mechanism": "none",
            "mean_ms": float(count[0]),
            "cpu": {"steal": next(it)},
            "records": [(0, 1, 0.01)],
        }

    return measured


def test_a_cell_under_the_limit_is_measured_once() -> None:
    discarded: list[dict[str, Any]] = []
    row = remeasure_while_stolen(
        readings(4.9), max_steal_pct=5.0, retries=2, discard=discarded.append
    )
    assert row["mean_ms"] == 1.0 and "disturbed" not in row and discarded == []


def test_a_stolen_cell_is_discarded_with_why_and_measured_again() -> None:
    discarded: list[dict[str, Any]] = []
    row = remeasure_while_stolen(
        readings(19.9, 34.4, 0.3), max_steal_pct=5.0, retries=2, discard=discarded.append
    )
    assert row["mean_ms"] == 3.0 and "disturbed" not in row and "discarded" not in row
    assert [d["mean_ms"] for d in discarded] == [1.0, 2.0]
    assert discarded[0]["discarded"] == "steal 19.9 % > 5 %"
    assert discarded[1]["discarded"] == "steal 34.4 % > 5 %"
    assert all("records" not in d for d in discarded) and row["records"]  # never aggregated


def test_after_the_retries_the_last_measurement_is_kept_and_marked() -> None:
    discarded: list[dict[str, Any]] = []
    row = remeasure_while_stolen(
        readings(9.0, 8.0), max_steal_pct=5.0, retries=1, discard=discarded.append
    )
    assert row["mean_ms"] == 2.0
    assert row["disturbed"] == "steal 8 % > 5 % after 1 re-measurement(s)"
    assert len(discarded) == 1


@pytest.mark.parametrize("limit, steal", [(None, 50.0), (5.0, None)])
def test_off_or_without_a_reading_the_cell_is_measured_once(limit, steal) -> None:
    discarded: list[dict[str, Any]] = []
    row = remeasure_while_stolen(
        readings(steal), max_steal_pct=limit, retries=2, discard=discarded.append
    )
    assert row["mean_ms"] == 1.0 and discarded == [] and "disturbed" not in row


def test_discarded_cells_are_left_out_of_the_summary() -> None:
    def row(mean: float, **extra: Any) -> dict[str, Any]:
        return {
            "subscriptions": 10,
            "mechanism": "none",
            "rate": 100.0,
            "mean_ms": mean,
            "p99_ms": mean,
            "cpu": {"steal": extra.pop("steal", 0.1)},
            **extra,
        }

    rows = [row(80.0, steal=30.0, discarded="steal 30 % > 5 %"), row(10.0), row(20.0)]
    (s,) = summarize(rows)
    assert s["repeats"] == 2 and s["mean_ms"] == 15.0 and s["cpu"]["steal"] == 0.1


def test_the_report_lists_discarded_and_disturbed_cells() -> None:
    from middleware.settings import Settings
    from qosmq_bench.spark_phoenix import PhoenixGrid
    from qosmq_bench.spark_phoenix_report import report as _report

    grid = PhoenixGrid("rate", (10,), (100.0,), ("none",), 1.0, 1, 0.0)
    cells = [
        {
            "subscriptions": 10,
            "mechanism": "inner",
            "rate": 100.0,
            "repeat": 0,
            "mean_ms": 14.5,
            "p99_ms": 43.9,
            "cpu": {"steal": 19.9},
            "discarded": "steal 19.9 % > 5 %",
        },
        {
            "subscriptions": 10,
            "mechanism": "inner",
            "rate": 100.0,
            "repeat": 0,
            "mean_ms": 7.0,
            "p99_ms": 16.0,
            "cpu": {"steal": 6.0},
            "disturbed": "steal 6 % > 5 % after 2 re-measurement(s)",
        },
        {"subscriptions": 10, "mechanism": "none", "rate": 100.0, "cpu": {"steal": 0.2}},
    ]
    report = _report(grid, [], [], Settings.load(), False, [], cells)
    assert "more than 5 % of the CPU (steal), at most 2 times" in report
    assert "| 10 | 100 | inner | 0 | 19.9 | 14.5 | 43.9 | discarded |" in report
    assert "| 10 | 100 | inner | 0 | 6.0 | 7.0 | 16.0 | kept: steal 6 % > 5 % after 2" in report
    assert "| none |" not in report.split("steal)")[-1]
    assert "Cells disturbed" not in _report(grid, [], [], Settings.load(), False, [], cells[2:])
