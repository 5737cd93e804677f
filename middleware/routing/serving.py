"""How a role process serves a role (driver): consume the role's control queue and its
process's queue, ``prepare``, then the inbox (a priority queue, a small prefetch,
batches split and each message gated by its urgency, a bad one dead-lettered alone);
on stop, cancel exactly those consumers by tag, so the same process, connections and
beat thread serve the next role.  ``node.RoleNode`` holds one :class:`Serving` for the
process and hands it each role it serves; what a role does with a message is its
handler tables' (``peer.Role``), what it holds while it serves its ``lifetime``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .. import heap
from ..errors import HopFailed, MiddlewareError, Requeue
from ..transport import AsyncClient, Delivery
from ..transport.delivery import outcome_of
from .batching import PriorityGate, split
from .messages import Message, Subscribe, Unsubscribe, encode
from .parked import Next, key_of
from .role_metrics import INBOX_LENGTH, served_again
from .timeliness import QuietReads
from .wiring import SEND_FAILURES, process_queue_spec, role_inbox_spec

if TYPE_CHECKING:
    from .peer import Role

#: an inbox message not passed on (``wiring.SEND_FAILURES``) is handled again after each of
#: these pauses (about 10 s in all), then given back to the inbox
AGAIN_AFTER_S = (0.25, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0)
#: the parked queue's prefetch, in ``inbox_prefetch``s: what its consumer holds in hand
#: (``_from_parked``), at most ``ParkedPace.pause_s`` each while its destination fails,
#: so the queue turns over at up to 64 messages a second by default
PARKED_PREFETCH = 4
#: control-queue kinds handled again and given back like inbox messages when their
#: onward send fails: a subscription of an arc handed over at a join (to the joiner's
#: routing master's control queue), which is lost if it is dead-lettered; the other
#: control messages are signals their machines send again, or that expire
HANDED = (Subscribe, Unsubscribe)

__all__ = ["Serving", "each"]

log = logging.getLogger(__name__)


class Serving:
    """Serves one role at a time in its process (``run``), its consumers by tag."""

    GAUGE_S = 1.0  # how often a role's inbox length is read for the metric

    async def run(self, role: Role, stop: asyncio.Event) -> None:
        """Serve ``role`` until ``stop`` (set by the process, or by the role when it
        switches or stops), with what it holds meanwhile (``Role.lifetime``)."""
        async with role.lifetime(stop):
            await self.serve(role, stop)

    async def serve(self, role: Role, stop: asyncio.Event) -> None:
        """Consume the control queue, ``prepare``, then the inbox, until ``stop``; then
        stop consuming (by tag: the process may go on serving another role)."""
        role.stop_event = stop
        began = time.monotonic()
        client = await role.client_for(role.cluster)
        control = role.control_of(role.id)
        await client.declare_queue(role_inbox_spec(control, role.topology, client))

        async def on_control(delivery: Delivery) -> None:
            await each(role, delivery, lambda m: role.from_control(m, delivery.queue), inbox=False)

        tags = [await client.consume(control, on_control)]
        # where a FENCE (masters) or a RETIRE (slaves) finds this process
        await client.declare_queue(process_queue_spec(role.connections.process_queue))
        tags.append(await client.consume(role.connections.process_queue, on_control))
        if role.promoted_from is not None:
            # the control queue it had as a slave: a master of another reign beats there
            # (it is judged like the slaves judge it), a late ELECTION is answered
            old = role.control_of(role.promoted_from)
            await client.declare_queue(role_inbox_spec(old, role.topology, client))
            role.former_tags.append(await client.consume(old, on_control))
            tags.append(role.former_tags[-1])
        recovery = asyncio.create_task(role.recovery(stop))
        try:
            await self._serve_inbox(role, client, stop, tags, began)
        finally:
            recovery.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await recovery
            # a master that stepped down lets nothing it still handles finish: what it holds
            # goes back to the inbox for the master it yielded to (a subscribe waiting for
            # replicas that follow that master now would hold the step-down for
            # ``close_grace``)
            grace = 0.0 if role.fenced else None
            for tag in tags:
                with contextlib.suppress(Exception):
                    await client.cancel(tag, grace=grace)
            await role.finish()

    async def _serve_inbox(
        self, role: Role, client: AsyncClient, stop: asyncio.Event, tags: list[str], began: float
    ) -> None:
        if not await self._prepared(role, stop):
            return
        prepared = time.monotonic()
        if role.settings.gc_freeze:  # what it loaded is never traversed again (heap.py)
            heap.settle(f"{role.role} of {role.cluster}")
        inbox = role.inbox_of(role.id)
        inboxes: list[tuple[str, Callable[[Delivery], Awaitable[None]]]] = []
        if role.promoted_from is not None:  # what was dispatched to it as a slave, first:
            # behind the inbox's backlog each round trip waits (0.1-0.2 s at 1000 events/s)
            former = role.former_inbox_handler()
            inboxes.append((role.inbox_of(role.promoted_from), former))

        async def on_message(delivery: Delivery) -> None:
            await each(role, delivery, role.handle, role.gate, park=True)

        inboxes.append((inbox, on_message))
        with heap.FullCollections() as collections:
            for name, handler in inboxes:
                await client.declare_queue(role_inbox_spec(name, role.topology, client))
                tags.append(
                    await client.consume(name, handler, prefetch=role.topology.inbox_prefetch)
                )
                if handler is not on_message:
                    role.former_tags.append(tags[-1])
            self._started(role, began, prepared)
            tags.append(await self._consume_parked(role, client))
            log.info("%s serving %s as %s", type(role).__name__, inbox, role.id)
            if role.observes_inbox:
                await stop.wait()
            else:
                watch = asyncio.create_task(self._watch_inbox(role, client, inbox, stop))
                await stop.wait()
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
        log.info(
            "%s of %s stopped; counters: %s; %s",
            role.role,
            role.cluster,
            dict(role.counters),
            collections.summary(),
        )

    @staticmethod
    async def _consume_parked(role: Role, client: AsyncClient) -> str:
        """What the role (or the master before it) parked: tried again behind nothing
        else, held in hand while it cannot be passed on (never parked again)."""

        async def on_parked(delivery: Delivery) -> None:
            await each(role, delivery, role.handle, role.gate, parked=True)

        parked = role.id.parked(role.topology.prefix)
        await client.declare_queue(role_inbox_spec(parked, role.topology, client))
        prefetch = role.topology.inbox_prefetch * PARKED_PREFETCH
        return await client.consume(parked, on_parked, prefetch=prefetch)

    @staticmethod
    async def _prepared(role: Role, stop: asyncio.Event) -> bool:
        """``role.prepare()`` done (False: stopped first, fenced or told to stop while
        it was reading its tables back)."""
        preparing = asyncio.create_task(role.prepare())
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({preparing, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not preparing.done():
            preparing.cancel()
            with contextlib.suppress(asyncio.CancelledError, MiddlewareError):
                await preparing
            log.warning("%s stopped before serving (it was still reading its tables)", role.id)
            return False
        preparing.result()
        return True

    @staticmethod
    def _started(role: Role, began: float, prepared: float) -> None:
        role.serving.set()
        if role.on_serving is not None:
            role.on_serving()
        if role.failed_at is not None:  # an elected master: its recovery's phases
            served_again(role.id, role.failed_at, began, prepared)

    async def _watch_inbox(
        self, role: Role, client: AsyncClient, inbox: str, stop: asyncio.Event
    ) -> None:
        """The inbox-length gauge, read every ``GAUGE_S``; not while the inbox is quiet
        (``QuietReads``: the last read found it empty and nothing was delivered since),
        then every tenth time."""
        reads, seen = QuietReads(), role.received[0]
        while not stop.is_set():
            delivered, seen = role.received[0] - seen, role.received[0]
            if reads.due(bool(delivered)):
                try:
                    length = await client.queue_length(inbox)
                    INBOX_LENGTH.labels(role.cluster, role.role, inbox).set(length)
                    reads.read(length)
                except Exception as exc:  # a metric is not worth a role
                    log.info("could not read the length of %s: %s", inbox, exc)
                    reads.read(None)
            await asyncio.sleep(self.GAUGE_S)


async def each(
    role: Role,
    delivery: Delivery,
    handle: Callable[[Message], Awaitable[None]],
    gate: PriorityGate | None = None,
    *,
    inbox: bool = True,
    park: bool = False,
    parked: bool = False,
) -> None:
    """Every message a delivery carries (one, or a batch: concurrently, so their onward
    sends batch again), each through ``gate`` when given; in a batch a malformed or
    failed element is dead-lettered alone, with its reason.  ``inbox``: counted in
    ``role.received`` (beats are not), handled again, ``park``ed or ``parked`` again
    (``_passed_on``)."""
    messages, malformed = split(delivery.body)
    if inbox:
        role.inbox_took()  # (a quiet role beats at the usual pace again)
        role.received[0] += 1
        role.received[1] += len(messages) + len(malformed)

    async def gated(message: Message) -> None:
        if gate is None:
            await handle(message)
            return
        await gate.acquire(role.urgency(message))  # (no context manager: per message)
        try:
            if role.fenced:  # stepped down while it waited: not this process's now
                raise Requeue(f"{role.id} stepped down")
            await handle(message)
        finally:
            gate.release()

    handle_one = functools.partial(_passed_on, role, gated, inbox, (park, parked))
    if len(messages) == 1 and not malformed:
        await handle_one(messages[0])  # errors settle the delivery, as for any consumer
        return
    results = await asyncio.gather(*map(handle_one, messages), return_exceptions=True)
    failed = [*malformed]
    for message, result in zip(messages, results, strict=True):
        if isinstance(result, asyncio.CancelledError):
            raise result
        if isinstance(result, Requeue):  # stepped down, not passed on: the batch goes
            raise result  # back (what was handled of it, the owner's and e2e dedup drop)
        if isinstance(result, BaseException):
            failed.append((encode(message), outcome_of(result).reason))
    if failed:
        await _dead_lettered(role, delivery, failed)
    role.count("batches_received")


async def _dead_lettered(role: Role, delivery: Delivery, failed: list[tuple[bytes, str]]) -> None:
    """The elements of a batch that failed for their own fault, each to the dead
    letters with its reason."""
    client = await role.client_for(role.cluster)
    for body, reason in failed:
        log.warning("dead-lettering one of a batch from %s: %s", delivery.queue, reason)
        await client.dead_letter(dataclasses.replace(delivery, body=body), reason)


async def _passed_on(
    role: Role,
    handle: Callable[[Message], Awaitable[None]],
    inbox: bool,
    parking: tuple[bool, bool],
    message: Message,
) -> None:
    """An inbox message (or a handed subscription on the control queue: ``HANDED``)
    whose onward send met a failure that passes (``wiring.SEND_FAILURES``: the next
    role's inbox on a node that is down, a failover) is handled again after a pause, as
    a delivery again would be; in the end it goes back to its queue (``Requeue``), never
    to the dead letters: it is not the message's fault.  ``parking`` = (park, parked).
    ``park``: at the first such failure it goes to the role's parked queue instead
    (``Peer.park``), so the inbox's prefetch is not held by messages that wait for a
    queue that is down; where that publish fails too, it is held here as without it.
    ``parked`` (from the parked queue): paced by its destination and parked again at
    the queue's tail, not given back (``_from_parked``): the messages behind it, for
    other queues, get their turn, and no delivery count grows (a quorum queue drops a
    message given back 20 times from RabbitMQ 4.0, unless told otherwise)."""
    if not inbox and not isinstance(message, HANDED):
        await handle(message)  # a control signal: its machine sends it again, or it expires
        return
    park, parked = parking
    if parked:
        await _from_parked(role, handle, message)
        return
    for pause in (*AGAIN_AFTER_S, None):
        try:
            await handle(message)
            return
        except SEND_FAILURES as exc:
            stopping = _stopping(role)
            if pause is None or stopping:
                raise Requeue(f"{role.id}: not passed on: {exc}") from exc
            if park and await _parked(role, message, exc):
                return
            park = False
            role.count("handled_again")
            kind = message.kind.value
            log.info("%s: %s not passed on (%s); again in %.2f s", role.id, kind, exc, pause)
            await asyncio.sleep(pause)


async def _from_parked(
    role: Role, handle: Callable[[Message], Awaitable[None]], message: Message
) -> None:
    """A message from the parked queue, paced by its destination (``parked.py``): tried
    now, or (its destination failing) held in hand and, unless it is the one probe of
    that destination, parked again at the queue's tail untried; one whose try fails is
    parked again too.  Each is held ``pause_s`` from its delivery before it goes back,
    so the queue turns over at most prefetch / ``pause_s`` a second.  Given back
    (``Requeue``) only by a role that stops, or when it cannot be parked again."""
    pace, key, since = role.parked_pace, key_of(message), time.monotonic()
    step, wait = pace.next(key, since, waited=False)
    if step is Next.WAIT:
        await asyncio.sleep(wait)
        step, _ = pace.next(key, time.monotonic(), waited=True)
    why: Exception = HopFailed(f"{key} still failing")
    if step is Next.TRY:
        passed: bool | None = None
        try:
            await handle(message)
            passed = True
            return
        except SEND_FAILURES as exc:
            passed, why = False, exc
            role.count("handled_again")
        finally:
            pace.tried(key, time.monotonic(), passed=passed)
    if not _stopping(role):
        await asyncio.sleep(max(0.0, since + pace.pause_s - time.monotonic()))
    if _stopping(role):
        raise Requeue(f"{role.id}: not passed on: {why}") from why
    if not await _parked(role, message, why, again=True):
        raise Requeue(f"{role.id}: not passed on: {why}") from why


def _stopping(role: Role) -> bool:
    return role.stop_event is not None and role.stop_event.is_set()


async def _parked(role: Role, message: Message, why: Exception, *, again: bool = False) -> bool:
    """``message`` confirmed in the role's parked queue (False: not, it is held)."""
    try:
        await role.park(message, again=again)
    except Exception as exc:  # its own node down too: held in hand, as before parking
        log.info("%s: could not park a %s: %s", role.id, message.kind.value, exc)
        return False
    parked = role.counters["parked_again" if again else "parked"]
    if parked & (parked - 1) == 0:  # the 1st, 2nd, 4th, 8th...: a long outage logs little
        log.info(
            "%s: %s not passed on (%s); parked%s (%d so far%s)",
            role.id,
            message.kind.value,
            why,
            " again" if again else "",
            parked,
            f"; {role.parked_pace.failing} destination(s) failing" if again else "",
        )
    return True
