"""The Phoenix Spark job's check of the paper's claim (pure)."""

from __future__ import annotations

from qosmq_bench.spark_phoenix import claims


def test_the_claim_is_checked_per_point_in_mean_and_p99() -> None:
    def cell(mechanism: str, rate: float, mean: float, p99: float) -> dict[str, object]:
        return {
            "subscriptions": 10,
            "mechanism": mechanism,
            "rate": rate,
            "mean_ms": mean,
            "p99_ms": p99,
        }

    summary = [
        cell("none", 100, 10.0, 30.0),
        cell("inner", 100, 9.0, 31.0),  # lower mean, higher p99
        cell("both", 100, 9.0, 29.0),
        cell("outer", 100, 1.0, 1.0),  # not claimed
        cell("inner", 200, 5.0, 5.0),  # no none at 200: nothing to compare
    ]
    assert claims(summary) == [
        {
            "subscriptions": 10,
            "rate": 100,
            "mechanism": "both",
            "lower_mean": True,
            "lower_p99": True,
        },
        {
            "subscriptions": 10,
            "rate": 100,
            "mechanism": "inner",
            "lower_mean": True,
            "lower_p99": False,
        },
    ]
