"""Small statistics helpers for benchmark summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["percentile"]


def percentile(values: Sequence[float], p: float) -> float:
    """The ``p``-th percentile (nearest rank); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return float(ordered[min(rank, len(ordered)) - 1])
