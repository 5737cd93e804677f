"""``qosmq bench phoenix --experiment matching``: one match broker's throughput vs subscriptions.

Experiment (c) of paper 000's set-up: N subscriptions on one event type, each an
equality on a symbol drawn from ``symbols`` plus a price bound (so a few
subscriptions match each event, as in a quote feed), matched by the
:class:`SubscriptionIndex` a match master runs; events/s over ``events`` events.
"""

from __future__ import annotations

import random
import time
from typing import Any

from middleware.routing import Filter, SubscriptionIndex

__all__ = ["matching_throughput"]


def matching_throughput(
    subscriptions: int, *, events: int = 20_000, symbols: int = 50_000, seed: int = 7
) -> dict[str, Any]:
    rng = random.Random(seed)
    index = SubscriptionIndex()
    started = time.perf_counter()
    for i in range(subscriptions):
        index.add(
            f"s{i}",
            Filter.parse(
                [
                    ("symbol", "=", f"S{rng.randrange(symbols)}"),
                    ("price", "<", rng.randrange(1, 1000)),
                ]
            ),
        )
    build_s = time.perf_counter() - started
    stream: list[dict[str, str | int | float | bool]] = [
        {"symbol": f"S{rng.randrange(symbols)}", "price": rng.randrange(1000)}
        for _ in range(events)
    ]
    matched = 0
    started = time.perf_counter()
    for attributes in stream:
        matched += len(index.match(attributes))
    seconds = time.perf_counter() - started
    return {
        "subscriptions": subscriptions,
        "events": events,
        "events_per_s": round(events / seconds),
        "matches_per_event": round(matched / events, 3),
        "build_s": round(build_s, 2),
        "work_per_event": round(index.work / events, 3),
    }
