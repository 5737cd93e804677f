"""A confirm-mode cell spread over parts that meet at barriers (issue #26), against the
real cluster: here the parts are threads with their own event loops and connections
(the Spark job runs them as a barrier stage's tasks: tests/integration/test_spark_job.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from qosmq_bench.confirms import CellSpec, merge_parts, run_cell_sync
from qosmq_bench.parts import Part

pytestmark = pytest.mark.rabbit


class ThreadBarrier:
    """``BarrierTaskContext``'s two calls for ``count`` threads."""

    def __init__(self, count: int) -> None:
        self._barrier = threading.Barrier(count, timeout=120)
        self._slots: list[str] = [""] * count
        self.gathers = 0

    def member(self, index: int) -> Any:
        outer = self

        class Member:
            def barrier(self) -> None:
                outer._barrier.wait()

            def allGather(self, message: str = "") -> list[str]:
                outer._slots[index] = message
                outer._barrier.wait()
                answers = list(outer._slots)
                if index == 0:
                    outer.gathers += 1
                outer._barrier.wait()
                return answers

        return Member()


@pytest.mark.parametrize("mode", ["raw", "e2e"])
def test_a_cell_in_two_parts_is_one_cell(settings, mode) -> None:
    """Two parts share one cell's queues: each runs half the producers and consumers,
    part 0 declares and deletes the queues, and the merged cell counts every message
    once: nothing lost, no duplicate, every confirmed message handled by some part."""
    spec = CellSpec(mode, 2, producers_per_queue=1, consumers_per_queue=2, duration_s=1.5)
    meeting = ThreadBarrier(2)
    results: list[Any] = [None, None]

    def run(index: int) -> None:
        part = Part(index, 2, f"parts{mode}", meeting.member(index))
        try:
            results[index] = run_cell_sync(settings, spec, part=part)
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(isinstance(r, BaseException) for r in results), results
    # each part published (one producer per queue each: queue i's producer is part i's)
    assert all(r["sent"] for r in results)
    handled_by = [{m for _, m, _ in r["handled"]} for r in results]
    assert handled_by[0] and handled_by[1]  # both parts' consumers took deliveries
    cell = merge_parts(spec, results, records=True)
    assert cell["published"] == sum(len(r["sent"]) for r in results)
    assert cell["confirmed"] > 0 and cell["lost"] == 0 and cell["duplicates"] == 0
    assert cell["parts"] == 2
    # one process here: part 1 finds part 0's clock where its own is, within the error
    assert cell["clock_offset_ms"] is not None
    assert cell["clock_offset_ms"] <= cell["clock_error_ms"] + 1.0
    assert meeting.gathers >= 1  # at least one drain round
    sent_at = {m: s for m, s, _c, _h in cell["records"]}
    assert all(h is None or h >= sent_at[m] - 0.05 for m, _s, _c, h in cell["records"])
