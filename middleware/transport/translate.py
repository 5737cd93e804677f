"""Translate pika and aiormq exceptions into the layer's error tree, at the boundary.

Two tables (one per library), most specific class first; the first match wins.
Callers write ``raise translate_aio(exc) from exc`` so the cause stays visible.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiormq.connection
import aiormq.exceptions as aexc
import pika.exceptions as pexc
from pika.adapters.utils.connection_workflow import AMQPConnectorException

from ..errors import (
    AccessRefused,
    ConfirmTimeout,
    ConnectionLost,
    EntityNotFound,
    GetTimeout,
    MiddlewareError,
    PreconditionFailed,
    PublishNacked,
    ResourceLocked,
    TopologyError,
    Unroutable,
)
from .message import OutgoingMessage

__all__ = ["REFUSAL_CODES", "confirm_timeout", "refusal_code", "translate_aio", "translate_sync"]

#: connection close codes that answer what the client just sent (a frame the broker
#: could not take): FRAME_ERROR, SYNTAX_ERROR, COMMAND_INVALID, UNEXPECTED_FRAME,
#: INTERNAL_ERROR (RabbitMQ's answer to a NaN header)
REFUSAL_CODES = frozenset({501, 502, 503, 505, 541})
_AIO_CODES: dict[type[BaseException], int] = {
    cls: code for code, cls in aiormq.connection.EXCEPTION_MAPPING.items()
}


def refusal_code(error: BaseException) -> int:
    """The reply code when the broker closed the connection in answer to a frame it
    could not take (``REFUSAL_CODES``), found along ``error``'s causes; else 0."""
    seen: set[int] = set()  # a chain may loop: ``raise translate(exc) from exc`` of itself
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        code = _AIO_CODES.get(type(cause), 0)
        if isinstance(cause, pexc.ConnectionClosedByBroker):
            code = cause.reply_code
        if code in REFUSAL_CODES:
            return code
        cause = cause.__cause__
    return 0


Factory = Callable[[BaseException], MiddlewareError]


def _make(kind: type[MiddlewareError], prefix: str) -> Factory:
    def build(exc: BaseException) -> MiddlewareError:
        detail = str(exc) or type(exc).__name__
        return kind(f"{prefix}: {detail}")

    return build


_AIO_TABLE: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], Factory], ...] = (
    (
        (aexc.AuthenticationError, aexc.ProbableAuthenticationError),
        _make(AccessRefused, "the broker refused the credentials or vhost"),
    ),
    (  # 530 in answer to Connection.Open: the vhost does not exist or is not allowed
        aexc.ConnectionNotAllowed,
        _make(AccessRefused, "the broker refused the credentials or vhost"),
    ),
    (aexc.ChannelAccessRefused, _make(AccessRefused, "access refused")),
    (aexc.ChannelNotFoundEntity, _make(EntityNotFound, "not found")),
    (aexc.ChannelPreconditionFailed, _make(PreconditionFailed, "precondition failed")),
    (aexc.ChannelLockedResource, _make(ResourceLocked, "resource locked")),
    (aexc.PublishError, _make(Unroutable, "message returned as unroutable")),
    (aexc.DeliveryError, _make(PublishNacked, "the broker nacked the message")),
    # before OSError: since Python 3.11 TimeoutError is an OSError
    (asyncio.TimeoutError, _make(ConfirmTimeout, "no answer from the broker in time")),
    (
        (
            aexc.AMQPConnectionError,
            aexc.ChannelInvalidStateError,
            ConnectionError,
            OSError,
            aexc.ChannelClosed,
            # aio-pika raises a bare RuntimeError("<Connection ...> closed") after close
            RuntimeError,
        ),
        _make(ConnectionLost, "connection lost"),
    ),
    (aexc.AMQPError, _make(TopologyError, "broker error")),
)

_SYNC_TABLE: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], Factory], ...] = (
    (
        (
            pexc.ProbableAuthenticationError,
            pexc.AuthenticationError,
            pexc.ProbableAccessDeniedError,
        ),
        _make(AccessRefused, "the broker refused the credentials or vhost"),
    ),
    (pexc.UnroutableError, _make(Unroutable, "message returned as unroutable")),
    (pexc.NackError, _make(PublishNacked, "the broker nacked the message")),
    (
        (
            pexc.AMQPConnectionError,
            pexc.ConnectionWrongStateError,
            pexc.ChannelWrongStateError,
            pexc.StreamLostError,
            # pika's connect with one address raises its connector's own error (a frozen
            # node accepts the TCP connection and never answers the handshake: a stack
            # timeout): a node that did not answer, as for any other, not a broker error
            AMQPConnectorException,
            ConnectionError,
            OSError,
        ),
        _make(ConnectionLost, "connection lost"),
    ),
    (pexc.AMQPError, _make(TopologyError, "broker error")),
)

_BY_REPLY_CODE: dict[int, Factory] = {
    403: _make(AccessRefused, "access refused"),
    404: _make(EntityNotFound, "not found"),
    405: _make(ResourceLocked, "resource locked"),
    406: _make(PreconditionFailed, "precondition failed"),
}


def _lookup(
    table: tuple[tuple[type[BaseException] | tuple[type[BaseException], ...], Factory], ...],
    exc: BaseException,
) -> MiddlewareError:
    if isinstance(exc, MiddlewareError):
        return exc
    for kinds, factory in table:
        if isinstance(exc, kinds):
            return factory(exc)
    return TopologyError(f"unexpected {type(exc).__name__}: {exc}")


#: what RabbitMQ says when it closes a connection over a ``basic.get`` it gave up on (a
#: quorum queue without its quorum: ``{timeout, ...}`` after about 65 s on 3.10)
_GET_GIVEN_UP = "Cannot get a message from queue"


def _get_given_up(exc: BaseException) -> GetTimeout | None:
    if _GET_GIVEN_UP not in str(exc):
        return None
    first_line = str(exc).split("\\n", 1)[0].split("\n", 1)[0]
    return GetTimeout(
        "the broker gave up on a basic.get and closed the connection (a quorum queue "
        f"without its quorum?); not tried again: {first_line}"
    )


def translate_aio(exc: BaseException) -> MiddlewareError:
    """The layer's error for an aio-pika/aiormq exception."""
    return _get_given_up(exc) or _lookup(_AIO_TABLE, exc)


def translate_sync(exc: BaseException) -> MiddlewareError:
    """The layer's error for a pika exception."""
    if given_up := _get_given_up(exc):
        return given_up
    if isinstance(exc, pexc.ChannelClosedByBroker) and exc.reply_code in _BY_REPLY_CODE:
        return _BY_REPLY_CODE[exc.reply_code](exc)
    return _lookup(_SYNC_TABLE, exc)


def confirm_timeout(
    message: OutgoingMessage, within: float, *, bound: str = "publish_timeout"
) -> ConfirmTimeout:
    """The error of a confirmed publish the broker did not answer within ``within``
    seconds (``publish_timeout``, or a caller's own bound), on either face: it may
    still be taken (a queue without its quorum confirms when the quorum is back), so
    the caller decides."""
    return ConfirmTimeout(
        f"message {message.message_id} to {message.exchange or '(default)'}/"
        f"{message.routing_key}: no broker confirm within {bound} = {within:g} s "
        "(not sent again; the broker may still take it)"
    )
