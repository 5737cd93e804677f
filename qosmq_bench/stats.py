"""Small statistics helpers for benchmark summaries."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["by_rate_and", "percentile", "row_percentile", "whole"]


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


def row_percentile(rows: Sequence[Mapping[str, Any]], key: str, p: float) -> float | None:
    """The ``p``-th percentile of ``key`` over the rows that have it, to the millisecond
    (None when none has it)."""
    values = [r[key] for r in rows if r.get(key) is not None]
    return round(percentile(values, p), 3) if values else None


def by_rate_and(
    rows: Sequence[Mapping[str, Any]], key: str, order: Iterable[str]
) -> Iterator[tuple[float, str, list[Mapping[str, Any]]]]:
    """The rows grouped by rate (ascending), then by ``key`` in ``order``; empty groups
    left out."""
    for rate in sorted({r["rate"] for r in rows}):
        for value in order:
            mine = [r for r in rows if r[key] == value and r["rate"] == rate]
            if mine:
                yield rate, value, mine
