"""A copy the broker returned (``delivery.CopySender``): dropped only when its queue
does not exist; a queue that is there but whose node is down (or stopping) keeps it
(``DOWN``: carried; a local put raises ``HopFailed``: handled again).  Until 2026-12-06
every return was taken for a deleted queue and the copy dropped.  The copies returned
together share one look at the broker."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from middleware.confirms.aio import _receipt_or_return
from middleware.errors import ConnectionLost, DuplicateMessageId, HopFailed, Unroutable
from middleware.phoenix.protocol import PhoenixTopology
from middleware.routing.copies import Outcome
from middleware.routing.delivery import CopySender

TOPOLOGY = PhoenixTopology.model_validate({"clusters": [{"id": "A"}, {"id": "B"}]})


class _Client:
    """A client whose publishes come back; ``gone``: what its passive declare says."""

    ready = True
    confirmed = 0

    def __init__(self, gone: bool | BaseException) -> None:
        self.gone, self.looks = gone, 0

    async def publish(self, _message: Any, **_: Any) -> None:
        raise Unroutable("returned as unroutable: 312 NO_ROUTE")

    async def queue_gone(self, _queue: str) -> bool:
        self.looks += 1
        await asyncio.sleep(0.01)
        if isinstance(self.gone, BaseException):
            raise self.gone
        return self.gone


def _sender(client: _Client) -> CopySender:
    async def client_for(_cluster: str) -> Any:
        return client

    return CopySender(topology=TOPOLOGY, client_for=client_for, known=lambda _: client)  # type: ignore[arg-type,return-value]


def _put(sender: CopySender, *, local: bool = False) -> Any:
    return sender.put("A", "q", "broker", b"{}", "e1:q", local=local)


def test_a_copy_returned_by_a_queue_that_does_not_exist_is_gone() -> None:
    outcome = asyncio.run(_put(_sender(_Client(gone=True))))
    assert outcome.outcome is Outcome.GONE


def test_a_copy_returned_by_a_queue_whose_node_is_down_is_kept() -> None:
    outcome = asyncio.run(_put(_sender(_Client(gone=False))))
    assert outcome.outcome is Outcome.DOWN and "its node is down" in outcome.reason


def test_a_look_that_fails_keeps_the_copy_too() -> None:
    outcome = asyncio.run(_put(_sender(_Client(gone=ConnectionLost("channel closed")))))
    assert outcome.outcome is Outcome.DOWN and "ConnectionLost" in outcome.reason


def test_a_local_put_whose_queue_is_down_raises_for_its_delivery_to_be_handled_again() -> None:
    with pytest.raises(HopFailed):
        asyncio.run(_put(_sender(_Client(gone=False)), local=True))
    outcome = asyncio.run(_put(_sender(_Client(gone=True)), local=True))
    assert outcome.outcome is Outcome.GONE


def test_copies_returned_together_share_one_look() -> None:
    client = _Client(gone=False)
    sender = _sender(client)

    async def many() -> list[Any]:
        return await asyncio.gather(*(_put(sender) for _ in range(20)))

    outcomes = asyncio.run(many())
    assert {o.outcome for o in outcomes} == {Outcome.DOWN}
    assert client.looks == 1


def test_a_held_e2e_copy_stops_waiting_for_its_receipt_once_returned() -> None:
    """``publish_held``'s wait: a receipt after the broker's ack ends it; a return (no
    queue took the copy: no receipt can come) ends it at once, not after the hold."""

    async def wait(answer: str) -> float:
        loop = asyncio.get_running_loop()
        receipt: asyncio.Future[None] = loop.create_future()
        taken: asyncio.Future[None] = loop.create_future()
        if answer == "returned":
            loop.call_later(0.01, taken.set_exception, Unroutable("returned"))
        else:
            loop.call_later(0.01, taken.set_result, None)
            loop.call_later(0.05, receipt.set_result, None)
        start = loop.time()
        await _receipt_or_return(receipt, taken, 5.0)
        if taken.done():
            taken.exception()
        return loop.time() - start

    assert asyncio.run(wait("returned")) < 1.0
    assert 0.04 < asyncio.run(wait("receipt")) < 1.0


@pytest.mark.parametrize("local", [True, False])
def test_a_copy_on_its_way_already_is_handled_again_not_dead_lettered(
    local: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same e2e copy put again while the first put is still on its way (its event,
    or the carried copy, came again after a connection was lost): the confirm publisher
    refuses the id (``DuplicateMessageId``); the delivery is handled again once the first
    is over.  Until 2026-12-07 the handler raised it and the copy was dead-lettered (a
    fresh-clone run, the restart file's subscriber-queues cell)."""
    sender = _sender(_Client(gone=False))

    async def on_its_way(*_: Any, **__: Any) -> Any:
        raise DuplicateMessageId("message id 'e1:q' is already in flight on this publisher")

    monkeypatch.setattr(sender, "_e2e_copy", on_its_way)
    put = sender.put("A", "q", "e2e", b"{}", "e1:q", local=local)
    with pytest.raises(HopFailed, match="on its way already"):
        asyncio.run(put)
