"""Phoenix recovery (paper 000 §2): pure state machines — failure detection, bully
elections, fencing of stale masters — that the role driver (``middleware/routing``)
wires to its control queues."""

from .detector import FailureDetector
from .election import Become, Bully, BullyState, Send
from .fencing import Reign, Trust, Verdict

__all__ = ["Become", "Bully", "BullyState", "FailureDetector", "Reign", "Send", "Trust", "Verdict"]
