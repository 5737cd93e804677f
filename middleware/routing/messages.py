"""Phoenix wire messages (pure): one pydantic model per kind, parsed and encoded here.

Every message is a JSON object whose ``kind`` picks its model (a discriminated union), and
each model has exactly the fields its kind needs, required where the kind cannot do
without them: a message that does not fit is refused at parsing, with pydantic's reason,
and a role dead-letters it once with that reason.  Roles dispatch on the model's type
through a table of handlers.

The kinds that travel the ring toward an event type's owner (:class:`Routed`) carry the
event type, the clusters visited and the priority the routers give them; the others go
straight to one role's inbox or control queue.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter

from ..errors import DeadLetter
from ..phoenix.protocol import Kind
from .control_messages import (
    Ack,
    Answer,
    Beat,
    Configure,
    Confirmation,
    Fence,
    Found,
    HandedOver,
    Handover,
    Heartbeat,
    Join,
    Leave,
    Matched,
    Probe,
    Read,
    Recover,
    Recovered,
    Replicate,
    Retire,
    Snapshot,
    Takeover,
    Vote,
)
from .matching import Event
from .message_base import Routed

__all__ = [
    "Ack",
    "Advertise",
    "Answer",
    "Beat",
    "Configure",
    "Confirmation",
    "Copy",
    "Fence",
    "Found",
    "HandedOver",
    "Handover",
    "Heartbeat",
    "Join",
    "Leave",
    "Matched",
    "Message",
    "Probe",
    "Publish",
    "Read",
    "Recover",
    "Recovered",
    "Replicate",
    "Retire",
    "Routed",
    "RoutedMessage",
    "Snapshot",
    "Subscribe",
    "Takeover",
    "Unsubscribe",
    "Unsubscribed",
    "Vote",
    "encode",
    "heartbeat_value",
    "parse",
    "parse_many",
    "validate",
]


class Advertise(Routed):
    kind: Literal[Kind.ADVERTISE] = Kind.ADVERTISE


class Subscribe(Routed):
    kind: Literal[Kind.SUBSCRIBE] = Kind.SUBSCRIBE
    subscription_id: str = Field(min_length=1)
    queue: str = Field(min_length=1)  # the subscriber's own queue
    filter: list[list[Any]] = Field(default_factory=list)
    latency_level: int = Field(3, ge=1, le=5)
    confirm: Literal["broker", "e2e"] = "broker"  # how deliveries are confirmed
    home: str | None = None  # the subscriber's cluster (its RabbitMQ and vhost hold the queue)
    reply_to: str | None = None  # where the owner confirms it (W of N replicas hold it)


class Unsubscribe(Routed):
    kind: Literal[Kind.UNSUBSCRIBE] = Kind.UNSUBSCRIBE
    subscription_id: str = Field(min_length=1)
    home: str | None = None
    reply_to: str | None = None
    #: part of an arc's hand-over: the previous owner removed it while holding the arc
    #: (and told the routers then); the joiner forgets its own copy, and tells nobody
    handed_over: bool = False


class Unsubscribed(Routed):
    """Owner's match master -> the routers that counted the subscription's level."""

    kind: Literal[Kind.UNSUBSCRIBED] = Kind.UNSUBSCRIBED
    latency_level: int = Field(ge=1, le=5)


class Publish(Routed):
    kind: Literal[Kind.PUBLISH] = Kind.PUBLISH
    event: Event
    broker: str | None = None  # the match broker that matched it (on delivery)
    #: when its entry router first routed it (wall clock): a cluster that left and comes
    #: back drops what its inbox held from before its departure that entered elsewhere
    #: (the entry routers routed those again to its successor, which matched them)
    entered_at: float | None = Field(None, ge=0, allow_inf_nan=False)
    #: routed again after a cluster it had reached left the ring: that cluster may have
    #: matched and delivered it before it went (its MATCHED went with it)
    again: bool = False
    #: set by a match master dispatching it to a slave: its reign (epoch, by); a slave
    #: that trusts a newer one passes it to the master reigning now, never matches it
    #: with a state that master may have changed (a hand-over's tombstones)
    reign: tuple[int, int] | None = None


#: how a dead letter for a copy whose subscriber's home cluster left the ring begins (then
#: ``<queue> (cluster <X>)``, one per queue)
HOME_LEFT = "subscriber home cluster left the ring"
#: what a dead letter for a departed home adds when the subscriber may have the event
#: already: the copy's outcome went with the link, or with the departed cluster
MAYBE_DELIVERED = "an earlier copy may have reached it"


class Copy(Routed):
    """One matched event's copy for one subscriber queue, on its way to the routing
    master of the queue's home cluster, which puts it in the queue (a match broker that
    cannot reach that home directly hands it to its own routing master)."""

    kind: Literal[Kind.COPY] = Kind.COPY
    home: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    queue: str = Field(min_length=1)
    confirm: Literal["broker", "e2e"] = "broker"
    copy_id: str | None = Field(None, min_length=1, max_length=200)
    publish: Publish  # what the subscriber receives (stamped with the matching broker)
    #: the match broker could not reach the home directly: the routers' link may be down
    unreachable: bool = False


#: the kinds routed along the ring (the :class:`Routed` ones)
RoutedMessage = Advertise | Subscribe | Unsubscribe | Unsubscribed | Publish

Message = Annotated[
    Advertise
    | Subscribe
    | Unsubscribe
    | Unsubscribed
    | Publish
    | Heartbeat
    | Join
    | Handover
    | Replicate
    | Ack
    | Read
    | Snapshot
    | Configure
    | Takeover
    | Beat
    | Vote
    | Fence
    | Retire
    | Answer
    | Confirmation
    | Probe
    | Found
    | Leave
    | Recover
    | Recovered
    | Matched
    | HandedOver
    | Copy,
    Field(discriminator="kind"),
]
_ONE: TypeAdapter[Message] = TypeAdapter(Message)
_MANY: TypeAdapter[list[Message]] = TypeAdapter(list[Message])


def parse(body: bytes, what: str = "Phoenix message") -> Message:
    """A message as a role or client receives it; malformed: ``DeadLetter`` with why."""
    try:
        return _ONE.validate_json(body)
    except ValueError as exc:
        raise DeadLetter(f"malformed {what}: {exc}") from None


def parse_many(body: bytes) -> list[Message]:
    """A batch (a JSON array of messages); ``ValidationError`` if any is malformed."""
    return _MANY.validate_json(body)


def validate(element: Any) -> Message:
    """One element of a batch, already decoded; ``ValidationError`` if malformed."""
    return _ONE.validate_python(element)


def encode(message: Message) -> bytes:
    return message.model_dump_json().encode()


def heartbeat_value(value: float) -> float:
    """A measured value as a heartbeat carries it: finite (JSON has no infinity)."""
    return 0.0 if math.isnan(value) else min(max(value, 0.0), 1e9)
