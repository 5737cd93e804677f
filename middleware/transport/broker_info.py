"""What the broker says it is at connect, and what the layer does with each version (pure).

Read from ``Connection.Start``'s ``server_properties`` (both faces) or the management
API's ``rabbitmq_version``.  The layer chooses by these facts, never by guessing:

* **classic queue mirroring** (``ha-mode`` policies; Phoenix's ``inbox_mirrors``) exists
  up to 3.13 and was removed in 4.0;
* **quorum queue priorities**: none before 4.0, two levels (high above 4, normal) from 4.0;
* **transient non-exclusive queues** are refused from 4.3 (deprecated before): the
  layer's own queues are durable or exclusive on every version (the Phoenix lease queue
  is durable with an expiry);
* **management metrics** (``message_stats`` rates) are deprecated from 4.0.

A version the parser does not recognise is taken as the newest behaviour it knows (4.3),
said once in the log: the layer never degrades silently.  ``docs/compatibility.md`` has
the table, and which rows ran here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["NEWEST_KNOWN", "BrokerInfo"]

NEWEST_KNOWN = (4, 3, 0)
_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def _text(value: Any) -> str:
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    return "" if value is None else str(value)


@dataclass(frozen=True)
class BrokerInfo:
    """One broker's product, version and capabilities, and what follows from them."""

    product: str
    raw_version: str
    version: tuple[int, int, int] | None  # None: not recognised (see ``effective``)
    capabilities: frozenset[str] = frozenset()

    @classmethod
    def from_version(cls, text: Any, product: str = "RabbitMQ") -> BrokerInfo:
        raw = _text(text)
        match = _VERSION.match(raw)
        version = None
        if match:
            version = (int(match[1]), int(match[2]), int(match[3] or 0))
        return cls(product, raw, version)

    @classmethod
    def from_properties(cls, properties: Mapping[str, Any] | None) -> BrokerInfo:
        """From ``server_properties`` (keys and values as either library decodes them)."""
        props = {_text(k): v for k, v in (properties or {}).items()}
        capabilities = props.get("capabilities") or {}
        enabled = frozenset(_text(k) for k, v in dict(capabilities).items() if v)
        info = cls.from_version(props.get("version"), _text(props.get("product")) or "unknown")
        return cls(info.product, info.raw_version, info.version, enabled)

    @property
    def effective(self) -> tuple[int, int, int]:
        """The version the layer acts on: the one read, else the newest it knows."""
        return self.version if self.version is not None else NEWEST_KNOWN

    @property
    def classic_mirroring(self) -> bool:
        return self.effective < (4, 0, 0)

    @property
    def quorum_priority_levels(self) -> int:
        """Priority levels a quorum queue keeps apart: 0 (none) before 4.0, then 2."""
        return 0 if self.effective < (4, 0, 0) else 2

    @property
    def transient_nonexclusive_queues(self) -> bool:
        return self.effective < (4, 3, 0)

    @property
    def management_message_stats(self) -> bool:
        """Management metrics (rates) without a deprecation: before 4.0."""
        return self.effective < (4, 0, 0)

    def notices(self) -> list[str]:
        """One line for each thing this broker lacks that the layer adapts to."""
        out = []
        if self.version is None:
            out.append(
                f"{self.product} version {self.raw_version!r} not recognised: acting as for "
                f"{'.'.join(map(str, NEWEST_KNOWN))} (no classic mirroring, durable queues)"
            )
        if not self.classic_mirroring:
            out.append(
                f"{self.product} {self.raw_version}: no classic queue mirroring (removed in "
                "4.0): Phoenix's inbox_mirrors is not applied"
            )
        if not self.management_message_stats:
            out.append(
                f"{self.product} {self.raw_version}: management message rates are deprecated "
                "(4.0): the balancer reads queue lengths by passive declare and rates from "
                "rabbitmq_prometheus (balancer_rates)"
            )
        return out

    def describe(self) -> str:
        return f"{self.product} {self.raw_version or '?'}"
