"""How a role process reaches RabbitMQ: each cluster's settings, its connections (one
per RabbitMQ and vhost, kept across role switches), and the queues roles declare.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import EntityNotFound, NotConnected, RetryableError, Unroutable
from ..phoenix.protocol import PhoenixTopology
from ..settings import Settings
from ..transport import AsyncClient, OutgoingMessage, QueueKind, QueueSpec
from .messages import Message, encode

__all__ = [
    "SEND_FAILURES",
    "Connections",
    "Handler",
    "cluster_settings",
    "inbox_spec",
    "outgoing",
    "process_queue_spec",
    "role_inbox_spec",
]

#: what a role's send to another role may meet that passes: that role's inbox on a node
#: that is down (returned, or its declare refused with 404), a failover, no confirm in
#: time.  The message handled is tried again, then given back (``serving.each``); any
#: other error of a send is the message's own (a frame the broker refuses): dead-lettered
SEND_FAILURES = (RetryableError, Unroutable, EntityNotFound, NotConnected, TimeoutError)


def cluster_settings(
    settings: Settings, topology: PhoenixTopology, cluster: str, source: str | None = None
) -> tuple[str, Settings]:
    """The settings for a cluster's RabbitMQ (its own ``amqp_urls`` and ``vhost``, else
    the process's; reached from cluster ``source`` over the link's own addresses when the
    topology gives that link some), and a key that is the same for clusters sharing one
    RabbitMQ vhost and path (one connection each)."""
    spec = topology.cluster(cluster)
    link = topology.link(source, cluster)
    urls = link.amqp_urls if link else (spec.amqp_urls or settings.amqp_urls)
    vhost = spec.vhost or settings.vhost
    if (urls, vhost) == (settings.amqp_urls, settings.vhost):
        return "default", settings
    return f"{','.join(urls)}|{vhost}", settings.model_copy(
        update={"amqp_urls": urls, "vhost": vhost}
    )


def outgoing(message: Message, queue: str, **options: Any) -> OutgoingMessage:
    """A Phoenix message as every role and client publishes it: JSON, straight to ``queue``."""
    return outgoing_body(encode(message), queue, **options)


def outgoing_body(body: bytes, queue: str, **options: Any) -> OutgoingMessage:
    """An encoded Phoenix message or batch (``batching.encode``), straight to ``queue``.

    Persistent (delivery mode 2): what a durable queue holds (events in a role inbox,
    copies in a subscriber queue) survives its node's restart, as a confirm promises.
    Signals that expire (``expiration_ms``: beats, votes, an operator's requests) are
    transient: a restarted node would only drop them as stale."""
    options.setdefault("persistent", options.get("expiration_ms") is None)
    return OutgoingMessage(body, "", queue, content_type="application/json", **options)


#: a role's handler for one kind of message
Handler = Callable[[Any], Awaitable[None]]


def inbox_spec(name: str, kind: str = "classic") -> QueueSpec:
    """Every role inbox is declared alike (the topology's ``role_queues``), so any role
    may declare any inbox first: classic with priorities, or quorum (no broker
    priorities on RabbitMQ 3.x, which refuses ``x-max-priority`` on quorum queues)."""
    if kind == "quorum":
        return QueueSpec(name, kind=QueueKind.QUORUM)
    return QueueSpec(name, kind=QueueKind.CLASSIC, max_priority=9)


def role_inbox_spec(name: str, topology: PhoenixTopology, client: Any) -> QueueSpec:
    """A role inbox or control queue as ``client``'s broker takes it (the topology's
    ``role_queues``; ``auto`` by what the broker reported at connect)."""
    server = getattr(client, "server", None)
    mirroring = None if server is None else server.classic_mirroring
    return inbox_spec(name, topology.role_queue_kind(mirroring))


def process_queue_spec(name: str) -> QueueSpec:
    """A process's own queue: it lives exactly as long as the process's connection."""
    return QueueSpec(name, kind=QueueKind.CLASSIC, durable=False, exclusive=True, auto_delete=True)


class Connections:
    """A role process's connections: one per RabbitMQ and vhost, shared by the clusters on
    it.  They belong to the process, not to the role it serves: a switch keeps them."""

    def __init__(
        self, settings: Settings, topology: PhoenixTopology, home: str | None = None
    ) -> None:
        self.settings, self.topology = settings, topology
        self.home = home  # the process's cluster: other clusters are reached over its links
        #: the process's own queue (exclusive: gone with its connection), where a master
        #: serving from this process hears that a newer reign fenced it
        self.process_queue = f"{topology.prefix}.process.{uuid.uuid4().hex[:16]}"
        self._clients: dict[str, AsyncClient] = {}  # one per RabbitMQ and vhost
        self._cluster_clients: dict[str, AsyncClient] = {}  # cluster -> its client
        self._connecting: dict[str, asyncio.Future[AsyncClient]] = {}  # key -> first connect

    def known(self, cluster: str) -> AsyncClient | None:
        """``cluster``'s client if one was connected (or is connecting in the background)
        before: what ``client_for`` returns at once, without awaiting."""
        return self._cluster_clients.get(cluster)

    async def client_for(self, cluster: str) -> AsyncClient:
        client = self._cluster_clients.get(cluster)  # the hot path: every forward, delivery
        if client is not None:
            return client
        key, settings = cluster_settings(self.settings, self.topology, cluster, self.home)
        if key not in self._connecting:  # one connection per RabbitMQ and vhost, however
            self._connecting[key] = asyncio.ensure_future(self._connect(key, settings))
        client = await asyncio.shield(self._connecting[key])  # many sends ask at once
        self._cluster_clients[cluster] = client
        return client

    async def _connect(self, key: str, settings: Settings) -> AsyncClient:
        """The first connection to a RabbitMQ: when no node answers (a link cut before
        this process ever used it), the client is kept and goes on connecting in the
        background, so that later sends find it (not ``ready`` until it connects) instead
        of each starting a connection of its own; this first caller hears why."""
        client = AsyncClient(settings=settings)
        try:
            await client.connect()
        except RetryableError:
            client.reconnect_in_background()
            self._clients[key] = client
            self._cluster_clients.update(
                (c.id, client)
                for c in self.topology.clusters
                if cluster_settings(self.settings, self.topology, c.id, self.home)[0] == key
            )
            raise
        except BaseException:
            del self._connecting[key]  # a permanent error (refused): the next asks again
            raise
        self._clients[key] = client
        return client

    async def close(self) -> None:
        clients, self._clients, self._cluster_clients = self._clients, {}, {}
        for connecting in self._connecting.values():
            connecting.cancel()
        self._connecting = {}
        for client in clients.values():
            await client.close()
