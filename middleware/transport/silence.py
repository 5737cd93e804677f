"""A silent link found by the broker's clock (logic + two small drivers).

A link that is cut or reset is seen at once (the socket fails).  A *silent* one (a
partition, a blackholed route: the connection stays open and nothing arrives) is found
only by heartbeats.  RabbitMQ's heartbeat sender looks every ``heartbeat / 2`` seconds
and sends a frame when nothing left the socket since its last look
(``rabbit_heartbeat.erl``; it goes on while the connection is blocked, when only the
receiving side's monitor pauses), so a live connection is silent for about one
``heartbeat`` at most.  The clients judge far later: aiormq after ``3 * (heartbeat +
1)`` seconds of silence (33 s at the layer's default 10), pika after one or two checks
of ``heartbeat + 5`` seconds (15-30 s).  Meanwhile every publish, confirm and e2e
receipt on the connection waits.

:class:`Silence` is the layer's rule: nothing read for ``1.5 * heartbeat`` seconds (half
a heartbeat past the longest silence of a live connection, for a broker slow to beat on
a loaded machine) and the connection is lost, judged on a tick every ``heartbeat / 4``
seconds.  A tick that comes late (the process did not run: a blocked event loop, a
stopped process, a sync caller busy outside the client) excuses the silence so far,
since what the broker sent may be waiting unread in the socket.  The sync face looks
first: a pika connection's timers run only while the client runs it, and a client can
block in another connection's call (a sync consumer's watchdog waiting on its own
silent link left its replies connection unlooked for 3 s, and the excuse held the
receipts sent there 3 s more); with no byte waiting, a late look judges the silence as
it is.  The drivers:
:func:`watch_reader` (asyncio: the reader of a transport made by aiormq's
``TransportFactory``, ``coalesce.py``) and :class:`SyncSilence` (pika, on the blocking
connection's own timers); each closes a connection judged lost, and the client fails
over as for a reset.
"""

from __future__ import annotations

import asyncio
import logging
import select
from collections.abc import Callable
from typing import Any

__all__ = ["Silence", "SyncSilence", "watch_reader"]

log = logging.getLogger(__name__)


class Silence:
    """Whether a connection has been silent too long (no I/O: give it the times)."""

    def __init__(self, heartbeat: float, now: float) -> None:
        self.limit = 1.5 * heartbeat  # a live connection is silent a heartbeat at most
        self.interval = heartbeat / 4
        self.heard = self.ticked = now

    def late(self, now: float) -> bool:
        """Whether a look at ``now`` comes late (the process did not look meanwhile)."""
        return now - self.ticked > 2 * self.interval

    def tick(self, now: float, read: bool, *, unread: Callable[[], bool] = lambda: True) -> bool:
        """One look, ``read``: anything arrived since the last; True: the link is lost.
        A late look excuses the silence so far if ``unread()`` (asked only then: bytes
        may wait unread in the socket; a caller that can look says whether they do)."""
        late = self.late(now)
        self.ticked = now
        if read or (late and unread()):
            self.heard = now
            return False
        return now - self.heard >= self.limit

    def describe(self) -> str:
        return f"nothing received for {self.limit:g} s (1.5 heartbeats)"


def watch_reader(
    reader: asyncio.StreamReader, transport: asyncio.WriteTransport, heartbeat: float
) -> None:
    """Watch a connection's reader; a connection judged lost gets a ``ConnectionError``
    in its reader (what aiormq's frame reader then raises) and its transport aborted."""
    if heartbeat <= 0:
        return
    loop = asyncio.get_running_loop()
    silence = Silence(heartbeat, loop.time())
    feed = reader.feed_data
    read = [False]

    def stamped(data: bytes) -> None:
        read[0] = True
        feed(data)

    reader.feed_data = stamped  # type: ignore[method-assign,assignment]

    def tick() -> None:
        if transport.is_closing():
            return
        heard, read[0] = read[0], False
        if silence.tick(loop.time(), heard):
            log.warning("closing a silent connection: %s", silence.describe())
            reader.set_exception(ConnectionError(silence.describe()))
            transport.abort()
            return
        loop.call_later(silence.interval, tick)

    loop.call_later(silence.interval, tick)


class SyncSilence:
    """The same rule for a pika ``BlockingConnection``, ticked by timers of its I/O loop
    (the underlying connection's, as pika's own heartbeat checker): they run whenever
    pika polls its socket, inside a blocking call too (a publish waiting for its
    confirm, a ``basic.get``), where ``BlockingConnection.call_later``'s callbacks wait
    for the next ``process_data_events``; ``lost`` is called with the reason when the
    connection is judged lost (from inside pika's loop, as its checker does)."""

    def __init__(
        self,
        connection: Any,
        heartbeat: float,
        lost: Callable[[str], None],
        clock: Callable[[], float],
    ) -> None:
        self.impl = connection._impl
        self.clock = clock
        self.lost = lost
        self.silence = Silence(heartbeat, clock())
        self.received = self._bytes()
        self.stopped = heartbeat <= 0
        if not self.stopped:
            self.impl._adapter_call_later(self.silence.interval, self._tick)

    def _bytes(self) -> int:
        return int(getattr(self.impl, "bytes_received", 0))

    def _unread(self) -> bool:
        """Whether bytes wait unread in the connection's socket (True when it cannot
        tell): a late look is excused only then."""
        sock = getattr(getattr(self.impl, "_transport", None), "_sock", None)
        if sock is None:
            return True
        try:
            pending = getattr(sock, "pending", None)  # TLS: decrypted, not yet read
            if pending is not None and pending() > 0:
                return True
            readable, _, _ = select.select([sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _tick(self) -> None:
        if self.stopped or not self.impl.is_open:
            return
        received, before = self._bytes(), self.received
        self.received = received
        if self.silence.tick(self.clock(), received != before, unread=self._unread):
            self.stopped = True
            self.lost(self.silence.describe())
            return
        self.impl._adapter_call_later(self.silence.interval, self._tick)
