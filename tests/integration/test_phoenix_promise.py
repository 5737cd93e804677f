"""Issue #23's promise, on the paper's deployment: 3 clusters of 1 routing master, 2
routing slaves, 1 match master and 2 match slaves (18 role processes), events published
at A and at C. In one stream, one after the other: SIGKILL of B's match master; of the
process the provisioner starts for the slave role the winner left, the moment its
catch-up begins (the master logs its admission and sends it the whole table); of one of
B's routing slaves; of B's routing master.

Counted by the test itself, not by the roles: every event whose publish the broker
confirmed reaches the three subscribers at A (one with broker confirms, read by the test;
two with ``confirm="e2e"``, one on each client face, asyncio and pika, whose handlers the
test counts), and neither e2e handler is given an event twice. Afterwards one live
process serves each of B's roles, and the replacement killed during its catch-up was
replaced again."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from middleware.routing.client import PhoenixClient
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import (
    deployment as phoenix,
)
from tests.integration.phoenix_support import (
    event,
    eventually,
    eventually_async,
    owned_by,
    sync_e2e_subscriber,
    take,
    write_topology,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]

CLUSTERS = {c: {"routing_slaves": 2, "match_slaves": 2} for c in "ABC"}
RATE = 100  # events per second, at A and C alternately
SECONDS = 12.0
TABLE = 300  # subscriptions that match nothing: a catch-up that takes a while


@dataclass
class Run:
    published: int = 0
    handled: list[int] = field(default_factory=list)  # what the e2e handler was given
    handled_sync: list[int] = field(default_factory=list)  # the sync face's e2e handler
    got: list[int] = field(default_factory=list)  # what the broker-confirm queue held
    kills: dict[str, float] = field(default_factory=dict)  # what, when (after the start)


def _kill_during_catch_up(deployment, run: Run, start: float) -> None:
    """B's match master is killed; its slave-0 wins and its provisioner starts a process
    for the slave role it left (in the dead master's slot): kill that process the moment
    the promoted master logs its admission (the whole table on its way to it)."""
    master = RoleId.match("B", 0)
    slave0 = master.slaves(deployment.topology.cluster("B"))[0]
    log = deployment.log_file(slave0)  # the winner's process writes here
    offset = log.stat().st_size
    deployment.kill(master)
    run.kills["match master"] = time.monotonic() - start
    eventually(
        lambda: f"admitting {slave0}" in log.read_text(errors="replace")[offset:],
        f"{slave0} admitted by the promoted master",
        30,
        interval=0.005,
    )
    os.kill(deployment.pids()[master], signal.SIGKILL)  # its slot's new process
    run.kills["slave-0 replacement in catch-up"] = time.monotonic() - start


async def _scenario(settings, topology, deployment, event_type: str, name: str) -> Run:
    run = Run()
    broker_queue, e2e_queue = f"{name}.broker", f"{name}.e2e"
    sync_queue = f"{name}.e2e-sync"
    stop = threading.Event()
    async with AsyncClient(settings=settings) as client:
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        for k in range(TABLE):
            await at_a.subscribe(event_type, [("n", "=", -10 - k)], 1, f"{name}.none")
        await at_a.subscribe(event_type, [("n", ">=", -1)], 1, broker_queue)
        await at_a.subscribe(event_type, [("n", ">=", -1)], 1, e2e_queue, confirm="e2e")
        await at_a.subscribe(event_type, [("n", ">=", -1)], 1, sync_queue, confirm="e2e")
        sync = threading.Thread(
            target=sync_e2e_subscriber,
            args=(settings, topology, sync_queue, run.handled_sync, stop),
            daemon=True,
        )
        sync.start()

        async def handler(ev, message) -> None:
            run.handled.append(ev.attributes["n"])

        await at_a.consume(e2e_queue, handler, e2e=True)

        async def probed() -> bool:  # both paths live end to end
            await at_c.publish(event(event_type, n=-1))
            await asyncio.sleep(0.3)
            run.got += [m["event"]["attributes"]["n"] for m in await take(client, broker_queue)]
            return -1 in run.handled and -1 in run.got and -1 in run.handled_sync

        await eventually_async(probed, "a probe through the three subscriptions", 90, interval=0)
        await asyncio.sleep(0.5)
        run.handled.clear()
        run.handled_sync.clear()
        await take(client, broker_queue)
        run.got.clear()

        start = time.monotonic()
        killers = {
            1.0: lambda: _kill_during_catch_up(deployment, run, start),
            6.0: lambda: deployment.kill(RoleId.router_slave("B", 1)),
            9.0: lambda: deployment.kill(RoleId.router("B")),
        }
        threads: list[threading.Thread] = []
        while (now := time.monotonic() - start) < SECONDS:
            for at in [t for t in killers if now >= t]:
                kill = killers.pop(at)
                thread = threading.Thread(target=kill, daemon=True)
                thread.start()
                threads.append(thread)
                run.kills.setdefault(f"kill at {at:.0f} s", now)
            publisher = at_a if run.published % 2 == 0 else at_c
            await publisher.publish(event(event_type, n=run.published))
            run.published += 1
            await asyncio.sleep(1 / RATE)
        for thread in threads:
            await asyncio.to_thread(thread.join, 60)

        async def all_there() -> bool:
            run.got += [m["event"]["attributes"]["n"] for m in await take(client, broker_queue)]
            wanted = set(range(run.published))
            return (
                wanted <= set(run.got)
                and wanted <= set(run.handled)
                and wanted <= set(run.handled_sync)
            )

        await eventually_async(all_there, "every event at the three subscribers", 60, strict=False)
        await asyncio.sleep(2.0)  # late duplicates show here
        await all_there()
        stop.set()
        await asyncio.to_thread(sync.join, 10)
        await at_a.close()
    return run


def test_no_event_is_lost_and_e2e_sees_none_twice_through_four_kills(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    event_type = owned_by(list(CLUSTERS), "B", "promise")
    topology_file, topology = write_topology(tmp_path, name, CLUSTERS)
    deployment = phoenix(topology_file, tmp_path / "state", settings, ",".join(brokers.urls))
    deployment.up()
    try:
        run = asyncio.run(_scenario(settings, topology, deployment, event_type, name))
        wanted = set(range(run.published))
        lost_broker = sorted(wanted - set(run.got))
        lost_e2e = sorted(wanted - set(run.handled))
        assert not lost_broker, f"{len(lost_broker)} lost (broker confirms): {lost_broker[:20]}"
        assert not lost_e2e, f"{len(lost_e2e)} lost (e2e): {lost_e2e[:20]}"
        lost_sync = sorted(wanted - set(run.handled_sync))
        assert not lost_sync, f"{len(lost_sync)} lost (e2e, sync face): {lost_sync[:20]}"
        for face, handled in (("asyncio", run.handled), ("sync", run.handled_sync)):
            twice = sorted({n for n in handled if handled.count(n) > 1})
            assert not twice, f"the {face} e2e handler was given {len(twice)} twice: {twice[:20]}"
        assert "slave-0 replacement in catch-up" in run.kills, run.kills

        # one live process serves each of B's roles (the replacement killed in its
        # catch-up replaced again), none serves a role twice
        spec = topology.cluster("B")
        roles = [RoleId.router("B"), RoleId.match("B", 0)]
        roles += [s for r in list(roles) for s in r.slaves(spec)]

        def served_once() -> bool:
            pids = deployment.pids()
            serving = [deployment.serves(s) for s, p in pids.items() if s.cluster == "B"]
            alive = all(pid_alive(p) for s, p in pids.items() if s.cluster == "B")
            return alive and sorted(map(str, serving)) == sorted(map(str, roles))

        eventually(served_once, "each of B's roles served by one live process", 30)
        duplicates = len(run.got) - len(set(run.got))
        print(
            f"\n{run.published} events at A and C, kills at {run.kills}: 0 lost at any "
            f"subscriber, 0 twice at the e2e ones, {duplicates} duplicates at the broker one"
        )
    finally:
        deployment.down()
