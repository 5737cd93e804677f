"""A client whose connect failed, or was cancelled, leaves nothing behind for its
caller to drop."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import pytest

from middleware.errors import BrokerUnreachable
from middleware.settings import Settings
from middleware.transport import AsyncClient


def _closed_port() -> int:
    with socket.socket() as s:  # bound and closed: nothing listens there now
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["refused", "cancelled"])
def test_a_client_whose_connect_did_not_finish_is_dropped_without_a_pending_task(
    caplog, how: str
) -> None:
    """Seen in the role logs: a routing master's connect over a cut link outlived its
    caller's ``wait_for``, the client was dropped, and asyncio logged "Task was destroyed
    but it is pending!" for its loop watch when the collector took it."""
    silent = socket.socket()  # listens, never answers the AMQP handshake
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    port = silent.getsockname()[1] if how == "cancelled" else _closed_port()
    settings = Settings(amqp_urls=f"amqp://127.0.0.1:{port}/", connect_timeout=5)

    async def attempt() -> str:
        try:
            await asyncio.wait_for(AsyncClient(settings=settings).connect(), 0.5)
        except (BrokerUnreachable, TimeoutError) as exc:  # its traceback is not kept
            return type(exc).__name__
        return "connected"

    async def main() -> str:
        outcome = await attempt()
        gc.collect()  # the client is garbage now, with whatever it left pending
        await asyncio.sleep(0.05)
        return outcome

    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            outcome = asyncio.run(main())
    finally:
        silent.close()
    assert outcome == ("TimeoutError" if how == "cancelled" else "BrokerUnreachable")
    assert "Task was destroyed" not in caplog.text
