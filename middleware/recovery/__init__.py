"""Phoenix recovery (paper 000 §2): pure state machines — failure detection and bully
elections — that the role driver (``middleware/routing``) wires to its control queues."""

from .detector import FailureDetector
from .election import Become, Bully, BullyState, Send

__all__ = ["Become", "Bully", "BullyState", "FailureDetector", "Send"]
