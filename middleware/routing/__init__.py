"""Phoenix routing clusters (paper 000).

Pure logic here (Chord ring with fingers and hand-over arcs, typed events,
filters and the subscription index, latency levels and predicted processing
times, replica quorums); the roles that run it over RabbitMQ are in
:mod:`middleware.routing.node` (one driver per process), their processes in ``qosmq phoenix``.

The faces a service uses (``PhoenixClient``, ``SyncPhoenixClient``), the deployment
(``PhoenixDeployment``, ``PhoenixTopology``) and their errors are exported here too,
imported on first use, so that a process that needs only the pure logic (a
simulation, a test of the ring) does not load the role driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..phoenix.ids import RoleId, RoleKind, role_queues
from ..phoenix.ring import ChordRing, Handover, ring_id
from .matching import Event, Filter, FilterError, Op, Predicate, SubscriptionIndex
from .replicas import Quorum, Versioned
from .timeliness import (
    LatencyMap,
    QueuePredictor,
    QuietReads,
    RemoteBroker,
    choose_broker,
    mean_processing_time,
    predicted_queue,
    round_robin,
)

if TYPE_CHECKING:
    from ..phoenix.protocol import PhoenixTopology
    from ..sidecar.deployment import DeploymentError, PhoenixDeployment, RoleStatus
    from .client import PhoenixClient, SubscriptionUnconfirmed, SyncPhoenixClient
    from .messages import HOME_LEFT, MAYBE_DELIVERED
    from .records import RecordError, SubscriptionRecord

_LAZY = {
    "PhoenixClient": "client",
    "SyncPhoenixClient": "client",
    "SubscriptionUnconfirmed": "client",
    # processes are the sidecar's (it wires the drivers into processes); exported here
    # as the deployment's face, imported only when asked for
    "PhoenixDeployment": "..sidecar.deployment",
    "DeploymentError": "..sidecar.deployment",
    "RoleStatus": "..sidecar.deployment",
    "PhoenixTopology": "protocol",
    "HOME_LEFT": "messages",
    "MAYBE_DELIVERED": "messages",
    "RecordError": "records",
    "SubscriptionRecord": "records",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    relative = module if module.startswith("..") else f".{module}"
    value = getattr(importlib.import_module(relative, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "HOME_LEFT",
    "MAYBE_DELIVERED",
    "ChordRing",
    "DeploymentError",
    "Event",
    "Filter",
    "FilterError",
    "Handover",
    "LatencyMap",
    "Op",
    "PhoenixClient",
    "PhoenixDeployment",
    "PhoenixTopology",
    "Predicate",
    "QueuePredictor",
    "QuietReads",
    "Quorum",
    "RecordError",
    "RemoteBroker",
    "RoleId",
    "RoleKind",
    "RoleStatus",
    "SubscriptionIndex",
    "SubscriptionRecord",
    "SubscriptionUnconfirmed",
    "SyncPhoenixClient",
    "Versioned",
    "choose_broker",
    "mean_processing_time",
    "predicted_queue",
    "ring_id",
    "role_queues",
    "round_robin",
]
