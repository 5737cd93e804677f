"""Persistent queues (paper 004, EMQ): durable queue verbs, result codes, windows, a spool."""

from ..errors import (
    ConnectionNotEstablished,
    MessageMalformed,
    QueueDoesNotExist,
    QueueResult,
    QueueSaveFailed,
    WindowExceeded,
)
from .aio import AsyncQueues, QueueMessage
from .core import EnqueueResult, EnqueueStatus, RecoverReport, validate
from .sharing import LeastLoaded, NodePool, RoundRobin, SharingRule
from .spool import Spool, SpoolEntry, SpoolFull
from .sync import SyncQueueMessage, SyncQueues

__all__ = [
    "AsyncQueues",
    "ConnectionNotEstablished",
    "EnqueueResult",
    "EnqueueStatus",
    "LeastLoaded",
    "MessageMalformed",
    "NodePool",
    "QueueDoesNotExist",
    "QueueMessage",
    "QueueResult",
    "QueueSaveFailed",
    "RecoverReport",
    "RoundRobin",
    "SharingRule",
    "Spool",
    "SpoolEntry",
    "SpoolFull",
    "SyncQueueMessage",
    "SyncQueues",
    "WindowExceeded",
    "validate",
]
