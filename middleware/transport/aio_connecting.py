"""The connection of an ``AsyncClient`` (a part of it, ``aio.py``): opening one to a
node and replaying the recorded topology on it, failing over when it is lost, closing
with the event loop, and running declares on short-lived channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection
from tenacity import AsyncRetrying, retry_if_exception_type

from ..errors import (
    AccessRefused,
    BrokerUnreachable,
    EntityNotFound,
    MiddlewareError,
    NotConnected,
    SubscribeTimeout,
)
from . import metrics, quiet
from .aio_live import (
    ClientState,
    Down,
    Live,
    frame_max,
    on_channel_of,
)
from .aio_watch import WatchedReplies
from .broker_info import BrokerInfo
from .coalesce import CoalescingConnection, WatchedConnection
from .message import tls_context
from .outbound import Limits
from .policy import Node, async_retrying, backoff
from .replay import HOME_DOWN, NOT_THERE, UNREACHABLE, VANISHED, Replay, Verdict
from .topology import BindingSpec, ConsumerSpec, ExchangeSpec, QueueSpec
from .translate import refusal_code, translate_aio

log = logging.getLogger(__name__)


class Connecting(ClientState):
    """A connection to one node, failover to the next, the topology replayed."""

    async def _open(self, node: Node) -> None:
        """Connect to ``node``, open channels, replay the topology; raise translated errors."""
        quiet.install()  # a lost connection: one line, not aiormq's traceback
        # aio_pika.connect() drops a connection whose handshake failed without closing it;
        # its __del__ then makes a close() coroutine that, collected off the loop, is never
        # awaited.  Build it here so that a failed connect is closed on this loop.
        connection_class = (  # amqps: aiormq's own writer
            CoalescingConnection
            if self.settings.coalesce_writes and not node.tls
            else WatchedConnection
        )
        connection = connection_class(
            aio_pika.connection.make_url(
                host=node.host,
                port=node.port,
                login=self.settings.username,
                password=self.settings.password.get_secret_value(),
                virtualhost=self.settings.vhost,
                ssl=node.tls,
                heartbeat=self.settings.heartbeat,
            ),
            ssl_context=tls_context(self.settings) if node.tls else None,
            client_properties={"connection_name": self.settings.client_name},
        )
        try:
            await connection.connect(timeout=self.settings.connect_timeout)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await connection.close()
            if isinstance(exc, Exception):
                raise translate_aio(exc) from exc
            raise
        try:
            live = Live(
                node=node,
                connection=connection,
                confirm_channel=await connection.channel(
                    publisher_confirms=True, on_return_raises=True
                ),
                replies=WatchedReplies(
                    connection,
                    policy=self.settings.retry,
                    linger_s=self.settings.publish_timeout,
                    resend=self._resend_watched,
                ),
                limits=Limits(
                    frame_max=frame_max(connection),
                    max_message_size=self.settings.max_message_size,
                ),
            )
            self._live = live
            await live.replies.open()
            await self._start_replies(live)
            replay = Replay(declared=frozenset(self.topology.queues))
            for spec in list(self.topology.replay_plan()):
                await self._replay(live, replay, spec)
        except BaseException as exc:
            self._live = Down()
            with contextlib.suppress(Exception):
                await connection.close()
            if isinstance(exc, Exception):
                raise translate_aio(exc) from exc
            raise
        connection.close_callbacks.add(self._on_connection_closed)
        self._fatal = None
        underlay = getattr(connection.transport, "connection", None)
        self.server = BrokerInfo.from_properties(getattr(underlay, "server_properties", None))
        metrics.broker_connected(log, self.server)
        self._ready.set()
        log.debug("connected to %s (%s)", node, self.server.describe())

    async def _replay(self, live: Live, replay: Replay, spec: Any) -> None:
        """One step of a failover's replay, as ``Replay`` says (the pika face does the same)."""
        verdict, why = replay.before(spec), HOME_DOWN
        if verdict is Verdict.APPLY:
            try:
                await self._apply(live, spec)
                return
            except SubscribeTimeout:
                if not isinstance(spec, ConsumerSpec):
                    raise
                verdict, why = Verdict.LATER, "no answer to its subscription"
            except EntityNotFound:
                verdict, why = replay.not_found(spec), NOT_THERE
                if verdict is Verdict.RAISE:
                    raise
        if verdict is Verdict.REDECLARE:
            assert isinstance(spec, ConsumerSpec)
            log.info(VANISHED, spec.queue)
            try:
                await self._apply(live, self.topology.queues[spec.queue])
                await self._apply(live, spec)
                return
            except (EntityNotFound, SubscribeTimeout) as exc:
                verdict, why = Verdict.LATER, str(exc)
        if verdict is Verdict.LATER:
            assert isinstance(spec, ConsumerSpec)
            self._subscribe_later(live, spec.tag, why)
        elif isinstance(spec, QueueSpec):
            log.warning(UNREACHABLE, spec.name)

    def _stop_loop_watch(self) -> None:
        """After a failed or cancelled ``connect``: the caller may drop the client, and a
        watch left pending would be collected with it ("Task was destroyed but it is
        pending!", seen when a link's connect outlived its caller's timeout)."""
        if self._reconnect_task is not None and not self._reconnect_task.done():
            return  # reconnecting in the background: it watches on
        watch, self._loop_watch = self._loop_watch, None
        if watch is not None:
            watch.cancel()

    def _watch_loop_end(self) -> None:
        """Start a task that only waits, so that the end of the event loop shows.

        ``asyncio.run`` (and every runner like it) cancels all remaining tasks when its
        main coroutine returns: aiormq's reader with them, and the connection then closes
        with a CancelledError, as it does when aiormq finds it stuck (missed heartbeats).
        This task is cancelled only by us (``close``) or by that sweep, so a client left
        open at the end of the loop stops instead of failing over into a closing loop."""
        if self._loop_watch is None or self._loop_watch.done():
            self._loop_watch = asyncio.ensure_future(self._wait_for_loop_end())

    async def _wait_for_loop_end(self) -> None:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            if asyncio.current_task() is not self._loop_watch:
                raise  # stopped by _stop_loop_watch: a connect that failed, nothing to close
            if not self._closing:
                log.debug("event loop ending with the client open: closing it, not failing over")
                self._closing = True
                if self._reconnect_task is not None:
                    self._reconnect_task.cancel()
                # Close within the sweep (it waits for this task): left to the cancelled
                # reader, aio-pika's channel-close callbacks start tasks after the sweep and
                # the loop closes under them ("Task was destroyed", "Event loop is closed").
                live, self._live = self._live, Down()
                if isinstance(live, Live):
                    live.replies.close()
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(live.connection.close(), 2.0)
            raise

    def _loop_ending(self) -> bool:
        watch = self._loop_watch
        return watch is not None and (watch.done() or watch.cancelling() > 0)

    def _on_connection_closed(self, connection: object, exc: BaseException | None) -> None:
        live = self._live
        if self._closing or not isinstance(live, Live) or live.connection is not connection:
            return
        live.replies.close()
        if self._loop_ending():  # cancelled with every other task; aiormq closes it
            self._closing = True
            self._live = Down()
            self._ready.clear()
            return
        self._live = Down()
        self._ready.clear()
        if exc is not None and refusal_code(exc):
            self.refused_closes += 1
            self._last_refusal = translate_aio(exc)
        log.warning("connection to %s lost (%s); failing over", live.node, exc or "closed")
        # Finish closing the dead connection now, on this loop: left to aio-pika's __del__, its
        # close() coroutine may be created when no loop runs and is then never awaited.
        self._finish_close(live.connection)
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.ensure_future(self._reconnect())

    def _finish_close(self, connection: AbstractConnection) -> None:
        async def close() -> None:
            with contextlib.suppress(Exception):
                await connection.close()

        task = asyncio.ensure_future(close())
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def _reconnect(self) -> None:
        """Try the nodes in turn with backoff until one accepts and the replay succeeds."""
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(MiddlewareError),
            wait=backoff(self.settings.retry),
            stop=lambda _state: self._closing,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    node = self._rotation.take()
                    try:
                        await self._open(node)
                    except AccessRefused as exc:
                        self._fatal = exc
                        raise
                    except MiddlewareError as exc:
                        log.info("failover to %s failed: %s", node, exc)
                        raise
        except MiddlewareError:
            return
        self.reconnects += 1
        metrics.RECONNECTS.inc()
        log.info("failed over to %s; topology replayed", self.connected_node)
        # The hooks run beside this task, not in it: a connection lost while they run
        # (a resent suspect closing it again) must start a new failover.
        task = asyncio.ensure_future(self._run_reconnect_hooks())
        self._hook_tasks.add(task)
        task.add_done_callback(self._hook_tasks.discard)

    async def _run_reconnect_hooks(self) -> None:
        for hook in list(self._reconnect_hooks):
            try:
                await hook()
            except Exception:
                log.exception("reconnect hook failed")

    async def _await_live(self) -> Live:
        if self._closing:
            raise NotConnected("client is closed")
        if self._fatal is not None:
            raise self._fatal
        if not self._ready.is_set():
            if self._reconnect_task is None and not isinstance(self._live, Live):
                raise NotConnected("not connected: await client.connect() first")
            wait = self.settings.connect_timeout
            try:
                await asyncio.wait_for(self._ready.wait(), wait)
            except TimeoutError:
                raise BrokerUnreachable(
                    f"no node reachable for {wait:.1f} s (failover still in progress)"
                ) from None
        live = self._live
        if not isinstance(live, Live):
            raise BrokerUnreachable("connection lost while waiting")
        return live

    async def _apply_with_retry(self, spec: Any) -> Any:
        async for attempt in async_retrying(self.settings.retry):
            with attempt:
                live = await self._await_live()
                result = await self._apply(live, spec)
        self.topology.add(spec)
        return result

    async def _apply(self, live: Live, spec: Any) -> Any:
        if isinstance(spec, ConsumerSpec):
            return await self._start_consumer(live, self._consumers[spec.tag])

        async def declare(ch: aiormq.abc.AbstractChannel) -> Any:
            match spec:
                case ExchangeSpec():
                    await ch.exchange_declare(
                        spec.name,
                        exchange_type=spec.type.value,
                        durable=spec.durable,
                        auto_delete=spec.auto_delete,
                        arguments=dict(spec.arguments),
                    )
                case QueueSpec():
                    ok = await ch.queue_declare(
                        spec.name,
                        durable=spec.durable,
                        exclusive=spec.exclusive,
                        auto_delete=spec.auto_delete,
                        arguments=spec.declare_arguments(),
                    )
                    return int(ok.message_count or 0) if ok else 0
                case BindingSpec():
                    await ch.queue_bind(
                        spec.queue,
                        spec.exchange,
                        routing_key=spec.routing_key,
                        arguments=dict(spec.arguments),
                    )
            return None

        return await on_channel_of(live, declare)

    async def _on_temp_channel(
        self, action: Callable[[aiormq.abc.AbstractChannel], Awaitable[Any]]
    ) -> Any:
        async for attempt in async_retrying(self.settings.retry):
            with attempt:
                live = await self._await_live()
                result = await on_channel_of(live, action)
        return result
