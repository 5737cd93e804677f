"""Phoenix routing clusters (paper 000): ring arithmetic, matching, timeliness.

Built so far: the pure logic (Chord ring with fingers and hand-over arcs, typed
events, filters and a counting-algorithm index, latency levels and predicted
processing times).  The sidecar roles that run it over RabbitMQ are not built yet.
"""

from .matching import Event, Filter, FilterError, Op, Predicate, SubscriptionIndex
from .replicas import Quorum, Versioned
from .ring import ChordRing, Handover, ring_id
from .timeliness import (
    LatencyMap,
    QueuePredictor,
    choose_broker,
    mean_processing_time,
    predicted_queue,
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
    "SubscriptionIndex",
    "Versioned",
    "choose_broker",
    "mean_processing_time",
    "predicted_queue",
    "ring_id",
]
