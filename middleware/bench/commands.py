"""``qosmq bench`` commands."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    sub.add_parser("bench", help="benchmark cells against the running cluster")
