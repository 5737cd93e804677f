"""Test doubles of :class:`~middleware.transport.AsyncClient` and
:class:`~middleware.transport.SyncClient` over an :class:`InMemoryBroker`.

Same methods, same settle rules: a handler's return acks, ``Reject`` rejects, ``Requeue``
requeues, ``DeadLetter`` or any other exception copies the message to the layer's
dead-letter queue with the reason (the one decision both real faces take,
``transport/consuming.py``), and an undecodable delivery never reaches a handler.  So the
confirm publishers and consumers (``middleware.confirms``) run on them unchanged: an e2e
publish confirms once every expected consumer handled it, fails with ``NegativeReceipt``
when one refused it, with ``ReceiptTimeout`` when one stayed silent.

The asyncio double hands deliveries to its event loop (a task per delivery, as the real
core); the sync double hands them over inside :meth:`InMemorySyncClient.run`, as pika
does.  ``published`` lists what a client sent, for assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue as queue_module
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Self

from ..errors import EntityNotFound, NotConnected, Unroutable
from ..settings import Settings
from ..transport import consuming
from ..transport.delivery import (
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_TOPOLOGY,
    Delivery,
    Outcome,
    dead_letter_message,
)
from ..transport.message import OutgoingMessage
from ..transport.outbound import Limits, check_message
from ..transport.topology import BindingSpec, ExchangeSpec, QueueSpec, TopologyRecord
from .broker import REPLY_TO, InMemoryBroker, _Consumer

__all__ = ["InMemoryClient", "InMemorySyncClient", "default_broker"]

log = logging.getLogger("middleware.testing")
_DEFAULT = InMemoryBroker()


def default_broker() -> InMemoryBroker:
    """The process-wide broker of doubles created without one."""
    return _DEFAULT


class _Double:
    """What both doubles share: settings, the broker, topology, publishing, settling."""

    def __init__(
        self, *, settings: Settings | None = None, broker: InMemoryBroker | None = None
    ) -> None:
        self.settings = settings if settings is not None else Settings()
        self.broker = broker if broker is not None else _DEFAULT
        self.topology = TopologyRecord()
        self.reconnects = 0
        self.refused_closes = 0
        self.published: list[OutgoingMessage] = []
        self._address = f"{REPLY_TO}.{uuid.uuid4().hex}"
        self._opened = False
        self._tag_seq = 0
        self._consumers: dict[str, tuple[str, Any, Any]] = {}  # tag -> queue, handler, hook

    @property
    def ready(self) -> bool:
        return self._opened

    @property
    def limits(self) -> Limits:
        return Limits(max_message_size=self.settings.max_message_size)

    @property
    def connected_node(self) -> str | None:
        return "in-memory" if self._opened else None

    def _check_open(self) -> None:
        if not self._opened:
            raise NotConnected("not connected: connect the client first")

    def _declare(self, spec: ExchangeSpec | QueueSpec | BindingSpec) -> int:
        self._check_open()
        result = 0
        match spec:
            case ExchangeSpec():
                self.broker.declare_exchange(spec)
            case QueueSpec():
                result = self.broker.declare_queue(spec)
            case BindingSpec():
                self.broker.bind(spec)
        self.topology.add(spec)
        return result

    def _own_consumers_of(self, queue: str) -> list[str]:
        return [tag for tag, entry in self._consumers.items() if entry[0] == queue]

    def _delete_queue(self, name: str) -> None:
        self._check_open()
        self.broker.delete_queue(name)
        self.topology.forget_queue(name)

    def _delete_exchange(self, name: str) -> None:
        self._check_open()
        self.broker.delete_exchange(name)
        self.topology.forget_exchange(name)

    def _publish(self, message: OutgoingMessage, *, confirm: bool) -> None:
        check_message(message, self.limits)
        self._check_open()
        try:
            self.broker.publish(message, reply_address=self._address)
        except (EntityNotFound, Unroutable) as exc:
            if confirm:
                raise
            # unconfirmed: the real clients cannot tell either; the message is gone
            log.info("unconfirmed publish %s dropped: %s", message.message_id, exc)
        self.published.append(message)

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        for spec in DEAD_LETTER_TOPOLOGY:  # idempotent, as on the real clients' first use
            self._declare(spec)
        self._publish(
            dead_letter_message(
                delivery, reason, exchange=DEAD_LETTER_EXCHANGE, limits=self.limits
            ),
            confirm=True,
        )

    def _next_tag(self, tag: str | None) -> str:
        self._tag_seq += 1
        return tag or f"qosmq-double-{id(self):x}-{self._tag_seq}"

    def _settle(self, consumer: _Consumer, delivery: Delivery, outcome: Outcome) -> Outcome:
        try:
            for step in consuming.settle_steps(outcome):
                if step is consuming.Step.COPY_TO_DEAD_LETTER:
                    self._dead_letter(delivery, outcome.reason)
                else:
                    requeue = step is consuming.Step.REQUEUE
                    self.broker.settle(consumer, delivery, requeue=requeue)
        except Exception as exc:  # the copy failed: the message goes back, as on a broker
            outcome = consuming.settle_lost(delivery, exc, outcome)
            self.broker.settle(consumer, delivery, requeue=True)
        return outcome


class InMemoryClient(_Double):
    """The asyncio client's double (``AsyncClient``'s methods, no broker needed)."""

    def __init__(
        self, *, settings: Settings | None = None, broker: InMemoryBroker | None = None
    ) -> None:
        super().__init__(settings=settings, broker=broker)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reply_handlers: list[Callable[[Delivery], None]] = []
        self._close_hooks: list[Callable[[], Awaitable[None]]] = []
        self._handling: dict[str, set[asyncio.Task[None]]] = {}

    async def connect(self) -> Self:
        self._loop = asyncio.get_running_loop()
        self._opened = True
        return self

    async def __aenter__(self) -> Self:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def reconnect_in_background(self) -> None:
        """Nothing to reconnect in memory."""

    def on_reconnect(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Never called: an in-memory client does not fail over."""

    def on_close(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._close_hooks.append(hook)

    async def close(self) -> None:
        if not self._opened:
            return
        for tag in list(self._consumers):
            await self.cancel(tag)
        for hook in self._close_hooks:
            await hook()
        self.broker.forget(self._address)
        self._opened = False

    async def declare_exchange(self, spec: ExchangeSpec) -> None:
        self._declare(spec)

    async def declare_queue(self, spec: QueueSpec) -> int:
        return self._declare(spec)

    async def bind(self, spec: BindingSpec) -> None:
        self._declare(spec)

    async def delete_queue(self, name: str) -> None:
        for tag in self._own_consumers_of(name):  # as the real client: they end here
            await self.cancel(tag)
        self._delete_queue(name)

    async def delete_exchange(self, name: str) -> None:
        self._delete_exchange(name)

    async def queue_length(self, name: str) -> int:
        self._check_open()
        return self.broker.queue_length(name)

    async def get(self, queue: str) -> Delivery | None:
        self._check_open()
        return self.broker.get(queue)

    async def publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool = True,
        block: bool = True,
        retry: bool = True,
        retry_nacked: bool = True,
    ) -> None:
        self._publish(message, confirm=confirm)

    async def resend_alone(self, message: OutgoingMessage, *, confirm: bool = True) -> None:
        self._publish(message, confirm=confirm)

    async def answers(self, within: float) -> bool:
        """The in-memory broker always answers an open client."""
        return bool(self._opened)

    async def publish_watched(self, message: OutgoingMessage) -> asyncio.Future[None]:
        self._publish(message, confirm=False)
        taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        taken.set_result(None)
        return taken

    def publish_nowait(
        self, message: OutgoingMessage, *, confirm: bool = True
    ) -> asyncio.Future[None]:
        return asyncio.ensure_future(self.publish(message, confirm=confirm))

    async def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._dead_letter(delivery, reason)

    async def listen_replies(self, handler: Callable[[Delivery], None]) -> None:
        self._check_open()
        self._reply_handlers.append(handler)
        self.broker.listen_replies(self._address, self)

    async def consume(
        self,
        queue: str,
        handler: Callable[[Delivery], Awaitable[None]],
        *,
        prefetch: int | None = None,
        tag: str | None = None,
        on_settled: Callable[[Delivery, Outcome], Awaitable[None]] | None = None,
    ) -> str:
        self._check_open()
        tag = self._next_tag(tag)
        self._consumers[tag] = (queue, handler, on_settled)
        self._handling[tag] = set()
        self.broker.consume(queue, tag, prefetch or self.settings.prefetch, self)
        return tag

    async def cancel(self, tag: str, *, grace: float | None = None) -> None:
        entry = self._consumers.pop(tag, None)
        if entry is None:
            return
        running = self._handling.pop(tag, set())
        running.discard(asyncio.current_task())
        grace = self.settings.close_grace if grace is None else grace
        if running and grace:
            await asyncio.wait(running, timeout=grace)
        self.broker.cancel(entry[0], tag)  # what is still held goes back, redelivered
        for task in running:
            task.cancel()

    # the broker's side (any thread): into this client's loop
    def offer(self, consumer: _Consumer, delivery: Delivery) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._start, consumer, delivery)

    def reply(self, delivery: Delivery) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_reply, delivery)

    def _on_reply(self, delivery: Delivery) -> None:
        for handler in list(self._reply_handlers):
            handler(delivery)

    def _start(self, consumer: _Consumer, delivery: Delivery) -> None:
        running = self._handling.get(consumer.tag)
        if running is None:
            return  # cancelled: the broker took it back
        task = asyncio.ensure_future(self._handle(consumer, delivery))
        running.add(task)
        task.add_done_callback(running.discard)

    async def _handle(self, consumer: _Consumer, delivery: Delivery) -> None:
        entry = self._consumers.get(consumer.tag)
        if entry is None:
            return
        _, handler, on_settled = entry
        outcome = consuming.before_handler(delivery)
        if outcome is None:
            error: BaseException | None = None
            try:
                await handler(delivery)
            except Exception as exc:
                error = exc
            outcome = consuming.after_handler(delivery, error)
        outcome = self._settle(consumer, delivery, outcome)
        if on_settled is not None:
            await on_settled(delivery, outcome)


class InMemorySyncClient(_Double):
    """The sync client's double (``SyncClient``'s methods); deliveries are handled
    inside :meth:`run`, on the caller's thread."""

    def __init__(
        self, *, settings: Settings | None = None, broker: InMemoryBroker | None = None
    ) -> None:
        super().__init__(settings=settings, broker=broker)
        self._inbox: queue_module.SimpleQueue[tuple[Any, ...]] = queue_module.SimpleQueue()
        self._reply_handlers: list[Callable[[Delivery], None]] = []
        self._step_hooks: list[Callable[[], None]] = []
        self._step_s = 0.1
        self._turns = threading.RLock()

    def turn(self) -> AbstractContextManager[Any]:
        """As ``SyncClient.turn``: one thread's several calls in a row."""
        return self._turns

    def connect(self) -> Self:
        self._opened = True
        return self

    def connect_later(self) -> None:
        self._opened = True

    def __enter__(self) -> Self:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for tag in list(self._consumers):
            self.cancel(tag)
        self.broker.forget(self._address)
        self._opened = False

    def declare_exchange(self, spec: ExchangeSpec) -> None:
        self._declare(spec)

    def declare_queue(self, spec: QueueSpec) -> int:
        return self._declare(spec)

    def bind(self, spec: BindingSpec) -> None:
        self._declare(spec)

    def delete_queue(self, name: str) -> None:
        for tag in self._own_consumers_of(name):  # as the real client: they end here
            self.cancel(tag)
        self._delete_queue(name)

    def delete_exchange(self, name: str) -> None:
        self._delete_exchange(name)

    def queue_length(self, name: str) -> int:
        self._check_open()
        return self.broker.queue_length(name)

    def get(self, queue: str) -> Delivery | None:
        self._check_open()
        return self.broker.get(queue)

    def publish(
        self,
        message: OutgoingMessage,
        *,
        confirm: bool = True,
        retry: bool = True,
        within: float | None = None,
        retry_nacked: bool = True,
    ) -> None:
        self._publish(message, confirm=confirm)

    def answers(self, within: float) -> bool:
        """The in-memory broker always answers an open client."""
        return bool(self._opened)

    def resend_alone(self, message: OutgoingMessage, *, confirm: bool = True) -> None:
        self._publish(message, confirm=confirm)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._dead_letter(delivery, reason)

    def listen_replies(self, handler: Callable[[Delivery], None]) -> None:
        self._check_open()
        self._reply_handlers.append(handler)
        self.broker.listen_replies(self._address, self)

    def consume(
        self,
        queue: str,
        handler: Callable[[Delivery], None],
        *,
        prefetch: int | None = None,
        tag: str | None = None,
        on_settled: Callable[[Delivery, Outcome], None] | None = None,
    ) -> str:
        self._check_open()
        tag = self._next_tag(tag)
        self._consumers[tag] = (queue, handler, on_settled)
        self.broker.consume(queue, tag, prefetch or self.settings.prefetch, self)
        return tag

    def cancel(self, tag: str) -> None:
        entry = self._consumers.pop(tag, None)
        if entry is not None:
            self.broker.cancel(entry[0], tag)

    def every_step(self, hook: Callable[[], None], *, within: float = 0.1) -> None:
        self._step_hooks.append(hook)
        self._step_s = min(self._step_s, max(within, 0.001))

    def run(self, seconds: float | None = None, *, until: Callable[[], bool] | None = None) -> None:
        """Handle deliveries for ``seconds`` (forever if None) or until ``until()``."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while (deadline is None or time.monotonic() < deadline) and not (until and until()):
            wait = self._step_s
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            with contextlib.suppress(queue_module.Empty):
                self._do(self._inbox.get(timeout=wait))
                self.poll()
            for hook in list(self._step_hooks):
                hook()

    def poll(self) -> None:
        """Handle what is waiting, without waiting."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue_module.Empty:
                return
            self._do(item)

    # the broker's side (any thread): into this client's inbox
    def offer(self, consumer: _Consumer, delivery: Delivery) -> None:
        self._inbox.put(("delivery", consumer, delivery))

    def reply(self, delivery: Delivery) -> None:
        self._inbox.put(("reply", delivery))

    def _do(self, item: tuple[Any, ...]) -> None:
        if item[0] == "reply":
            for handler in list(self._reply_handlers):
                handler(item[1])
            return
        consumer, delivery = item[1], item[2]
        entry = self._consumers.get(consumer.tag)
        if entry is None:
            return  # cancelled: the broker took it back
        _, handler, on_settled = entry
        outcome = consuming.before_handler(delivery)
        if outcome is None:
            error: BaseException | None = None
            try:
                handler(delivery)
            except Exception as exc:
                error = exc
            outcome = consuming.after_handler(delivery, error)
        outcome = self._settle(consumer, delivery, outcome)
        if on_settled is not None:
            on_settled(delivery, outcome)
