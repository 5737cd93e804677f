"""Putting one matched event's copy into one subscriber queue: the driver both a match
broker (directly) and a subscriber's home routing master (a copy carried over the ring)
use.  Each copy has an outcome of its own (``copies.Outcome``: delivered, taken, gone,
refused, unreachable); what each outcome takes is decided in ``copies.settle``.

With the topology's ``copy_batch_max`` above 1, the copies for one subscriber queue
that are put close together leave as one AMQP message (a JSON array,
``batching.Batcher`` with the roles' linger); each copy's outcome is its batch's (they
share a queue and a home, so they share what can go wrong).  The Phoenix client's
``consume`` hands the application one event at a time.  An e2e batch is one e2e message
with one receipt: it names each copy's id and content (``ELEMENTS_HEADER``), so the
subscriber's duplicate check takes each copy as the message it would be alone (a copy
sent again alone or in another batch, after a match master's death, is suppressed).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..confirms.aio import AsyncConfirmPublisher
from ..confirms.pace import QueuePace
from ..confirms.tracking import CONTENT_HEADER, ELEMENTS_HEADER, encode_elements
from ..errors import (
    DuplicateMessageId,
    HopFailed,
    LinkDown,
    NegativeReceipt,
    NotConnected,
    PublishNacked,
    RetryableError,
    Unroutable,
)
from ..phoenix.protocol import PhoenixTopology
from ..transport import AsyncClient
from .batching import Batcher, encode
from .copies import CopyOutcome, Outcome, event_content
from .linkbound import bounded
from .wiring import outgoing_body

__all__ = ["CopyOutcome", "CopySender", "Outcome", "event_content"]

log = logging.getLogger(__name__)
#: what a copy's send raises when its home, not the copy, is at fault; and
#: ``DuplicateMessageId``, which ``put`` raises as ``HopFailed``: an e2e copy this role
#: sends for another delivery right now (the event, or the carried copy, came again
#: while the first was on its way: a connection lost), handled again once that one is
#: over, never dead-lettered for it
HOME_ERRORS = (RetryableError, NotConnected, TimeoutError)
#: e2e copies one message carries at most, whatever ``copy_batch_max`` says: each is
#: named in its ``ELEMENTS_HEADER`` (at most ~105 bytes: an id of up to 81 characters
#: and a 16-digit content name), and headers must fit one AMQP frame (128 KB by
#: default; a message whose headers do not is refused before it is sent)
E2E_BATCH_MAX = 500
#: how long the broker's answer for a subscriber queue whose copy came back is kept
LOOK_S = 0.5


class CopySender:
    """One role's copies into subscriber queues (one e2e publisher per connection)."""

    def __init__(
        self,
        *,
        topology: PhoenixTopology,
        client_for: Callable[[str], Awaitable[AsyncClient]],
        known: Callable[[str], AsyncClient | None] = lambda _: None,
        count: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.topology = topology  # ``count``: the role's (``copy_bounds_stretched``)
        self._stretched = functools.partial(count, "copy_bounds_stretched")
        self.client_for = client_for
        self.known = known  # a cluster's client when connected before: no wait, no task
        self.pace = QueuePace(
            hold_s=topology.e2e_hold_s, probe_s=topology.e2e_probe_s, window=topology.e2e_window
        )
        self._e2e: dict[AsyncClient, AsyncConfirmPublisher] = {}
        self._lock = asyncio.Lock()
        #: homes a copy could not reach: when a copy may try the direct way again (one
        #: every ``link_retry_s``); meanwhile their copies go to the ring at once instead
        #: of each waiting ``link_timeout_s`` with an inbox slot held
        self._down: dict[str, float] = {}
        #: the broker's answer for a subscriber queue whose copy came back (``_returned``):
        #: one look at a time per queue, kept ``LOOK_S`` (the copies returned together at
        #: a node's stop share it: a look each, at once, closed the connection once)
        self._looks: dict[tuple[str, str], tuple[float, asyncio.Future[bool]]] = {}
        self._batcher = Batcher(
            self._publish_copies,
            max_messages=topology.copy_batch_max,
            linger_s=topology.batch_linger_ms / 1000,
            progress=self._confirmed,
            stretched=self._stretched,
        )
        #: e2e copies: tagged (id, content name, link bound), a batch is one held message
        self._e2e_batcher = Batcher(
            max_messages=min(topology.copy_batch_max, E2E_BATCH_MAX),
            linger_s=topology.batch_linger_ms / 1000,
            publish_many=self._publish_e2e,
        )

    async def put(
        self,
        home: str,
        queue: str,
        confirm: str,
        body: bytes,
        copy_id: str | None,
        *,
        local: bool = False,
        content: str | None = None,
        priority: int = 0,
    ) -> CopyOutcome:
        """Send one copy and say how it ended (never raises for its home's faults).
        ``local``: the home is this role's own cluster (a routing master putting a copy
        the ring carried to it): no link bound, the transport's own retries, and a
        failure raises (the copy's delivery stays unacked).  ``content``: the event's
        name (``event_content``): an e2e subscriber takes two copies of one event as one
        message however each was stamped.  ``priority``: the event's (``linger_for``)."""
        bound = None if local else self.topology.link_timeout_s
        if not local and not self._may_try(home, time.monotonic()):
            return CopyOutcome(Outcome.UNREACHABLE, f"cluster {home} unreachable a moment ago")
        try:
            client = self.known(home) or await self._connected(home, bound)
            if not local and not client.ready:
                raise LinkDown(f"no connection to cluster {home}'s RabbitMQ (failing over)")
            if confirm == "e2e":
                if self._e2e_batcher.max_messages > 1 and copy_id and content:
                    tag = (copy_id, content, bound)
                    outcome: CopyOutcome = await self._e2e_batcher.send(
                        home, queue, body, priority, tag, bound=self._e2e_bound(bound)
                    )
                    return outcome
                alone = self._e2e_copy(client, home, queue, body, copy_id, bound, content)
                return await bounded(alone, self._e2e_bound(bound))  # type: ignore[no-any-return]
            await self._broker_copy(client, home, queue, body, priority, bound)
            self._down.pop(home, None)
            return CopyOutcome(Outcome.DELIVERED)
        except Unroutable:
            return await self._returned(home, queue, local)
        except PublishNacked as exc:  # the queue, not its home: its other queues go on
            return self._nacked(queue, local, exc)
        except NegativeReceipt as exc:
            return CopyOutcome(Outcome.REFUSED, str(exc))
        except DuplicateMessageId as exc:  # on its way for another delivery: HOME_ERRORS
            raise HopFailed(f"copy {copy_id} for {queue} is on its way already") from exc
        except HOME_ERRORS as exc:
            if local:
                raise
            self._down[home] = time.monotonic() + self.topology.link_retry_s
            return CopyOutcome(Outcome.UNREACHABLE, f"{type(exc).__name__}: {exc}")

    async def _returned(self, home: str, queue: str, local: bool) -> CopyOutcome:
        """A copy the broker returned: its queue is gone (deleted), or there but its node
        is down, or stopping (a durable classic queue's node; its copies are returned
        until the node is back).  Asked of the broker: a copy is dropped only for a queue
        that does not exist.  A local put raises (the carried copy's delivery is handled
        again, then given back); a match broker's copy is carried (``DOWN``)."""
        try:
            gone = await asyncio.shield(self._look(home, queue))
        except HOME_ERRORS as exc:
            gone, why = False, f"{type(exc).__name__}: {exc}"
        else:
            why = "its node is down"
        if gone:
            return CopyOutcome(Outcome.GONE, f"subscriber queue {queue} is gone")
        if local:
            raise HopFailed(f"subscriber queue {queue} was returned ({why})")
        return CopyOutcome(Outcome.DOWN, f"subscriber queue {queue} was returned ({why})")

    @staticmethod
    def _nacked(queue: str, local: bool, exc: PublishNacked) -> CopyOutcome:
        """A copy the broker refused (``basic.nack``): its queue is full and rejects
        publishes (``overflow: reject-publish``), or a quorum queue elects a leader.  The
        copy waits as one for a queue whose node is down (``DOWN``: carried to the
        home's routing master, which parks it and tries it again), and the home is not
        taken for down: its other subscriber queues take their copies meanwhile."""
        why = f"subscriber queue {queue} refused the copy (full, or electing a leader): {exc}"
        if local:
            raise HopFailed(why) from exc
        return CopyOutcome(Outcome.DOWN, why)

    def _look(self, home: str, queue: str) -> asyncio.Future[bool]:
        """Whether ``queue`` is gone, asked once per ``LOOK_S`` (``_looks``)."""
        now, key = time.monotonic(), (home, queue)
        held = self._looks.get(key)
        if held is not None and now < held[0]:
            return held[1]
        if len(self._looks) > 1000:
            self._looks = {k: v for k, v in self._looks.items() if now < v[0]}

        async def look() -> bool:
            client = self.known(home) or await self.client_for(home)
            return await client.queue_gone(queue)

        answer = asyncio.ensure_future(look())
        answer.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._looks[key] = (now + LOOK_S, answer)
        return answer

    @classmethod
    def for_role(cls, role: Any) -> CopySender:
        """The copies of a Phoenix role (``peer.Role``): its clusters' clients, counted
        in its counters."""
        known = role.connections.known
        return cls(
            topology=role.topology, client_for=role.client_for, known=known, count=role.count
        )

    async def _broker_copy(
        self,
        client: AsyncClient,
        home: str,
        queue: str,
        body: bytes,
        priority: int,
        bound: float | None,
    ) -> None:
        """A broker-confirmed copy, batched or alone; its bound stretches while the link
        confirms others (``bounded``; a copy's bound passing again is counted
        ``copy_bounds_stretched``: the link or the machine is slow).  ``priority``: how
        long a batched copy may linger."""
        if self._batcher.max_messages > 1:
            await self._batcher.send(home, queue, body, priority, bound=bound)
            return
        progress = functools.partial(self._confirmed, home)
        message = outgoing_body(body, queue, persistent=self.topology.persistent)
        publish = client.publish(message, retry_nacked=False)  # (a nack: ``_nacked``)
        await bounded(publish, bound, progress, self._stretched)

    def _e2e_bound(self, bound: float | None) -> float | None:
        """How long an e2e copy (alone or batched) waits in all: its receipt's hold
        and then its link's bound for the broker to take it (``publish_held``), with as
        much again for getting its turn.  Past it the copy is unreachable (carried around the
        link), so one wait that never ends cannot hold the event's other copies, and
        the ones to be carried, for ever; what was sent may still arrive, and the
        subscriber's duplicate check drops it."""
        return None if bound is None else 2 * (self.pace.hold_s + bound)

    def _confirmed(self, home: str) -> int:
        """How many publishes ``home``'s link has had confirmed (its progress)."""
        client = self.known(home)
        return -1 if client is None else client.confirmed

    async def _connected(self, home: str, bound: float | None) -> AsyncClient:
        """``home``'s client when none was connected before: within ``bound``."""
        return await asyncio.wait_for(self.client_for(home), bound)

    async def _publish_copies(self, home: str, queue: str, body: bytes, priority: int) -> None:
        """One AMQP message of a batch of copies (``put`` checked the home's link)."""
        client = self.known(home)
        if client is None:
            client = await self.client_for(home)
        message = outgoing_body(body, queue, persistent=self.topology.persistent)
        await client.publish(message, retry_nacked=False)  # (a nack: ``_nacked``)

    def _may_try(self, home: str, now: float) -> bool:
        """Whether a copy to ``home`` tries the direct way (a home not known down, or
        the one probe of a down home every ``link_retry_s``)."""
        due = self._down.get(home)
        if due is None:
            return True
        if now < due:
            return False
        self._down[home] = now + self.topology.link_retry_s
        return True

    async def _publish_e2e(
        self,
        home: str,
        queue: str,
        bodies: list[bytes],
        tags: list[tuple[str, str, float | None]],
        priority: int,
    ) -> CopyOutcome:
        """One e2e message of a batch of copies (``put`` checked the home's link): alone,
        the copy as it would go unbatched; several: one message named by its copies'
        ids and contents, each listed in ``ELEMENTS_HEADER``."""
        client = await self.client_for(home)
        bounds = [bound for _, _, bound in tags]
        bound = None if None in bounds else max(b for b in bounds if b is not None)
        if len(bodies) == 1:
            copy_id, content, _ = tags[0]
            return await self._e2e_copy(client, home, queue, bodies[0], copy_id, bound, content)
        elements = [(copy_id, content) for copy_id, content, _ in tags]
        headers = {
            CONTENT_HEADER: _digest("\n".join(content for _, content in elements)),
            ELEMENTS_HEADER: encode_elements(elements),
        }
        batch_id = "batch:" + _digest("\n".join(copy_id for copy_id, _ in elements))
        return await self._e2e_copy(
            client, home, queue, encode(bodies), batch_id, bound, headers=headers
        )

    async def _e2e_copy(
        self,
        client: AsyncClient,
        home: str,
        queue: str,
        body: bytes,
        copy_id: str | None,
        bound: float | None,
        content: str | None = None,
        *,
        headers: dict[str, str] | None = None,
    ) -> CopyOutcome:
        publisher = await self._publisher(client)
        hold = self.pace.hold(queue, time.monotonic())
        if headers is None and content:
            headers = {CONTENT_HEADER: content}
        try:
            in_time = await publisher.publish_held(
                body,
                hold_s=hold,
                taken_within=client.settings.publish_timeout if bound is None else bound,
                routing_key=queue,
                expect=[queue],
                message_id=copy_id,
                headers=headers,
            )
        finally:
            if hold > 0:
                self.pace.released(queue)
        self._down.pop(home, None)
        if in_time:
            self.pace.receipted(queue)
            return CopyOutcome(Outcome.DELIVERED)
        if hold > 0:
            log.info("subscriber queue %s: no receipt within %.1f s: lagging", queue, hold)
            self.pace.overdue(queue, time.monotonic())
        return CopyOutcome(Outcome.TAKEN)

    async def _publisher(self, client: AsyncClient) -> AsyncConfirmPublisher:
        publisher = self._e2e.get(client)
        if publisher is not None:
            return publisher
        async with self._lock:  # one publisher (one reply listener) per connection
            if client not in self._e2e:
                started = AsyncConfirmPublisher(client, mode="e2e")
                await started.start()  # a failed start leaves nothing registered
                self._e2e[client] = started
        return self._e2e[client]

    async def close(self) -> None:
        publishers, self._e2e = self._e2e, {}
        for publisher in publishers.values():
            await publisher.close()


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()
