"""``dispatching``: a match master's choice for each event (drop, here, or a slave)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from middleware.phoenix.effects import Box, Count, Send
from middleware.phoenix.ids import RoleId
from middleware.recovery.fencing import Reign
from middleware.routing.dispatching import (
    Drop,
    MatchHere,
    from_older_reign,
    matched_elsewhere,
    on_publish,
)
from middleware.routing.timeliness import Dispatch, QueuePredictor


@dataclass(frozen=True)
class _Event:  # what the choice reads of a PUBLISH, and how it signs one it dispatches
    priority: int = 3
    reign: tuple[int, int] | None = None

    def model_copy(self, *, update: dict[str, Any]) -> _Event:
        return replace(self, **update)


EVENT = _Event()
MASTER = RoleId.match("B", 1)


def _to(slave: int, reign: tuple[int, int] = (0, 0)) -> Send:
    """The event to ``slave``'s inbox, at its priority, signed with the master's reign."""
    signed = replace(EVENT, reign=reign)
    return Send(RoleId.match_slave("B", 1, slave), signed, box=Box.INBOX, priority=3)


def _publish(
    dispatch: Dispatch,
    *,
    stale: bool = False,
    local: bool = False,
    inner: bool = True,
    blind: str = "round_robin",
    live: tuple[int, ...] = (0, 1),
    owing: tuple[int, ...] = (),
    reign: tuple[int, int] = (0, 0),
) -> list:
    return on_publish(
        EVENT,
        MASTER,
        stale=stale,
        local=local,
        dispatch=dispatch,
        predictor=QueuePredictor(window_s=1.0),
        live=live,
        now=10.0,
        inner=inner,
        blind=blind,
        owing=owing,
        reign=reign,
    )


def test_an_event_matched_elsewhere_while_the_cluster_was_out_is_dropped() -> None:
    assert matched_elsewhere("B", 100.0, 99.0, ["A", "B"])  # entered at A before B left
    assert not matched_elsewhere("B", 100.0, 101.0, ["A", "B"])  # after the leave
    assert not matched_elsewhere("B", 100.0, 99.0, ["B"])  # entered here: never rerouted
    assert not matched_elsewhere("B", None, 99.0, ["A", "B"])  # never left
    effects = _publish(Dispatch(), stale=True)
    assert effects[0] == Count("dropped_after_rejoin") and isinstance(effects[1], Drop)


def test_a_type_its_slaves_do_not_hold_is_matched_here() -> None:
    dispatch = Dispatch()
    for j in (0, 1):
        dispatch.reported(j, 0.0, 1000.0, 10.0)
    assert _publish(dispatch, local=True, inner=False) == [MatchHere()]


def test_inner_keeps_an_event_when_nothing_waits_here_and_blind_takes_turns() -> None:
    dispatch = Dispatch()
    for j in (0, 1):
        dispatch.reported(j, 0.0, 1000.0, 10.0)
    assert _publish(dispatch) == [MatchHere()]  # nothing queued here: no broker is sooner
    turns = [_publish(dispatch, inner=False) for _ in range(3)]
    assert {tuple(t) for t in turns} == {
        (MatchHere(),),
        (Count("dispatched"), _to(0)),
        (Count("dispatched"), _to(1)),
    }  # the master and each live slave once in three
    assert _publish(dispatch, inner=False, blind="master") == [MatchHere()]
    assert _publish(Dispatch(), inner=False, live=()) == [MatchHere()]  # no slave reports


def test_a_slave_that_has_not_acknowledged_a_subscription_of_the_type_gets_no_event() -> None:
    """A subscription handed over at a join comes with the arc's events: its replica
    may still be behind them in a slave's inbox, which would match them without it."""
    dispatch = Dispatch()
    for j in (0, 1):
        dispatch.reported(j, 0.0, 1000.0, 10.0)
    turns = {tuple(_publish(dispatch, inner=False, owing=(1,))) for _ in range(4)}
    assert turns == {(MatchHere(),), (Count("dispatched"), _to(0))}
    assert _publish(dispatch, inner=False, owing=(0, 1)) == [MatchHere()]


def test_a_slave_passes_on_what_a_master_of_an_older_reign_dispatched() -> None:
    """A master stopped and resumed before its fence reached it sends what it held with
    its old reign: the slave, which trusts the successor's, hands it to the master that
    reigns now (a tombstone that master wrote would otherwise lose it)."""
    dispatch = Dispatch()
    for j in (0, 1):
        dispatch.reported(j, 0.0, 1000.0, 10.0)
    signed = {tuple(_publish(dispatch, inner=False, live=(0,), reign=(2, -1))) for _ in range(2)}
    assert (Count("dispatched"), _to(0, (2, -1))) in signed
    assert from_older_reign((0, 0), Reign(1, -1))  # the master as started, superseded
    assert from_older_reign((1, -2), Reign(1, -1))  # the same epoch won by a lower slave
    assert not from_older_reign((1, -1), Reign(1, -1))
    assert not from_older_reign((2, -2), Reign(1, -1))  # newer than it knows: its own
    assert not from_older_reign(None, Reign(3, -1))  # not dispatched (a pass-on)
