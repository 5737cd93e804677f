"""Persistent queues (paper 004, EMQ): durable queue verbs, result codes, windows, a spool."""

from .aio import AsyncQueues, QueueMessage
from .core import EnqueueResult, EnqueueStatus, RecoverReport, validate
from .sharing import LeastLoaded, NodePool, RoundRobin, SharingRule
from .spool import Spool, SpoolEntry
from .sync import SyncQueueMessage, SyncQueues

__all__ = [
    "AsyncQueues",
    "EnqueueResult",
    "EnqueueStatus",
    "LeastLoaded",
    "NodePool",
    "QueueMessage",
    "RecoverReport",
    "RoundRobin",
    "SharingRule",
    "Spool",
    "SpoolEntry",
    "SyncQueueMessage",
    "SyncQueues",
    "validate",
]
