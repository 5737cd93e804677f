"""Benchmark cells (``qosmq bench …``) and the Spark pipeline's building blocks."""

from __future__ import annotations

from typing import Any

from .confirms import MODES, CellSpec, run_cell, run_cell_sync

__all__ = ["MODES", "CellSpec", "register", "run_cell", "run_cell_sync"]


def register(sub: Any) -> None:
    """Add the ``bench``, ``demo`` and ``spark`` command groups."""
    from .commands import register as _register

    _register(sub)
