"""What a client declared, kept so it can be replayed after a reconnect, and routed locally.

Pure: no I/O.  :class:`TopologyRecord` remembers exchanges, queues, bindings and
consumers in declaration order (aio-pika's ``RobustQueue.restore`` idea, for
both faces), and :meth:`TopologyRecord.route` computes which queues a publish
reaches from exchange types and bindings, the way the broker does, so the
confirms layer knows whose receipts to expect.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Any

__all__ = [
    "BindingSpec",
    "ConsumerSpec",
    "ExchangeSpec",
    "ExchangeType",
    "QueueKind",
    "QueueSpec",
    "TopologyRecord",
    "topic_matches",
]

Arguments = Mapping[str, Any]
ROUTE_CACHE_SIZE = 4096


class ExchangeType(StrEnum):
    DIRECT = "direct"
    FANOUT = "fanout"
    TOPIC = "topic"
    HEADERS = "headers"
    CONSISTENT_HASH = "x-consistent-hash"


class QueueKind(StrEnum):
    QUORUM = "quorum"
    CLASSIC = "classic"
    STREAM = "stream"


@dataclass(frozen=True, slots=True)
class ExchangeSpec:
    name: str
    type: ExchangeType = ExchangeType.DIRECT
    durable: bool = True
    auto_delete: bool = False
    arguments: Arguments = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """A queue: quorum by default (replicated, survives a node loss), classic by choice."""

    name: str
    kind: QueueKind = QueueKind.QUORUM
    durable: bool = True
    exclusive: bool = False
    auto_delete: bool = False
    max_priority: int | None = None
    dead_letter_exchange: str | None = None
    dead_letter_routing_key: str | None = None
    max_length: int | None = None
    message_ttl_ms: int | None = None
    leader_locator: str | None = None
    arguments: Arguments = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind is not QueueKind.CLASSIC and (self.exclusive or not self.durable):
            raise ValueError(
                f"queue {self.name!r}: {self.kind} queues must be durable, "
                "non-exclusive (use kind=classic for temporary queues)"
            )
        if self.max_priority is not None and not 1 <= self.max_priority <= 255:
            raise ValueError(f"queue {self.name!r}: max_priority must be 1..255")

    def declare_arguments(self) -> dict[str, Any]:
        """The ``x-`` arguments sent with ``queue.declare``."""
        args: dict[str, Any] = {"x-queue-type": self.kind.value}
        optional = {
            "x-max-priority": self.max_priority,
            "x-dead-letter-exchange": self.dead_letter_exchange,
            "x-dead-letter-routing-key": self.dead_letter_routing_key,
            "x-max-length": self.max_length,
            "x-message-ttl": self.message_ttl_ms,
        }
        if self.leader_locator is not None:
            # "client-local" puts the leader on the node the declaring client is connected to.
            key = (
                "x-queue-master-locator"
                if self.kind is QueueKind.CLASSIC
                else ("x-queue-leader-locator")
            )
            optional[key] = self.leader_locator
        args.update({k: v for k, v in optional.items() if v is not None})
        args.update(self.arguments)
        return args


@dataclass(frozen=True, slots=True)
class BindingSpec:
    queue: str
    exchange: str
    routing_key: str = ""
    arguments: Arguments = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
        return (
            self.queue,
            self.exchange,
            self.routing_key,
            tuple(sorted((k, repr(v)) for k, v in self.arguments.items())),
        )


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    queue: str
    tag: str
    prefetch: int
    exclusive: bool = False


@dataclass
class TopologyRecord:
    """Declarations in the order they were made; replayed in that order."""

    exchanges: dict[str, ExchangeSpec] = field(default_factory=dict)
    queues: dict[str, QueueSpec] = field(default_factory=dict)
    bindings: dict[tuple[Any, ...], BindingSpec] = field(default_factory=dict)
    consumers: dict[str, ConsumerSpec] = field(default_factory=dict)
    # (exchange, routing key) -> queues, for every type but headers; cleared on any change,
    # so an e2e publish does not walk every binding
    _routes: dict[tuple[str, str], frozenset[str]] = field(
        default_factory=dict, repr=False, init=False, compare=False
    )

    def add(self, spec: ExchangeSpec | QueueSpec | BindingSpec | ConsumerSpec) -> None:
        self._routes.clear()
        match spec:
            case ExchangeSpec():
                self.exchanges[spec.name] = spec
            case QueueSpec():
                self.queues[spec.name] = spec
            case BindingSpec():
                self.bindings[spec.key] = spec
            case ConsumerSpec():
                self.consumers[spec.tag] = spec

    def forget_queue(self, name: str) -> None:
        self._routes.clear()
        self.queues.pop(name, None)
        self.bindings = {k: b for k, b in self.bindings.items() if b.queue != name}
        self.consumers = {t: c for t, c in self.consumers.items() if c.queue != name}

    def forget_exchange(self, name: str) -> None:
        self._routes.clear()
        self.exchanges.pop(name, None)
        self.bindings = {k: b for k, b in self.bindings.items() if b.exchange != name}

    def forget_consumer(self, tag: str) -> None:
        self.consumers.pop(tag, None)

    def replay_plan(self) -> Iterator[ExchangeSpec | QueueSpec | BindingSpec | ConsumerSpec]:
        """Exchanges, then queues, then bindings, then consumers."""
        yield from self.exchanges.values()
        yield from self.queues.values()
        yield from self.bindings.values()
        yield from self.consumers.values()

    # ------------------------------------------------------------ routing
    def route(
        self, exchange: str, routing_key: str, headers: Mapping[str, Any] | None = None
    ) -> frozenset[str]:
        """Queues a publish reaches, computed like the broker does.

        The default exchange ``""`` routes to the queue named by the key.  An
        exchange this record does not know routes to nothing.
        """
        if exchange == "":
            return frozenset({routing_key})
        spec = self.exchanges.get(exchange)
        if spec is None:
            return frozenset()
        cacheable = spec.type is not ExchangeType.HEADERS
        if cacheable and (cached := self._routes.get((exchange, routing_key))) is not None:
            return cached
        queues = frozenset(
            b.queue
            for b in self.bindings.values()
            if b.exchange == exchange and _binding_matches(spec, b, routing_key, headers or {})
        )
        if cacheable:
            if len(self._routes) >= ROUTE_CACHE_SIZE:
                self._routes.clear()
            self._routes[(exchange, routing_key)] = queues
        return queues


def _binding_matches(
    exchange: ExchangeSpec, binding: BindingSpec, routing_key: str, headers: Mapping[str, Any]
) -> bool:
    match exchange.type:
        case ExchangeType.DIRECT:
            return binding.routing_key == routing_key
        case ExchangeType.FANOUT | ExchangeType.CONSISTENT_HASH:
            # consistent-hash picks one of these; callers expecting receipts must use expect=.
            return True
        case ExchangeType.TOPIC:
            return topic_matches(binding.routing_key, routing_key)
        case ExchangeType.HEADERS:
            return _headers_match(binding.arguments, headers)
    return False  # pragma: no cover - every ExchangeType is handled above


def _headers_match(arguments: Arguments, headers: Mapping[str, Any]) -> bool:
    mode = str(arguments.get("x-match", "all"))
    wanted = {k: v for k, v in arguments.items() if not k.startswith("x-")}
    if not wanted:
        return mode.startswith("all")
    hits = [k in headers and (v is None or headers[k] == v) for k, v in wanted.items()]
    return any(hits) if mode.startswith("any") else all(hits)


def topic_matches(pattern: str, routing_key: str) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more."""
    return _words_match(tuple(pattern.split(".")), tuple(routing_key.split(".")))


@lru_cache(maxsize=8192)
def _words_match(pattern: tuple[str, ...], words: tuple[str, ...]) -> bool:
    if not pattern:
        return not words
    head, rest = pattern[0], pattern[1:]
    if head == "#":
        return any(_words_match(rest, words[i:]) for i in range(len(words) + 1))
    return bool(words) and head in ("*", words[0]) and _words_match(rest, words[1:])
