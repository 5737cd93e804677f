"""What a failover's replay does with a step the broker answers "not found" (404).

Pure: no I/O; both faces execute its verdicts.  A failover replays what the client
declared (``TopologyRecord.replay_plan``) on the new node.  A durable classic queue
whose home node is down is still in the cluster's metadata, and its declare is
refused with 404 ("home node ... is down or inaccessible") until the node is back.
Before this, that one refusal failed the whole failover, which was tried again for as
long as the node was down: the asyncio face's publishes to every other queue waited,
the pika face's raised (and so did ``run``).  Now the replay goes on without that
queue: its bindings are skipped (they are kept by the broker with the queue), and its
consumers are subscribed again in the background once it answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .topology import BindingSpec, ConsumerSpec, ExchangeSpec, QueueSpec

__all__ = [
    "HOME_DOWN",
    "NOT_THERE",
    "UNREACHABLE",
    "VANISHED",
    "Replay",
    "Verdict",
    "absent",
]

#: what the faces log (the same words on both)
UNREACHABLE = (
    "queue %r: its home node is down or inaccessible; failing over without it "
    "(its consumers are subscribed again when it is back)"
)
VANISHED = "queue %r vanished during the replay; declared again"
HOME_DOWN = "its queue's home node is down"  # why a consumer waits
NOT_THERE = "its queue is not there"

Spec = ExchangeSpec | QueueSpec | BindingSpec | ConsumerSpec


class Verdict(StrEnum):
    """What to do with one step of the replay."""

    APPLY = "apply"  # declare, bind or subscribe it now
    SKIP = "skip"  # go on without it
    LATER = "later"  # a consumer: subscribe it again in the background
    REDECLARE = "redeclare"  # a consumer whose own queue vanished: declare it, subscribe
    RAISE = "raise"  # the failover fails (and is tried again)


@dataclass
class Replay:
    """One failover's replay: the queues found unreachable so far, and the verdicts."""

    declared: frozenset[str]  # the queues this client declared (and may declare again)
    unreachable: set[str] = field(default_factory=set)

    def before(self, spec: Spec) -> Verdict:
        """Before trying ``spec``: a binding or consumer of an unreachable queue waits."""
        if isinstance(spec, BindingSpec) and spec.queue in self.unreachable:
            return Verdict.SKIP
        if isinstance(spec, ConsumerSpec) and spec.queue in self.unreachable:
            return Verdict.LATER
        return Verdict.APPLY

    def not_found(self, spec: Spec) -> Verdict:
        """``spec`` was refused with 404.

        A queue's own declare (not passive) is refused only when the queue exists and
        cannot be reached: its home node is down.  A consumer's queue that this client
        declared vanished between the two steps (the broker removing a lost node's
        exclusive queues): declared again.  Any other consumer's queue is someone else's
        to declare: subscribed once it exists.  A binding's 404 is its exchange missing,
        as before: the failover fails."""
        match spec:
            case QueueSpec():
                self.unreachable.add(spec.name)
                return Verdict.SKIP
            case ConsumerSpec() if spec.queue in self.declared:
                return Verdict.REDECLARE
            case ConsumerSpec():
                return Verdict.LATER
        return Verdict.RAISE


def absent(not_found: str) -> bool:
    """Whether a 404 (``not_found``: the broker's reply text) says the queue exists but
    cannot be reached now: its home node down or inaccessible, its process stopped (a
    node stopping) or crashed, or a time-out; RabbitMQ says "no queue ..." for a queue
    that does not exist."""
    return "no queue" not in not_found
