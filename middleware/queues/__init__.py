"""Persistent queues (paper 004, EMQ): durable queue verbs, result codes, windows, a spool."""

from .aio import AsyncQueues, QueueMessage
from .core import EnqueueResult, EnqueueStatus, RecoverReport, validate
from .spool import Spool, SpoolEntry
from .sync import SyncQueueMessage, SyncQueues

__all__ = [
    "AsyncQueues",
    "EnqueueResult",
    "EnqueueStatus",
    "QueueMessage",
    "RecoverReport",
    "Spool",
    "SpoolEntry",
    "SyncQueueMessage",
    "SyncQueues",
    "validate",
]
