"""RabbitMQ versions by what the broker reports, against the real brokers (3.10 here): both
faces read the version and capabilities at connect; the Phoenix inbox mirroring takes
the 3.x branch here and, forced to a 4.0 broker's facts, the 4.x one (no ``ha-mode``
policy, one line that says so); the lease queue is one that 4.3 accepts."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client import REGISTRY

from middleware.routing.beats import Beater
from middleware.transport import AsyncClient, SyncClient
from middleware.transport.broker_info import BrokerInfo
from middleware.transport.management import management_get
from tests.integration.phoenix_support import deployment, management, write_topology

pytestmark = pytest.mark.rabbit


def test_both_faces_read_the_version_and_capabilities_at_connect(settings, caplog) -> None:
    async def read() -> BrokerInfo | None:
        async with AsyncClient(settings=settings) as client:
            return client.server

    caplog.set_level(logging.WARNING)
    seen = [asyncio.run(read())]
    sync = SyncClient(settings=settings).connect()
    seen.append(sync.server)
    sync.close()
    version = management_get(settings, "/api/overview")["rabbitmq_version"]
    for info in seen:
        assert info is not None and info.raw_version == version and info.product == "RabbitMQ"
        assert {"publisher_confirms", "basic.nack", "direct_reply_to"} <= info.capabilities
        assert info.version is not None and info.effective == info.version
    value = REGISTRY.get_sample_value(
        "qosmq_broker_info", {"product": "RabbitMQ", "version": version}
    )
    assert value == 1
    if seen[0] is not None and seen[0].classic_mirroring:  # 3.x: nothing to say at connect
        assert "no classic queue mirroring" not in caplog.text


def test_inbox_mirroring_by_the_brokers_version(settings, brokers, tmp_path, name) -> None:
    path, topology = write_topology(tmp_path, name, {"A": {}}, {"inbox_mirrors": 2})
    deployed = deployment(path, tmp_path / "state", settings, ",".join(brokers.urls))
    policy = f"/api/policies/%2F/qosmq-phoenix-{topology.prefix}"
    try:
        forced = deployed.mirror_inboxes(
            ["A"], version_of=lambda _: BrokerInfo.from_version("4.0.5")
        )
        assert len(forced) == 1 and "no classic queue mirroring" in forced[0]
        assert "quorum queues (role_queues = auto)" in forced[0]  # the asked-for HA holds
        assert management(settings, "GET", policy) == 404  # the 4.x branch set none
        real = BrokerInfo.from_version(
            management_get(settings, "/api/overview")["rabbitmq_version"]
        )
        if not real.classic_mirroring:
            pytest.skip(f"{real.describe()} has no classic mirroring: the 3.x branch is not here")
        assert deployed.mirror_inboxes(["A"]) == []
        assert management(settings, "GET", policy) == 200  # the 3.x branch: ha-mode policy
    finally:
        management(settings, "DELETE", policy)


@pytest.mark.parametrize(
    ("role_queues", "mirrors", "version", "kind"),
    [
        ("auto", 2, None, "classic"),  # this broker (3.10): classic, mirrored by policy
        ("auto", 2, "4.0.5", "quorum"),  # 4.x asked for replicas: quorum
        ("auto", 0, "4.0.5", "classic"),  # 4.x, no replicas asked for
        ("classic", 2, "4.3.0", "classic"),  # as named
        ("quorum", 0, None, "quorum"),
    ],
)
def test_role_queues_by_the_brokers_version(
    settings, tmp_path, name, role_queues, mirrors, version, kind
) -> None:
    """A role queue declared through a real client whose broker facts are this broker's
    or forced to a 4.x one: the type the topology's ``role_queues`` asks for there, as the
    broker holds it (RabbitMQ 3.10 serves quorum role queues, without priorities)."""
    from middleware.routing.wiring import role_inbox_spec

    _, topology = write_topology(
        tmp_path, name, {"A": {}}, {"inbox_mirrors": mirrors, "role_queues": role_queues}
    )
    queue = f"{topology.prefix}.A.router.inbox"

    async def declare() -> None:
        async with AsyncClient(settings=settings) as client:
            if version is not None:
                client.server = BrokerInfo.from_version(version)
            await client.declare_queue(role_inbox_spec(queue, topology, client))

    asyncio.run(declare())
    try:
        held = management_get(settings, f"/api/queues/%2F/{queue}")
        assert held["type"] == kind
        assert ("x-max-priority" in held["arguments"]) == (kind == "classic")
    finally:
        management(settings, "DELETE", f"/api/queues/%2F/{queue}")


def test_the_lease_queue_is_one_rabbitmq_4_3_accepts() -> None:
    spec = Beater._lease_spec("px.process.1.lease.1")
    assert spec.durable or spec.exclusive  # 4.3 refuses transient non-exclusive queues
    assert not spec.exclusive  # watchers on other connections consume it
    assert spec.arguments.get("x-expires")  # gone once nobody uses it
