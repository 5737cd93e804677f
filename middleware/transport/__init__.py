"""AMQP transport: the asyncio core (aio-pika), the sync face (pika), and the logic they share."""

from .aio import REPLY_TO, AsyncClient, AsyncHandler
from .delivery import DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE, Action, Delivery, Outcome
from .management import management_get, vhost_path
from .message import OutgoingMessage
from .sync import SyncClient, SyncHandler
from .topology import (
    BindingSpec,
    ConsumerSpec,
    ExchangeSpec,
    ExchangeType,
    QueueKind,
    QueueSpec,
    TopologyRecord,
)

__all__ = [
    "DEAD_LETTER_EXCHANGE",
    "DEAD_LETTER_QUEUE",
    "REPLY_TO",
    "Action",
    "AsyncClient",
    "AsyncHandler",
    "BindingSpec",
    "ConsumerSpec",
    "Delivery",
    "ExchangeSpec",
    "ExchangeType",
    "Outcome",
    "OutgoingMessage",
    "QueueKind",
    "QueueSpec",
    "SyncClient",
    "SyncHandler",
    "TopologyRecord",
    "management_get",
    "vhost_path",
]
