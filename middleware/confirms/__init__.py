"""End-to-end confirms (paper 003): a publisher's confirm means every expected consumer handled it.

Receipts travel on RabbitMQ's direct reply-to: each consumer sends batched
receipts straight to the publishing channel, with no queue to declare and no
queue process on the path; a receipt lost with a connection is covered by the
publisher's resend (same id) and the consumers' duplicate filter.
"""

from ..errors import DuplicateMessageId, NegativeReceipt, NoRoute, ReceiptTimeout
from .aio import AsyncConfirmConsumer, AsyncConfirmPublisher
from .core import ConsumerCore, PublisherCore
from .modes import ConfirmMode, ModeProfile
from .sync import SyncConfirmConsumer, SyncConfirmPublisher
from .tracking import ConfirmTracker, DuplicateFilter, Receipt, ReceiptBatcher

__all__ = [
    "AsyncConfirmConsumer",
    "AsyncConfirmPublisher",
    "ConfirmMode",
    "ConfirmTracker",
    "ConsumerCore",
    "DuplicateFilter",
    "DuplicateMessageId",
    "ModeProfile",
    "NegativeReceipt",
    "NoRoute",
    "PublisherCore",
    "Receipt",
    "ReceiptBatcher",
    "ReceiptTimeout",
    "SyncConfirmConsumer",
    "SyncConfirmPublisher",
]
