"""The operator's requests to running roles (``qosmq phoenix reconfigure``,
``qosmq phoenix takeover``), over one request/answer helper: :class:`Requests` asks
through control queues (ahead of any backlog, expiring when the request would be stale)
and collects the :class:`~middleware.routing.messages.Answer` each role sends back to a
reply queue of the request's own, on each RabbitMQ asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable
from types import TracebackType

from ..errors import MiddlewareError, Unroutable
from ..phoenix.ids import RoleId
from ..phoenix.protocol import MAX_PRIORITY, PhoenixTopology
from ..settings import Settings
from ..transport import AsyncClient, Delivery
from .messages import Answer, Configure, Message, Takeover, parse
from .wiring import cluster_settings, inbox_spec, outgoing

__all__ = ["Requests", "reconfigure", "take_over"]

log = logging.getLogger(__name__)


class Requests:
    """One request to running roles: its id, its reply queue (declared on each RabbitMQ
    asked), the answers (what each role named itself by) as they come."""

    POLL_S = 0.1  # how often ``until`` asks its condition when no answer comes

    def __init__(self, settings: Settings, topology: PhoenixTopology, what: str) -> None:
        self.settings, self.topology, self.what = settings, topology, what
        self.request = uuid.uuid4().hex
        self.reply_to = f"{topology.prefix}.{what}.{self.request}"
        self.answers: set[str] = set()
        self._news = asyncio.Event()
        self._clients: dict[str, AsyncClient] = {}
        self._tags: dict[str, str] = {}

    async def __aenter__(self) -> Requests:
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def client_for(self, cluster: str) -> AsyncClient:
        """A connection to ``cluster``'s RabbitMQ, its reply queue consumed (once per
        RabbitMQ and vhost)."""
        key, conf = cluster_settings(self.settings, self.topology, cluster)
        if key not in self._clients:
            client = self._clients[key] = await AsyncClient(settings=conf).connect()
            await client.declare_queue(inbox_spec(self.reply_to))
            self._tags[key] = await client.consume(self.reply_to, self._on_reply)
        return self._clients[key]

    async def _on_reply(self, delivery: Delivery) -> None:
        reply = parse(delivery.body, f"{self.what} answer")
        if isinstance(reply, Answer) and reply.request == self.request:
            self.answers.add(str(reply.broker))
            self._news.set()

    async def ask(self, cluster: str, control: str, message: Message, timeout_s: float) -> bool:
        """``message`` to the control queue ``control``, expiring after ``timeout_s``;
        False when no such queue exists (not declared here: a role that never ran has
        none, and one that is down does not act on a stale request when it comes back)."""
        client = await self.client_for(cluster)
        expiration_ms = int(timeout_s * 1000)
        try:
            await client.publish(
                outgoing(message, control, priority=MAX_PRIORITY, expiration_ms=expiration_ms)
            )
        except Unroutable:
            return False
        return True

    async def until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``done()`` (asked at each answer and every ``POLL_S``); whether
        it was before ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                while not done():
                    self._news.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._news.wait(), self.POLL_S)
                return True
        return done()

    async def close(self) -> None:
        for key, client in self._clients.items():
            with contextlib.suppress(Exception):
                if key in self._tags:  # first: a queue deleted under its consumer warns
                    await client.cancel(self._tags[key])
                await client.delete_queue(self.reply_to)
            await client.close()
        self._clients.clear()


async def reconfigure(
    settings: Settings,
    topology: PhoenixTopology,
    clusters: Iterable[str],
    *,
    outer: bool | None = None,
    inner: bool | None = None,
    blind_dispatch: str | None = None,
    batch_max: int | None = None,
    batch_linger_ms: float | None = None,
    timeout_s: float = 30.0,
) -> list[str]:
    """Switch ``outer``/``inner``/``blind_dispatch`` (and ``batch_max``,
    ``batch_linger_ms``) live on the routing and match masters of ``clusters`` (through
    their control queues, ahead of any backlog); return the control queues of the
    masters that confirmed. Raises :class:`MiddlewareError` naming the ones that did not
    answer in ``timeout_s``."""
    asked = (
        ("outer", outer),
        ("inner", inner),
        ("blind_dispatch", blind_dispatch),
        ("batch_max", batch_max),
        ("batch_linger_ms", batch_linger_ms),
    )
    switches = {k: v for k, v in asked if v is not None}
    expected: set[str] = set()
    async with Requests(settings, topology, "configure") as requests:
        message = Configure(switches=switches, request=requests.request, reply_to=requests.reply_to)
        targets: list[tuple[str, str]] = []
        for cluster in clusters:  # every master expected before any is asked (replies race)
            spec = topology.cluster(cluster)
            await requests.client_for(cluster)
            masters = [RoleId.router(cluster)]
            masters += [RoleId.match(cluster, i) for i in range(spec.match_masters)]
            for master in masters:  # each master answers with the queue it was asked on
                targets.append((cluster, master.control(topology.prefix)))
                expected.add(master.control(topology.prefix))
        for cluster, control in targets:
            await requests.ask(cluster, control, message, timeout_s)  # (missing if not)
        await requests.until(lambda: expected <= requests.answers, timeout_s)
        confirmed = set(requests.answers)
    missing = expected - confirmed
    if missing:
        raise MiddlewareError(
            f"no confirmation of {switches} in {timeout_s:.0f} s from {', '.join(sorted(missing))}"
        )
    return sorted(confirmed)


async def take_over(
    settings: Settings,
    topology: PhoenixTopology,
    slave: RoleId,
    *,
    timeout_s: float = 30.0,
    served: Callable[[], bool] | None = None,
) -> str:
    """Tell ``slave`` to serve its master's role; return once it does (the master's id).
    ``served``: says whether it serves it already (its slaves' election may win while
    the message waits in a control queue the switching process no longer reads).

    Raises :class:`MiddlewareError` when ``slave`` is no slave of the topology, or when
    it did not answer in ``timeout_s`` (it may not be running)."""
    if not slave.is_slave or not slave.in_topology(topology):
        raise MiddlewareError(f"{slave} is not a slave in the topology: nothing to take over")
    async with Requests(settings, topology, "takeover") as requests:
        message = Takeover(
            master=slave.master.owner, request=requests.request, reply_to=requests.reply_to
        )
        if not await requests.ask(
            slave.cluster, slave.control(topology.prefix), message, timeout_s
        ):
            raise MiddlewareError(f"{slave} has no control queue: is it running?")

        def finished() -> bool:
            return bool(requests.answers) or (served is not None and served())

        if not await requests.until(finished, timeout_s):
            raise MiddlewareError(f"{slave} did not take over {slave.master} in {timeout_s:.0f} s")
        return next(iter(requests.answers), slave.master.owner)
