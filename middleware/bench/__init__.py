"""Benchmark cell runners (``qosmq bench …``)."""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``bench`` command group."""
    from .commands import register as _register

    _register(sub)
