"""A master that was only frozen comes back after its slaves elected a successor: it
must step down, not split its cluster in two (issue #23, item 7), and the slave role it
steps down to is caught up and counts again: when the successor dies in turn, the old
master's process wins the next election and serves with the subscriptions it got back.

Real role processes, real SIGSTOP / SIGCONT / SIGKILL by PID, and the test's own counter:
every event it published (and the broker confirmed) is looked for in its subscriber
queue."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from tests.integration.phoenix_support import eventually
from tests.integration.test_phoenix_recovery import _deployment, _stream, _subscribe

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]


def _until(check, timeout: float, what: str) -> float:
    """When ``check`` came true (wall clock, to compare with the roles' logs)."""
    eventually(check, what, timeout, interval=0.02)
    return time.time()


MASTER = RoleId.match("B", 0)


def _b_with_two_match_slaves(settings, brokers, tmp_path: Path, name: str):
    """Clusters A and B, B's match master with two slaves (not started), an event type B
    owns and the subscriber queue's name."""
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 2}}
    )
    return event_type, topology, deployment, f"{name}.sub"


def test_a_frozen_master_that_comes_back_steps_down_and_serves_again_as_a_caught_up_slave(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    event_type, topology, deployment, queue = _b_with_two_match_slaves(
        settings, brokers, tmp_path, name
    )
    master, slave0, slave1 = MASTER, *MASTER.slaves(topology.cluster("B"))
    pids = deployment.up()
    frozen: dict[str, float] = {}
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))

        def thaw_once_replaced() -> None:
            frozen["replaced"] = _until(
                lambda: deployment.serves(slave0) == master, 10, f"{slave0} serving {master}"
            )
            time.sleep(0.3)  # the successor serves for a while beside the frozen one
            os.kill(pids[master], signal.SIGCONT)
            frozen["thawed"] = time.time()

        thawer = threading.Thread(target=thaw_once_replaced)

        def freeze() -> None:  # returns at once: events flow through the freeze
            os.kill(pids[master], signal.SIGSTOP)
            frozen["stopped"] = time.time()
            thawer.start()

        got, published, _ = asyncio.run(_stream(settings, topology, event_type, queue, freeze))
        thawer.join(15)
        assert "thawed" in frozen, "the frozen master was never replaced"
        # the old master's process is alive and serves the slave role its successor left
        _until(lambda: deployment.serves(master) == slave0, 10, f"old {master} stepping down")
        stepped_down = json.loads(deployment.status_file(master).read_text())["since"]
        assert pid_alive(pids[master]) and deployment.serves(slave0) == master
        missing = sorted(set(range(published)) - set(got))
        assert not missing, f"{len(missing)} events lost: {missing[:20]}"
        log = deployment.log_file(master).read_text()
        assert "fenced by" in log and f"stepping down to {slave0}" in log
        first = published

        # the successor dies: the old master's process, a slave again and caught up,
        # outranks slave-1 and serves the master with the subscription it got back
        got, published, killed_at = asyncio.run(
            _stream(
                settings,
                topology,
                event_type,
                queue,
                lambda: os.kill(pids[slave0], signal.SIGKILL),
                first,
            )
        )
        missing = sorted(set(range(first, published)) - set(got))
        assert not missing, f"after the second failure: {len(missing)} events lost: {missing[:20]}"
        assert deployment.serves(master) == master and not pid_alive(pids[slave0])
        assert deployment.serves(slave1) == slave1
        again = json.loads(deployment.status_file(master).read_text())["since"] - killed_at
        print(
            f"\nfrozen {frozen['replaced'] - frozen['stopped']:.2f} s until replaced, "
            f"thawed, serving as {slave0} {stepped_down - frozen['thawed']:.2f} s later; "
            f"{first} + {published - first} events, 0 lost, "
            f"{len(got) - len(set(got))} duplicates after the second failure, "
            f"which it served again {again:.2f} s after the kill"
        )
    finally:
        if pid_alive(pids[master]):
            os.kill(pids[master], signal.SIGCONT)
        deployment.down()


def test_dead_roles_are_replaced_by_the_provisioner_and_the_replacements_count(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """Issue #23, items 4 and 5: a promoted master's provisioner starts a process for
    the slave role it left, in the slot of the dead master; a killed slave is replaced in
    its own slot; each replacement is caught up, and when the promoted master dies too,
    the replacement (it outranks slave-1) takes over with the subscription: 0 lost."""
    event_type, topology, deployment, queue = _b_with_two_match_slaves(
        settings, brokers, tmp_path, name
    )
    master, slave0, slave1 = MASTER, *MASTER.slaves(topology.cluster("B"))
    first_pids = deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        got, published, _ = asyncio.run(
            _stream(settings, topology, event_type, queue, lambda: deployment.kill(master))
        )
        lost = sorted(set(range(published)) - set(got))
        assert not lost, f"{len(lost)} events lost: {lost[:20]}"
        assert deployment.serves(slave0) == master
        # the dead master's slot gets a new process, serving the slave role left vacant
        _until(
            lambda: pid_alive(deployment.pids()[master]) and deployment.serves(master) == slave0,
            30,
            f"a replacement for {slave0}",
        )
        assert deployment.pids()[master] != first_pids[master]
        promoted_log = deployment.log_file(slave0).read_text()
        # its death told by its lease (or, were the token lost with its node, by silence)
        assert (
            f"lease of {slave0} returned" in promoted_log or f"{slave0} silent for" in promoted_log
        )
        assert f"admitting {slave0}" in promoted_log

        # a killed slave is replaced in its own slot
        deployment.kill(slave1)
        _until(
            lambda: pid_alive(deployment.pids()[slave1]) and deployment.serves(slave1) == slave1,
            30,
            f"a replacement for {slave1}",
        )
        assert deployment.pids()[slave1] != first_pids[slave1]

        # the promoted master dies: the replacement of slave-0 wins and serves with the
        # subscription it was caught up with
        first = published
        got, published, _ = asyncio.run(
            _stream(
                settings,
                topology,
                event_type,
                queue,
                lambda: os.kill(first_pids[slave0], signal.SIGKILL),
                first,
            )
        )
        lost = sorted(set(range(first, published)) - set(got))
        assert not lost, f"after the second failure: {len(lost)} events lost: {lost[:20]}"
        assert deployment.serves(master) == master
    finally:
        pids = deployment.pids()
        deployment.down()
    assert not any(pid_alive(p) for p in pids.values())  # replacements stopped too


def test_the_winner_killed_while_it_takes_over_is_replaced_by_the_next_slave(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """Issue #23, "a master during an election": B's match master is SIGKILLed, and
    slave-0 is SIGKILLed the moment its log says it takes over (before it serves); the
    slaves left (slave-1) elect again and serve the master's role; nothing is lost."""
    event_type, topology, deployment, queue = _b_with_two_match_slaves(
        settings, brokers, tmp_path, name
    )
    master, slave0, slave1 = MASTER, *MASTER.slaves(topology.cluster("B"))
    pids = deployment.up()
    killed: dict[str, float] = {}
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))

        def kill_the_winner() -> None:
            log = deployment.log_file(slave0)
            start = log.stat().st_size
            _until(
                lambda: "taking over" in log.read_text(errors="replace")[start:],
                10,
                f"{slave0} taking over",
            )
            os.kill(pids[slave0], signal.SIGKILL)
            killed["winner"] = time.time()

        killer = threading.Thread(target=kill_the_winner)

        def kill_master() -> None:
            killer.start()  # watches slave-0's log from before the master's death
            os.kill(pids[master], signal.SIGKILL)
            killed["master"] = time.time()

        got, published, _ = asyncio.run(_stream(settings, topology, event_type, queue, kill_master))
        killer.join(15)
        assert "winner" in killed, "slave-0 never took over"
        missing = sorted(set(range(published)) - set(got))
        assert not missing, f"{len(missing)} events lost: {missing[:20]}"
        _until(lambda: deployment.serves(slave1) == master, 10, f"{slave1} serving {master}")
        since = json.loads(deployment.status_file(slave1).read_text())["since"]
        print(
            f"\nwinner killed {killed['winner'] - killed['master']:.2f} s after the master; "
            f"{slave1} serves {since - killed['master']:.2f} s after the master's kill; "
            f"{published} events, 0 lost, {len(got) - len(set(got))} duplicates"
        )
    finally:
        deployment.down()


def test_a_second_process_beating_as_one_slave_is_retired_and_nothing_is_lost(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """Issue #23, item 7 (races): a scheduler that cannot see a frozen slave (another
    host) starts a second process for its role. Here: slave-1 is SIGSTOPped, a second
    process for B/matcher-0-slave-1 is started by hand once the master counts slave-1 as
    silent, then the frozen one gets SIGCONT. The master tells the one it does not count
    as serving (the thawed one) to stop; it exits, the second one serves on; nothing is
    lost through it all."""
    event_type, topology, deployment, queue = _b_with_two_match_slaves(
        settings, brokers, tmp_path, name
    )
    master, _, slave1 = MASTER, *MASTER.slaves(topology.cluster("B"))
    pids = deployment.up()
    second: subprocess.Popen[bytes] | None = None
    second_status = tmp_path / "second.json"
    master_log = deployment.log_file(master)
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))

        def freeze_start_a_second_and_thaw() -> None:
            nonlocal second
            offset = master_log.stat().st_size
            os.kill(pids[slave1], signal.SIGSTOP)
            _until(
                lambda: f"{slave1} silent for" in master_log.read_text(errors="replace")[offset:],
                20,
                f"{master} counting {slave1} as silent",
            )
            argv = [sys.executable, "-m", "middleware.cli", "sidecar", "matcher"]
            argv += ["--cluster", "B", "--index", "0", "--role", "slave", "--slave", "1"]
            argv += ["--topology", str(deployment.topology_file)]
            argv += ["--status-file", str(second_status)]
            with (tmp_path / "second.log").open("ab") as out:
                second = subprocess.Popen(argv, env=deployment.env, stdout=out, stderr=out)
            _until(
                lambda: (
                    "served by another process now"
                    in master_log.read_text(errors="replace")[offset:]
                ),
                30,
                f"{master} counting the second process as {slave1}",
            )
            os.kill(pids[slave1], signal.SIGCONT)
            _until(lambda: not pid_alive(pids[slave1]), 20, f"the thawed {slave1} gone")

        failed: list[BaseException] = []

        def steps() -> None:
            try:
                freeze_start_a_second_and_thaw()
            except BaseException as exc:  # told after the stream
                failed.append(exc)

        runner = threading.Thread(target=steps, daemon=True)
        got, published, _ = asyncio.run(
            _stream(settings, topology, event_type, queue, runner.start, seconds=20.0)
        )
        runner.join(60)
        if failed:
            raise failed[0]
        lost = sorted(set(range(published)) - set(got))
        assert not lost, f"{len(lost)} events lost: {lost[:20]}"
        assert second is not None and second.poll() is None, "the second process stopped"
        thawed_log = deployment.log_file(slave1).read_text(errors="replace")
        assert f"{slave1}: retired by {master}" in thawed_log
        assert "a second process beats as" in master_log.read_text(errors="replace")
        assert json.loads(second_status.read_text())["serves"] == slave1.key
    finally:
        if pid_alive(pids[slave1]):
            os.kill(pids[slave1], signal.SIGCONT)
        deployment.down()
        if second is not None:
            second.terminate()
            second.wait(20)
