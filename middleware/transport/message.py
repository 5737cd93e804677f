"""An outgoing message, built once and sent by either face."""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..settings import Settings
from ..unique import random_hex

__all__ = ["OutgoingMessage", "new_message_id", "tls_context"]


def new_message_id() -> str:
    return random_hex(16)


@dataclass(frozen=True, slots=True)
class OutgoingMessage:
    """What to publish, independent of pika and aio-pika."""

    body: bytes
    exchange: str = ""
    routing_key: str = ""
    message_id: str = field(default_factory=new_message_id)
    headers: Mapping[str, Any] = field(default_factory=dict)
    persistent: bool = False
    mandatory: bool = True
    priority: int | None = None
    reply_to: str | None = None
    correlation_id: str | None = None
    expiration_ms: int | None = None
    content_type: str | None = None
    timestamp: float | None = None

    @property
    def delivery_mode(self) -> int:
        return 2 if self.persistent else 1


def tls_context(settings: Settings) -> ssl.SSLContext:
    """The TLS context for amqps:// nodes, from the settings' CA, cert and key."""
    tls = settings.tls
    context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    if tls.cert_file and tls.key_file:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if not tls.verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
