"""The embedded default: a local RabbitMQ cluster of plain processes on 127.0.0.1."""

from .layout import ClusterLayout, NodeLayout
from .manager import ClusterError, LocalCluster, NodeExited, RabbitMQMissing, pid_alive
from .proxy import FaultProxy

__all__ = [
    "ClusterError",
    "ClusterLayout",
    "FaultProxy",
    "LocalCluster",
    "NodeExited",
    "NodeLayout",
    "RabbitMQMissing",
    "pid_alive",
]
