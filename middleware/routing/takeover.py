"""A successor's routing master taking a departed cluster's arc over, without I/O.

When a cluster leaves the ring, its successor's routing master holds the arc's events
(the driver's hold) while it gathers what the arc needs, then lets them go on:

1. at the leave (:meth:`ArcTakeover.left`) it reads the departed router's routing-table
   entries of the arc (:class:`ReadTable`) and makes the capacity plan, starting the
   match roles it adds (:class:`MakePlan`), both at once;
2. with the plan (:meth:`ArcTakeover.planned`) it records it as in force
   (:class:`Adopt`), asks each match master the plan names to restore its share (a
   ``Send`` of RECOVER to each, ``departures.recover_asks``) and bounds the wait
   (``After``: then :meth:`ArcTakeover.expired`);
3. each master answers how many subscriptions it restored (:meth:`ArcTakeover.answered`);
   the bound may pass first (:meth:`ArcTakeover.expired`);
4. once every master answered (or the bound passed) and the table was read (or failed),
   :class:`Released`: the events go on, the table's entries are written as this
   router's own, and what it took is said.

The RECOVER round is a record here (who has not answered yet, the count so far), not a
future: the driver (``router_roles.py``) performs the effects and feeds the results back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..phoenix.effects import After, Send
from ..phoenix.ring import Handover as Arc
from .departures import recover_asks

__all__ = [
    "Adopt",
    "ArcTakeover",
    "Effect",
    "MakePlan",
    "ReadTable",
    "Released",
]


@dataclass(frozen=True, slots=True)
class ReadTable:
    """Read the departed router's routing-table entries of ``cluster``'s arc; answer
    :meth:`ArcTakeover.table_read`."""

    cluster: str


@dataclass(frozen=True, slots=True)
class MakePlan:
    """Make the capacity plan for ``cluster``'s arc (start the roles it adds); answer
    :meth:`ArcTakeover.planned`."""

    cluster: str


@dataclass(frozen=True, slots=True)
class Adopt:
    """Record ``plan`` as in force for ``cluster``'s arc (routing and the store)."""

    cluster: str
    plan: Any


@dataclass(frozen=True, slots=True)
class Released:
    """The arc's events go on.  ``restored`` subscriptions (``complete``: every master
    answered in time); ``entries``: the table's entries to write as this router's own
    (``table_error``: why there are none); ``took_s`` since the leave."""

    cluster: str
    restored: int
    complete: bool
    entries: Mapping[str, Any]
    table_error: str | None
    took_s: float


Effect = ReadTable | MakePlan | Adopt | Send | After | Released


@dataclass
class _Taking:
    request: str
    since: float
    arc: Arc
    waiting: set[str] | None = None  # None: no plan yet
    restored: int = 0
    restore_done: bool = False
    complete: bool = True
    entries: Mapping[str, Any] | None = None  # None: not read yet
    table_error: str | None = None


@dataclass
class ArcTakeover:
    """One routing master's take-overs in progress, by departed cluster; ``bound_s``:
    how long its match masters may take to restore (``read_timeout_s``); ``reply_to``:
    where they answer (its process queue)."""

    bound_s: float
    reply_to: str = ""
    taking: dict[str, _Taking] = field(default_factory=dict)

    def left(self, cluster: str, request: str, now: float, arc: Arc) -> list[Effect]:
        """``cluster`` left and this router is its successor (of ``arc``)."""
        self.taking[cluster] = _Taking(request, now, arc)
        return [ReadTable(cluster), MakePlan(cluster)]

    def planned(self, cluster: str, plan: Any, masters: Iterable[str], now: float) -> list[Effect]:
        """The plan in force, naming ``masters`` (owner names) to restore the arc."""
        held = self.taking.get(cluster)
        if held is None or held.waiting is not None:
            return []  # joined again meanwhile, or planned twice
        held.waiting = set(masters)
        effects: list[Effect] = [Adopt(cluster, plan)]
        if held.waiting:
            effects += [*self._asks(plan, held), After(self.bound_s, held.request)]
        else:
            held.restore_done = True
        return effects + self._release(cluster, now)

    def _asks(self, plan: Any, held: _Taking) -> list[Send]:
        """RECOVER to each master of ``plan`` (their answers: :meth:`answered`)."""
        return list(recover_asks(plan, held.arc, request=held.request, reply_to=self.reply_to))

    def answered(self, request: str, master: str, count: int, now: float) -> list[Effect]:
        """``master`` restored ``count`` of the arc's subscriptions."""
        cluster, held = self._of(request)
        if held is None or held.restore_done or held.waiting is None:
            return []
        if master not in held.waiting:
            return []
        held.waiting.discard(master)
        held.restored += count
        if not held.waiting:
            held.restore_done = True
        return self._release(cluster, now)

    def expired(self, request: str, now: float) -> list[Effect]:
        """The bound passed: the events go on with what was restored so far."""
        cluster, held = self._of(request)
        if held is None or held.restore_done:
            return []
        held.restore_done, held.complete = True, False
        return self._release(cluster, now)

    def table_read(
        self, cluster: str, entries: Mapping[str, Any] | None, error: str | None, now: float
    ) -> list[Effect]:
        """The departed router's entries of the arc (``error``: none could be read)."""
        held = self.taking.get(cluster)
        if held is None or held.entries is not None:
            return []
        held.entries, held.table_error = dict(entries or {}), error
        return self._release(cluster, now)

    def joined(self, cluster: str) -> None:
        """``cluster`` is back: its take-over, if still in progress, ends unreleased (the
        driver lets the held events go on to the joiner)."""
        self.taking.pop(cluster, None)

    def requests(self) -> set[str]:
        return {held.request for held in self.taking.values()}

    def _of(self, request: str) -> tuple[str, _Taking | None]:
        for cluster, held in self.taking.items():
            if held.request == request:
                return cluster, held
        return "", None

    def _release(self, cluster: str, now: float) -> list[Effect]:
        held = self.taking[cluster]
        if not held.restore_done or held.entries is None:
            return []
        del self.taking[cluster]
        return [
            Released(
                cluster,
                held.restored,
                held.complete,
                held.entries,
                held.table_error,
                now - held.since,
            )
        ]
