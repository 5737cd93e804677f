"""A confirm-mode cell spread over several processes (issue #26): which part runs which
client, how parts' records make one cell, and how a cell's limit is named."""

from __future__ import annotations

import argparse

import pytest

from qosmq_bench.confirms import CellSpec, merge_parts
from qosmq_bench.parts import Part
from qosmq_bench.spark_confirms import arguments, limit, parse_grid, summarise_repeats


class _Nobody:
    def barrier(self) -> None:
        raise AssertionError("not met in these tests")

    def allGather(self, message: str = "") -> list[str]:
        raise AssertionError("not met in these tests")


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_every_client_runs_in_exactly_one_part(count: int) -> None:
    parts = [Part(i, count, "r", _Nobody()) for i in range(count)]
    for k in range(40):
        assert sum(p.mine(k) for p in parts) == 1


def _part(sent, handled, *, duplicates=0, cpu=50.0, duration=2.0, clock=(0.0, 0.0)) -> dict:
    return {
        "sent": sent,
        "handled": handled,
        "duplicates": duplicates,
        "failed": 0,
        "errors": {},
        "duration_s": duration,
        "client_cpu_pct": cpu,
        "client_wait_pct": 3.0,
        "machine_pct": 70.0,
        "steal_pct": 0.0,
        "broker_cpu_pct": 80.0,
        "run_queue": 1.5,
        "cores": 2,
        "clock": clock,
    }


def test_parts_merge_into_one_cell_with_cross_part_duplicates_and_losses() -> None:
    spec = CellSpec("e2e", 1, producers_per_queue=2, consumers_per_queue=2, duration_s=2)
    # part 0 published a, b (both confirmed) and handled a; part 1 published c (not
    # confirmed) and handled a again (a duplicate across parts) and c; b is lost
    a = _part([("a", 10.0, 10.01), ("b", 10.1, 10.12)], [("q", "a", 10.02)], cpu=60.0)
    b = _part(
        [("c", 10.2, None)],
        [("q", "a", 10.015), ("q", "c", 10.3)],
        cpu=90.0,
        duration=2.5,
        clock=(-0.0004, 0.0002),
    )
    cell = merge_parts(spec, [a, b], records=True)
    assert cell["published"] == 3 and cell["confirmed"] == 2 and cell["handled"] == 2
    assert cell["lost"] == 1 and cell["duplicates"] == 1
    assert cell["duration_s"] == 2.5 and cell["confirmed_per_s"] == pytest.approx(2 / 2.5, 0.01)
    assert cell["parts"] == 2 and cell["client_cpu_pct"] == 90.0
    assert cell["client_cpu_pct_parts"] == [60.0, 90.0]
    assert cell["clock_offset_ms"] == pytest.approx(0.4)
    assert cell["clock_error_ms"] == pytest.approx(0.2)
    records = {m: (s, c, h) for m, s, c, h in cell["records"]}
    assert records["a"] == (10.0, 10.01, 10.015)  # the first handle, wherever it was
    assert records["b"][2] is None and records["c"][1] is None


@pytest.mark.parametrize(
    ("readings", "named"),
    [
        ({"client_cpu_pct": 95.0, "machine_pct": 99.0}, "client"),
        ({"client_cpu_pct": 60.0, "machine_pct": 97.0}, "cores"),
        ({"client_cpu_pct": 40.0, "machine_pct": 60.0, "broker_cpu_pct": 180.0}, "brokers"),
        ({"client_cpu_pct": 40.0, "machine_pct": 60.0, "broker_cpu_pct": 50.0}, "none"),
        # always runnable (running or waiting for a core) while the machine had room
        ({"client_cpu_pct": 75.0, "client_wait_pct": 24.0, "machine_pct": 70.0}, "client"),
        ({"client_cpu_pct": 50.0, "client_wait_pct": 50.0, "machine_pct": 99.0}, "cores"),
        ({"client_cpu_pct": None, "machine_pct": None}, "unknown"),
    ],
)
def test_a_cells_limit_is_named_from_its_readings(readings: dict, named: str) -> None:
    assert limit({"cores": 2, **readings}) == named


def test_ratios_compare_cells_with_the_same_tasks_per_cell() -> None:
    rows = [
        {
            "mode": mode,
            "queues": 1,
            "tasks": tasks,
            "repeat": 0,
            "confirmed_per_s": rate,
            "published": 1,
            "confirmed": 1,
            "handled": 1,
            "lost": 0,
            "duplicates": 0,
            "confirm_p50_ms": 1.0,
            "client_cpu_pct": 50.0,
            "machine_pct": 50.0,
            "cores": 2,
        }
        for mode, tasks, rate in (
            ("persistent", 1, 500.0),
            ("e2e", 1, 1000.0),
            ("persistent", 2, 800.0),
            ("e2e", 2, 2400.0),
        )
    ]
    ratio = {(s["mode"], s["tasks"]): s["ratio_vs_persistent"] for s in summarise_repeats(rows)}
    assert ratio[("e2e", 1)] == pytest.approx(2.0) and ratio[("e2e", 2)] == pytest.approx(3.0)


def test_the_summary_judges_the_brokers_cpu_against_the_machines_cores() -> None:
    """Three brokers using 100 % of one core between them on 2 cores are not the limit
    (the summary once lost ``cores`` and judged them against one core)."""
    row = {
        "mode": "raw",
        "queues": 1,
        "tasks": 1,
        "repeat": 0,
        "confirmed_per_s": 1.0,
        "published": 1,
        "confirmed": 1,
        "handled": 1,
        "lost": 0,
        "duplicates": 0,
        "client_cpu_pct": 60.0,
        "machine_pct": 80.0,
        "broker_cpu_pct": 100.0,
        "cores": 2,
    }
    (summary,) = summarise_repeats([row])
    assert summary["cores"] == 2 and summary["limit"] == "none"
    (summary,) = summarise_repeats([row | {"broker_cpu_pct": 180.0}])
    assert summary["limit"] == "brokers"


def test_tasks_per_cell_is_a_grid_dimension_checked_before_anything_starts() -> None:
    grid = parse_grid(arguments().parse_args(["--queues", "1,2", "--tasks-per-cell", "1,2"]))
    assert grid.tasks == (1, 2) and grid.count == 2 * 2 * 4 * 3
    assert {t for _, t, _ in grid.cells()} == {1, 2}
    for bad in ("0", "a", "1,,x", "9"):  # 9 tasks for 1 queue of 2 + 3 clients: idle tasks
        args = arguments().parse_args(["--queues", "1", "--tasks-per-cell", bad])
        with pytest.raises(ValueError, match="tasks-per-cell"):
            parse_grid(args)
    # auto (the default): every task slot, at most one task per client of the smallest cell
    auto = parse_grid(arguments().parse_args(["--queues", "1,15"]))
    assert auto.auto_tasks and auto.with_slots(2).tasks == (2,)
    assert auto.with_slots(64).tasks == (5,)  # 2 producers + 3 consumers at 1 queue
    assert auto.with_slots(1).tasks == (1,) and not auto.with_slots(8).auto_tasks
    assert grid.with_slots(64) is grid  # a number given stays
    # a namespace from before the option (the demo's) means one task per cell
    old = arguments().parse_args([])
    delattr(old, "tasks_per_cell")
    assert parse_grid(argparse.Namespace(**vars(old))).tasks == (1,)


@pytest.mark.parametrize(
    ("cpu", "named"),
    [
        ({"machine": 95.0, "client": 30.0, "router": 96.0, "router_wait": 99.0}, "router"),
        ({"machine": 95.0, "client": 90.0, "router": 40.0}, "client"),
        ({"machine": 95.0, "client": 30.0, "router": 40.0, "match_slave_wait": 99.0}, "cores"),
        ({"machine": 50.0, "client": 30.0, "match_master": 40.0}, "none"),
    ],
)
def test_a_phoenix_cells_limit_is_the_process_near_a_core_or_the_machine(cpu, named) -> None:
    from qosmq_bench.spark_phoenix import phoenix_limit

    assert phoenix_limit(cpu) == named
