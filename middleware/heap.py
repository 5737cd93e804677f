"""Full garbage collections in processes that hold large tables.

A match broker holds its subscriptions (the index and their documents): about 900 000
tracked objects per 100 000 subscriptions.  CPython's full (generation 2) collection
traverses every one of them, and measured here it takes about 0.3 s at 100 000
subscriptions, during which the process answers nothing.  Full collections are rare
(CPython starts one when the objects promoted since the last one exceed a quarter of
the long-lived ones), but in a busy role the events in flight keep being promoted, so
one comes every few minutes, and every event waiting meanwhile lands in the tail.

``settle`` collects once and then freezes what survived (``gc.freeze``): the tables a
role has just loaded move to a permanent generation that later collections do not
traverse (and no longer count towards the quarter).  What a role adds afterwards is
collected as usual; what is removed of the frozen tables is freed by reference
counting, as almost everything in Python is (only cycles among them would stay).
``paused`` holds automatic collection off while a role builds a large temporary
structure that holds no cycles (a slave answering its master's read of the whole
table: measured, five full collections of 0.3-0.6 s each while it did, on a slave
holding 100 000 subscriptions that kept matching events meanwhile).
``FullCollections`` times every full collection of the process (the
``qosmq_gc_full_collection_seconds`` histogram, and a log line for a long one).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import Histogram

__all__ = ["FullCollections", "freeze", "paused", "settle"]

log = logging.getLogger(__name__)

FULL_COLLECTION = Histogram(
    "qosmq_gc_full_collection_seconds",
    "Full (generation 2) garbage collections of this process",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


class FullCollections:
    """Times this process's full collections while installed (a context manager)."""

    def __init__(self, *, log_over_s: float = 0.02) -> None:
        self.log_over_s = log_over_s
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0
        self._started: float | None = None

    def __enter__(self) -> FullCollections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        if self._started is None:
            return
        seconds = time.perf_counter() - self._started
        self._started = None
        self.count += 1
        self.total_s += seconds
        self.longest_s = max(self.longest_s, seconds)
        FULL_COLLECTION.observe(seconds)
        if seconds >= self.log_over_s:  # logging allocates; it is safe in the callback
            log.info("full garbage collection took %.0f ms", 1000 * seconds)

    def summary(self) -> dict[str, float]:
        return {
            "full_collections": self.count,
            "full_collection_ms": round(1000 * self.total_s, 1),
            "longest_ms": round(1000 * self.longest_s, 1),
        }


def settle(what: str) -> dict[str, float]:
    """Collect once, then freeze every object that survived (see the module's text);
    returns how many were frozen and how long the collection took."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - started
    frozen = gc.get_freeze_count()
    log.info(
        "%s: froze %d objects after loading (collection took %.0f ms)", what, frozen, 1000 * took
    )
    return {"frozen": frozen, "collection_ms": round(1000 * took, 1)}


def freeze(what: str) -> int:
    """Freeze every tracked object now, without collecting first: for tables built
    under ``paused`` (no cycles among them), moved out of every later collection's way at
    no cost (a collection of a heap that size takes about a second here); whatever
    cyclic garbage existed at that moment stays (a role's events are freed by reference
    counting). How many objects are frozen in all."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: froze %d objects (no collection)", what, frozen)
    return frozen


_paused = 0  # how many ``paused`` blocks are open (tasks may overlap them)
_resume = False  # whether collection was on when the first of them opened


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection until every open ``paused`` block (nested, or in
    overlapping tasks) has ended; what became collectable meanwhile is collected by the
    next collection as usual."""
    global _paused, _resume
    if _paused == 0:
        _resume = gc.isenabled()
        gc.disable()
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1
        if _paused == 0 and _resume:
            gc.enable()
