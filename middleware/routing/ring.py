"""Moved to :mod:`middleware.phoenix.ring` (what routing and recovery share); kept
so that code importing it from here goes on working."""

from ..phoenix.ring import BITS, ChordRing, Handover, master_index, ring_id

__all__ = ["BITS", "ChordRing", "Handover", "master_index", "ring_id"]
