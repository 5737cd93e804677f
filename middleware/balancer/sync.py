"""The sync (pika) face of the balanced publisher: the same choice (``Choice``) as the
asyncio core's ``BalancedPublisher``, sent over a ``SyncClient``.

The sync face has no background task, so what the asyncio core is told it looks up
itself, in the caller's thread, before a choice: the last load report (its inbox holds
only the last one; read every ``report_poll_s``) and whether a missing replica's queue
exists again (every ``recheck_s``).  A stalled publish cannot run on after its caller
moved on: its channel is abandoned (``SyncClient.publish(within=...)``), so a stalled
replica has no confirm to come back by; it is chosen again after ``recheck_s`` instead,
and a message that stalls there again goes to a live replica too."""

from __future__ import annotations

import logging
import time
from typing import Self, Unpack

from ..errors import ConfirmTimeout, EntityNotFound, MiddlewareError, PublishNacked, Unroutable
from ..transport import SyncClient
from ..transport.message import new_message_id
from . import metrics
from .choice import Choice, ChoiceOptions
from .publisher import publish_timed_out, replica_message, report_inbox, report_topology

__all__ = ["SyncBalancedPublisher"]

log = logging.getLogger(__name__)


class SyncBalancedPublisher(Choice):
    """Sends each message of a topic to exactly one replica, as ``BalancedPublisher``
    does; threads may share it (a publish is one thread's at a time, as on its
    ``SyncClient``).

    Differences from the asyncio face, all from having no background task: reports
    are read when a publish finds the last read older than ``report_poll_s``; a
    replica that stalled (no confirm within ``stall_s`` while the client's own node
    answers) leaves the choice for ``recheck_s`` and is then tried again; a message
    every replica stalled on waits for the last one it tried for what is left of
    ``publish_timeout``; and when the client's own node does not answer either, the
    publish ends in ``ConfirmTimeout`` at once (the link is mended by the client's next
    call: the silence rule and a failover, as for any sync publish)."""

    def __init__(
        self,
        client: SyncClient,
        *,
        topic: str,
        replicas: int,
        report_poll_s: float = 0.25,
        **options: Unpack[ChoiceOptions],
    ) -> None:
        super().__init__(topic=topic, replicas=replicas, **options)
        self.client, self.report_poll_s = client, report_poll_s
        self._inbox: str | None = None
        self._next_poll = self._next_recheck = 0.0
        self._stalled_at: dict[int, float] = {}  # stalled replica: when it stalled

    def start(self) -> Self:
        """Declare this publisher's report inbox (not for ``round_robin``)."""
        if self.algorithm != "round_robin":
            exchange, queue, binding = report_topology(self.topic, report_inbox(self.topic, self))
            self.client.declare_exchange(exchange)
            self.client.declare_queue(queue)
            self.client.bind(binding)
            self._inbox = queue.name
        return self

    def close(self) -> None:
        """Nothing runs on (the inbox is exclusive: it goes with the connection)."""

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def publish(self, body: bytes, **fields: object) -> str:
        """Publish to a chosen live replica with broker confirms; return its queue.
        Threads may share the publisher: a publish is one thread's at a time (its choice
        kept with the client's turn, ``SyncClient.turn``)."""
        with self.client.turn():
            return self._publish(body, fields)

    def _publish(self, body: bytes, fields: dict[str, object]) -> str:
        limit = self.client.settings.publish_timeout
        deadline = time.monotonic() + limit
        message_id = str(fields.pop("message_id", None) or new_message_id())
        self.look()
        tried: set[int] = set()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._timed_out(message_id, limit)
            index = self.choose(exclude=tried)
            tried.add(index)
            last = not self.choosable(tried)  # no other replica to send it to
            message = replica_message(self.queues[index], body, message_id, fields)
            within = left if last else min(self.stall_s, left)
            try:  # a nack sends it elsewhere; on the last replica the client retries it
                self.client.publish(message, within=within, retry_nacked=last)
            except (Unroutable, EntityNotFound):
                self.gone(index)
                continue
            except PublishNacked:
                if last:
                    raise
                self.refused(index)
                continue
            except ConfirmTimeout:
                if last or deadline - time.monotonic() <= 0:
                    raise self._timed_out(message_id, limit) from None
                if not self.client.answers(min(self.stall_s, deadline - time.monotonic())):
                    # the client's own node or link is silent, not the replica: another
                    # replica would stall as well, and the link is mended by the next
                    # call (the silence rule, a failover), which no bound can cut short
                    raise self._timed_out(message_id, limit) from None
                self._stall_here(index)
                self.resending()
                continue
            self._confirmed(index)
            return self.queues[index]

    def _timed_out(self, message_id: str, limit: float) -> ConfirmTimeout:
        metrics.BALANCED_TIMEOUTS.labels(self.topic).inc()
        return publish_timed_out(self.topic, message_id, limit)

    def _stall_here(self, index: int) -> None:
        if index not in self.stalled:
            self.stall(index)
        self._stalled_at[index] = time.monotonic()

    def _confirmed(self, index: int) -> None:
        """A publish to ``index`` was confirmed: a stalled replica answers again."""
        if index in self.stalled:
            self._stalled_at.pop(index, None)
            self.unstall(index)

    # -------------------------------------------------------------- looking
    def look(self) -> None:
        """What the asyncio face is told in the background, looked up when due (each
        publish calls it): the last report (every ``report_poll_s``), missing replicas'
        queues (every ``recheck_s``), stalled replicas' probation."""
        now = time.monotonic()
        if self._inbox is not None and now >= self._next_poll:
            self._next_poll = now + self.report_poll_s
            self._read_report(self._inbox)
        if now >= self._next_recheck:
            self._next_recheck = now + self.recheck_s
            for index in sorted(self.missing):
                try:
                    self.client.queue_length(self.queues[index])
                except MiddlewareError as exc:
                    self.rechecked(index, exc)
                else:
                    self.rechecked(index, None)
        for index, since in list(self._stalled_at.items()):
            if now - since >= self.recheck_s:  # tried again: a stall again is resent
                del self._stalled_at[index]
                self.unstall(index)

    def _read_report(self, inbox: str) -> None:
        try:
            delivery = self.client.get(inbox)
        except MiddlewareError as exc:  # the choice goes on with what it has
            log.debug("load report not read: %s", exc)
            return
        if delivery is not None and self.take_report(delivery.body) and self.report:
            # it may have waited in the inbox (the sidecar gone): as old as it was sent
            self.received_at -= max(0.0, time.time() - self.report.sent_at)
