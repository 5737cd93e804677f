"""Phoenix roles as real processes over the real cluster: cross-cluster routing and matching."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from middleware import runtime
from middleware.bench.phoenix_timeliness import phoenix_cli
from middleware.errors import EntityNotFound
from middleware.localcluster.manager import pid_alive
from middleware.routing import ChordRing, FilterError
from middleware.routing.client import PhoenixClient
from middleware.routing.ids import RoleId, role_queues
from middleware.routing.protocol import PhoenixTopology
from middleware.routing.replicas import live
from middleware.routing.store import open_store
from middleware.transport import AsyncClient

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
BURST = 800
FANOUT = 8


def _phoenix(command: str, topology: Path, state: Path, urls: str, *arguments: str) -> str:
    return phoenix_cli(command, topology, state, urls.split(","), *arguments)


def _topology(
    tmp_path: Path,
    name: str,
    clusters: dict[str, dict[str, object]],
    fields: dict[str, object] | None = None,
) -> tuple[Path, PhoenixTopology]:
    """The test's topology file (top-level ``fields``, clusters with their own TOML
    fields) and its model."""

    def toml(value: object) -> str:
        if isinstance(value, bool):
            return str(value).lower()
        return f'"{value}"' if isinstance(value, str) else str(value)

    text = f'prefix = "{name}"\nstate_store = "{tmp_path / "state.sqlite3"}"\n'
    text += "".join(f"{key} = {toml(value)}\n" for key, value in (fields or {}).items())
    for cluster, fields in clusters.items():
        text += f'[[cluster]]\nid = "{cluster}"\n'
        text += "".join(f"{key} = {toml(value)}\n" for key, value in fields.items())
    path = tmp_path / "phoenix.toml"
    path.write_text(text)
    return path, PhoenixTopology.load(path)


def test_subscribe_at_a_publish_at_c_owner_b(settings, brokers, tmp_path, name) -> None:
    clusters = ["A", "B", "C"]
    ring = ChordRing(clusters)
    event_type = next(f"quotes{i}" for i in range(1000) if ring.owner(f"quotes{i}") == "B")
    topology_file, topology = _topology(
        tmp_path,
        name,
        {c: {"match_slaves": 2 * (c == "B"), "routing_slaves": 2 * (c == "B")} for c in clusters},
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.subscriber"

    async def scenario(subscribe: bool) -> list[dict]:
        client = await AsyncClient(settings=settings).connect()
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        if subscribe:
            with pytest.raises(FilterError):
                await at_a.subscribe(event_type, [("price", "~", 1)], 1, queue)
            await at_a.subscribe(
                event_type, [("price", "<", 10), ("symbol", "prefix", "AB")], 1, queue
            )
            for k in range(FANOUT):  # the burst also goes to FANOUT more queues, so that
                # matching and delivering, not routing, is the slow step: B's match inbox
                # is where the backlog forms
                await at_a.subscribe(event_type, [("symbol", "=", "ABZ")], 1, f"{queue}.fan{k}")
        got: list[dict] = []
        deadline = time.monotonic() + 60
        probe = 0
        while not got and time.monotonic() < deadline:  # until the path is live end to end
            await at_c.publish(
                {
                    "event_type": event_type,
                    "attributes": {"price": 1, "symbol": "ABC", "n": f"p{probe}"},
                }
            )
            probe += 1
            await asyncio.sleep(0.5)
            while (d := await client.get(queue)) is not None:
                got.append(json.loads(d.body))
        assert got, "no event reached the subscriber"
        for i in range(10):
            await at_c.publish(
                {
                    "event_type": event_type,
                    "attributes": {"price": i, "symbol": "ABX", "n": f"yes{i}"},
                }
            )
            await at_c.publish(
                {
                    "event_type": event_type,
                    "attributes": {"price": 50 + i, "symbol": "ABX", "n": f"no{i}"},
                }
            )
            await at_c.publish(
                {
                    "event_type": event_type,
                    "attributes": {"price": i, "symbol": "XYZ", "n": f"no-s{i}"},
                }
            )
        # a burst: a backlog forms in B's match inbox, the master sees it (q is measured
        # per 0.5 s window) and sends events to the slaves whose predicted T is smaller
        await asyncio.gather(
            *(
                at_c.publish(
                    {
                        "event_type": event_type,
                        "attributes": {"price": 2, "symbol": "ABZ", "n": f"burst{i}"},
                    }
                )
                for i in range(BURST)
            )
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            while (d := await client.get(queue)) is not None:
                got.append(json.loads(d.body))
            if sum(m["event"]["attributes"]["n"].startswith("burst") for m in got) >= BURST:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(1)
        while (d := await client.get(queue)) is not None:
            got.append(json.loads(d.body))
        for k in range(FANOUT):
            await client.delete_queue(f"{queue}.fan{k}")
        await client.close()
        return got

    try:
        _phoenix("up", topology_file, state, urls)
        got = asyncio.run(scenario(subscribe=True))
        names = [m["event"]["attributes"]["n"] for m in got]
        # exactly the matching events, each once (order is not kept: roles handle
        # several events at a time and the inner mechanism spreads them over brokers)
        assert sorted(n for n in names if n.startswith(("yes", "no"))) == sorted(
            f"yes{i}" for i in range(10)
        )
        bursts = [m for m in got if m["event"]["attributes"]["n"].startswith("burst")]
        assert sorted(m["event"]["attributes"]["n"] for m in bursts) == sorted(
            f"burst{i}" for i in range(BURST)
        ), "each event delivered exactly once"
        store = open_store(str(tmp_path / "state.sqlite3"))
        for j in (0, 1):  # B's routing slaves hold the replicated table entry
            entry = store.load(RoleId.router_slave("B", j).owner, "routing_table")[event_type]
            assert entry[1] == {"level_sum": 1 + FANOUT, "count": 1 + FANOUT}
        brokers_used = {m["broker"] for m in bursts}
        assert len(brokers_used) >= 2, brokers_used  # predicted-T dispatch inside cluster B
        assert all(RoleId.from_owner(b).master == RoleId.match("B", 0) for b in brokers_used)
        hops = got[-1]["hops"]
        assert hops[0] == "C" and hops[-1] == "B" and hops == ring.route("C", event_type)
        for j in (0, 1):  # B's match slaves hold acknowledged replicas of the subscription
            replica = store.load(RoleId.match_slave("B", 0, j).owner, "subscription")
            assert sorted(doc["queue"] for _, doc in replica.values()) == sorted(
                [queue, *(f"{queue}.fan{k}" for k in range(FANOUT))]
            )
        # every role restarts; the masters' own copies are lost: they read their tables
        # back from R of N replicas (the slaves' snapshots) and repair their own copies
        _phoenix("down", topology_file, state, urls)
        store.snapshot(RoleId.match("B", 0).owner, "subscription", {})
        store.snapshot(RoleId.router("B").owner, "routing_table", {})
        _phoenix("up", topology_file, state, urls)
        again = asyncio.run(scenario(subscribe=False))
        assert sorted(
            m["event"]["attributes"]["n"]
            for m in again
            if m["event"]["attributes"]["n"].startswith(("yes", "no"))
        ) == sorted(f"yes{i}" for i in range(10))
        assert len([m for m in again if m["event"]["attributes"]["n"].startswith("burst")]) == BURST
        repaired = store.load(RoleId.match("B", 0).owner, "subscription")
        assert sorted(doc["queue"] for _, doc in repaired.values()) == sorted(
            [queue, *(f"{queue}.fan{k}" for k in range(FANOUT))]
        )
        assert store.load(RoleId.router("B").owner, "routing_table")[event_type][1] == {
            "level_sum": 1 + FANOUT,
            "count": 1 + FANOUT,
        }
        store.close()
    finally:
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)


def test_a_joining_cluster_takes_over_its_arc_with_the_subscriptions(
    settings, brokers, tmp_path, name
) -> None:
    ring = ChordRing(["A", "B", "C"])
    # a newcomer whose arc is carved out of B's, and an event type inside that arc
    joiner = next(f"D{i}" for i in range(500) if ring.owner(f"D{i}") == "B")
    after = ChordRing(["A", "B", "C", joiner])
    event_type = next(
        f"ticks{i}"
        for i in range(20000)
        if ring.owner(f"ticks{i}") == "B" and after.owner(f"ticks{i}") == joiner
    )
    topology_file, topology = _topology(
        tmp_path, name, {"A": {}, "B": {}, "C": {}, joiner: {"joined": False}}
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.subscriber"

    async def until_delivered(client: AsyncClient, tag: str) -> dict:
        at_c = PhoenixClient(client, topology=topology, cluster="C")
        deadline = time.monotonic() + 60
        n = 0
        while time.monotonic() < deadline:
            await at_c.publish({"event_type": event_type, "attributes": {"v": 1, "n": f"{tag}{n}"}})
            n += 1
            await asyncio.sleep(0.5)
            while (d := await client.get(queue)) is not None:
                message = json.loads(d.body)
                if message["event"]["attributes"]["n"].startswith(tag):
                    return message
        raise AssertionError(f"no {tag} event reached the subscriber")

    sid = ""

    async def before_join() -> dict:
        nonlocal sid
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            sid = await at_a.subscribe(event_type, [("v", "=", 1)], 2, queue)
            return await until_delivered(client, "before")

    async def after_join() -> tuple[dict, bool]:
        async with AsyncClient(settings=settings) as client:
            moved = await until_delivered(client, "after")
            # removed at its new owner; every router that counted its level forgets it
            removed = await PhoenixClient(client, topology=topology, cluster="A").unsubscribe(
                event_type, sid
            )
            return moved, removed

    path = [RoleId.router(c).owner for c in ring.route("A", event_type)]  # where it was subscribed

    def counted(routers: list[str]) -> dict[str, object]:
        """The latencyMap entry of the type in each router's store."""
        store = open_store(str(tmp_path / "state.sqlite3"))
        try:
            return {r: live(store.load(r, "routing_table")).get(event_type) for r in routers}
        finally:
            store.close()

    try:
        _phoenix("up", topology_file, state, urls)
        first = asyncio.run(before_join())
        assert first["hops"][-1] == "B" and RoleId.from_owner(first["broker"]).cluster == "B"
        out = _phoenix("join", topology_file, state, urls, "--cluster", joiner)
        assert f"{joiner} joined" in out
        assert all(counted(path).values())  # the path's routers count its level
        moved, removed = asyncio.run(after_join())
        # the subscription made at A while B owned the type now lives at the newcomer
        assert moved["hops"][-1] == joiner and moved["broker"].startswith(f"{joiner}/")
        assert removed is True
        routers = [*path, f"{joiner}/router"]  # ... and so does the newcomer's, since
        deadline = time.monotonic() + 15
        while any(counted(routers).values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(counted(routers).values()), counted(routers)
    finally:
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)


def test_urgent_events_overtake_bulk_ones_under_load(settings, brokers, tmp_path, name) -> None:
    """Both types are owned by B; C's client subscribes (urgent: level 1, bulk: level 5,
    ten subscriptions that match every bulk event), publishes a burst of bulk events and
    then urgent ones.  With latency priorities (outer) the urgent events jump the backlog
    waiting in RabbitMQ's priority inboxes; without them they arrive behind it."""
    from middleware.bench.phoenix_timeliness import Deployment

    deployment = Deployment(
        tmp_path, prefix=name, amqp_urls=brokers.urls, routing_slaves=0, match_slaves=0
    )
    owned_by_b = [f"kind{i}" for i in range(2000) if deployment.ring.owner(f"kind{i}") == "B"]
    bulk_type, urgent_type = owned_by_b[:2]
    queue = f"{name}.subscriber"

    async def scenario() -> list[str]:
        async with AsyncClient(settings=settings) as client:
            at_c = PhoenixClient(client, topology=deployment.topology, cluster="C")
            await at_c.subscribe(urgent_type, [("n", "exists")], 1, queue)
            await at_c.subscribe(bulk_type, [("n", "exists")], 5, queue)
            for k in range(10):  # ten subscriber queues: ten deliveries per bulk event
                await at_c.subscribe(bulk_type, [("n", "exists")], 5, f"{queue}.{k}")
            for event_type in (bulk_type, urgent_type):  # until both paths are live
                deadline = time.monotonic() + 60
                seen = False
                while not seen and time.monotonic() < deadline:
                    await at_c.publish({"event_type": event_type, "attributes": {"n": "probe"}})
                    await asyncio.sleep(0.5)
                    for q in (queue, f"{queue}.0"):
                        while (d := await client.get(q)) is not None:
                            seen = seen or json.loads(d.body)["event_type"] == event_type
                assert seen, f"{event_type} never delivered"
            await asyncio.sleep(1)
            for q in (queue, *(f"{queue}.{k}" for k in range(10))):
                while await client.get(q) is not None:
                    pass
            burst = [
                at_c.publish({"event_type": bulk_type, "attributes": {"n": f"b{i}"}})
                for i in range(300)
            ]
            await asyncio.gather(*burst)
            await asyncio.gather(
                *(
                    at_c.publish({"event_type": urgent_type, "attributes": {"n": f"u{i}"}})
                    for i in range(10)
                )
            )
            order: list[str] = []  # arrivals at the queue that gets both types
            deadline = time.monotonic() + 90
            while len(order) < 310 and time.monotonic() < deadline:
                d = await client.get(queue)
                if d is None:
                    await asyncio.sleep(0.1)
                    continue
                order.append(json.loads(d.body)["event"]["attributes"]["n"])
            await asyncio.sleep(1)
            for k in range(10):
                await client.delete_queue(f"{queue}.{k}")
            await client.delete_queue(queue)
            return order

    def positions() -> list[float]:
        order = asyncio.run(scenario())
        bulk = [i for i, n in enumerate(order) if n.startswith("b")]
        assert len(bulk) == 300, len(bulk)
        urgent = [i for i, n in enumerate(order) if n.startswith("u")]
        assert len(urgent) == 10
        # for each urgent event: the share of bulk deliveries that arrived after it
        return [sum(b > u for b in bulk) / len(bulk) for u in urgent]

    deployment.configure(outer=True, inner=False)
    with deployment.running():
        overtaken = positions()
        # the same roles with the priorities switched off live (qosmq phoenix configure)
        out = phoenix_cli(
            "configure",
            deployment.topology_file,
            deployment.state_dir,
            brokers.urls,
            "--outer",
            "off",
            "--batch-max",
            "1",
        )
        assert "configured live (6 masters)" in out, out  # 3 routers + 3 match masters
        fifo = positions()
    # the burst left C's router in batches (logged at stop: role messages, AMQP messages)
    counters = (deployment.state_dir / RoleId.router("C").log_file).read_text()
    sent = int(re.search(r"'sent': (\d+)", counters).group(1))
    amqp_sent = int(re.search(r"'amqp_sent': (\d+)", counters).group(1))
    assert amqp_sent < sent, counters
    # the roles run on the loop their settings give (auto: uvloop, a dependency)
    assert f"event loop: {runtime.loop_name('auto')}" in counters, counters
    assert min(overtaken) >= 0.25, overtaken  # every urgent event beat a quarter of the bulk
    assert _queues_left(settings, deployment) == []  # the deployment removed its queues
    assert max(fifo) < min(overtaken), (fifo, overtaken)  # the priorities made the difference
    share, fifo_share = min(overtaken), max(fifo)
    print(f"urgent ahead of >= {share:.0%} of the bulk ({fifo_share:.0%} without priorities)")


def _queues_left(settings, deployment) -> list[str]:
    """The deployment's role queues that still exist in the broker."""

    async def check() -> list[str]:
        left = []
        async with AsyncClient(settings=settings) as client:
            for queue in role_queues(deployment.topology):
                try:
                    await client.queue_length(queue)
                    left.append(queue)
                except EntityNotFound:
                    pass
        return left

    return asyncio.run(check())


def test_e2e_subscription_confirms_delivery_when_the_subscriber_handled_it(
    settings, brokers, tmp_path, name
) -> None:
    """A subscription with confirm="e2e": the match broker waits for the subscriber's
    receipt; a handler that rejects an event gets it dead-lettered with the reason."""
    from middleware.bench.phoenix_timeliness import Deployment
    from middleware.errors import Reject
    from middleware.transport import DEAD_LETTER_QUEUE

    deployment = Deployment(
        tmp_path, prefix=name, amqp_urls=brokers.urls, routing_slaves=0, match_slaves=0
    )
    event_type = next(f"e2e{i}" for i in range(2000) if deployment.ring.owner(f"e2e{i}") == "B")
    queue = f"{name}.subscriber"

    async def scenario() -> tuple[list[str], list[dict]]:
        handled: list[str] = []
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=deployment.topology, cluster="A")
            with pytest.raises(FilterError):
                await at_a.subscribe(event_type, None, 1, queue, confirm="maybe")
            await at_a.subscribe(event_type, [("n", "exists")], 1, queue, confirm="e2e")

            async def handler(event, message) -> None:
                assert RoleId.from_owner(message.broker).master == RoleId.match("B", 0)
                handled.append(event.attributes["n"])
                if event.attributes["n"] == "bad":
                    raise Reject("bad event")

            await at_a.consume(queue, handler, e2e=True)
            at_c = PhoenixClient(client, topology=deployment.topology, cluster="C")
            deadline = time.monotonic() + 60
            while "probe" not in handled and time.monotonic() < deadline:
                await at_c.publish({"event_type": event_type, "attributes": {"n": "probe"}})
                await asyncio.sleep(0.5)
            for n in ("ok1", "bad", "ok2"):
                await at_c.publish({"event_type": event_type, "attributes": {"n": n}})
            deadline = time.monotonic() + 30
            dead: list[dict] = []
            while not dead and time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                while (d := await client.get(DEAD_LETTER_QUEUE)) is not None:
                    if d.headers.get("x-qosmq-queue") == RoleId.match("B", 0).inbox(name):
                        dead.append({"reason": d.headers["x-qosmq-reason"], **json.loads(d.body)})
            await at_a.close()  # its receipts consumer first, then the connection
            return handled, dead

    deployment.configure(outer=True, inner=False)
    with deployment.running():
        handled, dead = asyncio.run(scenario())
    assert {"ok1", "ok2", "bad"} <= set(handled)
    assert handled.count("bad") == 1  # rejected once, not redelivered
    assert [d["event"]["attributes"]["n"] for d in dead] == ["bad"], dead
    assert "bad event" in dead[0]["reason"] and queue in dead[0]["reason"], dead[0]["reason"]


def test_without_inner_the_match_master_takes_turns_or_matches_alone(
    settings, brokers, tmp_path, name
) -> None:
    """``inner`` off: round robin over the master and its two slaves, blind to load (the
    paper's base system), or with ``blind_dispatch = "master"`` the master alone; switched
    live with ``qosmq phoenix configure``. Events go one at a time: no backlog anywhere."""
    topology_file, topology = _topology(
        tmp_path, name, {"A": {"match_slaves": 2, "routing_slaves": 0}}
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.subscriber"

    async def round_of(client: AsyncClient, at_a: PhoenixClient, tag: str, n: int) -> list[str]:
        """Publish ``n`` events one after another; the broker that matched each."""
        got: dict[str, str] = {}
        for i in range(n):
            await at_a.publish({"event_type": "quotes", "attributes": {"n": f"{tag}{i}"}})
            deadline = time.monotonic() + 10
            while f"{tag}{i}" not in got and time.monotonic() < deadline:
                while (d := await client.get(queue)) is not None:
                    m = json.loads(d.body)
                    assert m["event"]["attributes"]["n"] not in got, "delivered twice"
                    got[m["event"]["attributes"]["n"]] = m["broker"]
                await asyncio.sleep(0.01)
        assert sorted(got) == sorted(f"{tag}{i}" for i in range(n)), "each event delivered once"
        return [got[f"{tag}{i}"] for i in range(n)]

    async def scenario() -> dict[str, list[str]]:
        client = await AsyncClient(settings=settings).connect()
        at_a = PhoenixClient(client, topology=topology, cluster="A")
        await at_a.subscribe("quotes", [("n", "exists")], 1, queue)
        await asyncio.sleep(2)  # every slave has reported (heartbeats every 0.5 s)
        rounds = {"round_robin": await round_of(client, at_a, "rr", 30)}
        await asyncio.to_thread(
            _phoenix, "configure", topology_file, state, urls, "--blind-dispatch", "master"
        )
        rounds["master"] = await round_of(client, at_a, "m", 12)
        await client.delete_queue(queue)
        await client.close()
        return rounds

    try:
        _phoenix("up", topology_file, state, urls)
        _phoenix("configure", topology_file, state, urls, "--inner", "off")
        rounds = asyncio.run(scenario())
    finally:
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)
    brokers_used = {b: rounds["round_robin"].count(b) for b in set(rounds["round_robin"])}
    assert sorted(brokers_used) == [
        r.owner for r in (RoleId.match("A", 0), *(RoleId.match_slave("A", 0, j) for j in (0, 1)))
    ]
    assert all(count == 10 for count in brokers_used.values()), brokers_used
    assert set(rounds["master"]) == {RoleId.match("A", 0).owner}


def test_live_configure_names_the_masters_that_did_not_answer(settings, brokers, name) -> None:
    """Nothing runs for this topology: the switch is not confirmed and says by whom."""
    from middleware.errors import MiddlewareError
    from middleware.routing.roles import reconfigure

    topology = PhoenixTopology.model_validate({"prefix": name, "clusters": [{"id": "A"}]})
    with pytest.raises(
        MiddlewareError, match=rf"{name}\.A\.match\.0\.control, {name}\.A\.router\.control"
    ):
        asyncio.run(reconfigure(settings, topology, ["A"], inner=False, timeout_s=1.0))


def _management(settings, method: str, path: str, body: dict | None = None) -> int:
    """One call to the management API of the test cluster's first node; the HTTP status."""
    import base64
    import urllib.error
    import urllib.request

    host, port, _ = settings.nodes[0]
    request = urllib.request.Request(
        f"http://{host}:{port + settings.management_port_offset}{path}",
        method=method,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _role_metrics(state: Path, role: RoleId) -> str:
    """The Prometheus text of a running role (``QOSMQ_METRICS_PORT=0``: its log names it)."""
    import re
    import urllib.request

    log = state / role.log_file
    deadline = time.monotonic() + 30
    while not (found := re.search(r"metrics: (http://\S+)", log.read_text())):
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    with urllib.request.urlopen(found.group(1), timeout=5) as response:
        return response.read().decode()


def _settled(state: Path, role: RoleId, metric: str, want: float, **labels: str) -> float:
    """A role's sample once it reads ``want`` (gauges are read every second or window,
    counters move with the role's last settlements), or its last reading after 15 s."""
    deadline = time.monotonic() + 15
    while (value := _sample(_role_metrics(state, role), metric, **labels)) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return value


def _sample(text: str, metric: str, **labels: str) -> float:
    """The value of one sample of ``metric`` whose labels include ``labels``."""
    for line in text.splitlines():
        if line.startswith(metric + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {metric} with {labels} in:\n{text}")


def test_clusters_on_their_own_vhosts_deliver_into_the_subscribers_vhost(
    settings, brokers, tmp_path, name, monkeypatch
) -> None:
    """Each cluster on a vhost of its own: a subscription made at A for a type owned by B
    is confirmed once B's match master and W of its 2 replicas hold it, and then every
    matching event published at C lands in A's vhost (none in B's, where matching ran).
    Every role serves its metrics: events by outcome, inbox lengths, predicted T, hops."""
    import urllib.parse

    monkeypatch.setenv("QOSMQ_METRICS_PORT", "0")  # each role process: a free port

    from middleware.routing.client import SubscriptionUnconfirmed

    try:
        _management(settings, "GET", "/api/overview")
    except OSError:
        pytest.skip("needs the brokers' management API (AMQP port + offset) to create vhosts")
    vhosts = {c: f"/{name}-{c.lower()}" for c in "ABC"}
    quoted = {c: urllib.parse.quote(v, safe="") for c, v in vhosts.items()}
    for c in "ABC":
        assert _management(settings, "PUT", f"/api/vhosts/{quoted[c]}", {}) in (201, 204)
        grant = {"configure": ".*", "write": ".*", "read": ".*"}
        assert _management(settings, "PUT", f"/api/permissions/{quoted[c]}/guest", grant) in (
            201,
            204,
        )
    ring = ChordRing(["A", "B", "C"])
    event_type = next(f"trades{i}" for i in range(1000) if ring.owner(f"trades{i}") == "B")
    topology_file, topology = _topology(
        tmp_path, name, {c: {"vhost": vhosts[c], "match_slaves": 2 * (c == "B")} for c in "ABC"}
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.subscriber"

    handled: list[int] = []

    async def scenario() -> list[str]:
        at_a = await PhoenixClient.connect(settings, topology=topology, cluster="A")
        at_c = await PhoenixClient.connect(settings, topology=topology, cluster="C")
        all_handled = asyncio.Event()

        async def handler(event, message) -> None:
            handled.append(event.attributes["price"])
            if len(handled) >= 10:
                all_handled.set()

        try:
            # confirmed: B matches it from now on, no probing for a live path needed
            await at_a.subscribe(event_type, [("price", "<", 10)], 2, queue, wait_s=60)
            # and an e2e one: B's receipts listener and A's subscriber across vhosts
            await at_a.subscribe(
                event_type, [("price", "<", 10)], 2, f"{queue}.e2e", confirm="e2e", wait_s=60
            )
            await at_a.consume(f"{queue}.e2e", handler, e2e=True)
            for i in range(20):
                await at_c.publish({"event_type": event_type, "attributes": {"price": i}})
            got: list[str] = []
            deadline = time.monotonic() + 30
            while len(got) < 10 and time.monotonic() < deadline:
                while (d := await at_a.client.get(queue)) is not None:
                    message = json.loads(d.body)
                    assert RoleId.from_owner(message["broker"]).master == RoleId.match("B", 0)
                    got.append(message["event"]["attributes"]["price"])
                await asyncio.sleep(0.2)
            await asyncio.sleep(0.5)
            while (d := await at_a.client.get(queue)) is not None:
                got.append(json.loads(d.body)["event"]["attributes"]["price"])
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(30):
                    await all_handled.wait()
            return got
        finally:
            await at_a.close()
            await at_c.close()

    async def unconfirmed() -> None:
        at_a = await PhoenixClient.connect(settings, topology=topology, cluster="A")
        try:
            with pytest.raises(SubscriptionUnconfirmed, match="did not confirm it in 2 s"):
                await at_a.subscribe(event_type, None, 1, f"{queue}.late", wait_s=2)
        finally:
            await at_a.close()

    try:
        missing = tmp_path / "missing.toml"  # a vhost nobody created: refused before any role
        missing.write_text(f'prefix = "{name}"\n[[cluster]]\nid = "A"\nvhost = "/{name}-nowhere"\n')
        with pytest.raises(subprocess.CalledProcessError) as refused:
            _phoenix("up", missing, tmp_path / "nowhere", urls)
        assert "cluster 'A'" in refused.value.stderr and f"/{name}-nowhere" in refused.value.stderr
        assert not (tmp_path / "nowhere" / "phoenix.json").exists()

        _phoenix("up", topology_file, state, urls)
        got = asyncio.run(scenario())
        assert sorted(got) == list(range(10)), got  # each matching event once, in A's vhost
        assert sorted(handled) == list(range(10)), handled  # e2e: handled once each
        queue_path = urllib.parse.quote(queue, safe="")
        assert _management(settings, "GET", f"/api/queues/{quoted['A']}/{queue_path}") == 200
        for c in "BC":  # neither the subscriber queue nor a stray copy elsewhere
            assert _management(settings, "GET", f"/api/queues/{quoted[c]}/{queue_path}") == 404
        for c in "ABC":  # each role's inbox lives in its cluster's vhost
            inbox = urllib.parse.quote(RoleId.router(c).inbox(name), safe="")
            assert _management(settings, "GET", f"/api/queues/{quoted[c]}/{inbox}") == 200
        matcher = _role_metrics(state, RoleId.match("B", 0))
        events = "qosmq_phoenix_events_total"
        assert _sample(matcher, events, cluster="B", role="MatchMaster", outcome="matched") >= 1
        # 20 copies, the e2e ones counted once A's handler took them (receipts crossed back),
        # by the master and the slaves the inner mechanism sent some events to
        b_brokers = [RoleId.match("B", 0), *(RoleId.match_slave("B", 0, j) for j in (0, 1))]

        def delivered() -> float:
            return sum(
                _sample(_role_metrics(state, r), events, outcome="delivered")
                if 'outcome="delivered"' in _role_metrics(state, r)
                else 0.0
                for r in b_brokers
            )

        deadline = time.monotonic() + 15
        while delivered() != 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert delivered() == 20
        assert _sample(matcher, events, role="MatchMaster", outcome="replicated") >= 1
        inbox_b = RoleId.match("B", 0).inbox(name)
        length = "qosmq_phoenix_inbox_length"
        assert _settled(state, RoleId.match("B", 0), length, 0, inbox=inbox_b) == 0
        assert (
            _sample(matcher, "qosmq_phoenix_predicted_seconds", broker=RoleId.match("B", 0).owner)
            >= 0
        )
        assert _sample(matcher, "qosmq_phoenix_hops_count", cluster="B") >= 1
        slave = _role_metrics(state, RoleId.match_slave("B", 0, 1))
        assert (
            _settled(
                state,
                RoleId.match_slave("B", 0, 1),
                length,
                0,
                inbox=RoleId.match_slave("B", 0, 1).inbox(name),
            )
            == 0
        )
        assert (
            _sample(
                slave, "qosmq_phoenix_predicted_seconds", broker=RoleId.match_slave("B", 0, 1).owner
            )
            >= 0
        )
        router_c = _role_metrics(state, RoleId.router("C"))
        assert (
            _sample(router_c, events, cluster="C", role="RouterMaster", outcome="forwarded") >= 20
        )
        assert (
            _settled(state, RoleId.router("C"), length, 0, inbox=RoleId.router("C").inbox(name))
            == 0
        )
        _phoenix("down", topology_file, state, urls)
        asyncio.run(unconfirmed())  # nobody at B to confirm it: said, not hung
    finally:
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)
        for c in "ABC":
            _management(settings, "DELETE", f"/api/vhosts/{quoted[c]}")


def test_unsubscribe_stops_deliveries_and_takes_its_level_out_of_latency_maps(
    settings, brokers, tmp_path, name
) -> None:
    """Two subscriptions made at A to a type owned by B (levels 1 and 5); removing the
    first stops its deliveries at once (confirmed: the owner and W of N replicas dropped
    it), and every routing master that counted its level takes it out — in its own
    store and its slave's replica; removing the last one leaves no latencyMap entry."""
    from middleware.routing.replicas import live

    ring = ChordRing(["A", "B", "C"])
    event_type = next(f"ticks{i}" for i in range(1000) if ring.owner(f"ticks{i}") == "B")
    path = ring.route("A", event_type)  # the routing masters a subscription from A passes
    topology_file, topology = _topology(
        tmp_path,
        name,
        {c: {"match_slaves": int(c == "B"), "routing_slaves": int(c == "B")} for c in "ABC"},
    )
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    kept, dropped = f"{name}.kept", f"{name}.dropped"
    store = open_store(str(tmp_path / "state.sqlite3"))

    def levels() -> dict[str, tuple[int, int] | None]:
        """(level sum, count) of the type per routing master (and B's slave), as stored."""
        owners = [RoleId.router(c).owner for c in path] + [RoleId.router_slave("B", 0).owner]
        found = {}
        for owner in owners:
            entry = live(store.load(owner, "routing_table")).get(event_type)
            found[owner] = None if entry is None else (entry[1]["level_sum"], entry[1]["count"])
        return found

    async def settled(expected: tuple[int, int] | None) -> dict[str, tuple[int, int] | None]:
        """The stored levels once every router (and the slave's replica) shows ``expected``:
        routers apply a change from their inboxes, beside the client's confirmation."""
        deadline = time.monotonic() + 15
        found = levels()
        while any(v != expected for v in found.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            found = levels()
        return found

    async def scenario() -> tuple[list, list, list, bool, bool]:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=topology, cluster="A")
            at_c = PhoenixClient(client, topology=topology, cluster="C")
            urgent = await at_a.subscribe(event_type, [("price", "<", 10)], 1, dropped)
            bulk = await at_a.subscribe(event_type, [("price", "<", 10)], 5, kept)
            before = await settled((6, 2))
            assert await at_a.unsubscribe(event_type, urgent) is True
            again = await at_a.unsubscribe(event_type, urgent)
            after = await settled((5, 1))
            for i in range(5):
                await at_c.publish({"event_type": event_type, "attributes": {"price": i}})
            got: list[int] = []
            deadline = time.monotonic() + 30
            while len(got) < 5 and time.monotonic() < deadline:
                while (d := await client.get(kept)) is not None:
                    got.append(json.loads(d.body)["event"]["attributes"]["price"])
                await asyncio.sleep(0.2)
            await asyncio.sleep(1)
            stray = []
            while (d := await client.get(dropped)) is not None:
                stray.append(json.loads(d.body))
            last = await at_a.unsubscribe(event_type, bulk)
            gone = await settled(None)
            for queue in (kept, dropped):
                await client.delete_queue(queue)
            return [before, after, gone], got, stray, again, last

    try:
        _phoenix("up", topology_file, state, urls)
        (before, after, gone), got, stray, again, last = asyncio.run(scenario())
        assert before == {owner: (6, 2) for owner in before}, before
        assert after == {owner: (5, 1) for owner in after}, after
        assert again is False  # the owner no longer knows it
        assert sorted(got) == list(range(5)) and stray == []
        assert last is True and gone == {owner: None for owner in before}, gone
        for owner in (
            RoleId.match("B", 0).owner,
            RoleId.match_slave("B", 0, 0).owner,
        ):  # tombstones, no live subscription
            assert live(store.load(owner, "subscription")) == {}
    finally:
        store.close()
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)


def test_the_sync_client_subscribes_publishes_and_unsubscribes(
    settings, brokers, tmp_path, name
) -> None:
    """The pika face, blocking: a confirmed subscription at A for a type owned by C gets
    the matching events published at B; unsubscribed, it gets no more; a malformed
    filter and a wrong cluster connection are refused before anything is sent."""
    from middleware.errors import ConfigurationError
    from middleware.routing.batching import encode
    from middleware.routing.client import SubscriptionUnconfirmed, SyncPhoenixClient
    from middleware.routing.messages import Publish, Subscribe
    from middleware.routing.roles import outgoing
    from middleware.transport import DEAD_LETTER_QUEUE, OutgoingMessage

    ring = ChordRing(["A", "B", "C"])
    event_type = next(f"orders{i}" for i in range(1000) if ring.owner(f"orders{i}") == "C")
    topology_file, topology = _topology(tmp_path, name, {c: {} for c in "ABC"})
    urls = ",".join(brokers.urls)
    state = tmp_path / "state"
    queue = f"{name}.subscriber"

    got: list[int] = []

    def drain(client: SyncPhoenixClient, want: int) -> list[int]:
        """The events the client's consumer handled, once ``want`` arrived (and 0.5 s)."""
        client.run(30, until=lambda: len(got) >= want)
        client.run(0.5)
        taken = got[:]
        got.clear()
        return taken

    try:
        _phoenix("up", topology_file, state, urls)
        with (
            SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a,
            SyncPhoenixClient.connect(settings, topology=topology, cluster="B") as at_b,
        ):
            with pytest.raises(FilterError):
                at_a.subscribe(event_type, [("qty", "between", 1)], 1, queue)
            other = topology.model_copy(
                update={
                    "clusters": (
                        *topology.clusters[:2],
                        topology.clusters[2].model_copy(update={"vhost": "/elsewhere"}),
                    )
                }
            )
            with pytest.raises(ConfigurationError, match="cluster 'C'"):
                SyncPhoenixClient(at_a.client, topology=other, cluster="C")
            sid = at_a.subscribe(event_type, [("qty", ">=", 100)], 2, queue)
            at_a.consume(queue, lambda event, message: got.append(event.attributes["qty"]))
            at_a.advertise(event_type)
            for qty in (50, 100, 150, 99, 200):
                at_b.publish({"event_type": event_type, "attributes": {"qty": qty}})
            assert sorted(drain(at_a, 3)) == [100, 150, 200]
            # a batch (as roles send each other under load) with a malformed element,
            # into B's router: the good ones are routed, the bad one dead-lettered alone
            batch = [
                outgoing(Publish(event_type=event_type, event=e), "")
                for e in (
                    {"event_type": event_type, "attributes": {"qty": 120}},
                    {"event_type": event_type, "attributes": {"qty": 130}},
                )
            ]
            body = encode([batch[0].body, b'{"kind": "publish", "qty": 1}', batch[1].body])
            at_b.client.publish(OutgoingMessage(body, "", RoleId.router("B").inbox(name)))
            assert sorted(drain(at_a, 2)) == [120, 130]
            assert at_a.unsubscribe(event_type, sid) is True
            assert at_a.unsubscribe(event_type, sid) is False
            for qty in (300, 400):
                at_b.publish({"event_type": event_type, "attributes": {"qty": qty}})
            # a barrier: a second subscription's event arrives after the two above
            probe = at_a.subscribe(event_type, [("qty", "=", 7)], 2, queue)
            at_b.publish({"event_type": event_type, "attributes": {"qty": 7}})
            assert drain(at_a, 1) == [7]  # not 300 or 400
            at_a.unsubscribe(event_type, probe)
            # a body that is no Phoenix event, in the subscriber queue: dead-lettered,
            # the handler never sees it
            at_a.client.publish(OutgoingMessage(b"junk", "", queue))
            at_a.run(1)
            assert got == []
            at_a.client.delete_queue(queue)
            # a subscribe naming a home cluster the topology does not have: dead-lettered
            # by A's router with the reason, nothing counted or forwarded
            stray = Subscribe(
                event_type=event_type,
                home="Z",
                queue=queue,
                subscription_id="stray",
            )
            at_a.client.publish(outgoing(stray, RoleId.router("A").inbox(name)))
            reasons: list[str] = []
            deadline = time.monotonic() + 15
            while len(reasons) < 3 and time.monotonic() < deadline:
                while (d := at_a.client.get(DEAD_LETTER_QUEUE)) is not None:
                    if d.headers.get("x-qosmq-queue") in (
                        RoleId.router("A").inbox(name),
                        RoleId.router("B").inbox(name),
                        queue,
                    ):
                        reasons.append(d.headers["x-qosmq-reason"])
                        if "batch" in reasons[-1]:
                            assert json.loads(d.body) == {"kind": "publish", "qty": 1}
                time.sleep(0.2)
            assert len(reasons) == 3, reasons
            assert any("malformed Phoenix message in a batch" in r for r in reasons), reasons
            assert any("malformed Phoenix delivery" in r for r in reasons), reasons
            assert any("home cluster 'Z' is not in the topology" in r for r in reasons), reasons
        # status: every role's process and inbox; a killed role makes it fail, by name
        report = _phoenix("status", topology_file, state, urls)
        pids = json.loads((state / "phoenix.json").read_text())
        for key in pids:
            line = rf"^{re.escape(key)} +{pids[key]} +running +{re.escape(key)} +\d+ "
            assert re.search(line, report, re.M), report  # each serves the role it started as
        assert f"{name}.C.match.0 " not in report and f"{name}.C.match.0\n" in report
        os.kill(pids[RoleId.match("C", 0).key], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while pid_alive(pids[RoleId.match("C", 0).key]) and time.monotonic() < deadline:
            time.sleep(0.1)
        with pytest.raises(subprocess.CalledProcessError) as failed:
            _phoenix("status", topology_file, state, urls)
        assert failed.value.returncode == 1
        assert "1 role(s) down: C/matcher-0" in failed.value.stderr
        assert re.search(r"^C/matcher-0 +\d+ +down ", failed.value.stdout, re.M)
        _phoenix("down", topology_file, state, urls)
        with SyncPhoenixClient.connect(settings, topology=topology, cluster="A") as at_a:
            with pytest.raises(SubscriptionUnconfirmed, match="did not confirm it in 1 s"):
                at_a.subscribe(event_type, None, 1, f"{queue}.late", wait_s=1)
            at_a.client.delete_queue(f"{queue}.late")
    finally:
        if (state / "phoenix.json").exists():
            _phoenix("down", topology_file, state, urls)
