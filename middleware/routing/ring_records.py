"""What a routing master records beside the ring's leaves and joins, in the same ``ring``
documents (driver helpers; call them in a thread): its cluster's join hold and the
hand-backs it starts, each while it is open, so that a router elected or restarted
meanwhile resumes them (``joining.JoinHold``, ``handback.HandBack``)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from .handback import OpenRound
from .replicas import live
from .store import StateStore, handback_key, hold_key, ring_owner

__all__ = ["RingRecords", "hold_open", "open_hand_backs"]


class RingRecords:
    """The records of one routing master's cluster in ``prefix``'s ring documents."""

    def __init__(self, store: StateStore, prefix: str) -> None:
        self.store, self.owner = store, ring_owner(prefix)

    def hold(self, cluster: str, state: str) -> None:
        """``cluster``'s join hold is "holding" or "released"."""
        document = {"state": state, "at": time.time()}
        self.store.save(self.owner, "ring", hold_key(cluster), document, time.time_ns())

    def hand_back(self, joiner: str, round_: OpenRound | None) -> None:
        """The hand-back of ``joiner``'s arc started (``round_``) or ended (None)."""
        document = {"state": "done", "at": time.time()} if round_ is None else round_.to_document()
        self.store.save(self.owner, "ring", handback_key(joiner), document, time.time_ns())


def hold_open(records: Mapping[str, tuple[int, Any]], cluster: str) -> bool:
    """Whether a router of ``cluster`` held for its join and did not let go."""
    document = live(records).get(hold_key(cluster), (0, None))[1]
    return isinstance(document, dict) and document.get("state") == "holding"


def open_hand_backs(
    records: Mapping[str, tuple[int, Any]], joiners: Iterable[str], by: str
) -> tuple[dict[str, OpenRound], list[str]]:
    """The hand-backs ``by``'s routers started and did not end, by joiner (of
    ``joiners``: the ring's clusters now), from the ``ring`` records; why any record
    was left out."""
    rounds, refused, current = {}, [], live(records)
    for joiner in joiners:
        try:
            round_ = OpenRound.from_document(current.get(handback_key(joiner), (0, None))[1])
        except ValueError as exc:
            refused.append(str(exc))
            continue
        if round_ is not None and round_.by == by:
            rounds[joiner] = round_
    return rounds, refused
