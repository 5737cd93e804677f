"""A master's beats, sent from a thread of their own (a driver piece, not logic).

A master busy with a burst (matching and delivering hundreds of events in one loop turn,
its publish window full) let 0.52 s pass between two beats sent from its event loop, and
its slaves elected a successor while it was alive.  Beats answer "is the process there",
so they leave from a thread with its own connection (the sync face), which runs however
busy the loop is (the GIL is handed over every few milliseconds), and stop exactly when
the process dies or the role stops.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from ..errors import MiddlewareError
from ..settings import Settings
from ..transport import OutgoingMessage, SyncClient

__all__ = ["Beater"]

log = logging.getLogger(__name__)


class Beater:
    """Publishes ``body`` (or what it returns, read at each beat) to every queue of
    ``queues`` every ``interval_s`` until stopped; :meth:`add` beats to one more queue."""

    def __init__(
        self,
        settings: Settings,
        queues: Sequence[str],
        body: bytes | Callable[[], bytes],
        *,
        interval_s: float,
        ttl_ms: int,
        priority: int,
        name: str,
    ) -> None:
        self.settings, self.queues, self.body = settings, list(queues), body
        self.interval_s, self.ttl_ms, self.priority = interval_s, ttl_ms, priority
        self.sent = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"beats of {name}", daemon=True)

    def add(self, queue: str) -> None:
        if queue not in self.queues:
            self.queues = [*self.queues, queue]  # a new list: the thread reads the old whole

    def start(self) -> Beater:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        self._halt.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        client: SyncClient | None = None
        while not self._halt.is_set():
            try:
                if client is None:
                    client = SyncClient(settings=self.settings).connect()
                body = self.body() if callable(self.body) else self.body
                for queue in self.queues:
                    client.publish(
                        OutgoingMessage(
                            body,
                            "",
                            queue,
                            content_type="application/json",
                            priority=self.priority,
                            expiration_ms=self.ttl_ms,
                            mandatory=False,
                        ),
                        confirm=False,
                        retry=False,
                    )
                    self.sent += 1
                client.run(self.interval_s)  # handles the connection's I/O meanwhile
            except MiddlewareError as exc:
                log.info("beats not sent (%s); trying again", exc)
                self._halt.wait(self.interval_s)
            except Exception:  # a beat thread must never die of one failure
                log.exception("beat thread: unexpected error; trying again")
                self._halt.wait(self.interval_s)
        if client is not None:
            try:
                client.close()
            except Exception as exc:
                log.info("beat connection not closed cleanly: %s", exc)
