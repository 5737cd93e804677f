"""Adaptive batching of role-to-role messages.

Under load a role has many messages in flight at once (its inbox prefetch), and the
ones it sends to the same inbox in one event-loop turn leave as one AMQP message: a
JSON array of Phoenix messages. A lone message leaves alone, as the plain JSON object.
Toward an inbox whose sends come closer together than ``linger_s`` (a smoothed gap per
inbox), a batch also waits up to ``linger_s`` for more (less the more urgent its most
urgent message: ``linger_for``), so batches form before a backlog does; at a light
load nothing waits and a message leaves at the end of the loop turn it was sent in.
A message per event is what costs most (one publish, confirm, delivery and ack per AMQP
message, in the broker and in every Python role).

A batch goes out at the highest priority of the messages it carries, so an urgent
message never waits behind bulk ones in the broker's priority queue; the bulk ones
that leave with it ride at its priority (at most a batch of them), and the receiving
role's ``PriorityGate`` lets the most urgent of the messages it holds go first.
(Batches used to be kept apart per priority. With ``outer`` on, each event type has
its own priority, and at 600 events/s the routers then sent 1.08 role messages per
AMQP message against 1.54-1.66 with ``outer`` off: the priorities took the batching
away exactly where the load needed it.) Each sender awaits the broker's confirm of
the AMQP message that carries its own.

``split`` is the receiving side (pure): an object or an array, each element
validated alone, so one malformed element is dead-lettered with its reason and
the others are handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..phoenix.protocol import MAX_PRIORITY, PhoenixTopology
from .linkbound import STRETCH_MAX, bounded
from .messages import Message, parse, parse_many, validate

__all__ = ["Batcher", "PriorityGate", "encode", "split"]

Publish = Callable[[str, str, bytes, int], Awaitable[None]]  # cluster, queue, body, priority
#: cluster, queue, the batch's bodies and the tags they were sent with, priority: what it
#: returns is every sender's result
PublishMany = Callable[[str, str, list[bytes], list[Any], int], Awaitable[Any]]


def encode(bodies: list[bytes]) -> bytes:
    """One body for several JSON messages: the message itself when alone."""
    return bodies[0] if len(bodies) == 1 else b"[" + b",".join(bodies) + b"]"


def split(body: bytes) -> tuple[list[Message], list[tuple[bytes, str]]]:
    """The messages of one body (an object, or an array of them) and the elements
    that are not messages, each as ``(its JSON, why)``."""
    if body.lstrip()[:1] != b"[":
        return [parse(body)], []  # a malformed object: DeadLetter, as before
    try:
        return parse_many(body), []
    except ValidationError:
        pass
    try:
        elements = json.loads(body)
    except ValueError as exc:
        return [], [(body, f"malformed Phoenix batch: {exc}")]
    good: list[Message] = []
    bad: list[tuple[bytes, str]] = []
    for element in elements:
        try:
            good.append(validate(element))
        except ValidationError as exc:
            raw = json.dumps(element).encode()
            bad.append((raw, f"malformed Phoenix message in a batch: {exc}"))
    return good, bad


@dataclass(slots=True)
class _Open:
    future: asyncio.Future[Any]
    opened: float  # the loop's clock when its first message came
    bodies: list[bytes] = field(default_factory=list)
    tags: list[Any] = field(default_factory=list)  # what each was sent with (``send``)
    size: int = 0
    priority: int = 0  # the highest of its messages'
    closed: bool = False  # full: no message joins it any more
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # full, or more urgent
    expiry: asyncio.TimerHandle | None = None  # its senders' earliest bound (``send``)
    #: the destination's confirm count (``progress``) when the batch went to be published
    #: (None: not yet), and when its bound may stretch no more
    mark: int | None = None
    cap: float | None = None


#: the weight of the newest gap between two sends to an inbox is 1 / GAP_SMOOTHING
GAP_SMOOTHING = 4
#: inboxes whose gaps a batcher keeps at most (replies go to per-client addresses)
MAX_INBOXES_TRACKED = 4096


def linger_for(priority: int, linger_s: float, top: int = MAX_PRIORITY) -> float:
    """How long a batch whose most urgent message has ``priority`` may wait for more:
    the whole ``linger_s`` at priority 0, nothing at the top priority (the most urgent
    latency level, control messages), in proportion between."""
    return linger_s * max(0, top - priority) / top


class Batcher:
    """Sends a message, in one AMQP message with the others sent to the same
    ``(cluster, queue)`` in the same loop turn (at most ``max_messages`` or about
    ``max_bytes`` together; ``max_messages = 1``: one AMQP message each), at the
    highest priority among them.  ``publish_many`` instead of ``publish``: the batch goes
    out as its bodies with the tags they were sent with, and what it returns is every
    sender's result (e2e copies: each copy's id and content name, whether receipted)."""

    def __init__(
        self,
        publish: Publish | None = None,
        *,
        max_messages: int,
        max_bytes: int = 256_000,
        linger_s: float = 0.0,
        publish_many: PublishMany | None = None,
        progress: Callable[[str], int] | None = None,
        stretched: Callable[[], None] = lambda: None,
    ) -> None:
        """``progress``: a destination cluster's confirm count (``AsyncClient.confirmed``
        of its link): a bound stretches while it grows (``bounded``; ``stretched`` is
        called each time)."""
        if (publish is None) == (publish_many is None):
            raise ValueError("a Batcher takes publish or publish_many")
        self._publish = publish
        self._publish_many = publish_many or self._encoded
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self.linger_s = linger_s  # at priority 0; less the more urgent (linger_for)
        self._open: dict[tuple[str, str], _Open] = {}
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop it sends on
        #: per inbox: the loop time of its last send and the smoothed gap between sends
        #: (None: one send seen so far); a batch lingers only where more messages are
        #: expected within the linger (``_streaming``)
        self._gaps: dict[tuple[str, str], tuple[float, float | None]] = {}
        self._flushing: set[asyncio.Task[None]] = set()
        self.sent = self.batches = 0  # messages, AMQP messages (for the counters)
        self.progress, self._on_stretch = progress, stretched
        self.stretched = 0  # bounds that passed again while the link confirmed others

    async def _encoded(
        self, cluster: str, queue: str, bodies: list[bytes], _tags: list[Any], priority: int
    ) -> None:
        assert self._publish is not None
        await self._publish(cluster, queue, encode(bodies), priority)

    async def send(
        self,
        cluster: str,
        queue: str,
        body: bytes,
        priority: int,
        tag: Any = None,
        *,
        bound: float | None = None,
    ) -> Any:
        """Send ``body`` (with ``tag``, for ``publish_many``); returns once the AMQP
        message that carries it was published, with what ``publish_many`` returned.
        ``bound``: raise ``TimeoutError`` if that has not happened within ``bound``
        seconds (the publish goes on); a batch holds one timer, for the earliest bound
        among its senders, instead of a task and a timer per message."""
        if self.max_messages <= 1:
            return await self._alone(cluster, queue, body, priority, tag, bound)
        key = (cluster, queue)
        loop = self._loop
        if loop is None or not loop.is_running():  # (asyncio's lookup costs a getpid())
            loop = self._loop = asyncio.get_running_loop()
        if self.linger_s > 0 and priority < MAX_PRIORITY:  # the top priority never waits
            self._sent_at(key, loop.time())
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = _Open(loop.create_future(), loop.time())
            # starts at the next loop turn, when this turn's sends have joined the batch
            task = loop.create_task(self._flush(key, batch))
            self._flushing.add(task)
            task.add_done_callback(self._flushing.discard)
        batch.bodies.append(body)
        batch.tags.append(tag)
        batch.size += len(body)
        if priority > batch.priority:
            batch.priority = priority
            batch.wake.set()  # a more urgent message: it may wait less
        if bound is not None:
            self._bound(loop, key, batch, bound)
        if len(batch.bodies) >= self.max_messages or batch.size >= self.max_bytes:
            self._close(key, batch)  # full: the next send opens a new batch
            batch.closed = True
            batch.wake.set()
        # shielded: a sender that is cancelled does not cancel the others' publish
        return await asyncio.shield(batch.future)

    def _bound(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, str], batch: _Open, bound: float
    ) -> None:
        """The batch's timer set for the earliest bound among its senders."""
        deadline = loop.time() + bound
        if batch.cap is None:
            batch.cap = loop.time() + STRETCH_MAX * bound
        if batch.expiry is None or deadline < batch.expiry.when():
            if batch.expiry is not None:
                batch.expiry.cancel()
            batch.expiry = loop.call_at(deadline, self._expire, key, batch, bound)

    def _expire(self, key: tuple[str, str], batch: _Open, bound: float) -> None:
        """A sender's bound passed before its batch was published: every sender of the
        batch hears it (the publish goes on; no message joins the batch any more).
        Unless the batch is being published and its link confirmed something since it
        went (or since the bound passed last): then the bound passes again (``bounded``)."""
        progress = self.progress
        if progress is not None and batch.mark is not None and batch.cap is not None:
            now = progress(key[0])
            loop = self._loop or asyncio.get_running_loop()
            if now != batch.mark and loop.time() + bound <= batch.cap:
                batch.mark = now
                self._stretched()
                batch.expiry = loop.call_at(loop.time() + bound, self._expire, key, batch, bound)
                return
        self._close(key, batch)
        batch.closed = True
        batch.wake.set()
        if not batch.future.done():
            batch.future.set_exception(TimeoutError(f"not published within {bound} s"))
            batch.future.exception()  # every sender awaits it; none left is not an error

    async def _alone(
        self, cluster: str, queue: str, body: bytes, priority: int, tag: Any, bound: float | None
    ) -> Any:
        """One AMQP message for one message (``max_messages`` 1)."""
        self.sent += 1
        self.batches += 1
        sending = self._publish_many(cluster, queue, [body], [tag], priority)
        progress = self.progress
        linked = None if progress is None else functools.partial(progress, cluster)
        return await bounded(sending, bound, linked, self._stretched)

    def _stretched(self) -> None:
        self.stretched += 1
        self._on_stretch()

    @classmethod
    def of(cls, publish: Publish, topology: PhoenixTopology) -> Batcher:
        """The batcher a role or client of ``topology`` sends through."""
        batcher = cls(publish, max_messages=topology.batch_max)
        batcher.configure(topology)
        return batcher

    def configure(self, topology: PhoenixTopology) -> None:
        """Take the topology's batch size and linger (at start, or switched live)."""
        self.max_messages = topology.batch_max
        self.linger_s = topology.batch_linger_ms / 1000

    def _sent_at(self, key: tuple[str, str], now: float) -> None:
        if key not in self._gaps and len(self._gaps) >= MAX_INBOXES_TRACKED:
            self._gaps.clear()  # many one-off addresses: start again (they relearn fast)
        last, gap = self._gaps.get(key, (now, None))
        if key in self._gaps:
            seen = now - last
            gap = seen if gap is None else gap + (seen - gap) / GAP_SMOOTHING
        self._gaps[key] = (now, gap)

    def _streaming(self, key: tuple[str, str]) -> bool:
        """More messages to this inbox are expected within the linger: the smoothed gap
        between its sends is shorter (or only one send was seen).  At a light load a
        message leaves at the end of its loop turn, as without a linger."""
        gap = self._gaps.get(key, (0.0, None))[1]
        return gap is None or gap < self.linger_s

    def _close(self, key: tuple[str, str], batch: _Open) -> None:
        if self._open.get(key) is batch:
            del self._open[key]

    async def _linger(self, batch: _Open) -> None:
        """Until the batch is full or has waited as long as its priority lets it."""
        loop = asyncio.get_running_loop()
        while not batch.closed:
            left = batch.opened + linger_for(batch.priority, self.linger_s) - loop.time()
            if left <= 0:
                return
            batch.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(batch.wake.wait(), left)

    async def _flush(self, key: tuple[str, str], batch: _Open) -> None:
        cluster, queue = key
        try:
            if self.linger_s > 0 and self._streaming(key):
                await self._linger(batch)
            self._close(key, batch)
            self.sent += len(batch.bodies)
            self.batches += 1
            if self.progress is not None:
                batch.mark = self.progress(cluster)
            result = await self._publish_many(
                cluster, queue, batch.bodies, batch.tags, batch.priority
            )
        except asyncio.CancelledError:
            self._close(key, batch)
            batch.future.cancel()
            raise
        except Exception as exc:
            if not batch.future.done():  # (expired: its senders heard that already)
                batch.future.set_exception(exc)
                batch.future.exception()  # every sender awaits it; none left is no error
        else:
            if not batch.future.done():
                batch.future.set_result(result)
        finally:
            if batch.expiry is not None:
                batch.expiry.cancel()


class PriorityGate:
    """At most ``capacity`` messages handled at once, the most urgent waiting one next
    (first come, first served within a priority).

    A role consumes its inbox with a prefetch of deliveries, and a delivery may carry a
    batch: the gate keeps the events a role works on at once to its capacity (the
    topology's ``inbox_concurrency``) and lets the ones it holds beyond that wait in
    priority order, so an urgent event that arrives behind a batch of bulk ones does not
    queue behind all of them.  A message holds its place until what it sent was
    confirmed: the capacity over that round trip bounds the role's rate."""

    def __init__(self, capacity: int) -> None:
        self.capacity = self.free = capacity
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = 0

    @property
    def waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    async def acquire(self, priority: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._seq += 1
        heapq.heappush(self._waiting, (-priority, self._seq, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # given a slot while being cancelled: pass it on
            raise

    def release(self) -> None:
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)  # the slot goes straight to the next waiter
                return
        self.free += 1

    @contextlib.asynccontextmanager
    async def slot(self, priority: int) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()
