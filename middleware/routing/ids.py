"""Moved to :mod:`middleware.phoenix.ids` (what routing and recovery share); kept
so that code importing it from here goes on working."""

from ..phoenix.ids import RoleId, RoleKind, role_queues

__all__ = ["RoleId", "RoleKind", "role_queues"]
