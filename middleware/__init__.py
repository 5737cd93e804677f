"""qosmq: qualities of service beside RabbitMQ.

Entry points: :func:`connect` (asyncio core) and :func:`connect_sync` (pika face),
both configured by one :class:`Settings` object.
"""

from __future__ import annotations

from .errors import (
    AccessRefused,
    BrokerUnreachable,
    ConfigurationError,
    ConfirmTimeout,
    ConnectionLost,
    DeadLetter,
    EntityNotFound,
    GetTimeout,
    MiddlewareError,
    NotConnected,
    PreconditionFailed,
    PublishError,
    PublishNacked,
    Reject,
    Requeue,
    SubscribeTimeout,
    Unroutable,
    WindowFull,
)
from .settings import Settings
from .transport import (
    AsyncClient,
    BindingSpec,
    Delivery,
    ExchangeSpec,
    ExchangeType,
    OutgoingMessage,
    QueueKind,
    QueueSpec,
    SyncClient,
)


def _version() -> str:
    """The installed distribution's version: ``pyproject.toml`` is its one source."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qosmq")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "0+unknown"


__version__ = _version()

__all__ = [
    "AccessRefused",
    "AsyncClient",
    "BindingSpec",
    "BrokerUnreachable",
    "ConfigurationError",
    "ConfirmTimeout",
    "ConnectionLost",
    "DeadLetter",
    "Delivery",
    "EntityNotFound",
    "ExchangeSpec",
    "ExchangeType",
    "GetTimeout",
    "MiddlewareError",
    "NotConnected",
    "OutgoingMessage",
    "PreconditionFailed",
    "PublishError",
    "PublishNacked",
    "QueueKind",
    "QueueSpec",
    "Reject",
    "Requeue",
    "Settings",
    "SubscribeTimeout",
    "SyncClient",
    "Unroutable",
    "WindowFull",
    "__version__",
    "connect",
    "connect_sync",
]


async def connect(settings: Settings | None = None) -> AsyncClient:
    """Connect the asyncio client to the cluster (settings from the environment by default)."""
    return await AsyncClient(settings=settings or Settings.load()).connect()


def connect_sync(settings: Settings | None = None) -> SyncClient:
    """Connect the blocking (pika) client to the cluster."""
    return SyncClient(settings=settings or Settings.load()).connect()
