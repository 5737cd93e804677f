"""Load sharing across the cluster's nodes (EMQ's producer-side server choice).

A :class:`NodePool` keeps one connection per node and a pluggable rule picks the
connection for each direct enqueue.  Nodes that join are learned from the
cluster itself: the management API's listener list (``/api/overview``) names
every node's AMQP port, polled every ``discover_every`` seconds - the paper's
"new server available" notice.

Opt-in: one producer spread over several connections no longer keeps its
messages in order (different channels interleave), which the single-connection
default guarantees.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from ..settings import Settings
from ..transport import AsyncClient
from ..transport.management import management_get

__all__ = ["LeastLoaded", "NodePool", "RoundRobin", "SharingRule"]

log = logging.getLogger(__name__)


class SharingRule(Protocol):
    """Chooses the connection for the next enqueue among the ready ones."""

    def pick(self, candidates: Sequence[AsyncClient]) -> AsyncClient: ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[AsyncClient]) -> AsyncClient:
        return candidates[next(self._turn) % len(candidates)]


class LeastLoaded:
    """The connection with the fewest enqueues in flight (ties: first)."""

    def __init__(self) -> None:
        self.in_flight: dict[int, int] = {}

    def pick(self, candidates: Sequence[AsyncClient]) -> AsyncClient:
        return min(candidates, key=lambda c: self.in_flight.get(id(c), 0))


class NodePool:
    """One client per known node; grows when the cluster reports a new node."""

    def __init__(
        self, settings: Settings, *, rule: SharingRule | None = None, discover_every: float = 10.0
    ) -> None:
        self.settings, self.rule = settings, rule or RoundRobin()
        self.discover_every = discover_every
        self.clients: dict[str, AsyncClient] = {}
        self.sent: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> NodePool:
        for host, port, tls in self.settings.nodes:
            await self._add(host, port, tls)
        await self.discover()
        self._task = asyncio.create_task(self._discover_loop())
        return self

    def pick(self) -> tuple[str, AsyncClient] | None:
        ready = [(url, c) for url, c in self.clients.items() if c.ready]
        if not ready:
            return None
        chosen = self.rule.pick([c for _, c in ready])
        url = next(u for u, c in ready if c is chosen)
        self.sent[url] = self.sent.get(url, 0) + 1
        return url, chosen

    async def discover(self) -> list[str]:
        """Ask the cluster for every node's AMQP listener; connect to the new ones."""
        try:
            listeners = await asyncio.get_running_loop().run_in_executor(None, self._listeners)
        except (OSError, ValueError) as exc:
            log.debug("node discovery unavailable: %s", exc)
            return []
        added = []
        tls = self.settings.nodes[0][2]
        for item in listeners:
            if item.get("protocol") not in ("amqp", "amqp/ssl"):
                continue
            host = item.get("ip_address") or self.settings.nodes[0][0]
            host = self.settings.nodes[0][0] if host in ("::", "0.0.0.0") else host
            url = await self._add(host, int(item["port"]), tls)
            if url is not None:
                log.info("new server available: %s (node %s)", url, item.get("node"))
                added.append(url)
        return added

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in self.clients.values():
            await client.close()

    async def _add(self, host: str, port: int, tls: bool) -> str | None:
        url = f"{'amqps' if tls else 'amqp'}://{host}:{port}/"
        if url in self.clients:
            return None
        others = tuple(u for u in self.settings.amqp_urls if u != url)
        client = AsyncClient(
            settings=self.settings.model_copy(update={"amqp_urls": (url, *others)})
        )
        try:
            await client.connect()
        except Exception as exc:  # a node that is down now is tried again on failover
            log.info("node %s not reachable yet: %s", url, exc)
            client.reconnect_in_background()
        self.clients[url] = client
        return url

    async def _discover_loop(self) -> None:
        while True:
            await asyncio.sleep(self.discover_every)
            await self.discover()

    def _listeners(self) -> list[dict[str, Any]]:
        listeners: list[dict[str, Any]] = management_get(self.settings, "/api/overview").get(
            "listeners", []
        )
        return listeners
