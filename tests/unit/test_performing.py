"""``performing``: the one performer of every Phoenix machine's effects (order, what a
performer returns performed next, ``here`` before the table, a refusal after the effects
before it, timers and sends fed back as the machine's inputs), and every effect type a
role's machines return has a performer in that role."""

from __future__ import annotations

import asyncio
import typing
from dataclasses import dataclass
from typing import Any

import pytest

from middleware.errors import DeadLetter
from middleware.phoenix.effects import After, Count, Refuse, Send, Sent, Signal
from middleware.phoenix.ids import RoleId
from middleware.routing.performing import Inputs, Performing


@dataclass(frozen=True)
class Ask:
    """An effect whose result goes back to the machine."""

    n: int


@dataclass(frozen=True)
class Note:
    text: str


class Recorder(Performing):
    """A performer that records what it did, in order (no I/O of its own)."""

    def __init__(self, failed_sends: set[int] | None = None) -> None:
        self.done: list[str] = []
        self.failed_sends = failed_sends or set()
        self.tasks: list[asyncio.Future[Any]] = []

    def count(self, outcome: str, n: int = 1) -> None:
        self.done.append(f"count {outcome} {n}")

    async def perform(self, effect: Send | Signal) -> Sent | None:
        await asyncio.sleep(0)  # a real await between effects
        number = int(effect.message)
        self.done.append(f"send {number}")
        if isinstance(effect, Send) and effect.then is not None:
            return Sent(effect.then, "down" if number in self.failed_sends else None)
        return None

    def _background(self, work: Any) -> None:
        self.tasks.append(asyncio.ensure_future(work))

    @property
    def performers(self) -> dict[type, Any]:
        return {**super().performers, Ask: self._ask, Note: lambda e: self.done.append(e.text)}

    async def _ask(self, effect: Ask) -> list[Any]:
        await asyncio.sleep(0)
        self.done.append(f"ask {effect.n}")
        return [Note(f"answer {effect.n}"), Count("answered")] if effect.n < 2 else []


ROLE = RoleId.router("A")


def test_effects_are_performed_in_order_and_answers_before_the_rest() -> None:
    role = Recorder()
    effects = [Count("a"), Ask(1), Send(ROLE, "7"), Ask(2), Note("last")]
    asyncio.run(role.enact(effects))
    assert role.done == [
        "count a 1",
        "ask 1",
        "answer 1",  # what the machine said on the result comes before the rest
        "count answered 1",
        "send 7",
        "ask 2",
        "last",
    ]


def test_here_comes_before_the_table_and_binds_the_input() -> None:
    role = Recorder()
    seen: list[str] = []
    here = {Note: lambda e: seen.append(f"bound {e.text}")}
    asyncio.run(role.enact([Note("x"), Count("c")], here=here))
    assert seen == ["bound x"]
    assert role.done == ["count c 1"]


def test_a_refusal_raises_after_the_effects_before_it_and_stops_the_rest() -> None:
    role = Recorder()
    with pytest.raises(DeadLetter, match="bad element"):
        asyncio.run(role.enact([Send(ROLE, "1"), Refuse("bad element"), Note("never")]))
    assert role.done == ["send 1"]


def test_an_effect_nobody_performs_is_a_programming_error() -> None:
    @dataclass(frozen=True)
    class Unknown:
        pass

    with pytest.raises(TypeError, match="performs no Unknown"):
        asyncio.run(Recorder().enact([Unknown()]))


def test_a_send_with_then_comes_back_as_the_machines_sent_input() -> None:
    role = Recorder(failed_sends={2})
    heard: list[tuple[Any, str | None]] = []

    def sent(effect: Send, result: Sent) -> list[Any]:
        heard.append((result.then, result.error))
        return [Note(f"after {effect.message}")]

    inputs = Inputs(sent=sent)
    effects = [Send(ROLE, "1", then="one"), Send(ROLE, "2", then="two"), Send(ROLE, "3")]
    asyncio.run(role.enact(effects, inputs))
    assert heard == [("one", None), ("two", "down")]  # a send without then: nothing back
    assert role.done == ["send 1", "after 1", "send 2", "after 2", "send 3"]


def test_a_timer_fires_the_machines_timer_input_with_its_key() -> None:
    role = Recorder()
    fired: list[Any] = []

    def timer(key: Any) -> list[Any]:
        fired.append(key)
        return [Note(f"fired {key}")]

    async def scenario() -> None:
        await role.enact([After(0.02, ("B", 3)), Note("set")], Inputs(timer=timer))
        assert fired == [] and role.done == ["set"]  # set, not waited for
        await asyncio.sleep(0.1)
        await asyncio.gather(*role.tasks)

    asyncio.run(scenario())
    assert fired == [("B", 3)]
    assert role.done == ["set", "fired ('B', 3)"]


def test_a_timer_without_a_timer_input_is_a_programming_error() -> None:
    with pytest.raises(TypeError, match="no timer input"):
        asyncio.run(Recorder().enact([After(1.0, "k")]))


def _types(union: Any) -> set[type]:
    return set(typing.get_args(union)) or {union}


def _role(cls: type, cluster: dict[str, object]) -> Any:
    from middleware.phoenix.protocol import PhoenixTopology
    from middleware.settings import Settings

    topology = PhoenixTopology.model_validate({"clusters": [cluster], "state_store": ":memory:"})
    kwargs: dict[str, Any] = {"slave": 1} if "Slave" in cls.__name__ else {}
    if cls.__name__ == "MatchSlave":
        kwargs["index"] = 0
    return cls(settings=Settings.load(), topology=topology, cluster=cluster["id"], **kwargs)


def test_every_effect_a_roles_machines_return_has_a_performer() -> None:
    """Each kind's machines (their ``Effect`` unions) against its performer table;
    ``After`` is the timer every machine may set, and the few types bound to the input
    being handled are performed by ``here`` where that input is handled (named)."""
    from middleware.recovery import fencing
    from middleware.routing import (
        copies,
        departures,
        dispatching,
        follower,
        forwarding,
        handback,
        joining,
        restoring,
        subscribing,
        supervision,
        takeover,
    )
    from middleware.routing.match_master import MatchMaster
    from middleware.routing.match_roles import MatchSlave
    from middleware.routing.router_roles import RouterMaster, RouterSlave

    bound = {  # performed by ``here`` in the handler named
        fencing.StepDown: "Master._rival",
        dispatching.MatchHere: "MatchMaster._on_publish",
        subscribing.Persist: "MatchMaster._subscribing",
        subscribing.Confirm: "MatchMaster._subscribing",
        restoring.Read: "RestoringMatcher._on_recover",
        restoring.Restore: "RestoringMatcher._on_recover",
        copies.Carry: "MatchBroker._deliver",
    }
    machines = {
        RouterMaster: [
            forwarding.Effect,
            departures.Effect,
            takeover.Effect,
            joining.Effect,
            handback.HandBackEffect,
            supervision.Effect,
            fencing.RivalOutcome,
        ],
        RouterSlave: [follower.Effect],
        MatchMaster: [
            subscribing.Effect,
            dispatching.Effect,
            restoring.Effect,
            copies.Effect,
            supervision.Effect,
            fencing.RivalOutcome,
        ],
        MatchSlave: [follower.Effect, copies.Effect],
    }
    for cls, unions in machines.items():
        role = _role(cls, {"id": "B"})
        returned = set().union(*(_types(u) for u in unions))
        missing = returned - set(role.performers) - set(bound) - {After, type(None)}
        assert not missing, f"{cls.__name__} performs none of {sorted(t.__name__ for t in missing)}"


def test_a_fencing_decision_of_nothing_to_do_performs_nothing() -> None:
    """``fencing.RivalOutcome`` may be None (a beat of its own reign, a rival not
    served yet): the master performs nothing and raises nothing."""
    from middleware.routing.router_roles import RouterMaster

    role = _role(RouterMaster, {"id": "B"})
    asyncio.run(role._rival(None, "B/router-slave-0"))
    assert not role.counters
