"""What both Phoenix client faces share, without I/O of their own (``client.py``): the
cluster check, the messages they build, the confirmations they read, the errors.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import pydantic

from ..confirms.core import ConsumerCore
from ..confirms.tracking import ELEMENTS_HEADER, decode_elements, named_digest
from ..errors import ConfigurationError, DeadLetter, RetryableError
from ..phoenix.ids import RoleId
from ..phoenix.protocol import PhoenixTopology
from ..settings import Settings
from ..transport import Delivery, QueueKind, QueueSpec
from ..transport.delivery import Action, Outcome, outcome_of
from ..unique import random_hex
from .batching import split
from .matching import Event, Filter, FilterError
from .messages import (
    Advertise,
    Confirmation,
    Publish,
    Subscribe,
    Unsubscribe,
    encode,
    parse,
)
from .wiring import cluster_settings

__all__ = ["ClientCore", "Element", "SubscriptionUnconfirmed"]

#: an e2e batch's event as its subscriber's duplicate check knows it: (id, content digest)
Element = tuple[str, bytes]


class SubscriptionUnconfirmed(RetryableError, TimeoutError):
    """The owner's match master did not confirm a subscribe or unsubscribe (W of N
    replicas) in time, or said why it could not; it may still take effect later."""


class ClientCore:
    """What both faces share, without I/O: the cluster check, the messages, the
    confirmations."""

    def __init__(self, settings: Settings, topology: PhoenixTopology, cluster: str) -> None:
        key, wanted = cluster_settings(settings, topology, cluster)
        if key != "default":  # the inbox and the subscriber queues live on the cluster's
            raise ConfigurationError(
                f"cluster {cluster!r} is on {','.join(wanted.amqp_urls)} vhost "
                f"{wanted.vhost!r}, the client on {','.join(settings.amqp_urls)} vhost "
                f"{settings.vhost!r}: connect it there (PhoenixClient.connect)"
            )
        self.topology, self.cluster = topology, cluster
        self.inbox = RoleId.router(cluster).inbox(topology.prefix)
        #: this client's queue for confirmations (exclusive: goes with the connection)
        self.reply_queue = f"{topology.prefix}.{cluster}.client.{uuid.uuid4().hex}"

    @staticmethod
    def settings_for(settings: Settings, topology: PhoenixTopology, cluster: str) -> Settings:
        return cluster_settings(settings, topology, cluster)[1]

    @staticmethod
    def subscriber_queue(queue: str, spec: QueueSpec | None) -> QueueSpec:
        """The subscriber queue ``subscribe`` declares: ``spec`` as given (a quorum queue
        that outlives a node, a bound, arguments), else a durable classic queue.  A
        ``spec`` naming another queue is refused before anything is sent."""
        if spec is None:
            return QueueSpec(queue, kind=QueueKind.CLASSIC)
        if spec.name != queue:
            raise ConfigurationError(
                f"queue_spec declares {spec.name!r}, the subscription's queue is {queue!r}"
            )
        return spec

    def reply_spec(self) -> QueueSpec:
        return QueueSpec(self.reply_queue, kind=QueueKind.CLASSIC, durable=False, exclusive=True)

    @staticmethod
    def check_wait(wait_s: float | None) -> None:
        if wait_s is not None and wait_s <= 0:
            raise ConfigurationError(f"wait_s must be > 0 or None, got {wait_s}")

    def advertisement(self, event_type: str) -> Advertise:
        return Advertise(event_type=event_type)

    def publication(self, event: Event | dict[str, Any]) -> Publish:
        event = event if isinstance(event, Event) else Event.parse(event)
        # the id lets the type's owner route it once, however often it is sent again
        return Publish(event_type=event.event_type, event=event, id=random_hex(8))

    def subscription(
        self,
        event_type: str,
        filter: Iterable[Sequence[Any]] | None,
        latency_level: int,
        queue: str,
        confirm: str,
        wait_s: float | None,
    ) -> Subscribe:
        """A validated subscribe (refused before anything is sent), with a new id."""
        flt = Filter.parse(filter)
        if not 1 <= latency_level <= 5:
            raise FilterError(f"latency level must be 1..5, got {latency_level}")
        if confirm not in ("broker", "e2e"):
            raise FilterError(f"confirm must be 'broker' or 'e2e', got {confirm!r}")
        self.check_wait(wait_s)
        try:
            return Subscribe(
                event_type=event_type,
                home=self.cluster,
                latency_level=latency_level,
                queue=queue,
                subscription_id=uuid.uuid4().hex,
                confirm="e2e" if confirm == "e2e" else "broker",
                filter=flt.spec(),
                reply_to=None if wait_s is None else self.reply_queue,
            )
        except pydantic.ValidationError as exc:  # e.g. an empty queue or event type name
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'subscribe'}: {e['msg']}" for e in exc.errors()
            )
            raise FilterError(f"subscribe refused: {problems}") from None

    def unsubscription(
        self, event_type: str, subscription_id: str, wait_s: float | None
    ) -> Unsubscribe:
        self.check_wait(wait_s)
        return Unsubscribe(
            event_type=event_type,
            home=self.cluster,
            subscription_id=subscription_id,
            reply_to=None if wait_s is None else self.reply_queue,
        )

    @staticmethod
    def delivered(delivery: Delivery) -> tuple[Event, Publish]:
        """A matched event as it lands in a subscriber queue (with its hops and broker)."""
        message = parse(delivery.body, "Phoenix delivery")
        if not isinstance(message, Publish):
            raise DeadLetter(f"not a Phoenix event delivery: {message.kind.value}")
        return message.event, message

    @staticmethod
    def batch_of(delivery: Delivery) -> tuple[list[Publish], list[tuple[bytes, Outcome]]] | None:
        """The events of a delivery that carries a batch of copies (a JSON array: the
        topology's ``copy_batch_max``), in order, and its elements that are not events,
        each as ``(its JSON, dead-lettered with why)``; None for a lone event
        (:meth:`delivered`)."""
        if delivery.body.lstrip()[:1] != b"[":
            return None
        messages, malformed = split(delivery.body)
        bad = [(body, Outcome(Action.DEAD_LETTER, why)) for body, why in malformed]
        events: list[Publish] = []
        for message in messages:
            if isinstance(message, Publish):
                events.append(message)
            else:
                why = f"not a Phoenix event delivery: {message.kind.value}"
                bad.append((encode(message), Outcome(Action.DEAD_LETTER, why)))
        return events, bad

    @staticmethod
    def e2e_batch_of(
        delivery: Delivery,
    ) -> tuple[list[tuple[Publish, Element | None]], list[tuple[bytes, Outcome]]] | None:
        """As :meth:`batch_of`, each event with its own id and content digest (an e2e
        batch's ``ELEMENTS_HEADER``), for the duplicate check of each; None beside an
        event when the header does not name every element in order (a batch with a
        malformed element, or from a sender that names none): it is handled without."""
        batch = ClientCore.batch_of(delivery)
        if batch is None:
            return None
        events, failed = batch
        names: list[Element] | None = None
        raw = delivery.headers.get(ELEMENTS_HEADER)
        if raw is not None and not failed:
            try:
                elements = decode_elements(raw)
            except ValueError:
                elements = []
            if len(elements) == len(events):
                names = [(element_id, named_digest(content)) for element_id, content in elements]
        return [(e, names[k] if names else None) for k, e in enumerate(events)], failed

    @staticmethod
    def handled_before(
        consumer: ConsumerCore,
        queue: str,
        message: Publish,
        name: Element,
        failed: list[tuple[bytes, Outcome]],
    ) -> bool:
        """An e2e batch's event this queue handled already (alone or in another batch):
        skipped; one whose id came with other content is dead-lettered with why (once:
        the same element coming again is skipped too)."""
        earlier = consumer.element_earlier(queue, *name)
        if earlier is None:
            return False
        if not earlier.ok and consumer.first_refusal(queue, *name):
            why = f"{earlier.reason}: {name[0]} was handled here with other content"
            failed.append((encode(message), Outcome(Action.DEAD_LETTER, why)))
        return True

    @staticmethod
    def element_settled(
        consumer: ConsumerCore,
        queue: str,
        message: Publish,
        name: Element | None,
        error: Exception | None,
        failed: list[tuple[bytes, Outcome]],
    ) -> bool:
        """After an e2e batch's event was handed over (``error``: what its handler
        raised): remember it, so that the batch or a copy coming again skips it.  True:
        the handler said ``Requeue``, the whole delivery goes back (no receipt), and the
        events handled already are skipped when it comes again; without ``name`` (no
        duplicate check) the event goes back alone, as in a broker-confirmed batch."""
        if error is not None:
            body, outcome = ClientCore.failed(message, error)
            if outcome.action is Action.REQUEUE and name is not None:
                return True
            failed.append((body, outcome))
        if name is not None:
            consumer.element_handled(queue, *name)
        return False

    @staticmethod
    def failed(message: Publish, error: Exception) -> tuple[bytes, Outcome]:
        """What becomes of one event of a batch whose handler raised: put back into the
        queue alone (``Requeue``), or dead-lettered alone with the reason (anything
        else, ``Reject`` included: the copy cannot be refused to a broker alone)."""
        outcome = outcome_of(error)
        if outcome.action in (Action.REQUEUE, Action.DEAD_LETTER):
            return encode(message), outcome
        return encode(message), Outcome(Action.DEAD_LETTER, f"rejected: {outcome.reason}")

    @staticmethod
    def reply(delivery: Delivery) -> Confirmation:
        message = parse(delivery.body, "subscribe confirmation")
        if not isinstance(message, Confirmation):
            raise DeadLetter(f"not a subscribe confirmation: {message.kind.value}")
        return message

    @staticmethod
    def _what(request: Subscribe | Unsubscribe) -> str:
        return f"{request.kind.value} {request.subscription_id} of {request.event_type!r}"

    def unconfirmed(
        self, request: Subscribe | Unsubscribe, wait_s: float
    ) -> SubscriptionUnconfirmed:
        return SubscriptionUnconfirmed(
            f"{self._what(request)}: the owner's match master did not confirm it in "
            f"{wait_s:g} s (it may still take effect)"
        )

    def outcome(self, request: Subscribe | Unsubscribe, reply: Confirmation | None) -> bool:
        """Subscribe: True.  Unsubscribe: whether the owner knew it (True unconfirmed).
        Raises when the owner said why it could not."""
        if reply is None:
            return True
        table = reply.outcome
        if table.get("refused") == "filter":
            raise FilterError(f"{self._what(request)} refused at {reply.broker}: {table['error']}")
        if table.get("error"):
            raise SubscriptionUnconfirmed(
                f"{self._what(request)} at {reply.broker}: {table['error']}"
            )
        return isinstance(request, Subscribe) or bool(table.get("removed"))
