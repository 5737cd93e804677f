"""``roles``: what the role drivers do with the store (snapshots, writes that do not
stall the loop) and with a cluster's connection settings."""

from __future__ import annotations

from typing import Any

from middleware.routing.records import LatencyEntry


def _role(cls: type, cluster: dict[str, object], state_store: str = ":memory:") -> Any:
    """One Phoenix role of cluster B built in-process (its I/O is not started)."""
    from middleware.phoenix.protocol import PhoenixTopology
    from middleware.settings import Settings

    topology = PhoenixTopology.model_validate({"clusters": [cluster], "state_store": state_store})
    return cls(settings=Settings.load(), topology=topology, cluster=cluster["id"])


def test_masters_snapshot_their_table_periodically(tmp_path) -> None:
    import asyncio

    from middleware.routing.replicas import TOMBSTONE
    from middleware.routing.router_roles import RouterMaster

    async def scenario() -> None:
        router = _role(RouterMaster, {"id": "B"}, str(tmp_path / "s.sqlite3"))
        replicas = router.replicas
        await replicas.write("a", LatencyEntry(1, 1).to_document())
        await replicas.write("b", LatencyEntry(2, 1).to_document())
        await replicas.write("b", None)  # deleted: a tombstone
        router.store.snapshot("B/router", "routing_table", {})  # the store lost its copy
        assert await replicas.persist_once() is True
        assert await replicas.persist_once() is False  # nothing changed since
        saved = router.store.load("B/router", "routing_table")
        assert saved == {"a": (1, LatencyEntry(1, 1).to_document()), "b": (3, TOMBSTONE)}
        stop = asyncio.Event()
        loop = asyncio.create_task(replicas.persist_loop(0.05, stop))
        await replicas.write("c", LatencyEntry(5, 1).to_document())
        await asyncio.sleep(0.2)
        stop.set()
        await loop
        assert router.store.load("B/router", "routing_table")["c"][0] == 4
        assert router.counters["snapshots"] == 2
        router.store.close()

    asyncio.run(scenario())


def test_a_replica_write_does_not_stall_the_loop_while_the_store_is_busy(tmp_path) -> None:
    import asyncio
    import threading
    import time

    from middleware.routing.router_roles import RouterMaster

    async def scenario() -> None:
        router = _role(RouterMaster, {"id": "B"}, str(tmp_path / "s.sqlite3"))
        held = threading.Event()

        def snapshot_elsewhere() -> None:  # another thread holds the store for 0.5 s
            with router.store._lock:
                held.set()
                time.sleep(0.5)

        busy = threading.Thread(target=snapshot_elsewhere)
        busy.start()
        held.wait()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        await router.replicas.write("a", LatencyEntry(1, 1).to_document())
        during = ticks - before
        tick.cancel()
        busy.join()
        assert during >= 5, during  # the loop went on while the write waited for the store
        assert router.store.load("B/router", "routing_table")["a"][0] == 1
        router.store.close()

    asyncio.run(scenario())


def test_clusters_on_one_rabbitmq_share_a_connection_key() -> None:
    from middleware.phoenix.protocol import PhoenixTopology
    from middleware.routing.wiring import cluster_settings
    from middleware.settings import Settings

    own = ["amqp://127.0.0.1:6001/"]
    topology = PhoenixTopology.model_validate(
        {
            "clusters": [
                {"id": "A"},
                {"id": "B", "amqp_urls": own},
                {"id": "C", "amqp_urls": own},
                {"id": "D", "vhost": "/d"},
                {"id": "E", "amqp_urls": own, "vhost": "/d"},
            ]
        }
    )
    settings = Settings.load()
    assert cluster_settings(settings, topology, "A") == ("default", settings)
    key_b, settings_b = cluster_settings(settings, topology, "B")
    assert key_b == cluster_settings(settings, topology, "C")[0] == f"{own[0]}|/"
    assert list(settings_b.amqp_urls) == own and settings_b.vhost == "/"
    # a vhost of the process's own RabbitMQ, and one of another RabbitMQ: each its own key
    key_d, settings_d = cluster_settings(settings, topology, "D")
    assert settings_d.amqp_urls == settings.amqp_urls and settings_d.vhost == "/d"
    key_e, settings_e = cluster_settings(settings, topology, "E")
    assert list(settings_e.amqp_urls) == own and settings_e.vhost == "/d"
    assert len({"default", key_b, key_d, key_e}) == 4
