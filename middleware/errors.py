"""The one error tree of qosmq.

Every exception the public API raises derives from :class:`MiddlewareError`.
pika and aiormq exceptions are translated at the transport boundary
(``middleware.transport.translate``) and never escape.

::

    MiddlewareError
    ├── ConfigurationError (ValueError)        permanent: fix the named setting
    ├── InvalidArgument (ValueError)           permanent: a call's argument is out of range
    │   ├── UnknownName (LookupError)             it names nothing that exists (a node, a spool)
    │   ├── FilterError                           Phoenix: a malformed filter or event
    │   └── RecordError                           Phoenix: a stored document that is no record
    ├── NotConnected (RuntimeError)            permanent: call connect() first
    ├── RetryableError                         the same call may succeed later
    │   ├── BrokerUnreachable (ConnectionError)   no node of the cluster answered
    │   │   ├── ManagementUnavailable             no management HTTP API answered
    │   │   ├── ConnectionLost                    a live connection died mid-call
    │   │   └── LinkDown                          Phoenix: a link to another cluster failed
    │   ├── WindowFull                            the in-flight window is full (non-blocking call)
    │   ├── ConfirmTimeout (TimeoutError)         no broker confirm in time
    │   ├── SubscribeTimeout (TimeoutError)       no consume-ok in time (a frozen queue leader)
    │   ├── GetTimeout (TimeoutError)             the broker gave up on a basic.get (no quorum)
    │   ├── SubscriptionUnconfirmed (TimeoutError)  Phoenix: W of N did not confirm a (un)subscribe
    │   ├── ReplicaTimeout (TimeoutError)         Phoenix: a replica write given up below W
    │   ├── HopFailed                             Phoenix: a role could not pass a message on
    │   └── ResourceLocked                        an exclusive queue is a lost connection's still
    ├── PublishError                           the broker refused a publish
    │   ├── SpoolFull                             queues: the local spool is at its limit (internal)
    │   ├── MalformedMessage (ValueError)         permanent: the broker would refuse this message
    │   │   └── MessageRefused                    the broker closed the connection over it
    │   ├── PublishNacked (also RetryableError)   basic.nack: e.g. quorum leader election
    │   ├── Unroutable                            mandatory publish returned: no queue bound
    │   ├── NoRoute                               e2e: the known topology routes it nowhere
    │   ├── NegativeReceipt                       e2e: a consumer's handler rejected it
    │   ├── DuplicateMessageId (ValueError)       e2e: that id is in flight on this publisher
    │   └── ReceiptTimeout (TimeoutError)         e2e: some queues never answered
    ├── TopologyError                          a declaration the broker refused
    │   ├── EntityNotFound (LookupError)          queue or exchange does not exist
    │   ├── PreconditionFailed                    redeclared with other arguments
    │   └── AccessRefused (PermissionError)       the user may not touch it
    ├── ClusterError                           the local cluster (``qosmq cluster``) failed
    │   ├── RabbitMQMissing                       rabbitmq-server is not installed
    │   └── NodeExited                            a node exited before it accepted AMQP
    ├── DeploymentError                        a Phoenix deployment cannot do what was asked
    └── HandlerInstruction                     raised by a consumer handler to steer the ack
        ├── Reject                                basic.reject, no requeue (queue's DLX if any)
        ├── Requeue                               basic.nack with requeue
        └── DeadLetter                            copy to the layer's dead-letter queue + reason

EMQ result codes (paper 004; ``middleware.queues``) are leaves with a numeric ``code``:
1 ``QueueDoesNotExist`` (EntityNotFound), 2 ``ConnectionNotEstablished`` (BrokerUnreachable),
3 ``QueueSaveFailed`` (PublishError), 4 ``MessageMalformed`` (MalformedMessage),
5 ``WindowExceeded`` (WindowFull).

Feature packages define their leaves in their own modules (``FilterError`` in
``middleware.routing.matching``, ``ClusterError`` in ``middleware.localcluster.manager``,
...) and export them from their package; each is drawn above, and
``tests/unit/test_error_tree.py`` fails on an exception class of the package that is not
a ``MiddlewareError`` or is missing from this drawing.
"""

from __future__ import annotations

__all__ = [
    "AccessRefused",
    "BrokerUnreachable",
    "ConfigurationError",
    "ConfirmTimeout",
    "ConnectionLost",
    "ConnectionNotEstablished",
    "DeadLetter",
    "DuplicateMessageId",
    "EntityNotFound",
    "GetTimeout",
    "HandlerInstruction",
    "HopFailed",
    "InvalidArgument",
    "LinkDown",
    "MalformedMessage",
    "ManagementUnavailable",
    "MessageMalformed",
    "MessageRefused",
    "MiddlewareError",
    "NegativeReceipt",
    "NoRoute",
    "NotConnected",
    "PreconditionFailed",
    "PublishError",
    "PublishNacked",
    "QueueDoesNotExist",
    "QueueResult",
    "QueueSaveFailed",
    "ReceiptTimeout",
    "Reject",
    "Requeue",
    "ResourceLocked",
    "RetryableError",
    "SubscribeTimeout",
    "TopologyError",
    "UnknownName",
    "Unroutable",
    "WindowExceeded",
    "WindowFull",
]


class MiddlewareError(Exception):
    """Base of every error qosmq raises."""


class ConfigurationError(MiddlewareError, ValueError):
    """A setting is missing or malformed; the message names the field and the fix."""


class InvalidArgument(MiddlewareError, ValueError):
    """An argument is out of range or malformed; the message names it and the expected form."""


class UnknownName(InvalidArgument, LookupError):
    """An argument names something that does not exist (a node, a spool file)."""


class NotConnected(MiddlewareError, RuntimeError):
    """The client was used before ``connect()`` or after ``close()``."""


class RetryableError(MiddlewareError):
    """The operation failed for a reason that may pass; retrying may succeed."""


class BrokerUnreachable(RetryableError, ConnectionError):
    """No node of the cluster accepted a connection within the retry policy."""

    def __init__(self, message: str, *, attempts: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.attempts: dict[str, str] = dict(attempts or {})


class ManagementUnavailable(BrokerUnreachable):
    """No node's management HTTP API answered, or it refused the credentials (each
    node's error in ``attempts``)."""


class ConnectionLost(BrokerUnreachable):
    """The connection died while a call was in progress."""


class LinkDown(BrokerUnreachable):
    """Phoenix: a routing master's send to another cluster was not confirmed within the
    topology's ``link_timeout_s`` (the router looks for a detour; nothing is lost)."""


class HopFailed(RetryableError):
    """Phoenix: a role could not pass the message it handles on to the next role (that
    role's inbox on a node that is down, a failover under way): the role tries it again,
    then gives it back to its own inbox; never dead-lettered for it."""


class WindowFull(RetryableError):
    """The in-flight window is full and the caller asked not to wait."""


class ResourceLocked(RetryableError):
    """An exclusive queue is held by another connection (405 RESOURCE_LOCKED).

    Retryable: after a failover the queue a client declares again is still the lost
    connection's until the broker notices that connection is gone (seen for seconds
    when the lost connection's node died)."""


class ConfirmTimeout(RetryableError, TimeoutError):
    """The broker did not confirm a publish within the timeout."""


class GetTimeout(RetryableError, TimeoutError):
    """The broker gave up on a ``basic.get`` and closed the connection (541, "Cannot get
    a message from queue ... timeout"): a quorum queue without its quorum, on RabbitMQ
    3.10 after about 65 s.  The client fails over as after any loss; the get is not
    tried again (each try would cost the same wait and another connection)."""


class SubscribeTimeout(RetryableError, TimeoutError):
    """The broker did not answer a ``basic.consume`` within ``consume_timeout``.

    Seen on RabbitMQ 3.10 for a quorum queue whose leader's node is frozen (a paused VM):
    the subscription waits for that node (65 s, or until it runs again).  The channel is
    closed; a failover's replay subscribes the consumer again in the background while
    the client goes on, so it is found within about ``consume_timeout`` of the thaw."""


class PublishError(MiddlewareError):
    """The broker refused a publish."""


class MalformedMessage(PublishError, ValueError):
    """The message can never be sent as it is (a header the broker refuses, a frame too
    large): refused before sending, never retried or spooled; the message says what to fix."""


class MessageRefused(MalformedMessage):
    """The broker closed the connection in direct answer to this message (twice, counting
    the one retry); it is not sent again."""

    def __init__(self, message: str, *, reply_code: int = 0) -> None:
        super().__init__(message)
        self.reply_code = reply_code


class PublishNacked(PublishError, RetryableError):
    """The broker answered basic.nack: it could not take responsibility for the message now.

    A quorum queue does this while it elects a new leader after a node loss, so the
    publish seam retries it with the same message id under the retry policy.
    """


class Unroutable(PublishError):
    """A mandatory publish was returned: no queue is bound for its routing key."""

    def __init__(self, message: str, *, exchange: str = "", routing_key: str = "") -> None:
        super().__init__(message)
        self.exchange = exchange
        self.routing_key = routing_key


class NoRoute(PublishError):
    """An end-to-end publish would reach no queue, so no receipt could ever confirm it."""


class NegativeReceipt(PublishError):
    """A consumer's handler rejected the message: the end-to-end confirm failed."""

    def __init__(self, message: str, *, message_id: str, queue: str, reason: str) -> None:
        super().__init__(message)
        self.message_id, self.queue, self.reason = message_id, queue, reason


class DuplicateMessageId(PublishError, ValueError):
    """An e2e publish reused the id of a message still in flight on the same publisher.

    An id names one message: resends reuse it, and consumers drop a second copy by it.
    (A consumer that already handled another message under the id answers a negative
    receipt, so that message is never confirmed as handled.)"""


class ReceiptTimeout(PublishError, TimeoutError):
    """Receipts from some expected queues never came, after every retransmit."""

    def __init__(
        self, message: str, *, message_id: str, missing: frozenset[str], attempts: int
    ) -> None:
        super().__init__(message)
        self.message_id, self.missing, self.attempts = message_id, missing, attempts


class TopologyError(MiddlewareError):
    """The broker refused a declaration, binding or consume."""


class EntityNotFound(TopologyError, LookupError):
    """The queue or exchange does not exist."""


class PreconditionFailed(TopologyError):
    """An entity exists with other arguments than the ones declared."""


class AccessRefused(TopologyError, PermissionError):
    """The user is not allowed to use this entity or vhost."""


class QueueResult:
    """Mixin: an EMQ result code (for logs and metrics) and what to do about it."""

    code: int = 0
    hint: str = ""


class QueueDoesNotExist(QueueResult, EntityNotFound):
    code, hint = 1, "create it with create_queue() first"


class ConnectionNotEstablished(QueueResult, BrokerUnreachable):
    code, hint = 2, "no broker node is reachable and the local spool is disabled or full"


class QueueSaveFailed(QueueResult, PublishError):
    code, hint = 3, "the broker refused to store it (full queue or no quorum): retry later"


class MessageMalformed(QueueResult, MalformedMessage):
    code, hint = 4, "fix the message: it is never retried"


class WindowExceeded(QueueResult, WindowFull):
    code, hint = 5, "too many unconfirmed messages: wait, or enqueue with block=True"


class HandlerInstruction(MiddlewareError):
    """Raised by a consumer handler to say what to do with the delivery."""

    def __init__(self, reason: str = "") -> None:
        super().__init__(reason)
        self.reason = reason


class Reject(HandlerInstruction):
    """Reject without requeue: the queue's own dead-letter exchange gets it, if it has one."""


class Requeue(HandlerInstruction):
    """Give the message back to the queue for another delivery."""


class DeadLetter(HandlerInstruction):
    """Move the message to the layer's dead-letter queue with this reason, then ack it."""
