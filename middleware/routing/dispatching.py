"""A match master's choice for each event it is sent, without I/O: drop it (matched
elsewhere while this cluster was out of the ring), match it here, or dispatch it to one
of its slaves (the paper's predicted-T choice over the slaves' load reports, or the
blind choice when ``inner`` is off).

The driver (``match_master.MatchMaster``) gives it the event, the live slaves and the
time, and performs what it returns: :class:`Drop` (nothing is sent; the first one is
said in the log), :class:`MatchHere`, a ``Send`` of the event to the chosen slave's
inbox (then it tells ``Dispatch.dispatched`` how long the send took), and ``Count``.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..phoenix.effects import Box, Count, Send
from ..phoenix.ids import RoleId
from ..recovery.fencing import Reign
from .timeliness import Dispatch, QueuePredictor

__all__ = ["Drop", "Effect", "MatchHere", "matched_elsewhere", "on_publish"]


@dataclass(frozen=True, slots=True)
class Drop:
    """Drop the event: ``why``."""

    why: str


@dataclass(frozen=True, slots=True)
class MatchHere:
    """Match the event at this master (no slave is chosen, or its slaves do not hold the
    type's subscriptions)."""


Effect = Drop | MatchHere | Send | Count


def matched_elsewhere(
    cluster: str, left_at: float | None, entered_at: float | None, hops: Sequence[str]
) -> bool:
    """An event from before this cluster left (``left_at``), that entered at another
    cluster: its entry router routed it again when this one left, and the successor
    matched it."""
    return (
        left_at is not None
        and entered_at is not None
        and entered_at < left_at
        and bool(hops)
        and hops[0] != cluster
    )


def on_publish(
    message: Any,
    master: RoleId,
    *,
    stale: bool,
    local: bool,
    dispatch: Dispatch,
    predictor: QueuePredictor,
    live: Iterable[int],
    now: float,
    inner: bool,
    blind: str,
    owing: Collection[int] = (),
    reign: tuple[int, int] = (0, 0),
) -> list[Effect]:
    """One event (``message``, a PUBLISH) at the match master ``master``.  ``stale``:
    :func:`matched_elsewhere`; ``local``: its type is one the slaves do not hold (a
    take-over's, indexed here only); ``owing``: the slaves that have not acknowledged a
    subscription of its type yet (its replica may still be behind this event in their
    inbox: a subscription handed over at a join came with the arc's events), not
    dispatched to; ``reign``: the master's, on what it dispatches (``from_older_reign``)."""
    if stale:
        return [Count("dropped_after_rejoin"), Drop("matched by the successor while left")]
    if local:
        return [MatchHere()]
    if owing:
        live = [slave for slave in live if slave not in owing]
    target = dispatch.choose(predictor, live, now) if inner else dispatch.choose_blind(live, blind)
    if target is None:
        return [MatchHere()]
    slave = RoleId.match_slave(master.cluster, master.index, target)
    signed = message.model_copy(update={"reign": reign})
    return [Count("dispatched"), Send(slave, signed, box=Box.INBOX, priority=message.priority)]


def from_older_reign(sent_by: tuple[int, int] | None, trusted: Reign) -> bool:
    """An event a master dispatched to this slave under a reign older than the one the
    slave trusts (that master was stopped and resumed, and sent what it held before its
    fence reached it): the master reigning now is to handle it, with its own state."""
    return sent_by is not None and Reign(*sent_by) < trusted
