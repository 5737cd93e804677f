"""A balanced publisher of either face, driven from an asyncio test body: the asyncio
core's ``BalancedPublisher`` on an ``AsyncClient``, or the sync face's
``SyncBalancedPublisher`` on a ``SyncClient`` whose calls run in one thread of their
own (a sync service's publishing thread).  The scenarios of the weighted-dispatch
cells are written once and run over both."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from middleware.balancer import BalancedPublisher, SyncBalancedPublisher
from middleware.settings import Settings
from middleware.transport import AsyncClient, SyncClient

FACES = ("async", "sync")


class Balanced:
    """``publish``, ``close`` and the publisher's counters (``routed``, ``resent``,
    ``missing``, ``report``…), whichever face runs it."""

    def __init__(self, face: str, settings: Settings, **options: Any) -> None:
        self.face, self.settings, self.options = face, settings, options
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="sync-publisher")
        self.publisher: BalancedPublisher | SyncBalancedPublisher | None = None
        self._client: AsyncClient | SyncClient | None = None

    async def _in_thread(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, functools.partial(call, *args, **kwargs)
        )

    async def start(self) -> Balanced:
        if self.face == "async":
            client = await AsyncClient(settings=self.settings).connect()
            self._client = client
            self.publisher = await BalancedPublisher(client, **self.options).start()
        else:

            def start() -> None:
                client = SyncClient(settings=self.settings).connect()
                self._client = client
                self.publisher = SyncBalancedPublisher(client, **self.options).start()

            await self._in_thread(start)
        return self

    async def publish(self, body: bytes, **fields: Any) -> str:
        publisher = self.publisher
        if isinstance(publisher, BalancedPublisher):
            return await publisher.publish(body, **fields)
        assert publisher is not None
        result: str = await self._in_thread(publisher.publish, body, **fields)
        return result

    async def publish_each(
        self, count: int, pause: float
    ) -> tuple[list[str], list[str], list[float]]:
        """``count`` messages ``m0``, ``m1``… one at a time, ``pause`` s apart: the ids
        confirmed, the failures (as ``repr``), and how long each publish took."""
        from middleware.errors import MiddlewareError

        confirmed, failed, took = [], [], []
        for i in range(count):
            started = time.monotonic()
            try:
                await self.publish(b"m", message_id=f"m{i}")
                confirmed.append(f"m{i}")
            except MiddlewareError as exc:
                failed.append(repr(exc)[:200])
            took.append(time.monotonic() - started)
            await asyncio.sleep(pause)
        return confirmed, failed, took

    async def look(self) -> None:
        """The sync face's look for a report (the asyncio face is told by a consumer)."""
        if isinstance(self.publisher, SyncBalancedPublisher):
            await self._in_thread(self.publisher.look)

    async def close(self) -> None:
        client, publisher = self._client, self.publisher
        if isinstance(publisher, BalancedPublisher):
            await publisher.close()
            assert isinstance(client, AsyncClient)
            await client.close()
        elif publisher is not None:
            assert isinstance(client, SyncClient)
            await self._in_thread(publisher.close)
            await self._in_thread(client.close)
        self._thread.shutdown(wait=False)

    def __getattr__(self, attribute: str) -> Any:  # the publisher's counters
        if attribute.startswith("_") or self.publisher is None:
            raise AttributeError(attribute)
        return getattr(self.publisher, attribute)
