"""Load reports: what the sidecar measures per replica, and how it is encoded (pure)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import InvalidArgument
from ..names import check_name

__all__ = [
    "REPORT_EXCHANGE",
    "TOPIC_MAX_BYTES",
    "LoadReport",
    "ReplicaLoad",
    "Sampler",
    "replica_names",
]

#: Direct exchange the sidecars publish to, routing key = topic name.
REPORT_EXCHANGE = "qosmq.balancer.reports"


#: a topic's longest name in UTF-8 bytes: its replicas are ``<topic>.r<i>`` and a
#: publisher's report inbox ``qosmq.balancer.inbox.<topic>.<id>``, names of at most 255
TOPIC_MAX_BYTES = 200


def replica_names(topic: str, replicas: int) -> list[str]:
    """The replica queues of ``topic``; :class:`InvalidArgument` for a topic the broker
    could not carry or fewer than one replica."""
    check_name(topic, "the topic", TOPIC_MAX_BYTES)
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise InvalidArgument(f"a replicated topic needs at least one replica, got {replicas!r}")
    return [f"{topic}.r{i}" for i in range(replicas)]


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    queue: str
    length: float  # b_n: average waiting messages over the period
    arrival_rate: float
    service_rate: float
    #: the replica's queue answered the sidecar's last sample (a deleted queue is not an
    #: idle one: publishers leave it out until it exists again)
    exists: bool = True


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
        """A report as a sidecar sends it; anything else raises ``InvalidArgument``
        naming the field (a publisher ignores such a report, says so once, counts it)."""
        try:
            data = json.loads(body)
            if not isinstance(data, dict) or not isinstance(data.get("replicas"), list):
                raise TypeError("not an object with a replicas list")
            return cls(
                topic=_text(data, "topic"),
                period_s=_number(data, "period_s", positive=True),
                sent_at=_number(data, "sent_at"),
                replicas=tuple(_replica(r) for r in data["replicas"]),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"malformed load report: {exc}") from None


def _text(data: dict[str, Any], key: str) -> str:
    value = data[key]
    if not isinstance(value, str) or not value:
        raise TypeError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _number(data: dict[str, Any], key: str, *, positive: bool = False) -> float:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{key} must be a number, got {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (positive and number == 0):
        raise ValueError(f"{key} must be finite and {'> 0' if positive else '>= 0'}, got {value}")
    return number


def _replica(r: Any) -> ReplicaLoad:
    if not isinstance(r, dict):
        raise TypeError(f"a replica must be an object, got {r!r}")
    exists = r.get("exists", True)
    if not isinstance(exists, bool):
        raise TypeError(f"exists must be true or false, got {exists!r}")
    return ReplicaLoad(
        queue=_text(r, "queue"),
        length=_number(r, "length"),
        arrival_rate=_number(r, "arrival_rate"),
        service_rate=_number(r, "service_rate"),
        exists=exists,
    )


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
