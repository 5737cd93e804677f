"""Moved to :mod:`middleware.phoenix.protocol` (what routing and recovery share); kept
so that code importing it from here goes on working."""

from ..phoenix.protocol import MAX_PRIORITY, ClusterSpec, Kind, LinkSpec, PhoenixTopology

__all__ = ["MAX_PRIORITY", "ClusterSpec", "Kind", "LinkSpec", "PhoenixTopology"]
