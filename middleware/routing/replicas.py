"""Replica quorums (paper 000: replicas on slaves managed by quorum consensus): pure logic.

A write is durable once W of the N replicas acknowledged it; a read asks R replicas
and keeps the newest version.  W + R > N makes every read set meet every write set,
so a read always sees the latest acknowledged write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TOMBSTONE", "Quorum", "Versioned", "live", "merge_replicas"]

#: A deleted entry is written as this document (with a new version), so a replica
#: that missed the delete cannot bring the entry back at the next quorum read.
TOMBSTONE: dict[str, Any] = {"_deleted": True}
Entries = Mapping[str, tuple[int, dict[str, Any]]]


@dataclass(frozen=True, slots=True)
class Versioned:
    version: int
    value: Any


@dataclass(frozen=True, slots=True)
class Quorum:
    replicas: int
    write: int
    read: int

    def __post_init__(self) -> None:
        if not 1 <= self.write <= self.replicas or not 1 <= self.read <= self.replicas:
            raise ValueError(
                f"need 1 <= W, R <= N; got N={self.replicas} W={self.write} R={self.read}"
            )
        if self.write + self.read <= self.replicas:
            raise ValueError(
                f"W + R must exceed N so reads meet writes; got N={self.replicas} "
                f"W={self.write} R={self.read}"
            )

    @classmethod
    def majority(cls, replicas: int) -> Quorum:
        w = replicas // 2 + 1
        return cls(replicas, w, replicas - w + 1)

    def written(self, acknowledged: Iterable[str]) -> bool:
        """True once W distinct replicas acknowledged the write."""
        return len(set(acknowledged)) >= self.write

    def resolve(self, responses: Mapping[str, Versioned | None]) -> Versioned | None:
        """The newest value among at least R replies (None = the replica has no copy)."""
        if len(responses) < self.read:
            raise ValueError(f"a read needs {self.read} replies, got {len(responses)}")
        present = [v for v in responses.values() if v is not None]
        return max(present, key=lambda v: v.version, default=None)


def merge_replicas(
    replies: Sequence[Entries], *, at_least: int
) -> dict[str, tuple[int, dict[str, Any]]]:
    """A read of whole tables: per key, the newest version among ``at_least`` (R) replies.

    Tombstones are kept (``live`` drops them), so the caller can repair its own copy.
    """
    if len(replies) < at_least:
        raise ValueError(f"a read needs {at_least} replies, got {len(replies)}")
    merged: dict[str, tuple[int, dict[str, Any]]] = {}
    for reply in replies:
        for key, (version, document) in reply.items():
            if key not in merged or version > merged[key][0]:
                merged[key] = (version, document)
    return merged


def live(entries: Entries) -> dict[str, tuple[int, dict[str, Any]]]:
    """The entries that are not tombstones."""
    return {k: (v, d) for k, (v, d) in entries.items() if d != TOMBSTONE}
