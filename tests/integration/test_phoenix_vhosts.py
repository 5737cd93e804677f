"""Clusters on vhosts of their own, and what each role reports about itself.

Each cluster on its own vhost: a subscription made at A for a type owned by B is
confirmed once B's match master and W of its 2 replicas hold it, and then every matching
event published at C lands in A's vhost (none in B's, where matching ran). Every role
serves its metrics: events by outcome, inbox lengths, predicted T, hops.

One run (the module fixture); the test counts with its own subscriber queues and the
brokers' management API."""

from __future__ import annotations

import asyncio
import json
import subprocess
import urllib.parse
from dataclasses import dataclass, field

import pytest

from middleware.phoenix.ids import RoleId
from middleware.routing import PhoenixDeployment
from middleware.routing.client import PhoenixClient, SubscriptionUnconfirmed
from tests.integration.phoenix_support import (
    cli,
    deployment,
    event,
    eventually,
    eventually_async,
    management,
    owned_by,
    role_metrics,
    running,
    sample,
    write_topology,
)

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
EVENTS = "qosmq_phoenix_events_total"
LENGTH = "qosmq_phoenix_inbox_length"
B_BROKERS = [RoleId.match("B", 0), *(RoleId.match_slave("B", 0, j) for j in (0, 1))]


@dataclass
class Run:
    name: str
    quoted: dict[str, str]  # each cluster's vhost, quoted for the management API
    refused: str  # what ``up`` said of a vhost nobody created
    refused_state: bool  # ... and whether it left a deployment behind
    got: list[int] = field(default_factory=list)  # A's plain subscriber queue
    handled: list[int] = field(default_factory=list)  # A's e2e handler
    matchers: set[str] = field(default_factory=set)  # the brokers that matched them
    metrics: dict[str, str] = field(default_factory=dict)  # role owner -> its metrics text
    settled: dict[str, float] = field(default_factory=dict)  # inbox -> its length, settled
    delivered: float = 0.0  # deliveries counted by B's match brokers
    unconfirmed: str = ""  # a subscribe once every role is down
    subscriber_queue: dict[str, int] = field(default_factory=dict)  # vhost -> GET status
    router_inbox: dict[str, int] = field(default_factory=dict)  # cluster -> GET status


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setenv("QOSMQ_METRICS_PORT", "0")  # each role process: a free port
    try:
        management(settings, "GET", "/api/overview")
    except OSError:
        pytest.skip("needs the brokers' management API (AMQP port + offset) to create vhosts")
    vhosts = {c: f"/{name}-{c.lower()}" for c in "ABC"}
    quoted = {c: urllib.parse.quote(v, safe="") for c, v in vhosts.items()}
    for c in "ABC":
        assert management(settings, "PUT", f"/api/vhosts/{quoted[c]}", {}) in (201, 204)
        grant = {"configure": ".*", "write": ".*", "read": ".*"}
        assert management(settings, "PUT", f"/api/permissions/{quoted[c]}/guest", grant) in (
            201,
            204,
        )
    event_type = owned_by(["A", "B", "C"], "B", "trades")
    queue = f"{name}.subscriber"
    directory = tmp_path_factory.mktemp("vhosts")
    urls = ",".join(brokers.urls)

    # a vhost nobody created: refused before any role starts
    missing, _ = write_topology(directory / "missing", name, {"A": {"vhost": f"/{name}-nowhere"}})
    nowhere = deployment(missing, directory / "nowhere", settings, urls)
    try:
        cli(nowhere, "up")
        refused = ""
    except subprocess.CalledProcessError as exc:
        refused = exc.stderr
    run = Run(name, quoted, refused, nowhere.state_file.exists())

    async def scenario(topology) -> None:
        at_a = await PhoenixClient.connect(settings, topology=topology, cluster="A")
        at_c = await PhoenixClient.connect(settings, topology=topology, cluster="C")
        all_handled = asyncio.Event()

        async def handler(event, message) -> None:
            run.handled.append(event.attributes["price"])
            if len(run.handled) >= 10:
                all_handled.set()

        async def received() -> bool:
            while (d := await at_a.client.get(queue)) is not None:
                message = json.loads(d.body)
                run.matchers.add(message["broker"])
                run.got.append(message["event"]["attributes"]["price"])
            return len(run.got) >= 10

        try:
            # confirmed: B matches it from now on, no probing for a live path needed
            await at_a.subscribe(event_type, [("price", "<", 10)], 2, queue, wait_s=60)
            # and an e2e one: B's receipts listener and A's subscriber across vhosts
            await at_a.subscribe(
                event_type, [("price", "<", 10)], 2, f"{queue}.e2e", confirm="e2e", wait_s=60
            )
            await at_a.consume(f"{queue}.e2e", handler, e2e=True)
            for i in range(20):
                await at_c.publish(event(event_type, price=i))
            await eventually_async(received, "ten events in A's vhost", 30, strict=False)
            await asyncio.sleep(0.5)
            await received()  # a duplicate would be here
            try:
                async with asyncio.timeout(30):
                    await all_handled.wait()
            except TimeoutError:
                pass
        finally:
            await at_a.close()
            await at_c.close()

    async def unconfirmed(topology) -> str:
        at_a = await PhoenixClient.connect(settings, topology=topology, cluster="A")
        try:
            await at_a.subscribe(event_type, None, 1, f"{queue}.late", wait_s=2)
            return "confirmed"
        except SubscriptionUnconfirmed as exc:
            return str(exc)
        finally:
            await at_a.close()

    def delivered(deployed: PhoenixDeployment) -> float:
        texts = [role_metrics(deployed, r) for r in B_BROKERS]
        return sum(sample(t, EVENTS, outcome="delivered") or 0.0 for t in texts)

    def settled(deployed: PhoenixDeployment, role: RoleId) -> float:
        """An inbox's length once it reads 0 (gauges are read every second), or after 15 s."""
        inbox = role.inbox(name)
        eventually(
            lambda: sample(role_metrics(deployed, role), LENGTH, inbox=inbox) == 0,
            f"{inbox} empty",
            15,
            strict=False,
        )
        return sample(role_metrics(deployed, role), LENGTH, inbox=inbox)

    clusters = {c: {"vhost": vhosts[c], "match_slaves": 2 * (c == "B")} for c in "ABC"}
    try:
        with running(directory, name, settings, urls, clusters) as deployed:
            asyncio.run(scenario(deployed.topology))
            # 20 copies, the e2e ones counted once A's handler took them (receipts crossed
            # back), by the master and the slaves the inner mechanism sent some events to
            eventually(lambda: delivered(deployed) == 20, "20 deliveries", 15, strict=False)
            run.delivered = delivered(deployed)
            for role in (RoleId.match("B", 0), RoleId.match_slave("B", 0, 1), RoleId.router("C")):
                run.settled[role.owner] = settled(deployed, role)
                run.metrics[role.owner] = role_metrics(deployed, role)
            for c in "ABC":
                path = urllib.parse.quote(queue, safe="")
                run.subscriber_queue[c] = management(
                    settings, "GET", f"/api/queues/{quoted[c]}/{path}"
                )
                inbox = urllib.parse.quote(RoleId.router(c).inbox(name), safe="")
                run.router_inbox[c] = management(
                    settings, "GET", f"/api/queues/{quoted[c]}/{inbox}"
                )
            deployed.down()
            run.unconfirmed = asyncio.run(unconfirmed(deployed.topology))
        return run
    finally:
        monkeypatch.undo()
        for c in "ABC":
            management(settings, "DELETE", f"/api/vhosts/{quoted[c]}")


def test_a_vhost_nobody_created_is_refused_before_any_role_starts(run: Run) -> None:
    assert "cluster 'A'" in run.refused and f"/{run.name}-nowhere" in run.refused
    assert not run.refused_state


def test_each_matching_event_lands_once_in_the_subscribers_vhost(run: Run) -> None:
    assert sorted(run.got) == list(range(10)), run.got
    assert {RoleId.from_owner(b).master for b in run.matchers} == {RoleId.match("B", 0)}


def test_an_e2e_subscriber_in_another_vhost_handles_each_event_once(run: Run) -> None:
    assert sorted(run.handled) == list(range(10)), run.handled


def test_no_copy_of_the_subscriber_queue_exists_in_other_vhosts(run: Run) -> None:
    assert run.subscriber_queue == {"A": 200, "B": 404, "C": 404}


def test_each_routers_inbox_lives_in_its_clusters_vhost(run: Run) -> None:
    assert run.router_inbox == {"A": 200, "B": 200, "C": 200}


def test_match_brokers_count_each_delivery_once(run: Run) -> None:
    assert run.delivered == 20


def test_the_match_master_reports_matched_replicated_predicted_t_and_hops(run: Run) -> None:
    owner = RoleId.match("B", 0).owner
    text = run.metrics[owner]
    assert (sample(text, EVENTS, cluster="B", role="MatchMaster", outcome="matched") or 0) >= 1
    assert (sample(text, EVENTS, role="MatchMaster", outcome="replicated") or 0) >= 1
    assert sample(text, "qosmq_phoenix_predicted_seconds", broker=owner) is not None
    assert (sample(text, "qosmq_phoenix_hops_count", cluster="B") or 0) >= 1


def test_a_match_slave_reports_its_predicted_t(run: Run) -> None:
    owner = RoleId.match_slave("B", 0, 1).owner
    assert sample(run.metrics[owner], "qosmq_phoenix_predicted_seconds", broker=owner) is not None


def test_the_publishers_router_counts_what_it_forwarded(run: Run) -> None:
    text = run.metrics[RoleId.router("C").owner]
    assert (sample(text, EVENTS, cluster="C", role="RouterMaster", outcome="forwarded") or 0) >= 20


def test_every_inbox_drains_to_zero(run: Run) -> None:
    assert run.settled == dict.fromkeys(run.settled, 0.0)


def test_a_subscription_nobody_confirms_is_said_not_hung(run: Run) -> None:
    assert "did not confirm it in 2 s" in run.unconfirmed
