"""A routing master's links to other clusters: the driver of ``recovery/links.py``.

Every forward to another cluster's routing master goes through :meth:`Detours.forward`:
over the direct link while it confirms within ``link_timeout_s``; when a send is not
confirmed, the link is marked down and a bounded flood (``recovery/flood.py``) looks for
another way, its PROBEs and FOUNDs travelling the routing masters' control queues (never
behind an inbox backlog, never through the priority gate the waiting forwards hold).  A
FOUND sets a detour: the message goes to the first hop with the rest of the path in
``via`` and each hop forwards along it at the message's priority.  Meanwhile the message
waits in the sending handler: its inbox delivery is not acknowledged until it left, so a
router that dies waiting loses nothing.  A background task tries each failed direct link
every ``link_retry_s`` (a round trip to the neighbour's inbox) and traffic goes back to
it once it answers; floods that found nothing are run again meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from ..errors import DeadLetter, LinkDown, MiddlewareError, NotConnected, RetryableError
from ..phoenix.ids import RoleId
from ..recovery import flood
from ..recovery.links import LinkTable, Started
from .linkbound import inbox_answers
from .messages import Copy, Found, Message, Probe, RoutedMessage
from .role_metrics import DETOURS, FLOOD_MESSAGES, LINKS_DOWN, REROUTE_S

if TYPE_CHECKING:
    from ..phoenix.protocol import PhoenixTopology
    from ..phoenix.ring import ChordRing
    from ..transport import AsyncClient

__all__ = ["LINK_ERRORS", "Detours"]

log = logging.getLogger(__name__)

#: what a send to another cluster raises when the link, not the message, is at fault
LINK_ERRORS = (RetryableError, NotConnected, TimeoutError)


class Detours:
    """One routing master's links (its role supplies the sends and the counters)."""

    def __init__(
        self,
        *,
        cluster: str,
        ring: ChordRing,
        topology: PhoenixTopology,
        send: Callable[[str, str, Message, int], Awaitable[None]],
        tell: Callable[[str, Message, str], Awaitable[None]],
        client_for: Callable[[str], Awaitable[AsyncClient]],
        count: Callable[[str, int], None],
        prefix: str,
        shared: Callable[[str], bool] = lambda _cluster: False,
        on_left: Callable[[str], Awaitable[None]] | None = None,
        on_unreachable: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.cluster, self.topology, self.prefix = cluster, topology, prefix
        self.table = LinkTable(cluster, ring)
        self._send, self._tell, self._client_for, self._count = send, tell, client_for, count
        #: clusters reached over this cluster's own connection (one RabbitMQ and vhost for
        #: both): no other path exists, the transport's failover is the recovery
        self.shared = shared
        #: called once for a cluster no flood reached for ``leave_after_s`` (it left)
        self.on_left = on_left
        self._declared: set[str] = set()
        #: called once per outage when a flood for a cluster found no way
        self.on_unreachable = on_unreachable
        self._suspected: set[str] = set()
        self._changed = asyncio.Event()  # set (and replaced) whenever a way changes
        self._watchers: set[Callable[[], None]] = set()  # sends on a link: woken then too
        self._tasks: set[asyncio.Future[Any]] = set()
        self._flooded = 0  # flood messages already counted in the metric

    # ------------------------------------------------------------------ forwarding
    async def forward(
        self, dest: str, message: RoutedMessage | Copy, priority: int
    ) -> tuple[str, ...] | None:
        """Send ``message`` to ``dest``'s routing master: directly, over a detour, or
        (no way known yet) once one is; the path it took (``dest`` last).  None: ``dest``
        left the ring meanwhile (the caller routes the message again)."""
        if self.shared(dest):
            await self._send(dest, RoleId.router(dest).inbox(self.prefix), message, priority)
            return (dest,)
        while True:
            if dest not in self.table.ring.clusters:
                return None
            path = self.table.path(dest)
            if path is None:
                changed = self._changed
                try:
                    await asyncio.wait_for(changed.wait(), self.topology.flood_timeout_s)
                except TimeoutError:
                    self._start(self.table.again(dest))
                continue
            hop = path[0]
            onward = message.model_copy(update={"via": [*path[1:], *message.via]})
            inbox = RoleId.router(hop).inbox(self.prefix)
            try:  # connecting, declaring and confirming together stay within the bound
                await self._sent_unless_down(hop, self._send(hop, inbox, onward, priority))
            except LINK_ERRORS as exc:
                self._count("link_failures", 1)
                if hop not in self.table.down:
                    log.warning("%s -> %s: link failed (%s); flooding", self.cluster, hop, exc)
                self._start(self.table.failed(hop, dest, time.monotonic()))
                self._wake()
                continue
            if len(path) > 1:
                self._count("detoured", 1)
            return tuple(path)

    async def _sent_unless_down(self, hop: str, send: Awaitable[None]) -> None:
        """``send`` within the bound, unless ``hop`` is found down meanwhile by another
        send or a neighbour check: a forward already waiting on a silent link then takes
        the detour at once (it waited out the whole bound before, its inbox slot held,
        and so did every message behind it).  What it had sent may still arrive: the
        owner routes an event id once and e2e subscribers drop a copy they have."""
        loop = asyncio.get_running_loop()
        sending = asyncio.ensure_future(send)
        sending.add_done_callback(lambda task: task.cancelled() or task.exception())
        deadline = loop.time() + 2 * self.topology.link_timeout_s
        try:
            while True:
                # woken by the send, a change of ways (``_wake``) or the deadline: no
                # task and no ``asyncio.wait`` per forward (a router's hot path)
                woken: asyncio.Future[None] = loop.create_future()

                def wake(_: object = None, woken: asyncio.Future[None] = woken) -> None:
                    if not woken.done():
                        woken.set_result(None)

                sending.add_done_callback(wake)
                self._watchers.add(wake)
                timer = loop.call_at(deadline, wake)
                try:
                    await woken
                finally:
                    timer.cancel()
                    sending.remove_done_callback(wake)
                    self._watchers.discard(wake)
                if sending.done():
                    return sending.result()
                if loop.time() >= deadline:
                    raise TimeoutError
                if hop in self.table.down:
                    raise LinkDown(f"{hop} found down meanwhile")
        finally:
            if not sending.done():
                sending.cancel()

    async def publish(self, client: AsyncClient, send: Callable[[], Awaitable[None]]) -> None:
        """One AMQP publish to another cluster: fail fast when its connection is down
        (the transport would wait ``connect_timeout`` for its failover), and within
        ``link_timeout_s`` for the broker's confirm."""
        if not client.ready:
            raise LinkDown("no connection (failing over)")
        try:
            await asyncio.wait_for(send(), self.topology.link_timeout_s)
        except TimeoutError:
            raise LinkDown(
                f"not confirmed within link_timeout_s = {self.topology.link_timeout_s} s"
            ) from None

    # ------------------------------------------------------------------ the flood
    def _start(self, started: list[Started]) -> None:
        loop = asyncio.get_running_loop()
        for flood_ in started:
            self._count("floods", 1)
            self._launch(flood_.sends)
            loop.call_later(
                self.topology.flood_timeout_s, self._timed_out, flood_.flood, flood_.target
            )
        self._gauges()

    def _timed_out(self, flood_id: str, target: str) -> None:
        verdict = self.table.timed_out(flood_id, target)
        if verdict is not None:
            self._count("floods_unanswered", 1)
            if target not in self._suspected and self.on_unreachable is not None:
                self._suspected.add(target)
                task = asyncio.ensure_future(self.on_unreachable(target))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            log.warning(
                "%s: no way to %s found within %.1f s (its events wait; flooding again)",
                self.cluster,
                target,
                self.topology.flood_timeout_s,
            )
            self._wake()

    def _launch(self, sends: list[flood.Send]) -> None:
        if sends:  # one line per node and step: the experiment sums them per flood
            log.info("flood %s: %d message(s) sent", sends[0].message.flood, len(sends))
        for send in sends:
            sent = send.message
            message = Probe.of(sent) if isinstance(sent, flood.Probe) else Found.of(sent)
            queue = RoleId.router(send.to).control(self.prefix)
            task = asyncio.ensure_future(self._quietly(queue, message, send.to))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._gauges()

    async def _quietly(self, queue: str, message: Message, cluster: str) -> None:
        """A flood message: one try, bounded; a link it cannot take is not an error (the
        flood goes on elsewhere)."""
        try:
            await asyncio.wait_for(
                self._tell(queue, message, cluster), self.topology.link_timeout_s
            )
        except (MiddlewareError, TimeoutError) as exc:
            log.debug("%s: flood message to %s not sent: %s", self.cluster, cluster, exc)

    async def on_probe(self, message: Probe) -> None:
        probe = message.to_flood()
        target = probe.target == self.cluster
        self._launch(self.table.answer(probe) if target else self.table.probe(probe))

    async def on_found(self, message: Found) -> None:
        found = message.to_flood()
        if found.at == 0 and found.origin != self.cluster:
            raise DeadLetter(
                f"found: flood {found.flood} is {found.origin}'s, not {self.cluster}'s"
            )
        if found.at > 0 and found.path[found.at] != self.cluster:
            raise DeadLetter(f"found: {self.cluster} is not at index {found.at} of its path")
        result = self.table.found(found)
        if isinstance(result, list):
            self._launch(result)
            return
        since = self.table.down.get(result.target)
        if self.table.detours.get(result.target) and since is not None:
            took = time.monotonic() - since
            REROUTE_S.labels(self.cluster).observe(took)
            self._count("detours_found", 1)
            log.warning(
                "%s -> %s: detour over %s, %.3f s after the link failed",
                self.cluster,
                result.target,
                " -> ".join(result.path[1:]),
                took,
            )
        self._wake()

    # ------------------------------------------------------------------ the way back
    async def watch(self, stop: asyncio.Event) -> None:
        """Every ``link_retry_s``: try each failed direct link; flood again for the
        clusters no flood reached.  Beside it, every ``neighbour_check_s``: the ring
        neighbours (:meth:`check_neighbours`)."""
        checks = asyncio.ensure_future(self._neighbour_checks(stop))
        try:
            await self._retry_links(stop)
        finally:
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
        for task in list(self._tasks):
            task.cancel()

    async def _retry_links(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.topology.link_retry_s)
            for dest in list(self.table.down):
                if await self._answers(dest) and self.table.healed(dest):
                    self._suspected.discard(dest)
                    self._count("links_healed", 1)
                    log.warning("%s -> %s: direct link answers again", self.cluster, dest)
                    self._wake()
            for dest in list(self.table.unreachable):
                self._start(self.table.again(dest))
            gone = self.table.gone(time.monotonic(), self.topology.leave_after_s)
            for dest in gone:
                if dest not in self._declared and self.on_left is not None:
                    if await self._still_answers(dest):
                        continue
                    self._declared.add(dest)
                    log.warning(
                        "%s: no flood reached %s for %.1f s: it left the ring",
                        self.cluster,
                        dest,
                        self.topology.leave_after_s,
                    )
                    await self.on_left(dest)
            self._gauges()

    async def _neighbour_checks(self, stop: asyncio.Event) -> None:
        interval = self.topology.neighbour_check_s
        if interval <= 0:
            return
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if not stop.is_set():
                await self.check_neighbours()

    async def check_neighbours(self) -> list[str]:
        """The paper's neighbour heartbeats: a round trip to the ring successor's and
        predecessor's inboxes over their direct links.  One that does not answer is a
        failed link, as a failed forward is (flood; no way for ``leave_after_s``: it
        left), so a cluster that goes while nobody sends to it is found gone before its
        arc's next event has to wait for that.  Returns the neighbours found down."""
        ring = self.table.ring
        if self.cluster not in ring.clusters or len(ring.clusters) < 2:
            return []
        neighbours = {ring.successors(self.cluster, 1)[0], ring.predecessor(self.cluster)}
        down: list[str] = []
        for dest in sorted(neighbours - {self.cluster}):
            if self.shared(dest) or dest in self.table.down or self.table.flooding(dest):
                continue  # one RabbitMQ for both, or already handled as failed
            if await self._answers(dest):
                continue
            down.append(dest)
            self._count("neighbour_checks_failed", 1)
            if dest in self.table.down:  # a failed forward got there first meanwhile
                continue
            log.warning("%s -> %s: ring neighbour does not answer; flooding", self.cluster, dest)
            self._start(self.table.failed(dest, dest, time.monotonic()))
            self._wake()
        return down

    def reported_down(self, dest: str) -> None:
        """Another role of this cluster could not reach ``dest``'s RabbitMQ (a match
        broker's copy): taken as a failed link now, as a failed check is, so the copies
        it hands over do not wait out the same timeout once more."""
        if self.shared(dest) or dest in self.table.down or self.table.flooding(dest):
            return
        if dest not in self.table.ring.clusters:
            return
        log.warning(
            "%s -> %s: reported unreachable by a match broker; flooding", self.cluster, dest
        )
        self._start(self.table.failed(dest, dest, time.monotonic()))
        self._wake()

    async def _still_answers(self, dest: str) -> bool:
        """The last word before ``dest`` is declared gone: one more round trip over the
        direct link, given twice ``link_timeout_s``.  A cluster that is only slow (a
        busy machine, a paused process) answers it and stays in the ring; a cut link
        refuses at once."""
        if not await self._answers(dest, 2 * self.topology.link_timeout_s):
            return False
        if self.table.healed(dest):
            self._suspected.discard(dest)
            self._count("departures_averted", 1)
            log.warning(
                "%s -> %s: no flood reached it for %.1f s, but its direct link answered "
                "the last check: not declared gone",
                self.cluster,
                dest,
                self.topology.leave_after_s,
            )
            self._wake()
        return True

    async def _answers(self, dest: str, bound: float | None = None) -> bool:
        """A round trip to ``dest``'s routing master's inbox over the direct link
        (``linkbound.inbox_answers``: an inbox not declared yet answers)."""
        bound = self.topology.link_timeout_s if bound is None else bound
        inbox = RoleId.router(dest).inbox(self.prefix)
        return await inbox_answers(self._client_for(dest), inbox, bound)

    def joined(self, cluster: str) -> None:
        """``cluster`` (re)joined the ring: it may be found gone again later."""
        self._declared.discard(cluster)
        self._suspected.discard(cluster)
        self.table.joined(cluster)

    def left(self, cluster: str) -> None:
        """``cluster`` left the ring (already dropped from it): forget it, and let the
        forwards waiting for it route again."""
        self.table.forget(cluster)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        for wake in list(self._watchers):
            wake()
        self._gauges()

    def _gauges(self) -> None:
        LINKS_DOWN.labels(self.cluster).set(len(self.table.down))
        DETOURS.labels(self.cluster).set(len(self.table.detours))
        fresh = self.table.flood_messages - self._flooded
        if fresh:
            FLOOD_MESSAGES.labels(self.cluster).inc(fresh)
            self._count("flood_messages", fresh)
            self._flooded = self.table.flood_messages
