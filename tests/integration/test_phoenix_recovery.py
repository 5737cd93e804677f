"""Phoenix recovers from a killed master by itself (issue #23, first part): its slaves
stop hearing its beats, elect with the bully algorithm, and the winner's process serves
the master's role; a steady stream of events goes on and nothing is lost.

Real role processes, a real SIGKILL, and the test's own counters: every event it
published (and the broker confirmed) is looked for in its subscriber queue."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.routing import PhoenixDeployment
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import deployment as phoenix
from tests.integration.phoenix_support import event, owned_by, take, until_delivered, write_topology

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
RATE = 100  # events per second, through the kill
SECONDS = 4.0


async def _stream(
    settings, topology, event_type: str, queue: str, kill, first: int = 0, seconds: float = SECONDS
) -> tuple[list[int], int, float]:
    """Publish RATE events/s at A for ``seconds``, calling ``kill()`` after one second;
    return what the subscriber queue got, how many were published, and the kill time."""
    async with AsyncClient(settings=settings) as client:
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        published, killed_at = first, 0.0
        start = time.monotonic()
        while time.monotonic() - start < seconds:
            if not killed_at and time.monotonic() - start >= 1.0:
                killed_at = time.time()
                await asyncio.to_thread(kill)
            await at_a.publish({"event_type": event_type, "attributes": {"n": published}})
            published += 1
            await asyncio.sleep(1 / RATE)
        got: list[int] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(set(got)) < published - first:
            while (d := await client.get(queue)) is not None:
                got.append(json.loads(d.body)["event"]["attributes"]["n"])
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # late duplicates show here
        while (d := await client.get(queue)) is not None:
            got.append(json.loads(d.body)["event"]["attributes"]["n"])
        return [n for n in got if n >= first], published, killed_at


def _deployment(
    settings,
    brokers,
    tmp_path: Path,
    name: str,
    clusters: dict[str, dict[str, object]],
    fields: dict[str, object] | None = None,
) -> tuple[str, PhoenixTopology, PhoenixDeployment]:
    """An event type cluster B owns, the topology of ``clusters`` (and top-level
    ``fields``) and its deployment over the test brokers (not started)."""
    event_type = owned_by(list(clusters), "B", "flow")
    topology_file, topology = write_topology(tmp_path, name, clusters, fields)
    deployment = phoenix(topology_file, tmp_path / "state", settings, ",".join(brokers.urls))
    return event_type, topology, deployment


async def _subscribe(settings, topology, event_type: str, queue: str) -> None:
    """Subscribe at A (filter ``n >= -1``) and wait until a probe reaches the queue."""
    async with AsyncClient(settings=settings) as client:
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        await at_a.subscribe(event_type, [("n", ">=", -1)], 1, queue)
        publish = lambda k: at_a.publish(event(event_type, n=-1))  # noqa: E731
        await until_delivered(client, queue, publish, "probe")  # the path is live end to end
        await take(client, queue)


def _scrape(deployment: PhoenixDeployment, process: RoleId) -> str:
    """The Prometheus page of the process started as ``process`` (its log names the port)."""
    found = re.findall(r"metrics: (http://\S+/metrics)", deployment.log_file(process).read_text())
    assert found, f"{process.key} logged no metrics address"
    with urllib.request.urlopen(found[-1], timeout=10) as page:
        return page.read().decode()


def _observed(page: str, metric: str, **labels: str) -> float:
    """The value of ``metric`` with these labels on a Prometheus page (0 if absent)."""
    total = 0.0
    for line in page.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_killed_masters_are_replaced_by_an_elected_slave_and_nothing_is_lost(
    settings, brokers, tmp_path: Path, name: str, monkeypatch
) -> None:
    """... and the processes say so in their metrics (every role serves them on a port
    of its own here): the detection observed by a slave, the election and the recovery
    by the winner for the kind it took over, one take-over counted."""
    monkeypatch.setenv("QOSMQ_METRICS_PORT", "0")  # the role processes' environment
    event_type, topology, deployment = _deployment(
        settings, brokers, tmp_path, name, {"A": {}, "B": {"match_slaves": 2, "routing_slaves": 2}}
    )
    queue = f"{name}.sub"
    pids = deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        report = []
        first = 0
        for master in (RoleId.match("B", 0), RoleId.router("B")):
            successor = master.slaves(topology.cluster("B"))[0]  # the highest ranked
            got, published, killed_at = asyncio.run(
                _stream(
                    settings,
                    topology,
                    event_type,
                    queue,
                    lambda m=master: deployment.kill(m),
                    first,
                )
            )
            missing = sorted(set(range(first, published)) - set(got))
            assert not missing, f"{master}: {len(missing)} events lost: {missing[:20]}"
            assert deployment.serves(successor) == master  # the election's winner serves it
            assert pid_alive(pids[successor]) and not pid_alive(pids[master])
            page = _scrape(deployment, successor)
            kind = master.kind.value
            # the slave that detected it may be either (a lease reaches one of them)
            detected = sum(
                _observed(
                    _scrape(deployment, s),
                    "qosmq_phoenix_recovery_seconds_count",
                    kind=kind,
                    phase="detection",
                )
                for s in master.slaves(topology.cluster("B"))
            )
            assert detected >= 1, f"no detection of {master} observed by its slaves"
            for phase in ("election", "recovery"):  # the winner's own
                count = _observed(
                    page, "qosmq_phoenix_recovery_seconds_count", kind=kind, phase=phase
                )
                assert count >= 1, f"{successor.key}: no {phase} of a {kind} observed"
            takeovers = _observed(page, "qosmq_phoenix_events_total", outcome="takeovers")
            assert takeovers == 1, page
            since = json.loads(deployment.status_file(successor).read_text())["since"]
            report.append(
                f"{master}: {published - first} events, 0 lost, "
                f"{len(got) - len(set(got))} duplicates, served again "
                f"{since - killed_at:.2f} s after the kill"
            )
            first = published
        print("\n" + "\n".join(report))
    finally:
        deployment.down()


def test_the_recovery_benchmark_kills_each_kind_and_counts_what_it_saw(
    brokers, tmp_path: Path
) -> None:
    """``qosmq bench phoenix --experiment recovery``, one kill of a master and one of a
    slave on the 18-process deployment: the rows say what was killed, who serves it
    now, the times read from the processes' status files and logs, and the test
    harness's own count of lost events (none; the command fails if any)."""
    out = tmp_path / "recovery.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "middleware.cli",
            "bench",
            "phoenix",
            "--experiment",
            "recovery",
            "--repeats",
            "1",
            "--kinds",
            "match,match_slave",
            "--rates",
            "100",
            "--stream",
            "4",
            "--work-dir",
            str(tmp_path / "work"),
            "--out",
            str(out),
        ],
        env={**os.environ, "QOSMQ_AMQP_URLS": ",".join(brokers.urls)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    rows = {r["kind"]: r for r in report["rows"]}
    assert set(rows) == {"match", "match_slave"}
    assert rows["match"]["served_by"] == "B/matcher-0-slave-0"  # the election's winner
    assert rows["match_slave"]["served_by"] == "B/matcher-0-slave-1"  # replaced in its slot
    for row in rows.values():
        assert row["lost"] == 0 and row["events"] > 300
        assert 0 < row["detection_s"] < row["recovery_s"]
    assert "paper / recovery_p50" in result.stdout
    assert report["run"]["retired"] == 0  # a kill leaves no second process to retire
    assert not any(pid_alive(int(p)) for p in re.findall(r"pid (\d+)", result.stdout))


def test_a_killed_master_is_known_by_its_lease_before_any_beat_is_missed(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """Beats that would take 5 s to tell (50 misses of 0.1 s): the SIGKILLed match
    master's connection closes, the broker hands its lease token to a slave, and the
    slaves elect at once; the winner serves long before the beats could have said it,
    and every event published through the kill arrives."""
    event_type, topology, deployment = _deployment(
        settings,
        brokers,
        tmp_path,
        name,
        {"A": {}, "B": {"match_slaves": 2}},
        {"heartbeat_misses": 50},
    )
    queue, master = f"{name}.sub", RoleId.match("B", 0)
    successor = master.slaves(topology.cluster("B"))[0]
    pids = deployment.up()
    try:
        asyncio.run(_subscribe(settings, topology, event_type, queue))
        got, published, killed_at = asyncio.run(
            _stream(settings, topology, event_type, queue, lambda: deployment.kill(master))
        )
        assert sorted(set(got)) == list(range(published))
        assert deployment.serves(successor) == master and not pid_alive(pids[master])
        since = json.loads(deployment.status_file(successor).read_text())["since"]
        assert since - killed_at < 50 * 0.1  # before the beats' timeout
        logs = "".join(
            deployment.log_file(s).read_text() for s in master.slaves(topology.cluster("B"))
        )
        assert f"lease of {master} returned" in logs
        assert "no beat from" not in logs
    finally:
        deployment.down()


def test_a_slave_stopped_cleanly_and_started_at_once_serves_and_is_not_retired(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """A clean stop hands the lease back silently, so the master has not missed the
    stopped process when the new one beats as the same slave: it looks at the known
    process's queue (gone with its connection) and takes the new process as the one
    serving the slave instead of telling it to stop as a second one.  Counted from
    outside: the started process is alive and serving seconds later, the master's log
    tells no second process to stop and starts no replacement."""
    # the master's window for a silent slave (``replace_after_s``) is 4 s here, not 2:
    # on a slow machine (the fresh-clone run of adbdf39) every one of 8 restarts beat
    # only after 2 s, and the master took the slave as silent each time (another path)
    window_s = 4.0
    _, _, deployment = _deployment(
        settings,
        brokers,
        tmp_path,
        name,
        {"A": {}, "B": {"match_slaves": 1}},
        {"replace_after_s": window_s},
    )
    slave = RoleId.match_slave("B", 0, 0)
    deployment.up()
    master_log = deployment.log_file(RoleId.match("B", 0))
    try:
        # each restart meant to land inside the master's detection window; on a slow
        # machine a new process may beat only after it (then the master took the slave
        # as silent, another path): restart again, up to 8 times, until 3 restarts were
        # made and at least one landed inside it
        for restart in range(8):
            stopped = deployment.stop(slave)
            started = deployment.start(slave)
            time.sleep(window_s + 1.0)  # beyond the window (``replace_after_s``)
            assert pid_alive(started) and not pid_alive(stopped)
            assert deployment.serves(slave) == slave
            if restart >= 2 and "ended cleanly" in master_log.read_text():
                break
        log = master_log.read_text()
        assert "a second process beats as" not in log
        assert "replacement started" not in log
        assert log.count("ended cleanly") >= 1, log[-2000:]
    finally:
        deployment.down()
