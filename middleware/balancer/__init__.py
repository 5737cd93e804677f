"""Weighted dispatch over queue replicas (paper 001): factors, sidecar, publisher."""

from .factors import ALGORITHMS, PredictiveChooser, WeightedPicker, inverse_factors, paper_factors
from .publisher import BalancedPublisher, declare_replicated_topic, subscribe_replicated
from .reports import REPORT_EXCHANGE, LoadReport, ReplicaLoad, replica_names
from .sidecar import BalancerSidecar
from .sync import SyncBalancedPublisher

__all__ = [
    "ALGORITHMS",
    "REPORT_EXCHANGE",
    "BalancedPublisher",
    "BalancerSidecar",
    "LoadReport",
    "PredictiveChooser",
    "ReplicaLoad",
    "SyncBalancedPublisher",
    "WeightedPicker",
    "declare_replicated_topic",
    "inverse_factors",
    "paper_factors",
    "replica_names",
    "subscribe_replicated",
]
