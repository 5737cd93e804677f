"""The e2e confirm contract a service relies on, over both real faces and both test
doubles (``middleware.testing``): the same publisher and consumer classes, the same
outcomes, so a service's unit tests on the doubles mean what they say on the brokers."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from middleware.confirms import (
    AsyncConfirmConsumer,
    AsyncConfirmPublisher,
    SyncConfirmConsumer,
    SyncConfirmPublisher,
)
from middleware.errors import NegativeReceipt, ReceiptTimeout, Reject, Requeue
from middleware.transport import BindingSpec, Delivery, QueueKind, QueueSpec
from tests.conftest import Face
from tests.integration.test_confirms import _fanout, _fast

pytestmark = pytest.mark.rabbit


class Confirms:
    """An e2e publisher and consumers on one face; consumers run in the background."""

    def __init__(self, face: Face, specs: list[Any]) -> None:
        self.face, self.stop = face, threading.Event()
        self.threads: list[threading.Thread] = []
        for spec in specs:
            self.declare(spec)
        if face.kind == "async":
            self.consumer_client = face.loop.run(face.new_client().connect())
            for spec in specs:
                face.loop.run(self._declare_on(self.consumer_client, spec))
            self.publisher = face.loop.run(AsyncConfirmPublisher(face.client, mode="e2e").start())
            self.consumer = AsyncConfirmConsumer(self.consumer_client)
        else:
            self.publisher = SyncConfirmPublisher(face.client, mode="e2e")

    @staticmethod
    async def _declare_on(client: Any, spec: Any) -> None:
        method = {QueueSpec: "declare_queue", BindingSpec: "bind"}.get(type(spec))
        await getattr(client, method or "declare_exchange")(spec)

    def declare(self, spec: Any) -> None:
        method = {QueueSpec: "declare_queue", BindingSpec: "bind"}.get(type(spec))
        self.face.call(method or "declare_exchange", spec)

    def consume(self, queues: list[str], handler: Callable[[Delivery], None]) -> None:
        if self.face.kind == "async":

            async def ahandler(d: Delivery) -> None:
                handler(d)

            for q in queues:
                self.face.loop.run(self.consumer.consume(q, ahandler))
            return
        ready = threading.Event()

        def run() -> None:
            client = self.face.new_client().connect()
            consumer = SyncConfirmConsumer(client)
            for q in queues:
                consumer.consume(q, handler)
            ready.set()
            consumer.run(until=self.stop.is_set)
            client.close()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.threads.append(thread)
        assert ready.wait(30)

    def publish(self, body: bytes, **kwargs: Any) -> None:
        if self.face.kind == "async":
            self.face.loop.run(self.publisher.publish(body, **kwargs))
        else:
            self.publisher.publish(body, **kwargs)

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        if self.face.kind == "async":
            self.face.loop.run(self.consumer.close())
            self.face.loop.run(self.publisher.close())
            self.face.loop.run(self.consumer_client.close())


@pytest.fixture
def confirms_face(request: pytest.FixtureRequest, settings) -> Any:
    face = Face(request.param, _fast(settings, receipt_timeout=1.0))
    face.call("connect")
    yield face
    face.close()


FACES = ["async", "sync", "double-async", "double-sync"]


@pytest.mark.parametrize("confirms_face", FACES, indirect=True)
def test_a_confirm_means_every_queue_handled_it_and_says_who_did_not(confirms_face, name) -> None:
    queues = [f"{name}.{i}" for i in range(3)]
    picky = queues[2]
    e2e = Confirms(confirms_face, _fanout(name, queues))
    handled: Counter[str] = Counter()
    seen = threading.Lock()

    def handler(d: Delivery) -> None:
        if d.queue == picky and d.text() == "bad":
            raise Reject("amount must be positive")
        if d.text() == "later" and d.queue == picky and not d.redelivered:
            raise Requeue("not yet")
        with seen:
            handled[f"{d.queue}:{d.text()}"] += 1

    try:
        e2e.consume(queues, handler)
        for i in range(10):
            e2e.publish(f"m{i}".encode(), exchange=name)
            with seen:  # confirmed: every queue handled it already
                assert all(handled[f"{q}:m{i}"] == 1 for q in queues), handled
        e2e.publish(b"later", exchange=name)  # a requeue: handled again, then confirmed
        assert handled[f"{picky}:later"] == 1
        e2e.publish(b"once", exchange=name, message_id=f"{name}-once")
        e2e.publish(b"once", exchange=name, message_id=f"{name}-once")  # a resend: answered
        assert all(handled[f"{q}:once"] == 1 for q in queues), handled
        with pytest.raises(NegativeReceipt) as refused:
            e2e.publish(b"bad", exchange=name)
        assert (refused.value.queue, refused.value.reason) == (picky, "amount must be positive")
        silent = f"{name}.silent"
        e2e.declare(QueueSpec(silent, kind=QueueKind.CLASSIC))
        e2e.declare(BindingSpec(silent, name))
        with pytest.raises(ReceiptTimeout) as timed_out:
            e2e.publish(b"late", exchange=name)
        assert timed_out.value.missing == {silent}
    finally:
        e2e.close()
