from __future__ import annotations

import inspect

import aiormq.exceptions as aexc
import pika.exceptions as pexc
import pytest
from pika.adapters.utils.connection_workflow import AMQPConnectorStackTimeout

import middleware
from middleware import errors
from middleware.errors import DeadLetter, Reject, Requeue
from middleware.transport.delivery import Action, outcome_of
from middleware.transport.translate import translate_aio, translate_sync


def test_public_all_is_sorted_and_importable() -> None:
    names = [n for n in middleware.__all__ if not n.startswith("__")]
    assert names == sorted(names)
    for name in middleware.__all__:
        assert hasattr(middleware, name)


def test_every_error_derives_from_the_one_base() -> None:
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, Exception) and cls.__module__ == errors.__name__:
            assert issubclass(cls, errors.MiddlewareError), cls
    assert issubclass(errors.BrokerUnreachable, ConnectionError)
    assert issubclass(errors.ConfirmTimeout, TimeoutError)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (aexc.ChannelNotFoundEntity("no queue"), errors.EntityNotFound),
        (aexc.ChannelPreconditionFailed("args"), errors.PreconditionFailed),
        (aexc.ChannelAccessRefused("no"), errors.AccessRefused),
        (aexc.ProbableAuthenticationError("auth"), errors.AccessRefused),
        (aexc.ConnectionClosed(320, "forced"), errors.ConnectionLost),
        (ConnectionRefusedError(111, "refused"), errors.ConnectionLost),
        (aexc.ChannelInvalidStateError("closed"), errors.ConnectionLost),
        (RuntimeError("<Connection ...> closed"), errors.ConnectionLost),
        (TimeoutError(), errors.ConfirmTimeout),
    ],
)
def test_aio_translation(exc, expected) -> None:
    assert type(translate_aio(exc)) is expected


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (pexc.ChannelClosedByBroker(404, "NOT_FOUND"), errors.EntityNotFound),
        (pexc.ChannelClosedByBroker(406, "PRECONDITION_FAILED"), errors.PreconditionFailed),
        (pexc.ChannelClosedByBroker(403, "ACCESS_REFUSED"), errors.AccessRefused),
        (pexc.UnroutableError([]), errors.Unroutable),
        (pexc.NackError([]), errors.PublishNacked),
        (pexc.StreamLostError("lost"), errors.ConnectionLost),
        (pexc.AMQPConnectionError("refused"), errors.ConnectionLost),
        (pexc.ProbableAuthenticationError("auth"), errors.AccessRefused),
        # a frozen node: TCP accepted, no AMQP handshake (was an "unexpected" TopologyError)
        (AMQPConnectorStackTimeout("Timeout during AMQP handshake"), errors.ConnectionLost),
    ],
)
def test_sync_translation(exc, expected) -> None:
    assert type(translate_sync(exc)) is expected


def test_handler_outcomes() -> None:
    assert outcome_of(None).action is Action.ACK
    assert outcome_of(Reject("bad")).action is Action.REJECT
    assert outcome_of(Requeue()).action is Action.REQUEUE
    assert outcome_of(DeadLetter("schema")).reason == "schema"
    boom = outcome_of(ValueError("boom"))
    assert boom.action is Action.DEAD_LETTER and "ValueError: boom" in boom.reason


def test_both_faces_and_their_doubles_have_the_same_topology_and_message_verbs() -> None:
    """A service moves between the faces (and onto a test double) without losing a verb:
    ``SyncClient.delete_exchange`` was missing while its double had it."""
    from middleware.testing import InMemoryClient, InMemorySyncClient
    from middleware.transport import AsyncClient, SyncClient

    verbs = {
        "declare_exchange",
        "declare_queue",
        "bind",
        "delete_queue",
        "delete_exchange",
        "queue_length",
        "get",
        "publish",
        "consume",
        "cancel",
        "connect",
        "close",
    }
    for cls in (AsyncClient, SyncClient, InMemoryClient, InMemorySyncClient):
        assert verbs <= set(dir(cls)), (cls.__name__, sorted(verbs - set(dir(cls))))
