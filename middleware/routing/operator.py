"""The operator's requests to running routing masters (``qosmq phoenix reconfigure``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable

from ..errors import MiddlewareError, Unroutable
from ..settings import Settings
from ..transport import AsyncClient, Delivery
from .ids import RoleId
from .messages import Answer, Configure, parse
from .protocol import MAX_PRIORITY, PhoenixTopology
from .wiring import cluster_settings, inbox_spec, outgoing

__all__ = ["reconfigure"]

log = logging.getLogger(__name__)


async def reconfigure(
    settings: Settings,
    topology: PhoenixTopology,
    clusters: Iterable[str],
    *,
    outer: bool | None = None,
    inner: bool | None = None,
    blind_dispatch: str | None = None,
    batch_max: int | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Switch ``outer``/``inner``/``blind_dispatch`` (and ``batch_max``) live on the
    routing and match masters of ``clusters`` (through their control queues, ahead of
    any backlog); return the control queues of the masters that confirmed. Raises
    :class:`MiddlewareError` naming the ones that did not answer in ``timeout_s``."""
    asked = (
        ("outer", outer),
        ("inner", inner),
        ("blind_dispatch", blind_dispatch),
        ("batch_max", batch_max),
    )
    switches = {k: v for k, v in asked if v is not None}
    request = uuid.uuid4().hex
    expected: set[str] = set()
    confirmed: set[str] = set()
    done = asyncio.Event()
    clients: dict[str, AsyncClient] = {}
    tags: dict[str, str] = {}

    async def on_reply(delivery: Delivery) -> None:
        reply = parse(delivery.body, "configure answer")
        if isinstance(reply, Answer) and reply.request == request:
            confirmed.add(reply.broker)
            if expected <= confirmed:
                done.set()

    reply_queue = f"{topology.prefix}.configure.{request}"
    message = Configure(switches=switches, request=request, reply_to=reply_queue)
    try:
        targets: list[tuple[AsyncClient, str]] = []
        for cluster in clusters:  # every master expected before any is asked (replies race)
            spec = topology.cluster(cluster)
            key, cluster_conf = cluster_settings(settings, topology, cluster)
            if key not in clients:
                client = await AsyncClient(settings=cluster_conf).connect()
                clients[key] = client
                await client.declare_queue(inbox_spec(reply_queue))
                tags[key] = await client.consume(reply_queue, on_reply)
            masters = [RoleId.router(cluster)]
            masters += [RoleId.match(cluster, i) for i in range(spec.match_masters)]
            for master in masters:  # each master answers with the queue it was asked on
                targets.append((clients[key], master.control(topology.prefix)))
                expected.add(master.control(topology.prefix))
        for client, control in targets:
            # not declared: a master that never ran has no control queue (unroutable),
            # and one that is down does not apply a stale switch when it comes back
            with contextlib.suppress(Unroutable):
                await client.publish(
                    outgoing(
                        message, control, priority=MAX_PRIORITY, expiration_ms=int(timeout_s * 1000)
                    )
                )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s if expected else 0):
                await done.wait()
    finally:
        for key, client in clients.items():
            with contextlib.suppress(Exception):
                if key in tags:  # first: a queue deleted under its consumer logs a warning
                    await client.cancel(tags[key])
                await client.delete_queue(reply_queue)
            await client.close()
    missing = expected - confirmed
    if missing:
        raise MiddlewareError(
            f"no confirmation of {switches} in {timeout_s:.0f} s from {', '.join(sorted(missing))}"
        )
    return sorted(confirmed)
