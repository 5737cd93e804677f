"""Test doubles for services built on the layer: an in-memory broker and clients with the
API of :class:`~middleware.transport.AsyncClient` and :class:`~middleware.transport.SyncClient`.

::

    from middleware.testing import InMemoryBroker, InMemoryClient

    async def test_orders_are_confirmed_end_to_end():
        broker = InMemoryBroker()
        async with InMemoryClient(broker=broker) as client:
            ...  # the same calls as on AsyncClient, confirm publishers included

One contract suite runs against the real brokers and these doubles
(``tests/integration/test_transport_contract.py`` and ``test_confirms_contract.py``), so
the doubles cannot drift from what the real clients do.  What they leave out is listed in
``broker.py``; nothing here opens a socket.
"""

from .broker import InMemoryBroker
from .clients import InMemoryClient, InMemorySyncClient, default_broker

__all__ = ["InMemoryBroker", "InMemoryClient", "InMemorySyncClient", "default_broker"]
