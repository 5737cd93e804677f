"""A fault-injecting TCP proxy for real link failures: cut, blackhole (drop), delay.

The tests and the ring-failure experiment (``qosmq bench phoenix --experiment link``)
put one in front of a RabbitMQ per link they want to break.

Threads and plain sockets, loopback only.  ``cut()`` resets every open
connection (and, with ``refuse=True``, closes new ones at once);
``blackhole()`` keeps connections open but forwards nothing, so only
heartbeats (or missing confirms) can notice, and ``heal()`` resets them;
``delay(s)`` holds every chunk for ``s`` seconds.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

__all__ = ["FaultProxy"]


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refusing = False
        self.blackholed = False
        self.delay_s = 0.0
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.port}/"

    # ------------------------------------------------------------ controls
    def cut(self, *, refuse: bool = True) -> None:
        """Reset every open connection; with ``refuse`` also refuse new ones."""
        self.refusing = refuse
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for a, b in pairs:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    # SO_LINGER 0: close sends RST, like a dropped link or dead peer
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    s.close()

    def blackhole(self) -> None:
        """Forward nothing, and no close either (as a partition): each end of an open
        connection stays open and hears nothing until ``heal`` or ``cut``."""
        self.blackholed = True

    def delay(self, seconds: float) -> None:
        self.delay_s = seconds

    def heal(self) -> None:
        """Back to forwarding.  Connections that were blackholed are reset: the bytes they
        dropped leave a gap no real TCP stream has (a real one retransmits, or dies by
        its timeouts), and resuming one would misalign AMQP's confirm numbering."""
        blackholed = self.blackholed
        self.refusing = self.blackholed = False
        self.delay_s = 0.0
        if blackholed:
            self.cut(refuse=False)

    def close(self) -> None:
        self._stop.set()
        self.cut()
        with contextlib.suppress(OSError):
            self._listener.close()

    # ------------------------------------------------------------ internal
    def _accept_loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, OSError):
                continue
            if self.refusing:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        open_ends = [a, b]
        try:
            while not self._stop.is_set():
                if len(open_ends) < 2 and not self.blackholed:
                    return  # an end closed while blackholed: the other learns it now
                readable, _, _ = select.select(open_ends, [], [], 0.2)
                for sock in readable:
                    try:
                        data = sock.recv(65536)
                    except OSError:  # a reset
                        data = b""
                    if not data:
                        if self.blackholed:  # a partition carries no close (or reset)
                            open_ends.remove(sock)  # either: the other end stays open
                            continue  # and silent
                        return
                    if self.blackholed:
                        continue
                    if self.delay_s:
                        time.sleep(self.delay_s)
                    peers[sock].sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()
