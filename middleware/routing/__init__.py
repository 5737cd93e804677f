"""Phoenix routing clusters (paper 000).

Pure logic here (Chord ring with fingers and hand-over arcs, typed events,
filters and the subscription index, latency levels and predicted processing
times, replica quorums); the roles that run it over RabbitMQ are in
:mod:`middleware.routing.roles`, their processes in ``qosmq phoenix``.
"""

from .ids import RoleId, RoleKind
from .matching import Event, Filter, FilterError, Op, Predicate, SubscriptionIndex
from .replicas import Quorum, Versioned
from .ring import ChordRing, Handover, ring_id
from .timeliness import (
    LatencyMap,
    QueuePredictor,
    RemoteBroker,
    choose_broker,
    mean_processing_time,
    predicted_queue,
    round_robin,
)

__all__ = [
    "ChordRing",
    "Event",
    "Filter",
    "FilterError",
    "Handover",
    "LatencyMap",
    "Op",
    "Predicate",
    "QueuePredictor",
    "Quorum",
    "RemoteBroker",
    "RoleId",
    "RoleKind",
    "SubscriptionIndex",
    "Versioned",
    "choose_broker",
    "mean_processing_time",
    "predicted_queue",
    "ring_id",
    "round_robin",
]
