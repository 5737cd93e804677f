"""The connection of a ``SyncClient`` (a part of it, ``sync.py``): every call through one
retry policy, a lost connection noticed by the call that needed it, the next node
connected and the recorded topology replayed."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.adapters.blocking_connection as blocking
import pika.exceptions
import pika.spec

from ..errors import (
    ConnectionLost,
    GetTimeout,
    MiddlewareError,
    NotConnected,
    RetryableError,
)
from . import metrics
from .broker_info import BrokerInfo
from .message import tls_context
from .policy import Node, retried, sync_retrying
from .replay import HOME_DOWN, NOT_THERE, UNREACHABLE, VANISHED, Replay, Verdict
from .silence import SyncSilence
from .sync_live import (
    SyncClientState,
    SyncLive,
    T,
    close_within,
)
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    QueueSpec,
)
from .translate import refusal_code, translate_sync

log = logging.getLogger(__name__)


class SyncConnecting(SyncClientState):
    """Calls under the retry policy, the connection, failover and replay."""

    def _record(self, spec: Any) -> Any:
        result = self._call(lambda live: self._apply(live, spec))
        self.topology.add(spec)
        return result

    def _call(self, action: Callable[[SyncLive], T], *, attempts: int | None = None) -> T:
        """Run ``action`` on a live connection; on loss reconnect, replay and retry."""
        if not self._opened:
            raise NotConnected("not connected: call client.connect() first")
        limit = attempts or self.settings.retry.attempts
        try:
            return self._attempt(action)
        except RetryableError as exc:
            if limit < 2 or not retried(exc):
                raise
            log.debug("%s failed (%s); retrying under the policy", action, exc)
        # The hot path above builds no retry object (as in the asyncio core): only a failed
        # call pays for tenacity.
        for attempt in sync_retrying(self.settings.retry, attempts=limit - 1):
            with attempt:
                return self._attempt(action)
        raise AssertionError("unreachable")  # pragma: no cover - tenacity re-raises

    def _attempt(self, action: Callable[[SyncLive], T]) -> T:
        live = self._ensure_live()
        try:
            return action(live)
        except MiddlewareError as known:
            if isinstance(known, ConnectionLost):
                self._drop(live, known, known.__cause__)
            raise
        except Exception as exc:
            translated = translate_sync(exc)
            if isinstance(translated, GetTimeout):  # the broker closed the connection
                metrics.GET_TIMEOUTS.inc()
                self._drop(live, translated)
                raise translated from exc
            if not isinstance(translated, ConnectionLost) and live.connection.is_closed:
                # pika's errors on a connection the broker closed under the call are not
                # always its own (a timer on the closed loop: "Timeout closed before
                # call", after a 541 closed it as a quorum queue was deleted): lost
                translated = ConnectionLost(f"connection closed under the call: {exc!r}")
            if isinstance(translated, ConnectionLost):
                self._drop(live, translated, exc)
            raise translated from exc

    def _ensure_live(self) -> SyncLive:
        if self._live is not None:
            return self._live
        node = self._rotation.take()
        self._open(node)
        if self._inherited is not None:  # a forked child's first call: its own connection
            self._inherited = None  # (the parent's, never written to, is left to close)
            log.info("connected to %s in forked process %d; topology replayed", node, os.getpid())
            assert self._live is not None
            return self._live
        self.reconnects += 1
        metrics.RECONNECTS.inc()
        log.info("failed over to %s; topology replayed", node)
        assert self._live is not None
        return self._live

    def _drop(self, live: SyncLive, error: Exception, cause: BaseException | None = None) -> None:
        if self._live is live:
            if refusal_code(cause or error):
                self.refused_closes += 1
                self._last_refusal = translate_sync(error)  # a MiddlewareError is kept as is
            log.warning("connection to %s lost (%s); failing over", live.node, error)
            self._live = None
            self._resends = []  # what the lost connection owed is the caller's to resend
            close_within(live.connection, self.settings.close_grace)

    def _open(self, node: Node) -> None:
        params = pika.ConnectionParameters(
            host=node.host,
            port=node.port,
            virtual_host=self.settings.vhost,
            credentials=pika.PlainCredentials(
                self.settings.username, self.settings.password.get_secret_value()
            ),
            heartbeat=self.settings.heartbeat,
            ssl_options=pika.SSLOptions(tls_context(self.settings), node.host)
            if node.tls
            else None,
            socket_timeout=self.settings.connect_timeout,
            stack_timeout=self.settings.connect_timeout,
            blocked_connection_timeout=self.settings.publish_timeout,
            connection_attempts=1,
            client_properties={"connection_name": self.settings.client_name},
        )
        try:
            connection = pika.BlockingConnection(params)
        except Exception as exc:
            raise translate_sync(exc) from exc
        try:
            confirm = connection.channel()
            confirm.confirm_delivery()
            live = SyncLive(node, connection, confirm, self._open_watched(connection))
            self._start_replies(live)
            replay = Replay(declared=frozenset(self.topology.queues))
            for spec in list(self.topology.replay_plan()):
                self._replay(live, replay, spec)
        except Exception as exc:
            close_within(connection, self.settings.close_grace)
            raise translate_sync(exc) from exc
        self._live = live
        impl = getattr(connection, "_impl", None)

        def silent(reason: str) -> None:  # pika's own way out of a stale connection
            log.warning("closing a silent connection to %s: %s", node, reason)
            impl._terminate_stream(pika.exceptions.AMQPHeartbeatTimeout(reason))  # type: ignore[union-attr]

        if impl is not None:
            SyncSilence(connection, self.settings.heartbeat, silent, time.monotonic)
        self.server = BrokerInfo.from_properties(getattr(impl, "server_properties", None))
        metrics.broker_connected(log, self.server)
        log.debug("connected to %s (%s)", node, self.server.describe())

    def _replay(self, live: SyncLive, replay: Replay, spec: Any) -> None:
        """One step of a failover's replay, as ``Replay`` says (the asyncio core does the
        same): a queue whose home node is down is left out with its bindings, and the
        consumers of a queue not there (or unreachable) wait for ``run``, which subscribes
        them again once it answers."""
        verdict, why = replay.before(spec), HOME_DOWN
        if verdict is Verdict.APPLY:
            try:
                self._apply(live, spec)
                return
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                verdict, why = replay.not_found(spec), NOT_THERE
                if verdict is Verdict.RAISE:
                    raise
        if verdict is Verdict.REDECLARE:
            assert isinstance(spec, ConsumerSpec)
            log.info(VANISHED, spec.queue)
            try:
                self._apply(live, self.topology.queues[spec.queue])
                self._apply(live, spec)
                return
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                verdict, why = Verdict.LATER, str(exc)
        if verdict is Verdict.LATER:
            assert isinstance(spec, ConsumerSpec)
            log.warning(
                "consumer %s of %r: %s; subscribing it again once it answers",
                spec.tag,
                spec.queue,
                why,
            )
            self._cancelled[spec.tag] = time.monotonic()
        elif isinstance(spec, QueueSpec):
            log.warning(UNREACHABLE, spec.name)

    def _reopen_channel(self, live: SyncLive) -> blocking.BlockingChannel:
        channel = live.connection.channel()
        channel.confirm_delivery()
        live.confirm_channel = channel
        return channel

    def _apply(self, live: SyncLive, spec: Any) -> Any:
        if isinstance(spec, ConsumerSpec):
            return self._start_consumer(live, self._consumers[spec.tag])

        def declare(ch: blocking.BlockingChannel) -> Any:
            match spec:
                case ExchangeSpec():
                    ch.exchange_declare(
                        spec.name,
                        spec.type.value,
                        durable=spec.durable,
                        auto_delete=spec.auto_delete,
                        arguments=dict(spec.arguments),
                    )
                case QueueSpec():
                    ok = ch.queue_declare(
                        spec.name,
                        durable=spec.durable,
                        exclusive=spec.exclusive,
                        auto_delete=spec.auto_delete,
                        arguments=spec.declare_arguments(),
                    )
                    return int(ok.method.message_count)
                case BindingSpec():
                    ch.queue_bind(
                        spec.queue, spec.exchange, spec.routing_key, arguments=dict(spec.arguments)
                    )
            return None

        return self._on_temp_channel(live, declare)

    @staticmethod
    def _on_temp_channel(live: SyncLive, action: Callable[[blocking.BlockingChannel], T]) -> T:
        channel = live.connection.channel()
        try:
            return action(channel)
        finally:
            if channel.is_open:
                with contextlib.suppress(Exception):
                    channel.close()

    @staticmethod
    def _on_probe_channel(live: SyncLive, action: Callable[[blocking.BlockingChannel], T]) -> T:
        """Run ``action`` (a passive declare: a queue length, the consumer watchdog's
        look) on the connection's probe channel, opened again only after a refusal
        closed it (as the asyncio face: no channel churn)."""
        if live.probe is None or not live.probe.is_open:
            live.probe = live.connection.channel()
        return action(live.probe)
