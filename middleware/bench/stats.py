"""Small statistics helpers for benchmark summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile", "whole"]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])


def whole(value: float | None) -> str:
    """A reading for a table: rounded to a whole number, ``-`` when there is none."""
    return "-" if value is None else f"{value:.0f}"
