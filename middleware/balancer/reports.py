"""Load reports: what the sidecar measures per replica, and how it is encoded (pure)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["REPORT_EXCHANGE", "LoadReport", "ReplicaLoad", "Sampler", "replica_names"]

#: Direct exchange the sidecars publish to, routing key = topic name.
REPORT_EXCHANGE = "qosmq.balancer.reports"


def replica_names(topic: str, replicas: int) -> list[str]:
    if replicas < 1:
        raise ValueError("a replicated topic needs at least one replica")
    return [f"{topic}.r{i}" for i in range(replicas)]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    queue: str
    length: float  # b_n: average waiting messages over the period
    arrival_rate: float
    service_rate: float


@dataclass(frozen=True, slots=True)
class LoadReport:
    topic: str
    period_s: float
    sent_at: float  # wall clock of the sidecar, for staleness across hosts
    replicas: tuple[ReplicaLoad, ...]

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> LoadReport:
        try:
            data: dict[str, Any] = json.loads(body)
            return cls(
                topic=str(data["topic"]),
                period_s=float(data["period_s"]),
                sent_at=float(data["sent_at"]),
                replicas=tuple(ReplicaLoad(**r) for r in data["replicas"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"malformed load report: {exc}") from None


class Sampler:
    """Accumulates one replica's samples over a report period (the paper's B_n)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self.first: tuple[float, float] | None = None  # (time, length)
        self.last: tuple[float, float] | None = None

    def add(self, now: float, length: float) -> None:
        self.total += length
        self.count += 1
        self.first = self.first or (now, length)
        self.last = (now, length)

    def average(self) -> float:
        """b_n = B_n / (number of samples); 0 without samples."""
        return self.total / self.count if self.count else 0.0

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]
