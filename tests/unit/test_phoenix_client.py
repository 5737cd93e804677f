"""``client``: what a Phoenix client refuses before any I/O."""

from __future__ import annotations

import pytest


def test_a_phoenix_client_refuses_a_connection_to_another_clusters_rabbitmq() -> None:
    from middleware.errors import ConfigurationError
    from middleware.phoenix.protocol import PhoenixTopology
    from middleware.routing.client import PhoenixClient
    from middleware.settings import Settings
    from middleware.transport import AsyncClient

    topology = PhoenixTopology.model_validate(
        {"clusters": [{"id": "A"}, {"id": "B", "vhost": "/b"}]}
    )
    client = AsyncClient(settings=Settings.load())  # never connected: refused before any I/O
    PhoenixClient(client, topology=topology, cluster="A")
    with pytest.raises(ConfigurationError, match=r"cluster 'B' is on .* vhost '/b'"):
        PhoenixClient(client, topology=topology, cluster="B")
    with pytest.raises(ConfigurationError, match="not in the topology"):
        PhoenixClient(client, topology=topology, cluster="Z")


@pytest.mark.parametrize("face", ["async", "sync"])
def test_a_subscribe_to_an_empty_queue_name_is_a_filter_error_not_a_validation_error(
    face,
) -> None:
    import asyncio

    from middleware.phoenix.protocol import PhoenixTopology
    from middleware.routing import FilterError
    from middleware.routing.client import PhoenixClient, SyncPhoenixClient
    from middleware.settings import Settings
    from middleware.transport import AsyncClient, SyncClient

    topology = PhoenixTopology.model_validate({"clusters": [{"id": "A"}]})
    settings = Settings.load()
    with pytest.raises(FilterError, match="queue"):  # refused before any I/O
        if face == "async":
            client = PhoenixClient(AsyncClient(settings=settings), topology=topology, cluster="A")
            asyncio.run(client.subscribe("quotes", [("price", "<", 10)], 1, queue=""))
        else:
            sync = SyncPhoenixClient(SyncClient(settings=settings), topology=topology, cluster="A")
            sync.subscribe("quotes", [("price", "<", 10)], 1, queue="")
