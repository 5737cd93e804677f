"""The master's supervision of its slaves (routing/supervision.py), driven with plain
numbers: process identity, second processes, replacement of a dead or silent slave."""

from __future__ import annotations

import ast
from pathlib import Path

from middleware.phoenix.effects import After
from middleware.routing.supervision import (
    DEAD_RETRIES_S,
    Check,
    Note,
    Provision,
    Retire,
    Supervision,
)


def machine(can_provision: bool = True) -> Supervision:
    return Supervision(replace_after_s=2.0, replace_retry_s=30.0, can_provision=can_provision)


def test_the_first_process_heard_serves_a_slave_and_a_second_one_is_told_to_stop_once_a_second():
    """A second process: the known one's queue is looked at first (``Check``); still
    there: the second is told to stop, at most once a second."""
    m = machine()
    assert m.beat(0, "p1", 0.0) == (True, [])
    assert m.beat(0, "p1", 0.1) == (True, [])
    serving, effects = m.beat(0, "p2", 0.2)
    assert not serving and effects == [Check(0, "p1", "p2")]
    effects = m.checked(0, "p1", "p2", known_there=True)
    assert Retire(0, "p2") in effects
    assert any(isinstance(e, Note) and "a second process" in e.text for e in effects)
    assert m.beat(0, "p2", 0.7) == (False, [])  # told already, less than a second ago
    assert m.beat(0, "p2", 1.3)[1] == [Check(0, "p1", "p2")]
    assert m.beat(1, None, 0.0) == (True, [])  # no process queue: nothing to tell apart


def test_a_process_restarted_after_a_clean_stop_serves_the_slave_at_its_next_beat():
    """The known process stopped cleanly (its lease handed back silently, its queue gone
    with its connection) and another beats as the slave before the master missed the
    first: it is not told to stop; its next beat makes it the one serving the slave."""
    m = machine()
    m.beat(0, "p1", 0.0)
    assert m.beat(0, "p2", 0.2) == (False, [Check(0, "p1", "p2")])
    said = m.checked(0, "p1", "p2", known_there=False)
    assert not any(isinstance(e, Retire) for e in said) and m.is_gone(0)
    serving, said = m.beat(0, "p2", 0.45)
    assert serving and [n.text for n in said if isinstance(n, Note)] == [
        "{slave} served by another process now"
    ]
    assert m.beat(0, "p1", 0.6)[1] == [Check(0, "p2", "p1")]  # now p1 would be the second


def test_a_look_answered_after_the_slave_changed_hands_does_nothing():
    m = machine()
    m.beat(0, "p1", 0.0)
    m.beat(0, "p2", 0.2)
    m.lease_returned(0)  # p1 died meanwhile
    m.beat(0, "p3", 0.3)  # and p3 serves the slave now
    assert m.checked(0, "p1", "p2", known_there=True) == []


def test_once_the_known_process_is_gone_the_next_one_heard_serves_the_slave():
    m = machine()
    m.beat(0, "p1", 0.0)
    effects = m.lease_returned(0)
    assert effects == [After(DEAD_RETRIES_S[0], 0)] and m.is_gone(0)
    serving, said = m.beat(0, "p2", 0.5)
    assert serving and [n.text for n in said if isinstance(n, Note)] == [
        "{slave} served by another process now"
    ]
    assert not m.is_gone(0)
    assert m.beat(0, "p1", 0.6)[0] is False  # the old one, back from the dead: a second


def test_a_dead_slave_is_replaced_on_a_schedule_until_one_starts():
    m = machine()
    m.beat(0, "p1", 0.0)
    assert m.lease_returned(0) == [After(0.0, 0)]
    assert m.timer(0, alive=False, now=1.0) == [Provision(0, "whose lease came back")]
    # the dying process still looked alive to the provisioner: asked again after a pause
    assert m.provisioned(0, started=False) == [After(DEAD_RETRIES_S[1], 0)]
    assert m.timer(0, alive=False, now=1.05) == [Provision(0, "whose lease came back")]
    assert m.provisioned(0, started=True) == []
    assert m.timer(0, alive=False, now=2.0) == []  # done: no more tries
    # within replace_retry_s the silence rule does not ask again
    assert m.silences({0: 5.0}, timeout_s=0.5, now=3.0) == []


def test_the_tries_for_a_dead_slave_end_and_the_silence_rule_takes_over():
    m = machine()
    m.lease_returned(0)
    effects = m.timer(0, alive=False, now=0.0)
    for _ in DEAD_RETRIES_S[1:]:
        assert effects == [Provision(0, "whose lease came back")]
        after = m.provisioned(0, started=False)
        assert len(after) == 1 and isinstance(after[0], After)
        effects = m.timer(0, alive=False, now=0.1)
    assert m.provisioned(0, started=False) == []  # the last try: given up
    assert m.silences({0: 5.0}, timeout_s=0.5, now=0.2) == [Provision(0, "silent for 5.0 s")]


def test_a_slave_heard_again_stops_the_tries():
    m = machine()
    m.lease_returned(0)
    assert m.timer(0, alive=True, now=0.0) == []
    assert m.provisioned(0, started=False) == []


def test_a_silent_slave_is_replaced_once_per_retry_period_and_not_without_a_provisioner():
    m = machine()
    m.beat(0, "p1", 0.0)
    assert m.silences({0: 1.0, 1: None}, timeout_s=0.5, now=1.0) == []  # under the rule
    assert m.silences({0: 2.5}, timeout_s=0.5, now=2.5) == [Provision(0, "silent for 2.5 s")]
    assert m.is_gone(0)
    assert m.silences({0: 3.0}, timeout_s=0.5, now=3.0) == []  # asked 0.5 s ago
    assert m.silences({0: 40.0}, timeout_s=0.5, now=40.0) == [Provision(0, "silent for 40.0 s")]
    m.heard(0)
    assert m.silences({0: 41.0}, timeout_s=0.5, now=41.0) == [Provision(0, "silent for 41.0 s")]
    assert machine(can_provision=False).silences({0: 9.0}, timeout_s=0.5, now=9.0) == []
    # the detector's timeout above replace_after_s: it decides
    assert machine().silences({0: 2.5}, timeout_s=3.0, now=2.5) == []


def test_the_machine_does_no_io() -> None:
    """No asyncio, threads, clock, transport or store: it is fed and returns effects."""
    source = Path(__file__).parents[2] / "middleware" / "routing" / "supervision.py"
    tree = ast.parse(source.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (
            node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")]
        )
    }
    assert imported <= {"__future__", "collections", "dataclasses", "phoenix"}, imported  # effects
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef | ast.Await)]


def test_a_master_checks_its_slaves_silences_when_one_can_pass_the_bound() -> None:
    """The driver waits as long as ``next_check_in`` says: half the bound while every
    slave beats, to the moment the first would pass it, a beat interval while one is
    past it; and the check then asks for its replacement at once."""
    m = machine()
    assert m.next_check_in({}, 0.5, 0.2) == 1.0  # nobody watched: half the bound (2 s)
    assert m.next_check_in({0: 0.1, 1: 0.2}, 0.5, 0.2) == 1.0  # both beat
    wait = m.next_check_in({0: 0.1, 1: 1.5}, 0.5, 0.2)  # slave 1 silent for 1.5 s
    assert abs(wait - 0.501) < 1e-9
    assert m.silences({0: 0.1, 1: 1.5 + wait}, 0.5, 10.0) == [Provision(1, "silent for 2.0 s")]
    assert m.next_check_in({0: 0.1, 1: 2.5}, 0.5, 0.2) == 0.2  # past it: every interval
    assert m.next_check_in({0: 0.1}, 3.0, 0.2) == 1.5  # a longer detection timeout rules
    assert machine(can_provision=False).next_check_in({0: 5.0}, 0.5, 0.2) == 1.0
