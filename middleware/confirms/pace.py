"""How long a forwarder's e2e confirm waits for one queue's receipt (no I/O here).

A process that forwards messages and acknowledges its own input only once they are
confirmed (a Phoenix match broker delivering an event to its subscribers' queues) must
not let one queue that nobody consumes hold its input: with a few deliveries in hand at
a time, one silent queue stopped the forwarder for every other queue.  So a copy's
receipt is waited for ``hold_s`` at most; past that, the copy counts as confirmed once
the broker holds it in the queue (its consumer handles it when it comes back), and the
queue is *lagging*: its next copies wait only for the broker, so they cost the others
nothing.  Every ``probe_s`` one copy to a lagging queue waits ``hold_s`` again: a
receipt in time makes the queue prompt again.  And however prompt a queue looked, at
most ``window`` of its copies wait for receipts at a time (the others only for the
broker): a queue that has just gone silent holds at most that many inputs, once.

What a lagging queue's consumer gives up is the receipt's extra promise for those copies
(handled, not only enqueued): they are as safe as a broker-confirmed delivery.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["QueuePace"]


@dataclass
class QueuePace:
    """Per destination queue: prompt, or lagging since when and probed when."""

    hold_s: float
    probe_s: float
    window: int = 4
    _lagging: dict[str, float] = field(default_factory=dict)  # queue -> next probe due
    _waiting: dict[str, int] = field(default_factory=dict)  # queue -> copies held now

    def hold(self, queue: str, now: float) -> float:
        """How long the next copy to ``queue`` may wait for its receipt (0: only for the
        broker to hold it); a lagging queue's probe, when due, waits ``hold_s``.  A
        copy given a hold counts in the window until :meth:`released`."""
        if self.hold_s <= 0 or self._waiting.get(queue, 0) >= self.window:
            return 0.0
        due = self._lagging.get(queue)
        if due is not None:
            if now < due:
                return 0.0
            self._lagging[queue] = now + self.probe_s
        self._waiting[queue] = self._waiting.get(queue, 0) + 1
        return self.hold_s

    def released(self, queue: str) -> None:
        """A copy given a hold got its answer, or stopped waiting."""
        left = self._waiting.get(queue, 0) - 1
        if left > 0:
            self._waiting[queue] = left
        else:
            self._waiting.pop(queue, None)

    def receipted(self, queue: str) -> None:
        """A receipt came within the hold: ``queue`` is prompt."""
        self._lagging.pop(queue, None)

    def overdue(self, queue: str, now: float) -> None:
        """A copy's receipt did not come within the hold: ``queue`` lags from now."""
        self._lagging.setdefault(queue, now + self.probe_s)

    @property
    def lagging(self) -> list[str]:
        return sorted(self._lagging)
