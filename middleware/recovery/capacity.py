"""The capacity plan for a departed cluster's arc (paper 000 §2.2, steps 2-5), pure.

When cluster X leaves the ring, its successor S takes over X's arc.  X ran ``N`` match
masters (its topology's, or more while X itself held an arc it had taken over), S runs
``M``.  The paper's plan, as built here:

- **Capacity.**  When N > M, S adds match masters ``M .. N-1``, each with S's ``k``
  slaves: ``(1 + k)·(N - M)`` role processes (the paper's ``k·(N-M)`` brokers, ``k`` the
  brokers a match master manages), started by the provisioner (the same seam that
  replaces slaves).  Without a provisioner, or when it cannot start them, nothing is
  added and S's M masters share the arc (``masters`` = M).
- **Routing.**  S's router sends an event type of the adopted arc to its match master
  ``SHA-1(type) % P``, ``P = max(N, M)`` (its own arc stays ``% M``), so the load of
  the arc spreads over as many masters as X had.
- **matchBrokerMap.**  When P = N and X routed its whole arc ``% N`` (it held no
  adopted arc), lost master *i* maps to S's master *i*: each of S's masters restores
  exactly one lost master's subscriptions and advertisements (RECOVERY(RT_SUB), one
  store owner to read).  Otherwise (N < M, or X held an adopted arc routed over another
  count) each of S's masters reads every lost master and keeps the types it now routes.
- The paper's RECOVERY(RT) (the routing table only) is S's routing master's own step
  here: the latencyMap lives in routing masters, so every match master that takes part
  restores subscriptions.

Nothing here does I/O: the router's driver (``routing.router_roles.RouterMaster``) provisions,
persists the plan (state kind ``adopted``) and sends the RECOVER messages it names.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology

__all__ = ["Adoption", "CapacityPlan", "Restore", "plan_takeover", "running_masters"]


@dataclass(frozen=True, slots=True)
class Restore:
    """RECOVERY(RT_SUB) to one of the successor's match masters: read ``owners`` (the
    departed match masters' store owners) and keep the arc's types routed to it."""

    master: RoleId
    owners: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Adoption:
    """A take-over in force, as the router persists it (state kind ``adopted``, key: the
    departed cluster): who took the arc, over how many masters it routes it, the arc."""

    by: str
    masters: int
    departed_masters: int
    arc: tuple[int, int]

    def to_document(self) -> dict[str, object]:
        return {
            "by": self.by,
            "masters": self.masters,
            "departed_masters": self.departed_masters,
            "arc": [str(self.arc[0]), str(self.arc[1])],  # 160-bit: as text, for every store
        }

    @classmethod
    def from_document(cls, doc: Mapping[str, Any]) -> Adoption:
        """The record read back; ``ValueError`` naming what is wrong with it."""
        try:
            start, end = (int(x) for x in doc["arc"])
            adoption = cls(
                str(doc["by"]), int(doc["masters"]), int(doc["departed_masters"]), (start, end)
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"take-over record {dict(doc)!r}: {exc!r}") from None
        if adoption.masters < 1:
            raise ValueError(f"take-over record {dict(doc)!r}: no masters")
        return adoption


@dataclass(frozen=True, slots=True)
class CapacityPlan:
    departed: str
    successor: str
    departed_masters: int  # N: the match masters the departed cluster ran
    departed_plain: bool  # it held no adopted arc: it routed its whole arc % N
    masters: int  # P: the adopted arc's types go to the successor's master SHA-1 % P
    added: tuple[RoleId, ...]  # match masters and their slaves beyond the topology's
    restores: tuple[Restore, ...]

    @property
    def match_broker_map(self) -> dict[str, str]:
        """Lost master -> the successor's master that restores it (when one to one)."""
        return {r.owners[0]: r.master.owner for r in self.restores if len(r.owners) == 1}

    @property
    def added_masters(self) -> tuple[RoleId, ...]:
        return tuple(r for r in self.added if not r.is_slave)

    def to_document(self, arc: tuple[int, int]) -> dict[str, object]:
        """What the router persists (an :class:`Adoption` of ``arc``)."""
        return Adoption(self.successor, self.masters, self.departed_masters, arc).to_document()


def running_masters(topology: PhoenixTopology, cluster: str, adopted: Iterable[int]) -> int:
    """How many match masters ``cluster`` runs: its topology's, or more while it holds
    arcs it took over (``adopted``: each one's P)."""
    return max([topology.cluster(cluster).match_masters, *adopted])


def plan_takeover(
    topology: PhoenixTopology,
    departed: str,
    successor: str,
    *,
    departed_masters: int,
    departed_plain: bool,
    can_add: bool,
) -> CapacityPlan:
    """The plan for ``successor`` taking over ``departed``'s arc.

    ``departed_masters``: N (``running_masters`` of the departed cluster);
    ``departed_plain``: it held no adopted arc (it routed its whole arc ``% N``);
    ``can_add``: a provisioner can start roles at the successor."""
    spec = topology.cluster(successor)
    own = spec.match_masters
    n = departed_masters
    if n < 1:
        raise ValueError(f"{departed} ran {n} match masters")
    p = max(n, own) if can_add else own
    added: list[RoleId] = []
    for i in range(own, p):
        master = RoleId.match(successor, i)
        added += [master, *master.slaves(spec)]
    lost = tuple(RoleId.match(departed, i).owner for i in range(n))
    one_to_one = departed_plain and p == n
    restores = tuple(
        Restore(RoleId.match(successor, j), (lost[j],) if one_to_one else lost) for j in range(p)
    )
    return CapacityPlan(departed, successor, n, departed_plain, p, tuple(added), restores)
