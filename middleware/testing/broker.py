"""The in-memory broker behind the test doubles: exchanges, queues, bindings, consumers.

It keeps what a service's handlers rely on, as RabbitMQ does it: routing by exchange
type (the layer's own ``TopologyRecord.route``, the rule the e2e publisher already uses
for its expected queues), mandatory publishes that reach no queue refused
(``Unroutable``), a missing exchange or queue named (``EntityNotFound``), a queue
declared again with other arguments refused (``PreconditionFailed``), deliveries
round-robin over a queue's consumers within their prefetch, a requeue going back to the
head flagged redelivered, what a consumer held when it stopped going back too, higher
priorities first on a queue with ``max_priority``, and direct reply-to (a publish with
``reply_to=REPLY_TO`` is answered to its client).  Not modelled: TTLs, length limits,
the queues' own dead-letter exchanges, persistence, clusters and failures.

Thread-safe: clients of either face (an event loop's, a thread's) share one broker.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..errors import EntityNotFound, PreconditionFailed, Unroutable
from ..transport.delivery import Delivery
from ..transport.message import OutgoingMessage
from ..transport.topology import BindingSpec, ExchangeSpec, QueueSpec, TopologyRecord

__all__ = ["REPLY_TO", "InMemoryBroker", "Receiver"]

REPLY_TO = "amq.rabbitmq.reply-to"


class Receiver(Protocol):
    """A client's side of a consumer: handed a delivery, it settles it later."""

    def offer(self, consumer: _Consumer, delivery: Delivery) -> None: ...

    def reply(self, delivery: Delivery) -> None: ...


@dataclass
class _Consumer:
    tag: str
    queue: str
    prefetch: int
    receiver: Receiver
    held: dict[int, Delivery] = field(default_factory=dict)  # by delivery tag


@dataclass
class _Queue:
    spec: QueueSpec
    ready: deque[Delivery] = field(default_factory=deque)
    consumers: list[_Consumer] = field(default_factory=list)
    turn: int = 0

    def put(self, delivery: Delivery, *, head: bool = False) -> None:
        if head:
            self.ready.appendleft(delivery)
        elif self.spec.max_priority and self.ready:
            rank = min(delivery.priority or 0, self.spec.max_priority)
            position = next(
                (
                    i
                    for i, d in enumerate(self.ready)
                    if min(d.priority or 0, self.spec.max_priority) < rank
                ),
                len(self.ready),
            )
            self.ready.insert(position, delivery)
        else:
            self.ready.append(delivery)


def _declared(spec: QueueSpec) -> tuple[Any, ...]:
    return (spec.declare_arguments(), spec.durable, spec.exclusive, spec.auto_delete)


class InMemoryBroker:
    """One in-memory "RabbitMQ" for the doubles of a test (see the module doc)."""

    def __init__(self) -> None:
        self.topology = TopologyRecord()
        self._queues: dict[str, _Queue] = {}
        self._lock = threading.RLock()
        self._tags = itertools.count(1)
        self._replies: dict[str, Receiver] = {}

    # ------------------------------------------------------------------ topology
    def declare_exchange(self, spec: ExchangeSpec) -> None:
        with self._lock:
            known = self.topology.exchanges.get(spec.name)
            if known is not None and known != spec:
                raise PreconditionFailed(
                    f"exchange {spec.name!r} exists with other settings ({known.type}, "
                    f"durable={known.durable}): inequivalent arg"
                )
            self.topology.add(spec)

    def declare_queue(self, spec: QueueSpec) -> int:
        with self._lock:
            queue = self._queues.get(spec.name)
            if queue is None:
                self._queues[spec.name] = _Queue(spec)
                self.topology.add(spec)
                return 0
            if _declared(queue.spec) != _declared(spec):
                raise PreconditionFailed(
                    f"queue {spec.name!r} exists with other arguments: inequivalent arg"
                )
            return len(queue.ready)

    def bind(self, spec: BindingSpec) -> None:
        with self._lock:
            self._queue(spec.queue)
            if spec.exchange not in self.topology.exchanges:
                raise EntityNotFound(f"no exchange {spec.exchange!r} to bind {spec.queue!r} to")
            self.topology.add(spec)

    def delete_queue(self, name: str) -> None:
        with self._lock:
            queue = self._queues.pop(name, None)
            self.topology.forget_queue(name)
            for consumer in queue.consumers if queue else ():
                consumer.held.clear()

    def delete_exchange(self, name: str) -> None:
        with self._lock:
            self.topology.forget_exchange(name)

    def queue_length(self, name: str) -> int:
        with self._lock:
            return len(self._queue(name).ready)

    def consumer_count(self, name: str) -> int:
        with self._lock:
            return len(self._queue(name).consumers)

    def _queue(self, name: str) -> _Queue:
        queue = self._queues.get(name)
        if queue is None:
            raise EntityNotFound(f"no queue {name!r} in vhost '/'")
        return queue

    # ---------------------------------------------------------------- publishing
    def publish(self, message: OutgoingMessage, *, reply_address: str | None = None) -> int:
        """Route ``message``; return how many queues took it.  A reply to a direct
        reply-to address goes to its client.  Raises ``EntityNotFound`` (no exchange) or
        ``Unroutable`` (mandatory, no queue)."""
        with self._lock:
            if message.exchange == "" and message.routing_key.startswith(REPLY_TO + "."):
                receiver = self._replies.get(message.routing_key)
                if receiver is not None:
                    receiver.reply(self._delivery(message, REPLY_TO))
                return 1 if receiver else 0
            if message.exchange and message.exchange not in self.topology.exchanges:
                raise EntityNotFound(f"no exchange {message.exchange!r} in vhost '/'")
            names = self.topology.route(message.exchange, message.routing_key, message.headers)
            queues = [self._queues[n] for n in sorted(names) if n in self._queues]
            if not queues and message.mandatory:
                raise Unroutable(
                    f"message {message.message_id} to exchange {message.exchange!r} with key "
                    f"{message.routing_key!r} reached no queue (NO_ROUTE)",
                    exchange=message.exchange,
                    routing_key=message.routing_key,
                )
            if message.reply_to == REPLY_TO:
                message = replace(message, reply_to=reply_address or REPLY_TO)
            for queue in queues:
                queue.put(self._delivery(message, queue.spec.name))
                self._dispatch(queue)
            return len(queues)

    @staticmethod
    def _delivery(message: OutgoingMessage, queue: str) -> Delivery:
        return Delivery(
            body=bytes(message.body),
            queue=queue,
            exchange=message.exchange,
            routing_key=message.routing_key,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            reply_to=message.reply_to,
            content_type=message.content_type,
            priority=message.priority or 0,
            timestamp=None if message.timestamp is None else float(int(message.timestamp)),
            persistent=message.persistent,
            headers=dict(message.headers),
        )

    def get(self, name: str) -> Delivery | None:
        """basic.get with auto-ack: the head of the queue, or None."""
        with self._lock:
            queue = self._queue(name)
            return queue.ready.popleft() if queue.ready else None

    # ----------------------------------------------------------------- consuming
    def consume(self, queue: str, tag: str, prefetch: int, receiver: Receiver) -> None:
        with self._lock:
            target = self._queue(queue)
            target.consumers.append(_Consumer(tag, queue, max(1, prefetch), receiver))
            self._dispatch(target)

    def cancel(self, queue: str, tag: str) -> None:
        """Stop a consumer; what it held and had not settled goes back, redelivered."""
        with self._lock:
            target = self._queues.get(queue)
            if target is None:
                return
            for consumer in [c for c in target.consumers if c.tag == tag]:
                target.consumers.remove(consumer)
                for delivery in reversed(list(consumer.held.values())):
                    target.put(replace(delivery, redelivered=True), head=True)
                consumer.held.clear()
            self._dispatch(target)

    def settle(self, consumer: _Consumer, delivery: Delivery, *, requeue: bool) -> None:
        """Ack or reject (``requeue``: back to the head, redelivered)."""
        with self._lock:
            if consumer.held.pop(delivery.delivery_tag, None) is None:
                return  # cancelled meanwhile: it went back already
            target = self._queues.get(consumer.queue)
            if target is None:
                return
            if requeue:
                target.put(replace(delivery, redelivered=True), head=True)
            self._dispatch(target)

    def _dispatch(self, queue: _Queue) -> None:
        while queue.ready:
            consumer = self._next_with_room(queue)
            if consumer is None:
                return
            delivery = replace(queue.ready.popleft(), delivery_tag=next(self._tags))
            consumer.held[delivery.delivery_tag] = delivery
            consumer.receiver.offer(consumer, delivery)

    @staticmethod
    def _next_with_room(queue: _Queue) -> _Consumer | None:
        for step in range(len(queue.consumers)):
            consumer = queue.consumers[(queue.turn + step) % len(queue.consumers)]
            if len(consumer.held) < consumer.prefetch:
                queue.turn = (queue.turn + step + 1) % len(queue.consumers)
                return consumer
        return None

    # ----------------------------------------------------------------- replies
    def listen_replies(self, address: str, receiver: Receiver) -> None:
        with self._lock:
            self._replies[address] = receiver

    def forget(self, address: str, stop: Callable[[], None] | None = None) -> None:
        with self._lock:
            self._replies.pop(address, None)
            if stop is not None:
                stop()
