"""Dispatch inside a cluster without the inner mechanism: round robin over the master and
its two slaves, blind to load (the paper's base system), or with ``blind_dispatch =
"master"`` the master alone; both switched live with ``qosmq phoenix configure``. Events
go one at a time: no backlog anywhere. And a live switch nobody answers."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import pytest

from middleware.errors import MiddlewareError
from middleware.phoenix.ids import RoleId
from middleware.phoenix.protocol import PhoenixTopology
from middleware.routing.client import PhoenixClient
from middleware.routing.operator import reconfigure
from middleware.transport import AsyncClient
from tests.integration.phoenix_support import attribute, cli, event, eventually_async, running, take

pytestmark = [pytest.mark.rabbit, pytest.mark.slow]
BROKERS_OF_A = [RoleId.match("A", 0), *(RoleId.match_slave("A", 0, j) for j in (0, 1))]


@dataclass
class Run:
    round_robin: list[str]  # the broker that matched each event, in order
    master: list[str]  # ... after the switch to blind_dispatch = "master"
    duplicates: int  # events delivered more than once


@pytest.fixture(scope="module")
def run(brokers, module_settings, module_name, tmp_path_factory) -> Run:
    settings, name = module_settings, module_name
    queue = f"{name}.subscriber"
    seen: Counter[str] = Counter()

    async def round_of(client: AsyncClient, at_a: PhoenixClient, tag: str, n: int) -> list[str]:
        """Publish ``n`` events one after another; the broker that matched each."""
        by: dict[str, str] = {}
        for i in range(n):
            await at_a.publish(event("quotes", n=f"{tag}{i}"))

            async def arrived(i: int = i) -> bool:
                for m in await take(client, queue):
                    seen[attribute(m)] += 1
                    by[attribute(m)] = m["broker"]
                return f"{tag}{i}" in by

            await eventually_async(arrived, f"{tag}{i}", 10, interval=0.01, strict=False)
        return [by.get(f"{tag}{i}", "missing") for i in range(n)]

    async def scenario(deployed) -> Run:
        async with AsyncClient(settings=settings) as client:
            at_a = PhoenixClient(client, topology=deployed.topology, cluster="A")
            await at_a.subscribe("quotes", [("n", "exists")], 1, queue)
            await asyncio.sleep(2)  # every slave has reported (heartbeats every 0.5 s)
            rr = await round_of(client, at_a, "rr", 30)
            await asyncio.to_thread(cli, deployed, "configure", "--blind-dispatch", "master")
            master = await round_of(client, at_a, "m", 12)
            await client.delete_queue(queue)
            return Run(rr, master, sum(c > 1 for c in seen.values()))

    clusters = {"A": {"match_slaves": 2, "routing_slaves": 0}}
    directory = tmp_path_factory.mktemp("dispatch")
    with running(directory, name, settings, ",".join(brokers.urls), clusters) as deployed:
        cli(deployed, "configure", "--inner", "off")
        return asyncio.run(scenario(deployed))


def test_round_robin_takes_turns_over_the_master_and_its_slaves(run: Run) -> None:
    assert Counter(run.round_robin) == {r.owner: 10 for r in BROKERS_OF_A}


def test_blind_dispatch_master_keeps_every_event_at_the_master(run: Run) -> None:
    assert set(run.master) == {RoleId.match("A", 0).owner}


def test_no_event_is_delivered_twice(run: Run) -> None:
    assert run.duplicates == 0


def test_live_configure_names_the_masters_that_did_not_answer(settings, name) -> None:
    """Nothing runs for this topology: the switch is not confirmed and says by whom."""
    topology = PhoenixTopology.model_validate({"prefix": name, "clusters": [{"id": "A"}]})
    with pytest.raises(
        MiddlewareError, match=rf"{name}\.A\.match\.0\.control, {name}\.A\.router\.control"
    ):
        asyncio.run(reconfigure(settings, topology, ["A"], inner=False, timeout_s=1.0))
