"""The confirm-mode charts: queue counts as categories, ratios with error bars and the
paper's values, one colour per mode (issue #25 item 7)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from qosmq_bench.spark_confirms import summarise_repeats
from qosmq_bench.spark_confirms_report import _colour, _ratio_std
from qosmq_bench.spark_confirms_report import charts as _charts

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _summary() -> list[dict]:
    rows = []
    for mode, base in (("raw", 3000.0), ("broker", 1500.0), ("persistent", 700.0), ("e2e", 1400.0)):
        for queues in (1, 2, 15, 30):
            for repeat, wobble in enumerate((0.9, 1.0, 1.1)):
                rows.append(
                    {
                        "mode": mode,
                        "queues": queues,
                        "repeat": repeat,
                        "confirmed_per_s": base * wobble,
                        "published": 10,
                        "confirmed": 10,
                        "handled": 10,
                        "lost": 0,
                        "duplicates": 0,
                        "confirm_p50_ms": 5.0,
                        "confirm_p99_ms": 50.0,
                    }
                )
    return summarise_repeats(rows)


def test_three_charts_with_queue_counts_as_categories(tmp_path: Path, monkeypatch) -> None:
    figures = []
    real = plt.subplots
    monkeypatch.setattr(
        plt, "subplots", lambda *a, **k: figures.append(real(*a, **k)) or figures[-1]
    )
    made = _charts(tmp_path, _summary())
    assert made == ["throughput.png", "ratio.png", "latency.png"]
    for name in made:
        assert (tmp_path / name).stat().st_size > 1000
    for _, ax in figures:
        assert [t.get_text() for t in ax.get_xticklabels()] == ["1", "2", "15", "30"]
        assert list(ax.get_xticks()) == [0, 1, 2, 3]
    _, ratio = figures[1]
    labels = ratio.get_legend_handles_labels()[1]
    assert "paper e2e, optimisation 1" in labels and "e2e (ours)" in labels
    assert "persistent (ours)" not in labels


def test_ratio_error_propagates_both_stddevs() -> None:
    summary = {(s["mode"], s["queues"]): s for s in _summary()}
    e2e, base = summary[("e2e", 1)], summary[("persistent", 1)]
    rel = e2e["confirmed_per_s_std"] / e2e["confirmed_per_s_mean"]
    assert _ratio_std(e2e, base) == pytest.approx(e2e["ratio_vs_persistent"] * math.sqrt(2) * rel)
    assert _ratio_std(e2e, None) == 0.0


def test_one_colour_per_mode() -> None:
    colours = [_colour(m) for m in ("raw", "broker", "persistent", "e2e")]
    assert len(set(colours)) == 4
