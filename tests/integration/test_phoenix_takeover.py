"""A role process switches role at run time (issue #22 item 4): a match slave told to take
over serves its master's inbox with the tables it holds, in the same process.

Real processes (``PhoenixDeployment``, the API ``qosmq phoenix`` is made of), a real
SIGKILL of the master, counts kept by the test itself (what its subscriber queue
received, what the shared store holds)."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest

from middleware.localcluster.manager import pid_alive
from middleware.phoenix.ids import RoleId
from middleware.routing import ChordRing, PhoenixDeployment
from middleware.routing.client import PhoenixClient
from middleware.routing.replicas import live
from middleware.routing.store import open_store
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import (
    attribute,
    cli,
    collect,
    event,
    eventually,
    until_delivered,
    write_topology,
)
from tests.integration.phoenix_support import deployment as phoenix

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
EVENTS = 200


def _slow_detection(topology_file: Path) -> None:
    """The operator's take-over, not the slaves' election (which would win first: see
    test_phoenix_recovery.py): detection after 60 s of silence, and no leases (which
    would tell the slaves of the SIGKILL at once)."""
    text = topology_file.read_text()
    topology_file.write_text(
        text.replace(
            "[[cluster]]",
            "heartbeat_misses = 100\nheartbeat_interval_s = 0.6\nleases = false\n[[cluster]]",
            1,
        )
    )


def _b_owned(tmp_path: Path, name: str, b: dict) -> tuple[str, Path, object]:
    """An event type B owns, and a topology of A and B (``b``: B's fields) whose slaves
    detect slowly, so that the operator's take-over is what switches."""
    ring = ChordRing(["A", "B"])
    event_type = next(f"ticks{i}" for i in range(1000) if ring.owner(f"ticks{i}") == "B")
    topology_file, topology = write_topology(tmp_path, name, {"A": {}, "B": b})
    _slow_detection(topology_file)
    return event_type, topology_file, topology


async def _drain(client: AsyncClient, queue: str, want: int) -> list[dict]:
    """The events (n >= 0: probes aside) in ``queue`` once ``want`` arrived or 30 s passed,
    and one more second for anything beyond them (a duplicate), as {n, by}."""
    got = await collect(
        client,
        queue,
        lambda so_far: sum(attribute(m) >= 0 for m in so_far) >= want,
        f"{want} events",
        strict=False,
    )
    return [{"n": attribute(m), "by": m["broker"]} for m in got if attribute(m) >= 0]


def test_a_match_slave_told_to_take_over_serves_its_master_exactly_once(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    event_type, topology_file, topology = _b_owned(tmp_path, name, {"match_slaves": 2})
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue, later_queue = f"{name}.sub", f"{name}.sub.later"
    master, slave0, slave1 = (
        RoleId.match("B", 0),
        *(RoleId.match_slave("B", 0, j) for j in (0, 1)),
    )

    async def subscribe_and_probe(client: AsyncClient, at: PhoenixClient, q: str) -> None:
        await at.subscribe(event_type, [("n", ">=", -1)], 1, q)  # probes too
        await until_delivered(client, q, lambda k: at.publish(event(event_type, n=-1)), "probe")

    store = open_store(str(tmp_path / "state.sqlite3"))
    deployment = phoenix(topology_file, state, settings, urls)
    pids = deployment.up()
    try:

        async def before() -> None:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                await subscribe_and_probe(client, at_a, queue)

        asyncio.run(before())
        # the subscription is in slave-0's replica before its master dies (checked in the
        # store, not asked of the roles)
        eventually(
            lambda: len(live(store.load(slave0.owner, "subscription"))) == 1,
            "replica on slave-0",
        )
        deployment.kill(master)  # SIGKILL
        assert not pid_alive(pids[master])

        out = cli(deployment, "takeover", "--role", slave0.key)  # the CLI
        assert f"{slave0.key} now serves {master.key}" in out
        assert deployment.serves(slave0) == master
        assert pid_alive(pids[slave0])  # the same process, not a restart

        async def after() -> tuple[list[dict], list[dict]]:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                while await client.get(queue) is not None:  # probes
                    pass
                for n in range(EVENTS):
                    await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                got = await _drain(client, queue, EVENTS)
                # a new subscription is confirmed: W of N with the promoted master and slave-1
                await subscribe_and_probe(client, at_a, later_queue)
                await at_a.publish({"event_type": event_type, "attributes": {"n": 7}})
                later = await _drain(client, later_queue, 1)
                return got, later

        got, later = asyncio.run(after())
        assert sorted(m["n"] for m in got) == list(range(EVENTS))  # each once, none lost
        assert {m["by"] for m in got} <= {master.owner, slave1.owner}
        assert [m["n"] for m in later] == [7]
        # the new subscription is held by the promoted master and by slave-1
        assert later_queue in {
            d["queue"] for _, d in live(store.load(master.owner, "subscription")).values()
        }
        eventually(
            lambda: len(live(store.load(slave1.owner, "subscription"))) == 2,
            "replica of the new subscription on slave-1",
        )
        # status names what each process serves now; the killed master's process is down
        with pytest.raises(subprocess.CalledProcessError) as failed:
            cli(deployment, "status")
        line = next(x for x in failed.value.stdout.splitlines() if x.startswith(slave0.key))
        assert line.split()[2:4] == ["running", master.key], line
        assert line.endswith(master.inbox(name)), line
    finally:
        store.close()
        deployment.down()


def test_a_routing_slave_told_to_take_over_routes_with_the_table_it_holds(
    settings, brokers, tmp_path: Path, name: str
) -> None:
    """B's routing master killed; its slave-0 takes over in the same process: events from A
    for a type B owns are routed again, each once, and the latencyMap entry the slave held
    is the promoted master's (read back, not rebuilt)."""
    event_type, topology_file, topology = _b_owned(tmp_path, name, {"routing_slaves": 2})
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.sub"
    router, slave0 = RoleId.router("B"), RoleId.router_slave("B", 0)
    store = open_store(str(tmp_path / "state.sqlite3"))
    deployment = phoenix(topology_file, state, settings, urls)
    deployment.up()
    try:

        async def subscribe() -> None:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                await at_a.subscribe(event_type, [("n", ">=", 0)], 2, queue)

        asyncio.run(subscribe())
        eventually(
            lambda: event_type in live(store.load(slave0.owner, "routing_table")),
            "latencyMap entry on router slave-0",
        )
        deployment.kill(router)
        store.snapshot(router.owner, "routing_table", {})  # only the slaves hold it now
        assert deployment.take_over(slave0) == router

        async def publish() -> list[int]:
            async with AsyncClient(settings=settings) as client:
                at_a = PhoenixClient(client, topology=topology, cluster="A")
                for n in range(EVENTS):
                    await at_a.publish({"event_type": event_type, "attributes": {"n": n}})
                return [m["n"] for m in await _drain(client, queue, EVENTS)]

        assert sorted(asyncio.run(publish())) == list(range(EVENTS))
        # read repair: the promoted master's own copy holds the entry the slaves kept
        eventually(
            lambda: event_type in live(store.load(router.owner, "routing_table")),
            "repaired routing table",
        )
        # the deployment API stops and starts one role; status tells alive and what it serves
        slave1 = RoleId.router_slave("B", 1)
        stopped = deployment.stop(slave1)
        started = deployment.start(slave1)
        assert started != stopped and pid_alive(started) and not pid_alive(stopped)
        rows = {row.role: row for row in deployment.status()[0]}
        assert rows[slave1].alive and rows[slave0].serves == router and not rows[router].alive
    finally:
        store.close()
        deployment.down()


DOC = Path(__file__).resolve().parents[2] / "docs" / "phoenix-roles.md"


def test_the_deployment_example_in_the_docs_runs_as_printed(
    settings, brokers, tmp_path: Path, name: str, monkeypatch
) -> None:
    import re

    from middleware.phoenix.ids import role_queues

    block = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("QOSMQ_AMQP_URLS", ",".join(brokers.urls))
    (tmp_path / "phoenix.toml").write_text(
        f'prefix = "{name}"\n[[cluster]]\nid = "A"\n[[cluster]]\nid = "B"\nmatch_slaves = 1\n'
    )
    namespace: dict = {}
    try:
        exec(compile(block, "docs/phoenix-roles.md", "exec"), namespace)
    finally:
        leftover = PhoenixDeployment("phoenix.toml", ".qosmq")
        if leftover.state_file.exists():
            leftover.down()

        async def clean() -> None:
            async with AsyncClient(settings=settings) as client:
                for queue in role_queues(leftover.topology):
                    await client.delete_queue(queue)

        asyncio.run(clean())
    rows = {row.role: row for row in namespace["rows"]}
    assert namespace["problems"] == []
    assert rows[RoleId.match_slave("B", 0, 0)].serves == RoleId.match("B", 0)
    assert not rows[RoleId.match("B", 0)].alive and rows[RoleId.router("A")].alive
