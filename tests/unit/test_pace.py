"""``confirms/pace.py``: how long a forwarder waits for one queue's receipt."""

from __future__ import annotations

from middleware.confirms.pace import QueuePace


def test_a_prompt_queue_holds_at_most_its_window_at_once() -> None:
    pace = QueuePace(hold_s=2.0, probe_s=1.0, window=2)
    assert [pace.hold("q", 0.0) for _ in range(3)] == [2.0, 2.0, 0.0]
    assert pace.hold("other", 0.0) == 2.0  # each queue its own window
    pace.released("q")
    assert pace.hold("q", 0.1) == 2.0


def test_an_overdue_receipt_makes_the_queue_lag_until_a_probe_is_receipted() -> None:
    pace = QueuePace(hold_s=2.0, probe_s=1.0, window=4)
    assert pace.hold("q", 0.0) == 2.0
    pace.released("q")
    pace.overdue("q", 2.0)
    assert pace.lagging == ["q"]
    assert pace.hold("q", 2.5) == 0.0  # only the broker
    assert pace.hold("q", 3.0) == 2.0  # the probe
    assert pace.hold("q", 3.1) == 0.0  # one probe per probe_s
    pace.released("q")
    pace.receipted("q")
    assert pace.lagging == [] and pace.hold("q", 3.2) == 2.0


def test_no_hold_at_all_when_the_hold_is_zero() -> None:
    pace = QueuePace(hold_s=0.0, probe_s=1.0)
    assert pace.hold("q", 0.0) == 0.0
