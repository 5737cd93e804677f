"""Full collections: freezing what a role loaded, timing them, pausing them (heap.py)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from middleware import heap
from middleware.settings import Settings


@pytest.fixture(autouse=True)
def _unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()
    gc.enable()


def _table(n: int) -> dict[str, dict[str, object]]:
    return {f"s{i}": {"filter": [("symbol", "=", f"S{i}")], "level": i % 5} for i in range(n)}


def test_settle_moves_the_loaded_tables_out_of_reach_of_full_collections() -> None:
    table = _table(20_000)
    garbage: list[object] = []
    garbage.append(garbage)  # a cycle: only a collection frees it
    del garbage
    report = heap.settle("test")
    assert report["frozen"] >= 20_000
    tracked = {id(o) for o in gc.get_objects()}  # what collections traverse
    assert id(table) not in tracked
    assert not any(id(doc) in tracked for doc in table.values())
    # objects made afterwards are collected as usual
    fresh: list[object] = []
    assert gc.is_tracked(fresh) and id(fresh) in {id(o) for o in gc.get_objects()}


def test_full_collections_are_counted_and_young_ones_are_not() -> None:
    with heap.FullCollections(log_over_s=0.0) as watch:
        gc.collect(0)
        gc.collect(1)
        assert watch.count == 0
        gc.collect()
        gc.collect(2)
    gc.collect()  # after the block: not watched
    assert watch.count == 2
    summary = watch.summary()
    assert summary["full_collections"] == 2
    assert 0 < summary["longest_ms"] <= summary["full_collection_ms"]


def test_paused_holds_collection_off_until_every_open_block_has_ended() -> None:
    first, second = heap.paused(), heap.paused()
    first.__enter__()
    assert not gc.isenabled()
    second.__enter__()  # another task's block, overlapping the first
    first.__exit__(None, None, None)
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), heap.paused():
        raise RuntimeError("an error inside still resumes collection")
    assert gc.isenabled()


def test_paused_leaves_collection_off_when_it_was_off() -> None:
    gc.disable()
    with heap.paused():
        pass
    assert not gc.isenabled()


def test_gc_freeze_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().gc_freeze is True
    monkeypatch.setenv("QOSMQ_GC_FREEZE", "false")
    assert Settings().gc_freeze is False
    monkeypatch.setenv("QOSMQ_GC_FREEZE", "sometimes")
    with pytest.raises(ValueError, match="gc_freeze"):
        Settings()
