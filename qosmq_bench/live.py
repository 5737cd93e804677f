"""PerfTest-style live lines inside a benchmark cell.

A cell bumps :class:`Live`'s counters as it goes (``sent`` when a publish or enqueue
starts, ``confirmed`` with its latency when the broker confirmed it or the queue API
accepted it, ``consumed`` when a message was handled); while the cell runs, a thread
prints one line every ``interval_s`` with the rates over the last interval and the
confirm latency p50/p99 so far.  A thread, so that the asyncio cells and the blocking
sync cells are read the same way; it reads plain counters and never touches the cell's
connections.  With no ``progress`` (``--quiet``) the counters are still kept (the cells
cost the same either way) and nothing is printed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["Live", "live_line"]


class Live:
    def __init__(
        self, cell: str, progress: Callable[[str], None] | None = None, interval_s: float = 1.0
    ) -> None:
        self.cell, self.progress, self.interval_s = cell, progress, interval_s
        self.sent = self.confirmed = self.consumed = 0
        self.latencies_ms: list[float] = []

    def confirmed_since(self, started: float) -> None:
        """A publish begun at ``started`` (``time.perf_counter()``) was confirmed now."""
        self.confirmed += 1
        self.latencies_ms.append(1000 * (time.perf_counter() - started))

    def line(self, since: float, last: tuple[int, int, int], dt: float) -> str:
        """Rates over the last ``dt`` seconds (``last``: the counters then), latency so far."""
        now = (self.sent, self.confirmed, self.consumed)
        rates = tuple((n - before) / dt for n, before in zip(now, last, strict=True))
        return f"  {self.cell}" + live_line(since, rates, self.latencies_ms[:])

    @contextmanager
    def running(self) -> Iterator[Live]:
        """Print the lines while the ``with`` body runs (nothing without ``progress``)."""
        if self.progress is None:
            yield self
            return
        stop = threading.Event()
        started = time.perf_counter()

        def report() -> None:
            last, at = (0, 0, 0), started
            while not stop.wait(self.interval_s):
                now = time.perf_counter()
                assert self.progress is not None
                self.progress(self.line(now - started, last, max(1e-9, now - at)))
                last, at = (self.sent, self.confirmed, self.consumed), now

        thread = threading.Thread(target=report, name="live-lines", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()


def live_line(since: float, rates: tuple[float, ...], latencies_ms: list[float]) -> str:
    """PerfTest's line: seconds into the cell; sent, confirmed and consumed per second
    over the last interval; confirm latency p50/p99 so far."""
    ordered = sorted(latencies_ms)

    def pct(p: float) -> str:
        return f"{ordered[int(p / 100 * (len(ordered) - 1))]:.1f}" if ordered else "-"

    sent, confirmed, consumed = rates
    return (
        f"  {since:6.1f} s  sent {sent:7.0f}/s  confirmed {confirmed:7.0f}/s  "
        f"consumed {consumed:7.0f}/s  confirm p50 {pct(50)} ms p99 {pct(99)} ms"
    )
